"""What a sink's state may be: typed PRNG keys, equinox modules, donated states, step forms."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import sinkax
from sinkax.errors import BatchSpecError

# every way a sink runs its steps; "auto" is set (in `sink_options`) to try both of its
# candidates, scan and loop, within the first calls
STRATEGIES = {
    "scan": {"strategy": "scan"},
    "loop": {"strategy": "loop"},
    "step": {"strategy": "step"},
    "auto": {"strategy": "auto"},
    "eager": {"jit": False},
}


@pytest.fixture(params=list(STRATEGIES))
def sink_options(request, monkeypatch):
    monkeypatch.setattr(sinkax.strategy, "MIN_TRIAL_S", 0.0)  # auto: every call is a trial
    return STRATEGIES[request.param]


def ones(n: int = 6) -> list[np.ndarray]:
    return [np.full(3, i, np.float32) for i in range(n)]


def sink_size_for(options: dict) -> int:
    return 1 if options.get("strategy") == "step" else 2


# -- typed PRNG keys ------------------------------------------------------------------------------
def nnx_like_step(state, batch):
    """A step whose state holds a typed key it splits every step, as nnx ``Rngs`` do."""
    key, sub = jax.random.split(state["rngs"])
    noise = jax.random.normal(sub, batch.shape)
    return {"w": state["w"] + batch.sum(), "rngs": key}, (noise.sum(), sub)


def test_a_typed_key_in_the_state_and_the_outputs_matches_a_plain_loop(sink_options):
    data, sink_size = ones(), sink_size_for(sink_options)
    state = {"w": jnp.float32(0), "rngs": jax.random.key(0)}
    expected_state, expected = state, []
    for i in range(4 * sink_size):
        expected_state, out = jax.jit(nnx_like_step)(expected_state, data[i % len(data)])
        expected.append(out)
    got = []
    with sinkax.data_sink(nnx_like_step, data, sink_size, **sink_options) as sink:
        for _ in range(4):
            state, out = sink(state)
            got.append(out)
    noise = np.concatenate([np.asarray(n) for n, _ in got])
    np.testing.assert_allclose(noise, [float(n) for n, _ in expected], rtol=1e-6)
    keys = jnp.concatenate([k for _, k in got])
    assert keys.dtype == jax.random.key(0).dtype
    np.testing.assert_array_equal(
        jax.random.key_data(keys), jax.random.key_data(jnp.stack([k for _, k in expected]))
    )
    np.testing.assert_array_equal(
        jax.random.key_data(state["rngs"]), jax.random.key_data(expected_state["rngs"])
    )
    assert float(state["w"]) == float(expected_state["w"])


class DropoutTrainState(train_state.TrainState):
    dropout_key: jax.Array


def dropout_train_step(state, batch):
    """A flax TrainState step with dropout, its key folded with the step count."""
    key = jax.random.fold_in(state.dropout_key, state.step)

    def loss_fn(params):
        keep = jax.random.bernoulli(key, 0.5, batch.shape)
        return jnp.mean(jnp.where(keep, batch * params["w"] * 2, 0.0) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_a_flax_train_state_with_a_dropout_key_matches_a_plain_loop(sink_options):
    data, sink_size = ones(), sink_size_for(sink_options)

    def create():
        params = {"w": jnp.ones(3)}
        return DropoutTrainState.create(
            apply_fn=None, params=params, tx=optax.sgd(0.1), dropout_key=jax.random.key(1)
        )

    expected, losses = create(), []
    for i in range(3 * sink_size):
        expected, loss = jax.jit(dropout_train_step)(expected, data[i % len(data)])
        losses.append(float(loss))
    state, got = create(), []
    with sinkax.data_sink(dropout_train_step, data, sink_size, **sink_options) as sink:
        for _ in range(3):
            state, loss = sink(state)
            got.extend(np.asarray(loss).tolist())
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    np.testing.assert_allclose(state.params["w"], expected.params["w"], rtol=1e-5)
    assert int(state.step) == 3 * sink_size


def test_a_typed_key_in_a_batch_is_refused_with_the_fix():
    keys = [jax.random.key(i) for i in range(4)]
    with (
        sinkax.data_sink(lambda s, k: (s, jax.random.key_data(k)), keys, 2) as sink,
        pytest.raises(BatchSpecError, match=r"key_data.*wrap_key_data"),
    ):
        sink(jnp.float32(0))


# -- step forms -----------------------------------------------------------------------------------
def test_a_step_returning_only_the_state_names_the_form(sink_options):
    sink_size = sink_size_for(sink_options)
    with (
        sinkax.data_sink(lambda s, b: s + b.sum(), ones(), sink_size, **sink_options) as sink,
        pytest.raises(TypeError, match=r"pair \(new_state, out\).*new state alone.*state, None"),
    ):
        sink(jnp.float32(0))


def test_a_step_returning_a_triple_names_the_form():
    with (
        sinkax.data_sink(lambda s, b: (s, b, b), ones(), 2) as sink,
        pytest.raises(TypeError, match=r"pair \(new_state, out\).*returned tuple"),
    ):
        sink(jnp.float32(0))


def test_no_output_is_none():
    with sinkax.data_sink(lambda s, b: (s + b.sum(), None), ones(), 2, strategy="loop") as sink:
        state, outs = sink(jnp.float32(0))
    assert float(state) == 3.0 and outs is None


def test_a_stateful_step_called_without_a_state_says_to_pass_one():
    with sinkax.data_sink(lambda s, b: (s, b), ones(), 2) as sink:
        with pytest.raises(TypeError, match=r"takes a state\. Call sink\(state\)"):
            sink()
        state, _ = sink(jnp.float32(0))  # the refused call decided nothing
    assert float(state) == 0.0


def test_a_stateless_step_called_with_a_state_says_to_call_without():
    def evaluate(batch):
        return batch.sum()

    with sinkax.data_sink(evaluate, ones(), 2) as sink:
        with pytest.raises(TypeError, match=r"evaluate\(batch\) takes no state\. Call sink\(\)"):
            sink(jnp.float32(0))
        np.testing.assert_allclose(sink(), [0.0, 3.0])


# -- donation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["scan", "step"])
def test_passing_a_donated_state_again_is_refused_with_the_fix(strategy):
    sink_size = 1 if strategy == "step" else 2
    old = {"w": jnp.zeros(()), "rngs": jax.random.key(0)}
    with sinkax.data_sink(nnx_like_step, ones(), sink_size, strategy=strategy) as sink:
        new, _ = sink(old)
        position = sink.data_state()
        with pytest.raises(
            ValueError, match=r"donated to an earlier call.*use the one it returned"
        ):
            sink(old)
        assert sink.data_state() == position  # nothing ran
        new, _ = sink(new)
    assert float(new["w"]) == sum(range(2 * sink_size)) * 3


def test_a_deleted_state_is_refused_on_the_first_call_whatever_the_strategy(sink_options):
    state = {"w": jnp.zeros(()), "rngs": jax.random.key(0)}
    state["rngs"].delete()
    with sinkax.data_sink(nnx_like_step, ones(), sink_size_for(sink_options), **sink_options) as s:
        with pytest.raises(ValueError, match=r"donated.*leaf \['rngs'\] is deleted"):
            s(state)
        assert s.step == 0
        fresh, _ = s({"w": jnp.zeros(()), "rngs": jax.random.key(0)})
    assert float(fresh["w"]) == sum(range(sink_size_for(sink_options))) * 3
