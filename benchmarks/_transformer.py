"""A small decoder-only transformer language model as pure functions (pre-LayerNorm, causal
multi-head attention, GELU MLP, tied embeddings): the "real GPU work" workload of
benchmarks/gpu_sink_sizes.py, next to the dispatch-bound MLP and LeNet5."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LMShape:
    """Sizes of the model and of one batch (``batch`` sequences of ``seq`` tokens)."""

    vocab: int = 2048
    seq: int = 128
    width: int = 256
    layers: int = 4
    heads: int = 4
    batch: int = 16


TINY = LMShape(vocab=64, seq=16, width=32, layers=1, heads=2, batch=4)  # CPU dry runs


def init(key: jax.Array, shape: LMShape) -> dict[str, Any]:
    """Parameters: token and position embeddings, ``layers`` blocks, a final LayerNorm."""
    d = shape.width
    keys = iter(jax.random.split(key, 2 + 4 * shape.layers))

    def dense(n_in: int, n_out: int) -> jax.Array:
        return jax.random.normal(next(keys), (n_in, n_out)) * n_in**-0.5

    block = lambda: {  # noqa: E731
        "ln1": jnp.ones(d),
        "qkv": dense(d, 3 * d),
        "out": dense(d, d),
        "ln2": jnp.ones(d),
        "up": dense(d, 4 * d),
        "down": dense(4 * d, d),
    }
    return {
        "embed": jax.random.normal(next(keys), (shape.vocab, d)) * 0.02,
        "position": jax.random.normal(next(keys), (shape.seq, d)) * 0.02,
        "blocks": [block() for _ in range(shape.layers)],
        "ln": jnp.ones(d),
    }


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale


def _attention(x: jax.Array, p: dict[str, jax.Array], heads: int) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // heads) ** -0.5
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return mixed.reshape(b, t, d) @ p["out"]


def apply(params: dict[str, Any], tokens: jax.Array, heads: int) -> jax.Array:
    """Next-token logits ``(batch, seq, vocab)`` of ``tokens`` ``(batch, seq)``."""
    x = params["embed"][tokens] + params["position"][: tokens.shape[1]]
    for p in params["blocks"]:
        x = x + _attention(_norm(x, p["ln1"]), p, heads)
        x = x + jax.nn.gelu(_norm(x, p["ln2"]) @ p["up"]) @ p["down"]
    return _norm(x, params["ln"]) @ params["embed"].T


def batches(shape: LMShape, num_batches: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``num_batches`` of random token sequences: ``{"tokens", "targets"}`` (tokens shifted)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_batches):
        text = rng.integers(0, shape.vocab, (shape.batch, shape.seq + 1)).astype(np.int32)
        out.append({"tokens": text[:, :-1], "targets": text[:, 1:]})
    return out
