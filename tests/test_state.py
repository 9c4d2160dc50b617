"""What a sink's state may be: typed PRNG keys, equinox modules, donated states, step forms."""

import functools

import equinox as eqx
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import sinkax
from sinkax.errors import BatchSpecError
from sinkax.train import DatasetHelper, connect_network_with_dataset

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
    monkeypatch.setattr(sinkax.execution.auto, "TRIAL_S", 0.0)  # auto: one-step trials of each
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


@pytest.mark.parametrize("flag", [None, True], ids=["arrays", "with-a-python-flag"])
def test_a_learning_rate_set_in_place_on_the_returned_state_is_used(
    sink_options, monkeypatch, flag
):
    # optax's way to change a learning rate: assign it in the state's hyperparams, here as a
    # Python number, between calls (auto still measuring: trials longer than the run); a
    # Python flag in the state is compiled in: the state returned is rebuilt around it
    monkeypatch.setattr(sinkax.execution.auto, "TRIAL_S", 1e6)
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)

    def step(state, batch):
        params, opt, flag = state
        grads = jax.grad(lambda p: jnp.sum((p * batch) ** 2))(params)
        updates, opt = optimizer.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt, flag), params.sum()

    def run(call):
        state = (jnp.ones(3), optimizer.init(jnp.ones(3)), flag)
        for i, lr in enumerate([None, 0.05, 1]):  # a float, then an int
            if lr is not None:
                state[1].hyperparams["learning_rate"] = lr
            state = call(state, i)
        return state

    size, data = sink_size_for(sink_options), ones(6)
    with sinkax.data_sink(step, data, size, **sink_options) as sink:
        got = run(lambda state, i: sink(state)[0])
    plain = jax.jit(step)
    want = run(
        lambda state, i: functools.reduce(
            lambda s, b: plain(s, b)[0], data[i * size : (i + 1) * size], state
        )
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert float(got[1].hyperparams["learning_rate"]) == 1.0


def test_a_python_number_in_the_state_stays_weakly_typed_as_under_jit(sink_options):
    def sgd(state, batch):  # bfloat16 params, a Python-float learning rate
        params = state["w"] - state["lr"] * batch.astype(jnp.bfloat16)
        return {"w": params, "lr": state["lr"] * 1.0}, params.sum()

    data, sink_size = ones(), sink_size_for(sink_options)
    step, expected = jax.jit(sgd), {"w": jnp.ones(3, jnp.bfloat16), "lr": 0.5}
    for batch in data[: 2 * sink_size]:
        expected, _ = step(expected, batch)
    state = {"w": jnp.ones(3, jnp.bfloat16), "lr": 0.5}
    with sinkax.data_sink(sgd, data, sink_size, **sink_options) as sink:
        for _ in range(2):
            state, outs = sink(state)
    assert state["w"].dtype == outs.dtype == jnp.bfloat16  # lr promoted nothing
    assert jax.typeof(state["lr"]).weak_type == jax.typeof(expected["lr"]).weak_type
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(expected["w"]))


def test_an_output_from_a_python_number_stays_weakly_typed_as_under_jit(sink_options):
    def step(state, batch):  # the output: a Python float times a weakly typed leaf
        return state, {"half_lr": state["lr"] * 0.5, "sum": batch.sum()}

    data, sink_size = ones(), sink_size_for(sink_options)
    _, expected = jax.jit(step)({"lr": 0.5}, data[0])
    with sinkax.data_sink(step, data, sink_size, **sink_options) as sink:
        _, outs = sink({"lr": 0.5})
    for key, out in outs.items():  # so that they promote alike: bfloat16 * a weak float32 leaf
        assert jax.typeof(out).weak_type == jax.typeof(expected[key]).weak_type, key
        assert (out * jnp.bfloat16(1)).dtype == (expected[key] * jnp.bfloat16(1)).dtype, key
    np.testing.assert_array_equal(outs["half_lr"], np.full(sink_size, 0.25, np.float32))


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


