"""The strategies that run a window of a stacked chunk: ``"scan"`` and ``"loop"``.

Both make their output buffers on the device and take the window's first position as a device
scalar: the position the last window ended at (the usual case: calls run through a chunk in
order), or else one kept per value (a chunk's first position, once): a call transfers nothing
but the chunks. See :mod:`sinkax.execution.choice` for when each is used.

>>> import jax.numpy as jnp
>>> from sinkax.execution.compiler import Compiler
>>> loop = Loop(lambda s, b: (s + b, s + b), Compiler(None, "demo"))
>>> loop.run(jnp.float32(0), jnp.arange(4.0), offset=1, steps=3)[1]
Array([1., 3., 6.], dtype=float32)
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import jax
import numpy as np

from sinkax import placement
from sinkax.backend import Backend, backend_of
from sinkax.execution.compiler import Compiler
from sinkax.execution.guard import Guarded
from sinkax.execution.programs import (
    StepFn,
    concat_program,
    out_shape,
    scan_program,
    start_program,
    step_program,
    with_last_output,
)
from sinkax.execution.rewrite import canonical_convs
from sinkax.pytree import copy_tree, layout

MAX_BLOCKS = 64  # reported blocks of a window at most: each is a dispatch, the join's inputs


class Strategy(Protocol):
    """Runs ``fn`` over a window of a chunk."""

    name: str
    atomic: bool  # compiles before its first dispatch, which donates the state: see Sink
    feed: ClassVar[str]  # what it runs on: "stacked" chunks on the device, or "unstacked" batches
    # arrays the last window's compute makes that nothing donates or hands out: ready once that
    # compute is done, when its chunk's slot may be refilled (None: nothing to wait for)
    done: Any

    def dispatches(self, steps: int) -> int:
        """Executables dispatched to run a window of ``steps``."""

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        """``(state, outs)`` after batches ``offset .. offset+steps``; ``state`` is donated."""


def loop_body(fn: StepFn, backend: Backend) -> StepFn:
    """``fn`` as a loop body on ``backend``: where XLA:CPU compiles it, its convolutions in
    XLA:CPU's canonical layout (:func:`~sinkax.execution.rewrite.canonical_convs`), which XLA:CPU
    gives only a standalone step."""
    return canonical_convs(fn) if backend.xla_cpu else fn


def scan_window(fn: StepFn, backend: Backend, steps: int) -> Any:
    """The program of a ``"scan"`` window of ``steps`` on ``backend``: ``(state, chunk, i) ->
    (state, outs, end)``; a guarded step (``stop_if_nonfinite``) runs unguarded unless a step of
    the window was not finite (:meth:`~sinkax.execution.guard.Guarded.window`)."""
    if isinstance(fn, Guarded):
        return fn.window(lambda step: scan_program(loop_body(step, backend), steps))
    return scan_program(loop_body(fn, backend), steps)


def one_in_flight(chunk: Any) -> bool:
    """Whether windows over ``chunk`` dispatch one executable at a time, each after the last
    one's compute: over several XLA:CPU devices, whose collectives deadlocked with many
    executables in flight (a loop of sink calls that waited for none aborted the process)."""
    sharding = placement.of(chunk)
    return len(sharding.device_set) > 1 and backend_of(sharding).xla_cpu


def keeping_shardings(program: Callable[..., Any], state: Any) -> Callable[..., Any]:
    """``program`` (whose first argument and first result are the state, or for
    :func:`~sinkax.execution.programs.step_program` begin with it) returning the state placed as
    ``state`` is, leaf by leaf: a state sharded over a mesh (FSDP-style, or over a ``"model"``
    axis) comes back sharded alike, where XLA would otherwise choose the outputs' shardings
    (and the next call would not fit the executable). ``program`` itself on one device."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    if all(len(s.device_set) == 1 for s in jax.tree.leaves(shardings)):
        return program

    def kept(*args: Any) -> Any:
        new, *rest = program(*args)
        return (jax.lax.with_sharding_constraint(new, shardings), *rest)

    return kept


