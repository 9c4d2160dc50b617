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
