"""Small reference networks (LeNet5, MLP) as pure functions over pytrees of dicts.

The convolutions are plain ``lax.conv_general_dilated`` (NHWC input, HWIO kernel), as flax
``nn.Conv`` writes them. In a sink on CPU they run on XLA's fast kernels inside the loop body
too: the ``"scan"`` strategy puts every convolution of the step -- the weight gradients autodiff
emits included -- into XLA:CPU's canonical layout first (:mod:`sinkax.execution.rewrite`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Params = dict[str, Any]

_STD = 0.02


def _trunc_normal(key: jax.Array, shape: tuple[int, ...], std: float = _STD) -> jax.Array:
    """Normal(0, std) truncated to [-2 std, 2 std] (MindSpore ``TruncatedNormal(std)``)."""
    return std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)


@partial(jax.jit, static_argnums=1)
def _init_tree(key: jax.Array, spec: tuple[tuple[str, str, tuple[int, ...]], ...]) -> Params:
    """Draws every ``(layer, name, shape)`` in ``spec`` from one truncated-normal sample.

    One RNG call (instead of one per tensor) keeps compile time low: each distinct
    truncated-normal shape costs ~0.7 s of XLA:CPU compilation.
    """
    sizes = [math.prod(shape) for _, _, shape in spec]
    flat = _trunc_normal(key, (sum(sizes),))
    out: Params = {}
    offset = 0
    for (layer, name, shape), size in zip(spec, sizes, strict=True):
        out.setdefault(layer, {})[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    return out


def _dense_spec(layer: str, n_in: int, n_out: int) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return ((layer, "w", (n_in, n_out)), (layer, "b", (n_out,)))


_NHWC = ("NHWC", "HWIO", "NHWC")


def conv2d_valid(x: jax.Array, w: jax.Array) -> jax.Array:
    """Stride-1 VALID 2-D convolution of NHWC ``x`` with HWIO ``w``.

    >>> x = jnp.ones((2, 6, 6, 3)); w = jnp.ones((3, 3, 3, 4))
    >>> conv2d_valid(x, w).shape
    (2, 4, 4, 4)
    """
    return lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=_NHWC)


def _maxpool2(x: jax.Array) -> jax.Array:
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def lenet5_init(key: jax.Array, num_classes: int = 10) -> Params:
    """LeNet5 parameters: bias-free HWIO conv kernels, dense ``w``/``b``, all TruncNormal(0.02).

    >>> p = lenet5_init(jax.random.PRNGKey(0))
    >>> p["conv1"]["w"].shape, p["conv2"]["w"].shape, p["fc3"]["w"].shape
    ((5, 5, 1, 6), (5, 5, 6, 16), (84, 10))
    """
    spec = (
        ("conv1", "w", (5, 5, 1, 6)),
        ("conv2", "w", (5, 5, 6, 16)),
        *_dense_spec("fc1", 16 * 5 * 5, 120),
        *_dense_spec("fc2", 120, 84),
        *_dense_spec("fc3", 84, num_classes),
    )
    return _init_tree(key, spec)


def lenet5_apply(params: Params, x: jax.Array) -> jax.Array:
    """Logits of LeNet5 for float32 NHWC images ``x`` of shape (batch, 32, 32, 1).

    >>> p = lenet5_init(jax.random.PRNGKey(0))
    >>> lenet5_apply(p, jnp.zeros((4, 32, 32, 1))).shape
    (4, 10)
    """
    x = _maxpool2(jax.nn.relu(conv2d_valid(x, params["conv1"]["w"])))
    x = _maxpool2(jax.nn.relu(conv2d_valid(x, params["conv2"]["w"])))
    x = x.reshape(x.shape[0], -1)  # NHWC flatten order (5, 5, 16)
    x = jax.nn.relu(x @ params["fc1"]["w"] + params["fc1"]["b"])
    x = jax.nn.relu(x @ params["fc2"]["w"] + params["fc2"]["b"])
    return x @ params["fc3"]["w"] + params["fc3"]["b"]


def mlp_init(key: jax.Array, sizes: Sequence[int] = (1024, 128, 10)) -> Params:
    """MLP parameters ``{"layers": [{"w", "b"}, ...]}`` for the given layer widths.

    >>> p = mlp_init(jax.random.PRNGKey(0))
    >>> [layer["w"].shape for layer in p["layers"]]
    [(1024, 128), (128, 10)]
    """
    names = [f"{i}" for i in range(len(sizes) - 1)]
    spec = tuple(
        entry
        for name, a, b in zip(names, sizes[:-1], sizes[1:], strict=True)
        for entry in _dense_spec(name, a, b)
    )
    tree = _init_tree(key, spec)
    return {"layers": [tree[name] for name in names]}


def mlp_apply(params: Params, x: jax.Array) -> jax.Array:
    """Logits of the MLP (ReLU between layers); ``x`` is flattened to (batch, -1).

    >>> p = mlp_init(jax.random.PRNGKey(0))
    >>> mlp_apply(p, jnp.zeros((4, 32, 32))).shape
    (4, 10)
    """
    x = x.reshape(x.shape[0], -1)
    *hidden, last = params["layers"]
    for layer in hidden:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]
