"""The sink programs: pure functions over a window of a chunk.

A *chunk* is batches stacked on a leading axis, already on the device; a call of the sink runs
a window of ``steps`` consecutive batches of it, starting at ``i``, a position already on the
device (so several calls share one chunk and one transfer, and a call transfers nothing else).
The programs run a step function ``fn(state, batch) -> (state, out)`` over such a window:

* :func:`scan_program` -- the whole window in one executable: a loop of ``steps`` trips, known
  when it compiles (so no backend needs to read a loop condition back per trip), whose outputs
  the loop itself stacks; one step is a straight-line program. It returns the position after
  the window too: where the next call's window starts, already on the device;
* :func:`start_program` and :func:`step_program` -- the carry ``(state, outs, i, j)`` of a host
  loop that dispatches the compiled step once per batch (batch ``i`` into row ``j`` of ``outs``),
  with no host-side data work: the output buffer and the positions are made on the device by
  :func:`start_program`. XLA:CPU optimises some step functions better outside a loop body (see
  ``sinkax.execution.choice`` and ``sinkax.execution.rewrite``);
* :func:`single_step_program` -- one step on one batch (not a chunk), its output given a
  leading axis of one: a one-step call on a batch handed over as it is.

:class:`~sinkax.execution.compiler.Compiler` compiles them.

>>> import jax.numpy as jnp
>>> run = scan_program(lambda s, b: (s + b, s + b), steps=2)
>>> run(jnp.float32(0), jnp.arange(4.0), jnp.int32(1))
(Array(3., dtype=float32), Array([1., 3.], dtype=float32), Array(3, dtype=int32))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

StepFn = Callable[[Any, Any], tuple[Any, Any]]


def batch_at(chunk: Any, i: jax.Array) -> Any:
    """Batch ``i`` of ``chunk`` (a dynamic index: one program serves every position)."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), chunk)


def scan_program(fn: StepFn, steps: int) -> Callable[..., tuple[Any, Any, jax.Array]]:
    """``(state, chunk, i) -> (state, outs, i + steps)``: batches ``i .. i+steps`` of ``chunk``
    in a loop of ``steps`` trips, ``outs`` stacked by the loop."""

    def run(state: Any, chunk: Any, i: jax.Array) -> tuple[Any, Any, jax.Array]:
        if steps == 1:  # a straight-line program: no loop to run
            return (*single_step_program(fn)(state, batch_at(chunk, i)), i + 1)

        def body(carry: tuple[Any, jax.Array], _: None) -> tuple[tuple[Any, jax.Array], Any]:
            state, k = carry
            state, out = fn(state, batch_at(chunk, k))
            return (state, k + 1), out

        (state, end), outs = lax.scan(body, (state, i), None, length=steps)
        return state, outs, end

    return run


def with_last_output(
    window: Callable[..., tuple[Any, Any, jax.Array]],
) -> Callable[..., tuple[Any, Any, jax.Array, Any]]:
    """``window`` (a program such as :func:`scan_program`'s) returning its last step's output
    too: ``(state, chunk, i) -> (state, outs, end, last)``, what a progress report reads."""

    def run(state: Any, chunk: Any, i: jax.Array) -> tuple[Any, Any, jax.Array, Any]:
        state, outs, end = window(state, chunk, i)
        return state, outs, end, jax.tree.map(lambda o: o[-1], outs)

    return run


def concat_program(parts: list[Any]) -> Any:
    """Alike trees of stacked outputs (a list) as one tree, concatenated leaf by leaf along the
    steps: the outputs of consecutive windows."""
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *o: jnp.concatenate(o), *parts)


def out_shape(fn: StepFn, state: Any, chunk: Any) -> Any:
    """The abstract output of one step of ``fn`` on a batch of ``chunk``."""
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), chunk)
    return jax.eval_shape(fn, state, batch)[1]


def start_program(out: Any, steps: int) -> Callable[[jax.Array], tuple[Any, ...]]:
    """``i -> (outs, i, 0)``: the device-made rest of :func:`step_program`'s carry before batch
    ``i`` -- zeros for ``steps`` stacked outputs like ``out`` (see :func:`out_shape`) and the
    positions, fresh buffers that the steps may consume."""

    def start(i: jax.Array) -> tuple[Any, ...]:
        return jax.tree.map(lambda o: stacked_zeros(o, steps), out), i + 0, jnp.int32(0)

    return start


def stacked_zeros(out: jax.ShapeDtypeStruct, steps: int) -> jax.Array:
    """Zeros for ``steps`` stacked ``out``, weakly typed where ``out`` is -- as ``lax.scan``
    stacks a Python number's output, so that the outputs promote alike under every strategy (a
    weak leaf has its kind's default dtype: that of a Python zero of the kind)."""
    if out.weak_type:
        return jnp.full((steps, *out.shape), np.zeros((), out.dtype).item())
    return jnp.zeros((steps, *out.shape), out.dtype)


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
        state, out = fn(state, batch_at(chunk, i))
        outs = jax.tree.map(lambda buf, o: put_row(buf, o, j), outs, out)
        return state, outs, i + 1, j + 1

    return step


def put_row(buf: jax.Array, row: jax.Array, j: jax.Array) -> jax.Array:
    """``buf`` with ``row`` at index ``j``, weakly typed if ``buf`` is (``.at[j].set`` keeps a
    weak type; ``dynamic_update_slice``, the plainer program, takes its strong index's)."""
    if jax.typeof(buf).weak_type:
        return buf.at[j].set(row)
    return lax.dynamic_update_index_in_dim(buf, row, j, 0)
