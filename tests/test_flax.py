"""flax networks with non-trainable state and dropout: linen (BatchNorm + Dropout) and nnx,
through make_train_step / make_eval_step, data_sink and Model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sinkax
from sinkax.train import (
    Model,
    TrainState,
    cross_entropy,
    from_linen,
    from_nnx,
    make_eval_step,
    make_train_step,
)

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(3)(x)


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.norm(self.dense(x))))


def batches(n=64, size=8, seed=0):
    x = np.random.default_rng(seed).normal(2.0, 3.0, size=(n, 5)).astype(np.float32)
    y = (x[:, 0] > 2).astype(np.int32)
    return [{"image": x[i : i + size], "label": y[i : i + size]} for i in range(0, n, size)]


def linen(seed=0):
    module = LinenNet()
    variables = module.init(jax.random.key(seed), batches()[0]["image"], train=False)
    return module, variables, *from_linen(module, variables)


def test_linen_batch_stats_are_model_state_and_adamw_leaves_them_alone():
    module, variables, apply, params, model_state = linen()
    optimizer = optax.adamw(0.1, weight_decay=0.5)  # decay would shrink a trained variance
    state = TrainState.create(params, optimizer, model_state=model_state, rng=jax.random.key(1))
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(optimizer.init(params))
    batch = batches()[0]
    new_state, _ = jax.jit(make_train_step(apply, cross_entropy, optimizer))(state, batch)

    # the running statistics are exactly what flax's BatchNorm computes on this batch
    _, expected = module.apply(
        variables,
        batch["image"],
        train=True,
        rngs={"dropout": jax.random.key(0)},  # dropout comes after the norm
        mutable=["batch_stats"],
    )
    stats = new_state.model_state["batch_stats"]["BatchNorm_0"]
    np.testing.assert_allclose(stats["var"], expected["batch_stats"]["BatchNorm_0"]["var"], 1e-6)
    np.testing.assert_allclose(stats["mean"], expected["batch_stats"]["BatchNorm_0"]["mean"], 1e-6)
    assert not np.allclose(stats["var"], 1.0)  # moved from its initial value
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, new_state.params)
    assert all(jax.tree.leaves(moved)), moved  # every param trained
    assert int(new_state.step) == 1
    same_key = jax.random.key_data(new_state.rng) == jax.random.key_data(state.rng)
    assert bool(jnp.all(same_key))  # the base key stays; each step folds its count in


def losses_of(apply, params, model_state, key, steps=4):
    """Per-step losses of `steps` steps on one batch with lr 0: only dropout changes them."""
    optimizer = optax.sgd(0.0)
    params, model_state = jax.tree.map(jnp.copy, (params, model_state))  # the sink donates them
    state = TrainState.create(params, optimizer, model_state=model_state, rng=key)
    step = make_train_step(apply, cross_entropy, optimizer)
    with sinkax.data_sink(step, [batches()[0]], sink_size=steps) as sink:
        return np.asarray(sink(state)[1]["loss"])


def test_linen_dropout_differs_per_step_and_is_fixed_by_the_key():
    _, _, apply, params, model_state = linen()
    losses = losses_of(apply, params, model_state, jax.random.key(7))
    assert len(set(losses.tolist())) == len(losses), losses  # a new mask every step
    np.testing.assert_array_equal(losses, losses_of(apply, params, model_state, jax.random.key(7)))
    assert not np.array_equal(losses, losses_of(apply, params, model_state, jax.random.key(8)))


def test_linen_model_trains_and_evaluates_with_running_stats_without_dropout():
    module, _, apply, params, model_state = linen()
    data = batches()
    model = Model(apply, params, cross_entropy, optax.adamw(0.01), model_state=model_state,
                  rng=jax.random.key(1))  # fmt: skip
    model.train(3, data, sink_size=-1)
    assert int(model.state.step) == 24
    variables = {"params": model.params, **model.state.model_state}
    x = np.concatenate([b["image"] for b in data])
    y = np.concatenate([b["label"] for b in data])
    logits = module.apply(variables, x, train=False)
    np.testing.assert_allclose(model.predict(x), logits, rtol=1e-5, atol=1e-5)
    result = model.eval(data)
    assert result == model.eval(data)  # no dropout: the same every time
    np.testing.assert_allclose(result["loss"], float(cross_entropy(logits, y)), rtol=1e-5)
    assert result["accuracy"] > 0.8


def test_eval_step_of_a_stateful_network_takes_params_and_model_state():
    module, variables, apply, params, model_state = linen()
    batch = batches()[1]
    metrics = make_eval_step(apply)((params, model_state), batch)
    logits = module.apply(variables, batch["image"], train=False)
    np.testing.assert_allclose(metrics["loss"], cross_entropy(logits, batch["label"]), rtol=1e-6)


def test_from_linen_needs_params():
    with pytest.raises(ValueError, match="no 'params'"):
        from_linen(LinenNet(), {"batch_stats": {}})


def test_nnx_model_trains_through_a_sink_with_its_own_rng_streams():
    model = NnxNet(nnx.Rngs(0))
    apply, params, model_state = from_nnx(model)
    data = batches()
    trainer = Model(apply, params, cross_entropy, optax.adamw(0.01), model_state=model_state)
    before_params, before_var = (
        jax.tree.map(np.array, params),
        np.array(model_state["norm"]["var"][...]),
    )
    trainer.train(4, data, sink_size=6)  # 24 steps, over epoch boundaries

    changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), before_params, trainer.params)
    assert all(jax.tree.leaves(changed)), changed
    after = trainer.state.model_state
    assert not np.allclose(after["norm"]["var"][...], before_var)
    assert int(after["drop"]["rngs"]["count"][...]) == 24  # one draw per step
    result = trainer.eval(data)
    assert result == trainer.eval(data) and result["accuracy"] > 0.8

    nnx.update(model, trainer.params, trainer.state.model_state)  # back into the module
    model.eval()
    x = data[0]["image"]
    np.testing.assert_allclose(model(x), trainer.predict(x), rtol=1e-5, atol=1e-6)


def test_nnx_dropout_differs_per_step_and_is_fixed_by_the_seed():
    def losses(seed):  # the same params, dropout drawn from the stream `seed`
        return losses_of(*from_nnx(NnxNet(nnx.Rngs(0, dropout=seed))), key=None)

    first = losses(0)
    assert len(set(first.tolist())) == len(first), first
    np.testing.assert_array_equal(first, losses(0))
    assert not np.array_equal(first, losses(1))


def test_a_checkpoint_keeps_model_state_and_key_and_resumes_exactly(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    _, _, apply, params, model_state = linen()
    data = batches()

    def model():
        return Model(apply, params, cross_entropy, optax.adamw(0.01), model_state=model_state,
                     rng=jax.random.key(5))  # fmt: skip

    whole = model()
    whole.train(2, data)
    resumed = model()
    resumed.train(1, data, [sinkax.train.ModelCheckpoint(tmp_path)])
    resumed = model()
    resumed.train(2, data, resume_from=str(tmp_path))
    assert jax.random.key_impl(resumed.state.rng) == jax.random.key_impl(whole.state.rng)
    np.testing.assert_array_equal(
        jax.random.key_data(resumed.state.rng), jax.random.key_data(whole.state.rng)
    )
    for a, b in zip(
        jax.tree.leaves(resumed.state[:4]), jax.tree.leaves(whole.state[:4]), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("key", [jax.random.key(9), None])  # eval draws no key: may have none
def test_an_eval_only_model_restores_batch_stats_from_a_training_checkpoint(tmp_path, key):
    pytest.importorskip("orbax.checkpoint")
    _, _, apply, params, model_state = linen()
    data = batches()
    trained = Model(apply, params, cross_entropy, optax.adamw(0.01), model_state=model_state,
                    rng=jax.random.key(5))  # fmt: skip
    trained.train(1, data, [sinkax.train.ModelCheckpoint(tmp_path)])
    evaluating = Model(apply, params, cross_entropy, model_state=model_state, rng=key)
    assert evaluating.restore(tmp_path)["step"] == 8
    restored, saved = evaluating.state.model_state, trained.state.model_state
    jax.tree.map(np.testing.assert_array_equal, restored, saved)
    assert evaluating.state.opt_state is None and (evaluating.state.rng is None) == (key is None)
    assert evaluating.eval(data) == trained.eval(data)