def test_a_step_with_more_parameters_is_told_to_bind_them_not_to_drop_the_state():
    def train(state, batch, lr):
        return state - lr * batch.sum(), None

    with sinkax.data_sink(train, ones(), 2) as sink:
        with pytest.raises(TypeError, match=r"train\(state, batch, lr\) needs 3 arguments") as e:
            sink(jnp.float32(0))
        assert "takes no state" not in str(e.value)
        assert "functools.partial(train, lr=...)" in str(e.value)
    sink = sinkax.data_sink(lambda batch, scale, shift: batch * scale, ones(), 2)
    with sink, pytest.raises(TypeError, match=r"needs 3 arguments.*sink\(\) passes one"):
        sink()


def test_a_step_that_takes_batch_before_state_is_told_the_order():
    def train(batch, state):
        return state + batch.sum(), None

    sink = sinkax.data_sink(train, ones(), 2)
    with sink, pytest.raises(TypeError, match=r"train\(batch, state\) takes the batch first"):
        sink(jnp.float32(0))


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


# -- eval: params as state, not as compiled constants --------------------------------------------
def labelled(n: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(8, 3)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32))
        for _ in range(n)
    ]


def test_eval_with_carried_params_compiles_once_and_sees_each_params():
    data, apply = labelled(), lambda p, x: x @ p
    evaluate = sinkax.make_eval_step(apply, carry_params=True)
    plain = sinkax.make_eval_step(apply)
    compiles = []
    for seed in range(3):
        params = jax.random.normal(jax.random.key(seed), (3, 3))
        with sinkax.data_sink(evaluate, data, sink_size=-1, strategy="scan") as sink:
            kept, metrics = sink(jax.tree.map(jnp.copy, params))
            compiles.append(sink.stats.compiles)
        expected = [float(plain(params, batch)["loss"]) for batch in data]
        np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)
        np.testing.assert_array_equal(kept, params)
    assert compiles == [1, 0, 0]


def test_a_warning_points_at_the_users_line_not_at_sinkax():
    weights = jnp.eye(3)

    def step(state, batch):
        return state, batch @ weights  # captures an array: sinkax warns

    for make in (
        lambda: sinkax.data_sink(step, ones(), 2),
        lambda: sinkax.Sink(step, ones(), 2),
        lambda: connect_network_with_dataset(step, DatasetHelper(ones(), sink_size=2)),
    ):
        with pytest.warns(UserWarning, match="captures arrays") as record:
            make().close()
        assert [w.filename for w in record] == [__file__], [w.filename for w in record]


def test_a_step_closing_over_replaced_params_is_refused_not_run_stale():
    data, plain = labelled(), sinkax.make_eval_step(lambda p, x: x @ p)
    params = jnp.eye(3)

    def evaluate(batch):
        return plain(params, batch)["loss"]

    with pytest.warns(UserWarning, match=r"captures arrays \(params\)"):
        sink = sinkax.data_sink(evaluate, data, sink_size=-1, strategy="scan")
    with sink:
        np.testing.assert_allclose(sink(), [plain(params, b)["loss"] for b in data], rtol=1e-5)
        params = 2 * jnp.eye(3)  # what a training loop between evaluations does
        with pytest.raises(ValueError, match=r"replaced since it was compiled \(params\)"):
            sink()
        assert sink.step == 0 and sink.epoch == 1  # nothing ran
    with pytest.warns(UserWarning), sinkax.data_sink(evaluate, data, -1, strategy="scan") as sink:
        # a new sink of the same function compiles the new params in, not the cached old ones
        np.testing.assert_allclose(sink(), [plain(params, b)["loss"] for b in data], rtol=1e-5)


NOTEBOOK = """
import types

import jax
import jax.numpy as jnp

nnx = types.SimpleNamespace(state=lambda x: 2 * x)  # a module whose attribute is named `state`
graphdef, state = None, jnp.ones(3)  # what `graphdef, state = nnx.split(model)` leaves
params, scale = jnp.ones(3), jnp.ones(3)


class Trainer:
    def __init__(self):
        self.params = jnp.zeros(3)

    def step(self, carry, batch):  # `self.params` is no global `params`
        return carry + self.params.sum(), nnx.state(batch[0]).sum()


def scaled(carry, batch):  # reads the global `scale`, inside a lambda too
    return carry, jax.tree.map(lambda x: x @ scale, batch[0]).sum()
"""