class Windowed(abc.ABC):
    """A strategy over windows of device-resident chunks: :meth:`executables` compiles what a
    window needs (nothing runs, nothing is donated), :meth:`launch` runs it."""

    name: str
    atomic = True  # everything is compiled before the first dispatch donates the state
    feed: ClassVar[str] = "stacked"
    done: Any = None  # the position the last window ended at: see Strategy

    def __init__(self, fn: StepFn, compiler: Compiler):
        self._fn, self._compiler = fn, compiler
        self._positions: dict[Any, jax.Array] = {}  # first positions, by value and devices
        self._end: tuple[int, Any] = (-1, None)  # where the last window ended, and on the device
        self._last: tuple[Any, Any, Any] = (None, None, None)  # state out, window, executables
        self._bounded = False  # one executable in flight at a time: see one_in_flight

    @abc.abstractmethod
    def dispatches(self, steps: int) -> int:
        """Executables dispatched to run a window of ``steps``."""

    def reported(self, steps: int) -> int:
        """Steps of a window of ``steps`` that its blocks report (see
        :mod:`sinkax.execution.progress`): none."""
        return 0

    @abc.abstractmethod
    def executables(self, state: Any, chunk: Any, start: jax.Array, steps: int) -> Any:
        """What runs a window of ``steps`` for these layouts, compiled; runs nothing."""

    @abc.abstractmethod
    def launch(
        self, executables: Any, state: Any, chunk: Any, start: jax.Array, steps: int
    ) -> tuple[Any, Any, jax.Array]:
        """``(state, outs, end)`` after the window from ``start``, run by ``executables``;
        ``end`` is the position after it, on the device."""

    def position(self, offset: int, chunk: Any) -> jax.Array:
        """``offset`` as an int32 on ``chunk``'s devices: where the last window ended, or else
        transferred once per value."""
        end_offset, end = self._end
        if offset == end_offset:
            return end
        where = placement.replicated(placement.of(chunk))
        key = (offset, where)
        if key not in self._positions:
            self._positions[key] = jax.device_put(np.int32(offset), where)
        return self._positions[key]

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        start = self.position(offset, chunk)
        window = (steps, layout(chunk))  # a chunk has few leaves: cheap, unlike the state
        last_state, last_window, executables = self._last
        if state is not last_state or window != last_window:
            executables = self.executables(state, chunk, start, steps)
            self._bounded = one_in_flight(chunk)
        if self._bounded and self.done is not None:  # the last window's compute (a call's too)
            jax.block_until_ready(self.done)
        state, outs, end = self.launch(executables, state, chunk, start, steps)
        self._last = (state, window, executables)  # the usual next call passes `state` back
        self._end = (offset + steps, end)
        self.done = end  # on the device, never donated: an input of the next window at most
        return state, outs


