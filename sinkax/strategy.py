"""Execution strategies: how the steps of one device-resident chunk are run.

* ``"scan"``  -- one executable runs the whole chunk (``lax.scan``): one dispatch per chunk. The
  loop-sink proper, and the fastest choice wherever the step compiles as well inside a loop body
  as outside (GPU, dense-only networks on CPU).
* ``"loop"``  -- the compiled step is dispatched once per step over slices of the chunk, which
  stays on the device. No per-step host data work, but one dispatch per step. On XLA:CPU some step
  functions (e.g. convolutions' weight gradients) only get the fast kernels outside a while-loop
  body; for those this beats ``"scan"``.
* ``"step"``  -- one-step calls only: the compiled step runs on one batch as the producer copied
  it, unstacked, which XLA takes at dispatch, as a plain jitted step does. On a CPU device the
  device memory is host memory, so stacking batches into a ring of chunks and slicing them out
  again is more memory traffic, in a second thread that competes with XLA's compute threads for
  the cores.
* ``"eager"`` -- PyNative: the step function runs un-jitted, op by op, for prints and breakpoints.
* ``"auto"``  -- times ``"scan"`` and ``"loop"`` on whole sinks (compile time excluded) and
  keeps the faster per step. The first :data:`MIN_TRIAL_S` of calls run untimed (the producer
  is still filling the ring then, which would bias whichever ran first); then the candidates
  run in the order A, B, B, A (each trial at least :data:`MIN_TRIAL_S` of calls), each judged
  by its best trial (noise only ever slows a trial down). ``"scan"`` -- the loop sink proper --
  is kept unless ``"loop"`` is faster by :data:`PREFER_MARGIN`; measuring stops after A, B
  when ``"scan"`` is clearly faster (by :data:`CLEAR_MARGIN`), while a ``"loop"`` that looks
  faster waits for the second round, which gives ``"scan"`` a second trial: one slow spell of a
  shared machine during a scan trial does not decide. A sink of one-step calls is not measured (see
  :func:`resolve`). ``Sink.stats`` records the choice and the timings.

Every strategy computes the same steps in the same order; only speed differs. Each runs a
window of ``steps`` batches of a chunk, starting at ``offset``: batches stacked on the device, or
for ``"step"``, a sequence of unstacked batches (see :func:`takes_stacked_chunks`).

>>> import jax.numpy as jnp
>>> from sinkax.executable import Compiler
>>> loop = Loop(lambda s, b: (s + b, s + b), Compiler(None, "demo"))
>>> loop.run(jnp.float32(0), jnp.arange(4.0), offset=1, steps=3)[1]
Array([1., 3., 6.], dtype=float32)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from sinkax import placement
from sinkax.executable import (
    Compiler,
    StepFn,
    check_step_result,
    layout,
    scan_program,
    single_step_program,
    step_program,
)
from sinkax.pytree import stacked_zeros

if TYPE_CHECKING:
    from sinkax.backend import Backend

NAMES = ("auto", "scan", "loop", "step")
CLEAR_MARGIN = 1.5
MIN_TRIAL_S = 0.2
PREFER_MARGIN = 1.1


class Strategy(Protocol):
    """Runs ``fn`` over a window of a chunk."""

    name: str
    atomic: bool  # one dispatch and no blocking per window: an interrupt cannot split it

    def dispatches(self, steps: int) -> int:
        """Executables dispatched to run a window of ``steps``."""

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        """``(state, outs)`` after batches ``offset .. offset+steps``; ``state`` is donated."""


class Candidate(Strategy, Protocol):
    """A strategy that :class:`Auto` can time: it compiles ahead, outside the timed run."""

    def prepare(self, state: Any, chunk: Any, offset: int, steps: int) -> None:
        """Compile what :meth:`run` needs for this layout, running nothing."""


class Scan:
    """All steps of a window in one ``lax.scan`` executable."""

    name = "scan"
    atomic = True

    def dispatches(self, steps: int) -> int:
        return 1

    def __init__(self, fn: StepFn, compiler: Compiler, unroll: int = 1):
        self._fn, self._unroll, self._compiler = fn, unroll, compiler
        self._last: tuple[Any, ...] = (None, None, None, None)  # state out, chunk, steps, exe

    def _executable(self, state: Any, chunk: Any, offset: int, steps: int) -> Any:
        def program():
            return scan_program(self._fn, steps, self._unroll)

        return self._compiler.get("scan", steps, program, state, chunk, offset)

    def prepare(self, state: Any, chunk: Any, offset: int, steps: int) -> None:
        self._executable(state, chunk, offset, steps)

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        last_state, last_chunk, last_steps, executable = self._last
        if not (state is last_state and chunk is last_chunk and steps == last_steps):
            executable = self._executable(state, chunk, offset, steps)
        # the usual call passes back the state the last one returned, on the same chunk: its
        # layout is known, so the lookup above (a walk over every leaf) is skipped
        state, outs = executable(state, chunk, offset)
        self._last = (state, chunk, steps, executable)
        return state, outs


class Loop:
    """The compiled step dispatched once per batch of the device-resident chunk."""

    name = "loop"
    atomic = False

    def dispatches(self, steps: int) -> int:
        return steps

    def __init__(self, fn: StepFn, compiler: Compiler):
        self._fn = fn
        self._program = step_program(fn)
        self._compiler = compiler

    def _out_shape(self, state: Any, chunk: Any) -> Any:
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), chunk)
        return jax.eval_shape(self._fn, state, batch)[1]

    def _start(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, ...]:
        key = ("out_shape", layout((state, chunk)))
        out = self._compiler.memo(key, lambda: self._out_shape(state, chunk))
        where = placement.replicated(jax.tree.leaves(chunk)[0].sharding)
        outs = stacked_zeros(out, steps, where)
        start = jax.device_put((outs, np.int32(offset), np.int32(0)), where)  # one transfer
        return (state, *start)

    def _executable(self, carry: Any, chunk: Any, steps: int) -> Any:
        return self._compiler.get("step", steps, lambda: self._program, carry, chunk)

    def prepare(self, state: Any, chunk: Any, offset: int, steps: int) -> None:
        self._executable(self._start(state, chunk, offset, steps), chunk, steps)

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        carry = self._start(state, chunk, offset, steps)
        step = self._executable(carry, chunk, steps)
        devices = jax.tree.leaves(chunk)[0].sharding.device_set
        bounded = len(devices) > 1 and next(iter(devices)).platform == "cpu"
        for i in range(steps):
            carry = step(carry, chunk)
            if i == 0 and len(devices) > 1:  # over several devices the step may return the
                step = self._executable(carry, chunk, steps)  # outputs sharded otherwise
            if bounded:  # XLA:CPU's devices deadlock in a collective with many steps in flight
                jax.block_until_ready(carry)
        return carry[0], carry[1]


class Step:
    """One-step windows: the compiled step on one batch of a sequence, outputs given a leading
    axis inside the executable.

    ``batches_alike``: every batch has one layout (a sink's ring checks it), so the executable is
    looked up again only for a new state. Without it (non-sink mode, whose last eval batch may be
    smaller) every call looks it up by the state's and the batch's layout.
    """

    name = "step"
    atomic = True

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

    def dispatches(self, steps: int) -> int:
        return 0

    def __init__(self, fn: StepFn):
        self._fn = fn

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        outs = []
        for i in range(offset, offset + steps):
            result = self._fn(state, jax.tree.map(lambda x, i=i: x[i], chunk))
            check_step_result(result, state)
            state, out = result
            outs.append(out)
        return state, jax.tree.map(lambda *o: jnp.stack(o), *outs)


class Auto:
    """Measures each candidate on whole sinks, then keeps the fastest per step.

    Each trial runs whole calls until it has :data:`MIN_TRIAL_S` of measured work, so that tiny
    sinks are not judged on one noisy call.
    """

    def __init__(self, candidates: list[Candidate], clock: Callable[[], float] = time.perf_counter):
        self._schedule = [candidates[0], *candidates, *reversed(candidates)]  # warm-up, A B B A
        self._first, *self._others = candidates  # the first is kept unless another is faster
        self._clock = clock
        self._trial = 0
        self._trial_s = self._trial_steps = 0.0
        self.chosen: Candidate | None = None
        self.last: Candidate = candidates[0]
        self.timings: dict[str, float] = {c.name: math.inf for c in candidates}

    @property
    def name(self) -> str:
        return self.chosen.name if self.chosen else "auto (measuring)"

    @property
    def atomic(self) -> bool:
        """False while measuring: a trial blocks after its dispatch."""
        return self.chosen.atomic if self.chosen else False

    def dispatches(self, steps: int) -> int:
        return (self.chosen or self.last).dispatches(steps)

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        if self.chosen:
            return self.chosen.run(state, chunk, offset, steps)
        candidate = self.last = self._schedule[self._trial]
        candidate.prepare(state, chunk, offset, steps)
        t0 = self._clock()
        state, outs = jax.block_until_ready(candidate.run(state, chunk, offset, steps))
        self._trial_s += self._clock() - t0
        self._trial_steps += steps
        if self._trial_s >= MIN_TRIAL_S:
            if self._trial > 0:  # the warm-up trial is not recorded
                per_step = self._trial_s / self._trial_steps
                self.timings[candidate.name] = min(self.timings[candidate.name], per_step)
            self._trial += 1
            self._trial_s = self._trial_steps = 0.0
            rivals = [self.timings[c.name] for c in self._others]
            clear = all(map(math.isfinite, rivals)) and (
                min(rivals) > CLEAR_MARGIN * self.timings[self._first.name]
            )
            if clear or self._trial == len(self._schedule):
                self.chosen = self._fastest()
        return state, outs

    def _fastest(self) -> Candidate:
        """The first candidate, unless another is faster by :data:`PREFER_MARGIN`."""
        best = min(self._others, key=lambda c: self.timings[c.name])
        if self.timings[best.name] * PREFER_MARGIN < self.timings[self._first.name]:
            return best
        return self._first


def resolve(
    name: str,
    *,
    jit: bool,
    steps_per_call: int | None,
    backend: Backend,
    devices: int = 1,
    processes: int = 1,
) -> str:
    """The strategy a sink runs, by name: ``name`` itself, or what ``"auto"`` settles to
    without measuring.

    Without jit, ``"eager"``. ``"auto"`` for one-step calls measures nothing: XLA inlines a loop of
    one trip, so ``"scan"`` *is* the standalone step, and where host memory is device memory
    (CPU) ``"step"`` runs it without the ring's copy. ``"step"`` needs one-step calls on one
    device (it hands over host batches, unplaced). Over several devices ``"auto"`` is
    ``"scan"``: across processes each would time its own trials and might choose differently,
    while every process must run the same programs; and ``"loop"`` over several XLA:CPU devices
    waits for each step (with many steps in flight their collectives deadlocked here), which
    ``"scan"`` never needs.

    >>> from sinkax.backend import Backend
    >>> cpu = Backend("cpu", True, True, True, True, 1)
    >>> resolve("auto", jit=True, steps_per_call=1, backend=cpu)
    'step'
    >>> resolve("auto", jit=True, steps_per_call=1, backend=Backend("gpu", *[False] * 4, 1))
    'scan'
    """
    if name not in NAMES:
        raise ValueError(f"strategy must be one of {NAMES}, got {name!r}.")
    if name == "step" and steps_per_call != 1:
        raise ValueError(
            f"strategy='step' runs one step per call, but this sink runs {steps_per_call} steps "
            "per call. Use sink_size=1, or strategy='scan' / 'loop' / 'auto' for longer sinks."
        )
    if name == "step" and devices > 1:
        raise ValueError(
            f"strategy='step' hands each host batch to the step unplaced, on one device; this "
            f"sink's sharding spans {devices} devices. Use strategy='scan' (or 'auto')."
        )
    if not jit:
        return "eager"
    if name == "auto" and steps_per_call == 1:
        return "step" if backend.host_is_device and devices == 1 else "scan"
    if name == "auto" and (processes > 1 or devices > 1):
        return "scan"
    return name


def takes_stacked_chunks(name: str) -> bool:
    """Whether the strategy ``name`` runs on batches stacked on the device (the ring's copy), or,
    for ``"step"``, on a sequence of unstacked batches."""
    return name != "step"


def make(name: str, fn: StepFn, compiler: Compiler, batches_alike: bool = True) -> Strategy | Auto:
    """The strategy called ``name``, as :func:`resolve` gave it (``batches_alike``: see
    :class:`Step`)."""
    if name == "eager":
        return Eager(fn)
    if name == "auto":
        return Auto([Scan(fn, compiler), Loop(fn, compiler)])
    if name == "step":
        return Step(fn, compiler, batches_alike)
    return {"scan": Scan, "loop": Loop}[name](fn, compiler)
