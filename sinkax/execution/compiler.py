"""Ahead-of-time compilation of the sink programs, cached per step function.

:class:`Compiler` compiles a program ahead of time (``jit(...).lower(...).compile()``) with the
state donated, caches one executable per (step function, program, window length, argument
layout) -- shared by all sinks of that step function: a process-wide cache, private to this
module -- counts compiles and, when asked, writes the StableHLO and the optimised HLO of each
executable to a folder. It refuses a step whose closure captured arrays that changed since its
executables compiled them in as constants (:func:`captured_arrays`).
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import os
import time
import types
import weakref
from collections.abc import Callable, Collection, Hashable
from typing import Any

import jax
import numpy as np

from sinkax.errors import warn
from sinkax.pytree import layout

_CARRY_ARRAYS = (
    "Carry arrays that change (params) through the sink as its state: "
    "`fn(params, batch) -> (params, out)`, called as `params, outs = sink(params)` (for eval: "
    "make_eval_step(..., carry_params=True)); one executable then serves every value."
)


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_loaded: weakref.WeakKeyDictionary[types.CodeType, frozenset[str]] = weakref.WeakKeyDictionary()


def global_loads(code: types.CodeType) -> frozenset[str]:
    """The global names ``code`` reads -- its ``LOAD_GLOBAL``/``LOAD_NAME`` instructions, and
    those of the functions, lambdas and comprehensions defined in it -- not the attribute or
    method names that ``code.co_names`` holds too (``nnx.state``, ``self.params``).

    >>> state = None
    >>> sorted(global_loads((lambda b: np.tanh(b).state + [state for _ in b]).__code__))
    ['np', 'state']
    """
    names = _loaded.get(code)
    if names is None:
        nested = (c for c in code.co_consts if isinstance(c, types.CodeType))
        names = frozenset(
            i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOADS
        ).union(*map(global_loads, nested))
        _loaded[code] = names
    return names


def captured_arrays(fn: Any) -> dict[str, tuple[Any, ...]]:
    """The arrays ``fn`` compiles in as constants, by where they are: the array leaves of its
    closure cells, of a ``functools.partial``'s arguments, and of the module globals its code
    reads (:func:`global_loads`; one level: not those of the functions it calls).

    >>> w = np.ones(2)
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
    for name in sorted(global_loads(code)):
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
    later sinks of the same function. ``compiles`` counts what this compiler had to build,
    ``seconds`` the time it spent building them; ``settle()``, if given, is called before each
    build (waiting there for work still running is not counted in ``seconds``); ``options``:
    XLA options every build compiles with (a backend's, see
    :func:`sinkax.backend.compiler_options`).
    """

    def __init__(
        self,
        fn: Any,
        name: str | None = None,
        save_graphs: str | os.PathLike[str] | None = None,
        settle: Callable[[], Any] | None = None,
        options: Collection[tuple[str, Any]] = (),
    ):
        self.name = name or getattr(fn, "__name__", type(fn).__name__).strip("<>")
        self.save_graphs, self._settle = save_graphs, settle
        self._options = tuple(options)  # part of the cache key: executables differ by them
        self.compiles, self.seconds = 0, 0.0
        try:
            self._cache = _shared.setdefault(fn, {})
        except TypeError:  # not weak-referenceable: cache per sink
            self._cache = {}
        self._dumped: dict[Any, str] = {}  # the file stem of each executable written
        self._fn = fn
        self._captured = captured_arrays(fn)
        if changed_captures(self._cache.get(_CAPTURED, {}), self._captured):
            self._cache.clear()  # compiled with other arrays in: stale for this sink
        self._cache[_CAPTURED] = self._captured
        if self._captured:
            warn(
                f"The step function {self.name} captures arrays ({', '.join(self._captured)}): "
                "they are compiled into its executables as constants, so a new step function "
                "per evaluation compiles again, and a sink refuses to run once they are "
                f"replaced. {_CARRY_ARRAYS}"
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
        self,
        kind: str,
        steps: int,
        make_program: Callable[[], Callable[..., Any]],
        *args: Any,
        donate: bool = True,
        variant: Hashable = None,
    ) -> Any:
        """The executable of ``make_program()`` for ``args``' layout, the first arg donated
        (if ``donate``); ``variant``: what else the program depends on that ``args`` do not show
        (e.g. the layout of the outputs it makes), part of the cache key."""
        key = (kind, steps, variant, self._options, layout(args))
        entry = self._cache.get(key)
        if entry is None:
            if self._settle is not None:
                self._settle()
            start = time.perf_counter()
            lowered = self.lower(make_program(), *args, donate=donate)
            entry = self._cache[key] = (lowered, lowered.compile(dict(self._options) or None))
            self.compiles += 1
            self.seconds += time.perf_counter() - start
        if self.save_graphs and key not in self._dumped:
            stem = _unused(f"{self.name}_{kind}_sink{steps}", self._dumped.values())
            self._dump(stem, *entry)
            self._dumped[key] = stem
        return entry[1]

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``, cached under ``key`` beside the executables (e.g. output shapes)."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    @staticmethod
    def lower(program: Callable[..., Any], *args: Any, donate: bool = True) -> jax.stages.Lowered:
        """``program`` lowered for ``args`` (concrete or ``jax.ShapeDtypeStruct``), the first
        donated (if ``donate``)."""
        return jax.jit(program, donate_argnums=0 if donate else ()).lower(*args)

    def _dump(self, stem: str, lowered: jax.stages.Lowered, compiled: jax.stages.Compiled) -> None:
        folder = os.fspath(self.save_graphs)  # type: ignore[arg-type]
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{stem}.stablehlo.mlir"), "w") as f:
            f.write(lowered.as_text())
        with open(os.path.join(folder, f"{stem}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())


def _unused(stem: str, taken: Collection[str]) -> str:
    """``stem``, or else the first of ``stem_2``, ``stem_3``, ... not ``taken``: the file names of
    executables of one kind and sink size but other layouts (a join of as many windows of other
    lengths, a window of another chunk shape)."""
    name, n = stem, 1
    while name in taken:
        n += 1
        name = f"{stem}_{n}"
    return name
