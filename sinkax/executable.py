"""The sink-executable builder: pure programs over a chunk, compiled once per layout.

Two programs run a step function ``fn(state, batch) -> (state, out)`` over a *chunk* (batches
stacked on a leading axis, already on the device):

* :func:`scan_program` -- all steps of the chunk in one executable (``lax.scan``); compile time
  does not depend on the chunk length;
* :func:`step_program` -- one step, reading batch ``i`` of the chunk and writing its output into
  a preallocated stacked buffer; a host loop dispatches it once per step with no host-side data
  work. XLA:CPU optimises some step functions better outside a loop body (see
  ``sinkax.strategy``).

:class:`Compiler` compiles them ahead of time (``jit(...).lower(...).compile()``) with the state
donated, caches one executable per (program, argument layout), counts compiles and, when asked,
writes the StableHLO and the optimised HLO of each executable to a folder.

>>> import jax.numpy as jnp
>>> run = scan_program(lambda s, b: (s + b, s + b))
>>> run(jnp.float32(0), jnp.arange(3.0))
(Array(3., dtype=float32), Array([0., 1., 3.], dtype=float32))
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

StepFn = Callable[[Any, Any], tuple[Any, Any]]


def scan_program(fn: StepFn, unroll: int = 1) -> Callable[[Any, Any], tuple[Any, Any]]:
    """``(state, chunk) -> (state, outs)``: every step of ``chunk`` in one loop."""

    def run(state: Any, chunk: Any) -> tuple[Any, Any]:
        return lax.scan(fn, state, chunk, unroll=unroll)

    return run


def step_program(fn: StepFn) -> Callable[[Any, Any], Any]:
    """``((state, outs, i), chunk) -> (state, outs, i + 1)``: step ``i`` of ``chunk``."""

    def step(carry: tuple[Any, Any, jax.Array], chunk: Any) -> tuple[Any, Any, jax.Array]:
        state, outs, i = carry
        batch = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), chunk)
        state, out = fn(state, batch)
        outs = jax.tree.map(lambda buf, o: lax.dynamic_update_index_in_dim(buf, o, i, 0), outs, out)
        return state, outs, i + 1

    return step


def layout(tree: Any) -> tuple[Any, tuple[Any, ...]]:
    """Tree structure and abstract value of every leaf: what an executable is specialised to."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(jax.typeof(leaf) for leaf in leaves)


class Compiler:
    """Ahead-of-time compilation with a cache, a compile counter and optional graph dumps."""

    def __init__(self, name: str, save_graphs: str | os.PathLike[str] | None = None):
        self.name = name
        self.save_graphs = save_graphs
        self.compiles = 0
        self._cache: dict[Any, Any] = {}

    def get(self, kind: str, program: Callable[..., Any], *args: Any, steps: int) -> Any:
        """The executable of ``program`` for ``args``' layout, the first argument donated."""
        key = (kind, layout(args))
        if key not in self._cache:
            lowered = self.lower(program, *args)
            compiled = lowered.compile()
            self.compiles += 1
            if self.save_graphs:
                self._dump(f"{self.name}_{kind}_sink{steps}", lowered, compiled)
            self._cache[key] = compiled
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
