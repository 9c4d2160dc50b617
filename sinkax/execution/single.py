"""Strategies that need no device-resident chunk window: ``"step"`` and ``"eager"``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sinkax.execution.compiler import Compiler
from sinkax.execution.programs import StepFn, single_step_program
from sinkax.execution.stepfn import check_step_result, returned_dtypes


class Step:
    """One-step windows: the compiled step on one batch of a sequence, outputs given a leading
    axis inside the executable.

    ``batches_alike``: every batch has one layout (a sink's ring checks it), so the executable is
    looked up again only for a new state. Without it (non-sink mode, whose last eval batch may be
    smaller) every call looks it up by the state's and the batch's layout.
    """

    name = "step"
    atomic = True
    feed = "unstacked"  # one host batch, as the producer copied it
    done = None  # its batches own no memory the ring reuses

    def dispatches(self, steps: int) -> int:
        return 1

    def __init__(self, fn: StepFn, compiler: Compiler, batches_alike: bool = True):
        self._program = single_step_program(fn)
        self._compiler = compiler
        self._batches_alike = batches_alike
        self._last: tuple[Any, Any] = (None, None)  # state out, executable

    def _executable(self, state: Any, batch: Any) -> Any:
        return self._compiler.get("step1", 1, lambda: self._program, state, batch)

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        assert steps == 1, "resolve() gives 'step' to one-step sinks only"
        batch = chunk[offset]
        last_state, executable = self._last
        if state is not last_state or not self._batches_alike:
            executable = self._executable(state, batch)
        state, outs = executable(state, batch)
        self._last = (state, executable)
        return state, outs


class Eager:
    """PyNative mode: ``fn`` runs un-jitted, op by op, one batch at a time."""

    name = "eager"
    atomic = True  # nothing is donated
    feed = "stacked"
    done: Any = None  # the last window's results

    def dispatches(self, steps: int) -> int:
        return 0

    def __init__(self, fn: StepFn):
        self._fn = fn

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        outs = []
        for i in range(offset, offset + steps):
            result = self._fn(state, jax.tree.map(lambda x, i=i: x[i], chunk))
            check_step_result(result, state)
            dtypes = returned_dtypes(state, jax.eval_shape(lambda r=result: r[0]))
            leaves, treedef = jax.tree.flatten(result[0])  # typed as a compiled step's are:
            state = treedef.unflatten(map(_typed, leaves, dtypes))  # (a float -> float32)
            out = result[1]
            outs.append(out)
        self.done = (state, jax.tree.map(lambda *o: jnp.stack(o), *outs))
        return self.done


def _typed(leaf: Any, dtype: Any) -> Any:
    """``leaf`` as a jax array of ``dtype`` (a typed PRNG key as it is)."""
    return leaf if isinstance(leaf, jax.Array) and leaf.dtype == dtype else jnp.asarray(leaf, dtype)
