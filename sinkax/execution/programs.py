"""The sink programs: pure functions over a window of a chunk.

A *chunk* is batches stacked on a leading axis, already on the device; a call of the sink runs
a window of ``steps`` consecutive batches of it, starting at a dynamic ``offset`` (so several
calls can share one chunk and one transfer). Two programs run a step function
``fn(state, batch) -> (state, out)`` over such a window:

* :func:`window_program` -- ``n`` steps in one executable (a loop of dynamic trip count), each
  reading batch ``i`` of the chunk and writing its output into row ``j`` of a stacked buffer
  carried along; its compile time does not depend on ``steps``. :func:`scan_program` is one
  whole window of it;
* :func:`single_step_program` -- one step on one batch (not a chunk), its output given a
  leading axis of one: a one-step call on a batch handed over as it is;
* :func:`step_program` -- one step, reading batch ``i`` of the chunk and writing its output into
  row ``j`` of a preallocated stacked buffer; a host loop dispatches it once per step, with no
  host-side data work. XLA:CPU optimises some step functions better outside a loop body (see
  ``sinkax.execution.choice`` and ``sinkax.execution.rewrite``).

The two share the carry ``(state, outs, i, j)``, so a window can be run partly by one and partly
by the other: what ``"auto"`` does while it measures. :class:`~sinkax.execution.compiler.Compiler`
compiles them.

>>> import jax.numpy as jnp
>>> run = scan_program(lambda s, b: (s + b, s + b), steps=2)
>>> run(jnp.float32(0), jnp.arange(4.0), 1)
(Array(3., dtype=float32), Array([1., 3.], dtype=float32))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

StepFn = Callable[[Any, Any], tuple[Any, Any]]


def window_program(fn: StepFn) -> Callable[..., Any]:
    """``((state, outs, i, j), chunk, n) -> carry``: :func:`step_program`'s step ``n`` times in a
    loop -- batches ``i .. i+n`` into rows ``j .. j+n`` -- for any ``n`` (a dynamic trip count):
    one executable runs a whole window, or any part of it."""
    step = step_program(fn)

    def run(carry: tuple[Any, ...], chunk: Any, n: jax.Array) -> tuple[Any, ...]:
        return lax.fori_loop(0, n, lambda _, c: step(c, chunk), carry)

    return run


def out_shape(fn: StepFn, state: Any, chunk: Any) -> Any:
    """The abstract output of one step of ``fn`` on a batch of ``chunk``."""
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), chunk)
    return jax.eval_shape(fn, state, batch)[1]


def empty_outs(out: Any, steps: int) -> Any:
    """Zeros for ``steps`` stacked outputs ``out`` (see :func:`out_shape`): the buffer a
    window fills."""
    return jax.tree.map(lambda o: jnp.zeros((steps, *o.shape), o.dtype), out)


def scan_program(fn: StepFn, steps: int) -> Callable[..., tuple[Any, Any]]:
    """``(state, chunk, offset) -> (state, outs)``: steps ``offset .. offset+steps`` in a loop,
    the :func:`window_program` of one whole window."""

    def run(state: Any, chunk: Any, offset: jax.Array) -> tuple[Any, Any]:
        carry = (state, empty_outs(out_shape(fn, state, chunk), steps), offset, jnp.int32(0))
        return window_program(fn)(carry, chunk, steps)[:2]

    return run


def with_leading_axis(tree: Any) -> Any:
    """Every leaf with a new leading axis of length one: one step's output, stacked."""
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), tree)


def single_step_program(fn: StepFn) -> StepFn:
    """``(state, batch) -> (state, outs)``: one step, its output stacked as a window of one."""

    def step(state: Any, batch: Any) -> tuple[Any, Any]:
        state, out = fn(state, batch)
        return state, with_leading_axis(out)

    return step


def step_program(fn: StepFn) -> Callable[..., Any]:
    """``((state, outs, i, j), chunk) -> (state, outs, i + 1, j + 1)``: batch ``i`` -> row ``j``."""

    def step(carry: tuple[Any, Any, jax.Array, jax.Array], chunk: Any) -> tuple[Any, ...]:
        state, outs, i, j = carry
        batch = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), chunk)
        state, out = fn(state, batch)
        outs = jax.tree.map(lambda buf, o: lax.dynamic_update_index_in_dim(buf, o, j, 0), outs, out)
        return state, outs, i + 1, j + 1

    return step
