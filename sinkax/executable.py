"""The sink-executable builder: pure programs over a window of a chunk, compiled per layout.

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
  ``sinkax.strategy`` and ``sinkax.rewrite``).

The two share the carry ``(state, outs, i, j)``, so a window can be run partly by one and partly
by the other: what ``"auto"`` does while it measures.

:class:`Compiler` compiles them ahead of time (``jit(...).lower(...).compile()``) with the state
donated, caches one executable per (step function, program, window length, argument layout) --
shared by all sinks of that step function -- counts compiles and, when asked, writes the
StableHLO and the optimised HLO of each executable to a folder.

>>> import jax.numpy as jnp
>>> run = scan_program(lambda s, b: (s + b, s + b), steps=2)
>>> run(jnp.float32(0), jnp.arange(4.0), 1)
(Array(3., dtype=float32), Array([1., 3.], dtype=float32))
"""

from __future__ import annotations

import os
import weakref
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


def empty_outs(out: Any, steps: int, zeros: Callable[..., Any] = jnp.zeros) -> Any:
    """``zeros`` for ``steps`` stacked outputs ``out`` (see :func:`out_shape`): the buffer a
    window fills."""
    return jax.tree.map(lambda o: zeros((steps, *o.shape), o.dtype), out)


def scan_program(fn: StepFn, steps: int) -> Callable[..., tuple[Any, Any]]:
    """``(state, chunk, offset) -> (state, outs)``: steps ``offset .. offset+steps`` in a loop,
    the :func:`window_program` of one whole window."""

    def run(state: Any, chunk: Any, offset: jax.Array) -> tuple[Any, Any]:
        carry = (state, empty_outs(out_shape(fn, state, chunk), steps), offset, jnp.int32(0))
        return window_program(fn)(carry, chunk, steps)[:2]

    return run


def stateless(fn: Callable[[Any], Any]) -> StepFn:
    """``fn(batch) -> out`` as a step over an empty state: eval and predict steps."""
    return lambda state, batch: (state, fn(batch))


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


def carry_dtypes(fn: StepFn, state: Any, batch: Any) -> list[Any]:
    """The dtype of each leaf of ``state`` with which ``fn`` returns the state as it takes it.

    The rule of ``lax.scan``'s carry: a weakly typed leaf (from a Python number) takes the
    dtype ``fn`` gives it; any other change of structure, shape or dtype is an error naming the
    leaf, as a sink runs one compiled step on the state the last one returned.

    >>> carry_dtypes(lambda s, b: (s + b, b), 0, jnp.float32(1))
    [dtype('float32')]
    """
    out = jax.eval_shape(fn, state, batch)[0]
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    out_leaves, out_treedef = jax.tree.flatten(out)
    if out_treedef != treedef:
        raise TypeError(
            f"The step function returns the state with structure {out_treedef}, but was given "
            f"{treedef}. {_SAME_LAYOUT}"
        )
    dtypes = []
    for (path, leaf), returned in zip(flat, out_leaves, strict=True):
        given = jax.typeof(leaf)
        if given.shape != returned.shape or not (given.dtype == returned.dtype or given.weak_type):
            raise TypeError(
                f"The step function returns state leaf {jax.tree_util.keystr(path) or '<root>'} "
                f"as {returned.dtype}{list(returned.shape)}, but was given "
                f"{given.dtype}{list(given.shape)}. {_SAME_LAYOUT}"
            )
        dtypes.append(returned.dtype)
    return dtypes


_SAME_LAYOUT = (
    "A sink runs one compiled step on the state the last step returned: return the state with "
    "the structure, shapes and dtypes it came in with (cast in the step, or start from a state "
    "of the dtypes it returns)."
)


@jax.jit
def copy_tree(tree: Any) -> Any:
    """A fresh copy of every leaf, in one dispatch: what a donating call may consume while the
    original stays valid.

    >>> x = jnp.ones(3); y = copy_tree(x)
    >>> y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    True
    """
    return jax.tree.map(jnp.copy, tree)


@jax.jit
def concat_trees(trees: list[Any]) -> Any:
    """Leaf-wise concatenation along the leading axis of a list of alike trees, in one dispatch."""
    return jax.tree.map(lambda *parts: jnp.concatenate(parts), *trees)


def layout(tree: Any) -> tuple[Any, tuple[Any, ...]]:
    """Tree structure and abstract value of every leaf: what an executable is specialised to."""
    leaves, treedef = jax.tree.flatten(tree)
    # .aval and .sharding are cheap attribute reads; this runs on every call of a sink. An
    # executable is compiled for its arguments' devices, so they are part of the layout.
    return treedef, tuple(
        (x.aval, x.sharding) if isinstance(x, jax.Array) else jax.typeof(x) for x in leaves
    )


# Executables by step function, shared by every sink of that function (a new sink over the same
# step and layouts compiles nothing); weak keys let a function and its executables go together.
_shared: weakref.WeakKeyDictionary[Any, dict[Any, tuple[Any, Any]]] = weakref.WeakKeyDictionary()


class Compiler:
    """Ahead-of-time compilation with a shared cache, a compile counter and optional dumps.

    ``fn`` is the user's step function: executables are cached under it, so they are reused by
    later sinks of the same function. ``compiles`` counts what this compiler had to build.
    """

    def __init__(
        self, fn: Any, name: str | None = None, save_graphs: str | os.PathLike[str] | None = None
    ):
        self.name = name or getattr(fn, "__name__", type(fn).__name__).strip("<>")
        self.save_graphs = save_graphs
        self.compiles = 0
        try:
            self._cache = _shared.setdefault(fn, {})
        except TypeError:  # not weak-referenceable: cache per sink
            self._cache = {}
        self._dumped: set[Any] = set()

    def get(
        self, kind: str, steps: int, make_program: Callable[[], Callable[..., Any]], *args: Any
    ) -> Any:
        """The executable of ``make_program()`` for ``args``' layout, the first arg donated."""
        key = (kind, steps, layout(args))
        entry = self._cache.get(key)
        if entry is None:
            lowered = self.lower(make_program(), *args)
            entry = self._cache[key] = (lowered, lowered.compile())
            self.compiles += 1
        if self.save_graphs and key not in self._dumped:
            self._dump(f"{self.name}_{kind}_sink{steps}", *entry)
            self._dumped.add(key)
        return entry[1]

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``, cached under ``key`` beside the executables (e.g. output shapes)."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    @staticmethod
    def lower(program: Callable[..., Any], *args: Any) -> jax.stages.Lowered:
        """``program`` lowered for ``args`` (concrete or ``jax.ShapeDtypeStruct``)."""
        return jax.jit(program, donate_argnums=0).lower(*args)

    def _dump(self, stem: str, lowered: jax.stages.Lowered, compiled: jax.stages.Compiled) -> None:
        folder = os.fspath(self.save_graphs)  # type: ignore[arg-type]
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{stem}.stablehlo.mlir"), "w") as f:
            f.write(lowered.as_text())
        with open(os.path.join(folder, f"{stem}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