def notebook() -> dict:
    """The globals of a notebook's cell that defines step functions beside array globals."""
    namespace: dict = {}
    exec(NOTEBOOK, namespace)
    return namespace


def test_attributes_named_like_array_globals_are_not_captures(recwarn):
    cell = notebook()
    with sinkax.data_sink(cell["Trainer"]().step, labelled(), sink_size=2) as sink:
        sink(jnp.float32(0))
        cell["state"], cell["params"] = jnp.zeros(3), jnp.zeros(3)  # the next cell's re-split
        sink(jnp.float32(0))  # refused before: "replaced since it was compiled (params, state)"
    assert not [w for w in recwarn if "captures arrays" in str(w.message)]


def test_a_global_read_inside_a_lambda_is_a_capture():
    cell = notebook()
    with pytest.warns(UserWarning, match=r"captures arrays \(scale\)"):
        sink = sinkax.data_sink(cell["scaled"], labelled(), sink_size=2)
    with sink:
        sink(jnp.float32(0))
        cell["scale"] = 2 * jnp.ones(3)
        with pytest.raises(ValueError, match=r"replaced since it was compiled \(scale\)"):
            sink(jnp.float32(0))


def test_a_partial_over_params_warns_that_each_one_compiles_again():
    plain = sinkax.make_eval_step(lambda p, x: x @ p)
    with (
        pytest.warns(UserWarning, match=r"argument 0 of the partial.*compiles again"),
        sinkax.data_sink(functools.partial(plain, jnp.eye(3)), labelled(), -1) as sink,
    ):
        assert set(sink()) == {"loss", "accuracy"}


# -- equinox modules ------------------------------------------------------------------------------
def eqx_regression(n: int = 6) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(8, 3)).astype(np.float32) for _ in range(n)]
    return [(x, np.tanh(x.sum(1, keepdims=True))) for x in xs]


EQX_OPTIMIZER = optax.adam(1e-2)


def eqx_train_step(state, batch):
    """The equinox way: a module (with its activation functions) and the optimizer state."""
    model, opt_state = state
    x, y = batch

    def loss_fn(m):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = EQX_OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return (eqx.apply_updates(model, updates), opt_state), loss


def eqx_reference(model, data, steps):
    state, losses, step = (model, EQX_OPTIMIZER.init(eqx.filter(model, eqx.is_array))), [], None
    step = eqx.filter_jit(eqx_train_step)
    for i in range(steps):
        state, loss = step(state, data[i % len(data)])
        losses.append(float(loss))
    return state[0], losses


def test_an_equinox_mlp_trains_as_with_filter_jit(sink_options):
    data, sink_size = eqx_regression(), sink_size_for(sink_options)
    model = eqx.nn.MLP(3, 1, 8, 2, activation=jax.nn.tanh, key=jax.random.key(0))
    expected_model, expected = eqx_reference(model, data, 3 * sink_size)
    state, got = (model, EQX_OPTIMIZER.init(eqx.filter(model, eqx.is_array))), []
    with sinkax.data_sink(eqx_train_step, data, sink_size, **sink_options) as sink:
        for _ in range(3):
            state, loss = sink(state)
            got.extend(np.asarray(loss).tolist())
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert isinstance(state[0], eqx.nn.MLP) and state[0].activation is jax.nn.tanh
    np.testing.assert_allclose(state[0].layers[0].weight, expected_model.layers[0].weight, 1e-5)


