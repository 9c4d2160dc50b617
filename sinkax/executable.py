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

import contextlib
import functools
import inspect
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sinkax.pytree import Static, partition

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


def stateless(fn: Callable[[Any], Any]) -> StepFn:
    """``fn(batch) -> out`` as a step over an empty state: eval and predict steps."""
    return lambda state, batch: (state, fn(batch))


def check_step_form(fn: Callable[..., Any], stateful: bool) -> None:
    """``TypeError`` naming the call form to use if ``fn`` cannot be called as a step of the
    form the sink was called with: ``fn(state, batch)`` for ``sink(state)``, ``fn(batch)`` for
    ``sink()``. Functions without a signature pass.

    >>> check_step_form(lambda b: b, stateful=True)
    Traceback (most recent call last):
    ...
    TypeError: sink(state) runs a step fn(state, batch) -> (state, out), but <lambda>(b) takes ...
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins, some C callables: nothing to check
        return
    try:
        signature.bind(None, None) if stateful else signature.bind(None)
    except TypeError:
        name = getattr(fn, "__name__", type(fn).__name__)
        if stateful:
            raise TypeError(
                f"sink(state) runs a step fn(state, batch) -> (state, out), but {name}"
                f"{signature} takes no state. Call sink() for a stateless step (eval, predict): "
                "it returns the outputs of every step."
            ) from None
        raise TypeError(
            f"sink() runs a stateless step fn(batch) -> out, but {name}{signature} takes a "
            "state. Call sink(state): it returns (state, outs), the state to pass next time."
        ) from None


def check_step_result(result: Any, state: Any) -> None:
    """``TypeError`` naming the fix if ``result`` (what a step returned, concrete or abstract)
    is not ``(state, out)`` for the ``state`` it was given."""
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return
    only_state = jax.tree.structure(result) == jax.tree.structure(state)
    raise TypeError(
        "A step function fn(state, batch) must return a pair (new_state, out), but it returned "
        + (
            "what looks like the new state alone. Return `state, None` if there is no output."
            if only_state
            else f"{type(result).__name__}. Return `state, out` (out may be None)."
        )
    )


def with_static(fn: StepFn, static: Static) -> StepFn:
    """``fn`` as a step over the array part of its state (:func:`sinkax.pytree.partition`),
    the ``static`` rest (functions, flags) put back around it: what ``eqx.filter_jit`` does."""

    def step(arrays: Any, batch: Any) -> tuple[Any, Any]:
        state = static.combine(arrays)
        result = fn(state, batch)
        check_step_result(result, state)
        arrays, rest = partition(result[0])
        if not static.same(rest):
            raise TypeError(
                "The step function changed the state's non-array leaves (functions, flags, "
                "other Python objects): a sink compiles them in, as constants. Return them as "
                "they came in; values that change must be arrays."
            )
        return arrays, result[1]

    return step


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
    result = jax.eval_shape(fn, state, batch)
    check_step_result(result, state)
    out = result[0]
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


_CARRY_ARRAYS = (
    "Carry arrays that change (params) through the sink as its state: "
    "`fn(params, batch) -> (params, out)`, called as `params, outs = sink(params)` (for eval: "
    "make_eval_step(..., carry_params=True)); one executable then serves every value."
)

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


def captured_arrays(fn: Any) -> dict[str, tuple[Any, ...]]:
    """The arrays ``fn`` compiles in as constants, by where they are: the array leaves of its
    closure cells, of a ``functools.partial``'s arguments, and of the module globals its code
    names (one level: not those of the functions it calls).

    >>> w = jnp.ones(2)
    >>> list(captured_arrays(functools.partial(lambda w, b: b @ w, w)))
    ['argument 0 of the partial']
    """
    found: dict[str, tuple[Any, ...]] = {}

    def add(where: str, value: Any) -> None:
        leaves = tuple(x for x in jax.tree.leaves(value) if isinstance(x, jax.Array | np.ndarray))
        if leaves:
            found[where] = leaves

    fn = inspect.unwrap(fn)
    while isinstance(fn, functools.partial):
        for i, arg in enumerate(fn.args):
            add(f"argument {i} of the partial", arg)
        for name, arg in fn.keywords.items():
            add(f"argument {name}= of the partial", arg)
        fn = inspect.unwrap(fn.func)
    code = getattr(fn, "__code__", None)
    if code is None:
        return found
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        with contextlib.suppress(ValueError):  # an empty cell: not assigned yet
            add(name, cell.cell_contents)
    module = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in module:
            add(name, module[name])
    return found


def changed_captures(
    before: dict[str, tuple[Any, ...]], now: dict[str, tuple[Any, ...]]
) -> list[str]:
    """Where ``now`` holds other arrays than ``before`` (compared by identity)."""
    return [
        where
        for where in before.keys() | now.keys()
        if len(before.get(where, ())) != len(now.get(where, ()))
        or any(a is not b for a, b in zip(before.get(where, ()), now.get(where, ()), strict=True))
    ]


_CAPTURED = "captured arrays"  # the cache entry saying which arrays its executables compiled in

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
        self._fn = fn
        self._captured = captured_arrays(fn)
        if changed_captures(self._cache.get(_CAPTURED, {}), self._captured):
            self._cache.clear()  # compiled with other arrays in: stale for this sink
        self._cache[_CAPTURED] = self._captured
        if self._captured:
            warnings.warn(
                f"The step function {self.name} captures arrays ({', '.join(self._captured)}): "
                "they are compiled into its executables as constants, so a new step function "
                "per evaluation compiles again, and a sink refuses to run once they are "
                f"replaced. {_CARRY_ARRAYS}",
                stacklevel=4,
            )

    def specialise(self, key: Any) -> None:
        """From now on cache under ``key`` too: for a step function wrapped around constants
        (a state's static leaves) that the argument layouts do not show."""
        self._cache = self._cache.setdefault(("specialised", key), {})

    def check_captures(self) -> None:
        """``ValueError`` if the arrays the step function captures were replaced since its
        executables compiled them in: they would run with the old values."""
        if not self._captured:
            return
        changed = changed_captures(self._captured, captured_arrays(self._fn))
        if changed:
            raise ValueError(
                f"The step function {self.name} captures arrays that were replaced since it was "
                f"compiled ({', '.join(sorted(changed))}): its executables hold the old values as "
                f"constants and would compute with them. {_CARRY_ARRAYS}"
            )

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
