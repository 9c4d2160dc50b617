"""Tests for sinkax.nets: shapes and trainability (the convolutions' rewrite: test_rewrite.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from sinkax import nets


def _batch(n: int = 8, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, 32, 32, 1), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, 10, n).astype(np.int32))
    return x, y


def _loss(apply, p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y).mean()


def test_shapes() -> None:
    key = jax.random.PRNGKey(0)
    p = jax.eval_shape(lambda k: nets.lenet5_init(k, num_classes=7), key)
    assert p["conv1"]["w"].shape == (5, 5, 1, 6) and p["fc1"]["w"].shape == (400, 120)
    out = jax.eval_shape(nets.lenet5_apply, p, jax.ShapeDtypeStruct((3, 32, 32, 1), jnp.float32))
    assert out.shape == (3, 7) and out.dtype == jnp.float32
    m = jax.eval_shape(nets.mlp_init, key)
    for shape in [(3, 1024), (3, 32, 32, 1)]:
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        assert jax.eval_shape(nets.mlp_apply, m, x).shape == (3, 10)


def test_lenet5_loss_decreases_with_sgd() -> None:
    p = nets.lenet5_init(jax.random.PRNGKey(2))
    x, y = _batch(16, seed=3)
    opt = optax.sgd(0.05, momentum=0.9)

    @jax.jit
    def step(p, o):
        loss, g = jax.value_and_grad(lambda q: _loss(nets.lenet5_apply, q, x, y))(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    o = opt.init(p)
    losses = []
    for _ in range(20):
        p, o, loss = step(p, o)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses


def test_mlp_loss_decreases_with_sgd() -> None:
    p = nets.mlp_init(jax.random.PRNGKey(0), sizes=(1024, 32, 10))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 1024), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, 10, 16).astype(np.int32))
    loss_fn = jax.value_and_grad(lambda q: _loss(nets.mlp_apply, q, x, y))

    @jax.jit
    def train(p):
        l0, _ = loss_fn(p)
        p = lax.fori_loop(
            0, 10, lambda _, q: jax.tree.map(lambda a, b: a - 0.1 * b, q, loss_fn(q)[1]), p
        )
        return l0, loss_fn(p)[0]

    l0, l1 = train(p)
    assert float(l1) < float(l0)