def test_an_equinox_module_s_python_number_fields_stay_static_as_under_filter_jit():
    # MaxPool2d's init=-inf is a plain float field: traced, reduce_window's jvp refuses it
    keys = jax.random.split(jax.random.key(0), 2)
    model = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(1, 2, 3, key=keys[0]),
            eqx.nn.MaxPool2d(2, 2),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(8, 1, key=keys[1]),
        ]
    )
    rng = np.random.default_rng(2)
    data = [(x, np.tanh(x.sum((1, 2, 3))[:, None])) for x in rng.normal(size=(4, 8, 1, 6, 6))]
    data = [(x.astype(np.float32), y.astype(np.float32)) for x, y in data]
    expected_model, expected = eqx_reference(model, data, 4)
    state = (model, EQX_OPTIMIZER.init(eqx.filter(model, eqx.is_array)))
    with sinkax.data_sink(eqx_train_step, data, 2) as sink:
        state, first = sink(state)
        state, second = sink(state)
    np.testing.assert_allclose(np.concatenate([first, second]), expected, rtol=1e-5)
    assert state[0].layers[1].init == -np.inf  # still the Python float it was
    np.testing.assert_allclose(state[0].layers[3].bias, expected_model.layers[3].bias, rtol=1e-5)


def test_a_filtered_equinox_model_trains_as_with_filter_jit():
    data = eqx_regression()
    model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
    expected_model, expected = eqx_reference(model, data, 6)
    params, static = eqx.partition(model, eqx.is_array)

    def step(state, batch):  # the user filters: only arrays in the state
        (model, opt_state), loss = eqx_train_step((eqx.combine(state[0], static), state[1]), batch)
        return (eqx.filter(model, eqx.is_array), opt_state), loss

    state = (params, EQX_OPTIMIZER.init(params))
    with sinkax.data_sink(step, data, 3) as sink:
        state, first = sink(state)
        state, second = sink(state)
    np.testing.assert_allclose(np.concatenate([first, second]), expected, rtol=1e-5)
    trained = eqx.combine(state[0], static)
    np.testing.assert_allclose(trained.layers[2].bias, expected_model.layers[2].bias, rtol=1e-5)


def test_modules_differing_only_in_functions_do_not_share_executables():
    data = eqx_regression()

    def predict(model, batch):
        return model, jax.vmap(model)(batch[0])

    for activation in (jax.nn.relu, jax.nn.tanh):
        model = eqx.nn.MLP(3, 1, 8, 2, activation=activation, key=jax.random.key(0))
        with sinkax.data_sink(predict, data, 2, strategy="scan") as sink:
            model, outs = sink(model)
            with pytest.raises(TypeError, match=r"non-array leaves.*differ"):
                sink(eqx.tree_at(lambda m: m.activation, model, jax.nn.sigmoid))
        np.testing.assert_allclose(
            outs,
            jax.vmap(jax.vmap(model))(np.stack([data[0][0], data[1][0]])),
            rtol=1e-4,
            atol=1e-6,
        )


def test_a_dropout_flag_and_key_in_an_equinox_state():
    data = eqx_regression()
    dropout = eqx.nn.Dropout(0.5)  # `inference` is a Python bool: static, not traced

    def step(state, batch):
        layer, key = state
        key, sub = jax.random.split(key)
        return (layer, key), layer(batch[0], key=sub).sum()

    with sinkax.data_sink(step, data, 2) as sink:
        (layer, key), outs = sink((dropout, jax.random.key(0)))
        (layer, key), _ = sink((layer, key))
    assert layer.inference is False and np.asarray(outs).shape == (2,)
    assert not np.allclose(outs, [x.sum() for x, _ in data[:2]])  # dropped and rescaled


# -- resuming a plain iterable --------------------------------------------------------------------
class Loader:
    """A torch-style loader: a new order every pass, from the pass count of all loaders (no
    seed, like torch's default generator), or from the epoch (seeded)."""

    passes = 0

    def __init__(self, seeded: bool, n: int = 10):
        self.seeded, self.n, self.epoch = seeded, n, 0

    def __iter__(self):
        seed = self.epoch if self.seeded else Loader.passes
        Loader.passes += 1
        self.epoch += 1
        for i in np.random.default_rng(seed).permutation(self.n):
            yield {"index": np.int32(i)}


