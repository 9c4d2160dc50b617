"""Execution strategies: how the steps of one device-resident chunk are run.

* ``"scan"``  -- one executable runs the whole window (a loop of dynamic trip count): one
  dispatch per window. The loop-sink proper. On a CPU device the step's convolutions are first
  put in XLA:CPU's canonical layout (:mod:`sinkax.rewrite`), which XLA:CPU itself does only
  outside loop bodies; with that, a convolutional step is as fast in the loop as standalone.
* ``"loop"``  -- the compiled step is dispatched once per step over slices of the chunk, which
  stays on the device. No per-step host data work, but one dispatch per step: for steps that
  XLA compiles better outside a loop body than inside one.
* ``"step"``  -- one-step calls only: the compiled step runs on one batch as the producer copied
  it, unstacked, which XLA takes at dispatch, as a plain jitted step does. On a CPU device the
  device memory is host memory, so stacking batches into a ring of chunks and slicing them out
  again is more memory traffic, in a second thread that competes with XLA's compute threads for
  the cores.
* ``"eager"`` -- PyNative: the step function runs un-jitted, op by op, for prints and breakpoints.
* ``"auto"``  -- measures ``"scan"`` and ``"loop"`` on the steps of the first call itself and
  keeps the faster per step. Both share one carry (state, output buffer, positions), so a
  window can be run partly by each, every step once and in order: one untimed step each (first
  runs are slow), one timed step that sizes the trials to about :data:`TRIAL_S`, then trials
  in the order A, B, A (``"scan"``, ``"loop"``, ``"scan"``), and the rest of the window with
  the choice. Each candidate is judged by its best trial: noise only ever slows a trial down,
  so one slow spell of a shared machine in a scan trial does not decide, and one in the loop
  trial keeps scan, the safe default. ``"scan"`` -- the loop sink proper -- is kept unless
  ``"loop"`` is faster by :data:`PREFER_MARGIN`; measuring stops after A, B when ``"scan"`` is
  clearly faster (by :data:`CLEAR_MARGIN`). A call too short for the trials carries them on
  into the next calls, so the decision comes after about ``3 * TRIAL_S`` of steps: inside the
  first call when it is that long. Both executables are compiled before the first dispatch and
  serve any window length, so measuring compiles nothing extra; its cost is what the slower
  candidate loses in its trial. The choice is kept per step function, state and batch layout
  and platform, and reused by every later sink of that step (``Sink.reselect()`` measures
  again); the environment variable :data:`ENV` or a data position that recorded a choice pins
  it (see :func:`pinned`). A sink of one-step calls is not measured (see :func:`resolve`).
  ``Sink.stats`` records the choice and the timings.

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

import abc
import math
import os
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
    out_shape,
    single_step_program,
    step_program,
    window_program,
)
from sinkax.pytree import stacked_zeros
from sinkax.rewrite import canonical_convs

if TYPE_CHECKING:
    from sinkax.backend import Backend

NAMES = ("auto", "scan", "loop", "step")
RECORDED = ("scan", "loop")  # the choices of "auto", which a data position records
ENV = "SINKAX_STRATEGY"  # pins what "auto" runs, e.g. SINKAX_STRATEGY=scan
CLEAR_MARGIN = 1.5
PREFER_MARGIN = 1.1
TRIAL_S = 0.01


class Strategy(Protocol):
    """Runs ``fn`` over a window of a chunk."""

    name: str
    atomic: bool  # compiles before its first dispatch, which donates the state: see Sink

    def dispatches(self, steps: int) -> int:
        """Executables dispatched to run a window of ``steps``."""

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        """``(state, outs)`` after batches ``offset .. offset+steps``; ``state`` is donated."""


class Windowed(abc.ABC):
    """A strategy that runs a window through the carry ``(state, outs, i, j)`` of
    :func:`~sinkax.executable.step_program` (batch ``i`` into row ``j`` of ``outs``), so that
    :class:`Auto` can run one window partly with each candidate.

    :meth:`executable` compiles (nothing runs), :meth:`advance` runs ``n`` steps of the carry.
    """

    name: str
    atomic = True  # everything is compiled before the first dispatch donates the state

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
        where = placement.replicated(_sharding(chunk))
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


def loop_body(fn: StepFn, platform: str) -> StepFn:
    """``fn`` as a loop body on ``platform``: on CPU its convolutions in XLA:CPU's canonical
    layout (:func:`~sinkax.rewrite.canonical_convs`), which XLA:CPU gives only a standalone
    step."""
    return canonical_convs(fn) if platform == "cpu" else fn


def _sharding(chunk: Any) -> jax.sharding.Sharding:
    return jax.tree.leaves(chunk)[0].sharding


class Scan(Windowed):
    """All steps of a window in one executable (:func:`~sinkax.executable.window_program`).

    On a CPU device the step's convolutions are put in XLA:CPU's canonical layout first (see
    :mod:`sinkax.rewrite`): inside a loop body XLA:CPU does not do that itself.
    """

    name = "scan"

    def dispatches(self, steps: int) -> int:
        return 1

    def executable(self, carry: Any, chunk: Any, steps: int) -> Any:
        def program():
            return window_program(loop_body(self._fn, placement.platform(_sharding(chunk))))

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
        devices = _sharding(chunk).device_set
        bounded = len(devices) > 1 and next(iter(devices)).platform == "cpu"
        for i in range(n):
            carry = executable(carry, chunk)
            if i == 0 and len(devices) > 1:  # over several devices the step may return the
                steps = len(jax.tree.leaves(carry[1])[0]) if jax.tree.leaves(carry[1]) else 0
                executable = self.executable(carry, chunk, steps)  # carry sharded otherwise
            if bounded:  # XLA:CPU's devices deadlock in a collective with many steps in flight
                jax.block_until_ready(carry)
        return carry


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
    """Measures its candidates on windows of the steps of the first call, then keeps the fastest.

    ``candidates[0]`` is kept unless another is faster by :data:`PREFER_MARGIN`. The decision is
    kept beside the executables (per step function, state and batch layout, device) and reused by
    every later sink of the same step; :meth:`reselect` measures again.
    """

    def __init__(
        self,
        candidates: list[Windowed],
        compiler: Compiler,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._candidates = candidates
        self._first, *self._others = candidates
        self._decisions: dict[Any, str] = compiler.memo("auto decisions", dict)
        self._clock = clock
        self._key: Any = None
        self._reset()
        self._use_decided = True  # what an earlier sink of this step decided

    def reselect(self) -> None:
        """Measure again at the next call, ignoring the decision made for this step before."""
        self._reset()
        self._use_decided = False

    def _reset(self) -> None:
        self.chosen: Windowed | None = None
        self.timings: dict[str, float] = {c.name: math.inf for c in self._candidates}
        self._warm = list(self._candidates)  # one untimed step each: first runs are slow
        self._pending = [*self._candidates, self._first]  # A B A: see the module docstring
        self._k: int | None = None  # steps per trial, from one timed step
        self._trial_s, self._trial_steps = 0.0, 0  # of the trial under way

    def pin(self, name: str) -> None:
        """Run the candidate called ``name`` from now on, measuring nothing."""
        self.chosen = next(c for c in self._candidates if c.name == name)

    @property
    def name(self) -> str:
        return self.chosen.name if self.chosen else "auto (measuring)"

    atomic = True  # every candidate compiles before the window's first dispatch

    def dispatches(self, steps: int) -> int:
        return (self.chosen or self._first).dispatches(steps)

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        if self._key is None:
            batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), chunk)
            self._key = (layout(state), layout(batch), placement.platform(_sharding(chunk)))
        if self.chosen is None and self._use_decided and self._key in self._decisions:
            self.pin(self._decisions[self._key])
        if self.chosen is not None:
            return self.chosen.run(state, chunk, offset, steps)
        return self._measure(state, chunk, offset, steps)

    def _measure(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        """Run the window, trials first: each step once, in order, whichever candidate runs it.
        A trial longer than what is left of the window continues in the next call."""
        carry = self._first.start(state, chunk, offset, steps)
        executables = {c.name: c.executable(carry, chunk, steps) for c in self._candidates}
        left = steps

        def advance(candidate: Windowed, n: int) -> float:
            """Seconds ``candidate`` takes to run the next ``n`` steps."""
            nonlocal carry, left
            jax.block_until_ready(carry)
            t0 = self._clock()
            carry = candidate.advance(executables[candidate.name], carry, chunk, n)
            jax.block_until_ready(carry)
            left -= n
            return self._clock() - t0

        while left and self._warm:
            advance(self._warm.pop(0), 1)
        if left and self._k is None:
            self._k = max(1, round(TRIAL_S / advance(self._first, 1)))
        while self.chosen is None and self._k is not None and left:
            candidate = self._pending[0]
            n = min(left, self._k - self._trial_steps)
            self._trial_s += advance(candidate, n)
            self._trial_steps += n
            if self._trial_steps == self._k:
                per_step = self._trial_s / self._k
                self.timings[candidate.name] = min(self.timings[candidate.name], per_step)
                self._pending.pop(0)
                self._trial_s, self._trial_steps = 0.0, 0
                if not self._pending or self._clearly_first():
                    self.chosen = self._fastest()
                    self._decisions[self._key] = self.chosen.name
        if left:
            rest = self.chosen or self._first
            carry = rest.advance(executables[rest.name], carry, chunk, left)
        return carry[0], carry[1]

    def _clearly_first(self) -> bool:
        rivals = [self.timings[c.name] for c in self._others]
        first = self.timings[self._first.name]
        return all(map(math.isfinite, rivals)) and min(rivals) > CLEAR_MARGIN * first

    def _fastest(self) -> Windowed:
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


def check_recorded(recorded: Any) -> None:
    """``ValueError`` unless ``recorded`` is a strategy a data position may record."""
    if recorded not in RECORDED:
        raise ValueError(
            f"data_state['strategy'] must be one of {RECORDED} (what Sink.data_state() "
            f"records), got {recorded!r:.100}."
        )


def pinned(name: str, recorded: str | None = None) -> str:
    """What a sink resolved to ``name`` (see :func:`resolve`) runs: ``"auto"`` -- which then
    measures -- becomes the strategy a saved data position ``recorded`` (see
    ``Sink.data_state``), else the environment variable :data:`ENV`; any other name stays.

    >>> pinned("auto", recorded="loop"), pinned("scan", recorded="loop")
    ('loop', 'scan')
    """
    if name != "auto":
        return name
    if recorded is not None:
        check_recorded(recorded)
        return recorded
    env = os.environ.get(ENV, "auto")
    if env not in ("auto", *RECORDED):
        raise ValueError(f"The environment variable {ENV}={env!r}: use one of {RECORDED} or auto.")
    return env


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
        return Auto([Scan(fn, compiler), Loop(fn, compiler)], compiler)
    if name == "step":
        return Step(fn, compiler, batches_alike)
    return {"scan": Scan, "loop": Loop}[name](fn, compiler)
