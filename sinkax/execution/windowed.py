"""The strategies that run a window of a stacked chunk through one carry: ``"scan"``, ``"loop"``.

Both run the carry ``(state, outs, i, j)`` of :func:`~sinkax.execution.programs.step_program`
(batch ``i`` into row ``j`` of ``outs``), so that :class:`~sinkax.execution.auto.Auto` can run
one window partly with each. See :mod:`sinkax.execution.choice` for when each is used.

>>> import jax.numpy as jnp
>>> from sinkax.execution.compiler import Compiler
>>> loop = Loop(lambda s, b: (s + b, s + b), Compiler(None, "demo"))
>>> loop.run(jnp.float32(0), jnp.arange(4.0), offset=1, steps=3)[1]
Array([1., 3., 6.], dtype=float32)
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Protocol

import jax
import numpy as np

from sinkax import placement
from sinkax.backend import Backend, backend_of
from sinkax.execution.compiler import Compiler
from sinkax.execution.programs import StepFn, out_shape, step_program, window_program
from sinkax.execution.rewrite import canonical_convs
from sinkax.pytree import layout, stacked_zeros


class Strategy(Protocol):
    """Runs ``fn`` over a window of a chunk."""

    name: str
    atomic: bool  # compiles before its first dispatch, which donates the state: see Sink
    feed: ClassVar[str]  # what it runs on: "stacked" chunks on the device, or "unstacked" batches

    def dispatches(self, steps: int) -> int:
        """Executables dispatched to run a window of ``steps``."""

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        """``(state, outs)`` after batches ``offset .. offset+steps``; ``state`` is donated."""


class Windowed(abc.ABC):
    """A strategy that runs a window through the carry ``(state, outs, i, j)`` of
    :func:`~sinkax.execution.programs.step_program` (batch ``i`` into row ``j`` of ``outs``), so
    that :class:`~sinkax.execution.auto.Auto` can run one window partly with each candidate.

    :meth:`executable` compiles (nothing runs), :meth:`advance` runs ``n`` steps of the carry.
    """

    name: str
    atomic = True  # everything is compiled before the first dispatch donates the state
    feed: ClassVar[str] = "stacked"

    def __init__(self, fn: StepFn, compiler: Compiler):
        self._fn, self._compiler = fn, compiler
        self._last: tuple[Any, ...] = (None,) * 5  # state out, chunk, steps, exe, one output

    @abc.abstractmethod
    def dispatches(self, steps: int) -> int:
        """Executables dispatched to run a window of ``steps``."""

    @abc.abstractmethod
    def executable(self, carry: Any, chunk: Any, steps: int) -> Any:
        """The compiled program for ``carry``'s layout; runs nothing."""

    @abc.abstractmethod
    def advance(self, executable: Any, carry: Any, chunk: Any, n: int) -> Any:
        """``carry`` after the next ``n`` steps, run by ``executable``."""

    def start(
        self, state: Any, chunk: Any, offset: int, steps: int, out: Any = None
    ) -> tuple[Any, ...]:
        """The carry before batch ``offset`` of a window of ``steps``: an empty output buffer
        for outputs like ``out`` (one step's, abstract; looked up when not given)."""
        if out is None:
            key = ("out_shape", layout((state, chunk)))
            out = self._compiler.memo(key, lambda: out_shape(self._fn, state, chunk))
        where = placement.replicated(placement.of(chunk))
        outs = stacked_zeros(out, steps, where)
        return (state, *jax.device_put((outs, np.int32(offset), np.int32(0)), where))

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        last_state, last_chunk, last_steps, executable, out = self._last
        if state is last_state and chunk is last_chunk and steps == last_steps:
            # the usual call passes back the state the last one returned, on the same chunk:
            # its layout is known, so the lookups (walks over every leaf) are skipped
            carry = self.start(state, chunk, offset, steps, out)
        else:
            carry = self.start(state, chunk, offset, steps)
            executable = self.executable(carry, chunk, steps)
            out = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), carry[1])
        carry = self.advance(executable, carry, chunk, steps)
        self._last = (carry[0], chunk, steps, executable, out)
        return carry[0], carry[1]


def loop_body(fn: StepFn, backend: Backend) -> StepFn:
    """``fn`` as a loop body on ``backend``: where XLA:CPU compiles it, its convolutions in
    XLA:CPU's canonical layout (:func:`~sinkax.execution.rewrite.canonical_convs`), which XLA:CPU
    gives only a standalone step."""
    return canonical_convs(fn) if backend.xla_cpu else fn


class Scan(Windowed):
    """All steps of a window in one executable (:func:`~sinkax.execution.programs.window_program`).

    On a CPU device the step's convolutions are put in XLA:CPU's canonical layout first (see
    :mod:`sinkax.execution.rewrite`): inside a loop body XLA:CPU does not do that itself.
    """

    name = "scan"

    def dispatches(self, steps: int) -> int:
        return 1

    def executable(self, carry: Any, chunk: Any, steps: int) -> Any:
        def program():
            return window_program(loop_body(self._fn, backend_of(placement.of(chunk))))

        return self._compiler.get("scan", steps, program, carry, chunk, np.int32(steps))

    def advance(self, executable: Any, carry: Any, chunk: Any, n: int) -> Any:
        return executable(carry, chunk, np.int32(n))


class Loop(Windowed):
    """The compiled step dispatched once per batch of the device-resident chunk."""

    name = "loop"

    def dispatches(self, steps: int) -> int:
        return steps

    def executable(self, carry: Any, chunk: Any, steps: int) -> Any:
        return self._compiler.get("step", steps, lambda: step_program(self._fn), carry, chunk)

    def advance(self, executable: Any, carry: Any, chunk: Any, n: int) -> Any:
        sharding = placement.of(chunk)
        devices = sharding.device_set
        bounded = len(devices) > 1 and backend_of(sharding).xla_cpu
        for i in range(n):
            carry = executable(carry, chunk)
            if i == 0 and len(devices) > 1:  # over several devices the step may return the
                steps = len(jax.tree.leaves(carry[1])[0]) if jax.tree.leaves(carry[1]) else 0
                executable = self.executable(carry, chunk, steps)  # carry sharded otherwise
            if bounded:  # XLA:CPU's devices deadlock in a collective with many steps in flight
                jax.block_until_ready(carry)
        return carry