def seen(sink, calls):
    return np.concatenate([sink() for _ in range(calls)]).tolist()


def test_resuming_a_loader_that_reshuffles_without_a_seed_is_refused_with_the_fix():
    with sinkax.data_sink(lambda b: b["index"], Loader(seeded=False), 3) as sink:
        seen(sink, 1)
        saved = sink.data_state()
    assert "fingerprint" in saved["source"]
    match = r"^Resuming replayed the first 3 batches of epoch 0.*reshuffles without a seed"
    with pytest.raises(ValueError, match=match) as refused:
        sinkax.data_sink(lambda b: b["index"], Loader(seeded=False), 3, data_state=saved)
    assert "grain MapDataset" in str(refused.value)
    assert "Give what Sink.data_state() returned" not in str(refused.value)  # the user did


def test_a_position_of_numpy_ints_resumes_as_one_of_ints():
    def numpy_ints(tree):  # what a position read back from np.savez/np.load holds, say
        if isinstance(tree, dict):
            return {k: numpy_ints(v) for k, v in tree.items()}
        return np.int64(tree) if isinstance(tree, int) else tree

    data = [{"index": np.int32(i)} for i in range(10)]
    for dataset in (data, grain.MapDataset.source(data)):  # a re-iterable's, grain's
        with sinkax.data_sink(lambda b: b["index"], dataset, 3) as sink:
            seen(sink, 1)
            saved = numpy_ints(sink.data_state())
        assert isinstance(saved["source"][next(iter(saved["source"]))], np.int64)
        with sinkax.data_sink(lambda b: b["index"], dataset, 3, data_state=saved) as sink:
            assert seen(sink, 1) == [3, 4, 5]


def test_a_refused_restore_that_cannot_go_back_leaves_the_next_call_refused_too():
    class Rotating:  # a new order every pass, no seed: pass k starts at batch k
        passes = 0

        def __iter__(self):
            k, self.passes = self.passes, self.passes + 1
            return ({"index": np.int32((i + k) % 10)} for i in range(10))

    class Reversed:  # another dataset: a position saved over it does not fit Rotating
        def __iter__(self):
            return ({"index": np.int32(9 - i)} for i in range(10))

    with sinkax.data_sink(lambda b: b["index"], Reversed(), 3) as sink:
        seen(sink, 1)
        elsewhere = sink.data_state()
    with sinkax.data_sink(lambda b: b["index"], Rotating(), 3) as sink:
        assert seen(sink, 1) == [0, 1, 2]
        with pytest.raises(ValueError, match="Resuming replayed the first 3 batches"):
            sink.restore_data_state(elsewhere)
        # going back to batch 3 reads the epoch again, in another order: refused, not read on
        with pytest.raises(ValueError, match="reshuffles without a seed"):
            sink()


def test_a_position_saved_over_a_loader_resumes_over_a_list_of_its_batches_only():
    data = [{"index": np.int32(i)} for i in range(10)]

    class Again:  # a re-iterable that is no Sequence: its position holds a fingerprint
        def __iter__(self):
            return iter(data)

    with sinkax.data_sink(lambda b: b["index"], Again(), 3) as sink:
        seen(sink, 1)
        saved = sink.data_state()
    with sinkax.data_sink(lambda b: b["index"], data, 3, data_state=saved) as sink:
        assert seen(sink, 1) == [3, 4, 5]  # the same batches: the replay agrees
    with pytest.raises(ValueError, match="Resuming replayed the first 3 batches"):
        sinkax.data_sink(lambda b: b["index"], data[::-1], 3, data_state=saved)


def test_resuming_a_seeded_loader_replays_exactly():
    step = lambda b: b["index"]  # noqa: E731
    with sinkax.data_sink(step, Loader(seeded=True), 3) as sink:
        seen(sink, 2)
        saved = sink.data_state()
        expected = seen(sink, 2)
    with sinkax.data_sink(step, Loader(seeded=True), 3, data_state=saved) as sink:
        assert seen(sink, 2) == expected