class Scan(Windowed):
    """All steps of a window in one executable (:func:`~sinkax.execution.programs.scan_program`);
    with progress reports, a window of ``every`` steps or more in blocks of ``every`` steps
    (at most :data:`MAX_BLOCKS`), one executable each, dispatched back to back (each block's
    last output handed to ``submit``, see :mod:`sinkax.execution.progress`), then the steps
    left, and their outputs joined by one more. Guarded (``stop_if_nonfinite``), such blocks
    run the plain step and the join checks the window once, from a copy of its first state
    (:meth:`~sinkax.execution.guard.Guarded.redo`).

    Where XLA:CPU compiles it, the step's convolutions are put in XLA:CPU's canonical layout
    first (see :mod:`sinkax.execution.rewrite`): inside a loop body XLA:CPU does not do that
    itself.
    """

    name = "scan"

    def __init__(self, fn: StepFn, compiler: Compiler, report: Any = None):
        super().__init__(fn, compiler)
        self._report = report  # (every, submit): see sinkax.execution.progress

    def _blocks(self, steps: int) -> tuple[int, int, int]:
        """``(size, blocks, left)``: the reported blocks of a window of ``steps`` -- of
        ``every`` steps, or of a multiple of it where more than :data:`MAX_BLOCKS` would run
        -- and the steps left after them."""
        if self._report is None:
            return 0, 0, steps
        every = self._report[0]
        size = every * -(-steps // (every * MAX_BLOCKS))
        return size, *divmod(steps, size)

    def _redone(self, blocks: int) -> Guarded | None:
        """The guarded step whose window of ``blocks`` reported blocks the join checks (and
        runs again from a copy of its start, see :meth:`Guarded.redo`); ``None``: no such."""
        return self._fn if blocks and isinstance(self._fn, Guarded) else None

    def dispatches(self, steps: int) -> int:
        _, blocks, rest = self._blocks(steps)
        parts = blocks + bool(rest)
        if self._redone(blocks):  # a copy of the window's start, the join
            return parts + 2
        return parts + (parts > 1)

    def reported(self, steps: int) -> int:
        """Steps of a window of ``steps`` that its blocks report."""
        return steps - self._blocks(steps)[2]

    def executables(self, state: Any, chunk: Any, start: jax.Array, steps: int) -> Any:
        """``(block, size, blocks, left, join)``: the executable of a block of ``size`` steps and
        how often it runs, that of the steps left (or ``None``), that of the join (or
        ``None``); all compiled now."""
        backend = backend_of(placement.of(chunk))
        size, blocks, rest = self._blocks(steps)
        redone = self._redone(blocks)  # guarded blocks run the plain step, flagged

        def window(n: int, last: bool = False) -> Any:
            def program() -> Any:
                if redone:
                    run = redone.flagging(lambda step: scan_program(loop_body(step, backend), n))
                else:
                    run = scan_window(self._fn, backend, n)
                return keeping_shardings(with_last_output(run) if last else run, state)

            variant = ("last output" if last else None, "flagging" if redone else None)
            return self._compiler.get("scan", n, program, state, chunk, start, variant=variant)

        block = window(size, last=True) if blocks else None
        left = window(rest) if rest else None
        if blocks + bool(rest) == 1 and not redone:  # no join (nor out_info, which jax has
            return block, size, blocks, left, None, False  # not for ordered effects' programs)
        outs = [block.out_info[1]] * blocks if blocks else []
        outs += [left.out_info[1]] if rest else []
        join = None
        where = tuple(x.sharding for x in jax.tree.leaves(outs))  # placements: not in the layout
        if redone:  # the window again from its start, guarded, if a step was not finite
            checked = scan_program(loop_body(redone, backend), steps)
            join = self._compiler.get(
                "guarded join",
                steps,
                lambda: keeping_shardings(redone.redo(checked, steps), state),
                state,  # donated (the carry only: the parts' outputs join into new buffers)
                state,
                outs,
                chunk,
                start,
                variant=where,
            )
        elif len(outs) > 1:  # compiled for the outputs' layouts
            join = self._compiler.get(
                "concat", len(outs), lambda: concat_program, outs, donate=False, variant=where
            )
        return block, size, blocks, left, join, bool(redone)

    def launch(
        self, executables: Any, state: Any, chunk: Any, start: jax.Array, steps: int
    ) -> tuple[Any, Any, jax.Array]:
        block, size, blocks, left, join, redone = executables
        first = copy_tree(state) if redone else None  # what the join may compute again from
        parts, end = [], start
        for _ in range(blocks):
            state, outs, end, last = block(state, chunk, end)
            parts.append(outs)
            self._report[1](size, last)
            if self._bounded:
                jax.block_until_ready(last)
        if left is not None:
            state, outs, end = left(state, chunk, end)
            parts.append(outs)
        if redone:  # its end is the window's: the chunk is read until it is done
            return join(state, first, parts, chunk, start)
        return state, join(parts) if join else parts[0], end


class Loop(Windowed):
    """The compiled step dispatched once per batch of the device-resident chunk, after one
    small executable that makes the output buffer and positions on the device."""

    name = "loop"
    _started: Any = None  # the start of the window whose executables were just looked up

    def dispatches(self, steps: int) -> int:
        return steps + 1

    def executables(self, state: Any, chunk: Any, start: jax.Array, steps: int) -> Any:
        out = self._compiler.memo(
            ("out_shape", layout((state, chunk))), lambda: out_shape(self._fn, state, chunk)
        )
        begin = self._compiler.get(
            "loop start",
            steps,
            lambda: start_program(out, steps),
            start,
            donate=False,
            variant=layout(out),  # its argument does not show the outputs' layout
        )
        self._started = begin(start)  # donates nothing; the concrete carry gives the step's
        carry = (state, *self._started)  # layout, and starts this window
        step = self._compiler.get("step", steps, self._step_program(state), carry, chunk)
        return begin, step

    def _step_program(self, state: Any) -> Callable[[], Any]:
        """Makes the program of one step, returning the state placed as ``state`` is."""
        return lambda: keeping_shardings(step_program(self._fn), state)

    def launch(
        self, executables: Any, state: Any, chunk: Any, start: jax.Array, steps: int
    ) -> tuple[Any, Any, jax.Array]:
        begin, step = executables
        devices = placement.of(chunk).device_set
        started, self._started = self._started or begin(start), None
        carry = (state, *started)
        for i in range(steps):
            carry = step(carry, chunk)
            if i == 0 and len(devices) > 1:  # over several devices the step may return the
                step = self._compiler.get(  # carry sharded otherwise
                    "step", steps, self._step_program(state), carry, chunk
                )
            if self._bounded:
                jax.block_until_ready(carry)
        return carry[0], carry[1], carry[2]
