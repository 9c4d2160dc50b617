"""``"auto"``: measure ``"scan"`` against ``"loop"`` on the sink's own windows, keep the faster.

See :mod:`sinkax.execution.choice` for how the trials run and what is kept.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax

from sinkax import placement
from sinkax.execution.compiler import Compiler
from sinkax.execution.windowed import Windowed
from sinkax.pytree import layout

CLEAR_MARGIN = 1.5


PREFER_MARGIN = 1.1


TRIAL_S = 0.01


class Auto:
    """Measures its candidates on whole windows, in the order A, B, A, then keeps the fastest.

    A trial is one or more consecutive windows of one candidate, timed from the end of the last
    window's compute to the end of its own, less what compiling them took, until it spans
    :data:`TRIAL_S` seconds. Trials start at the first window of more than one step: over one
    step (an auto sink's first calls) the candidates differ only in the launches around the
    step, so ``candidates[0]`` runs it (``"scan"``: the step alone) and nothing is measured or
    compiled for the others.
    ``candidates[0]`` is kept unless another is faster than its best trial by
    :data:`PREFER_MARGIN` and by more than its trials differ (:meth:`_fastest`). The decision is
    kept beside the executables (per step function, state and batch layout, device) and reused by
    every later sink of the same step; :meth:`reselect` measures again.
    """

    def __init__(
        self,
        candidates: list[Windowed],
        compiler: Compiler,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._candidates, self._compiler = candidates, compiler
        self._first, *self._others = candidates
        self._decisions: dict[Any, str] = compiler.memo("auto decisions", dict)
        self._clock = clock
        self._key: Any = None
        self._ran: Windowed = self._first  # the candidate that ran the last window
        self._reset()
        self._use_decided = True  # what an earlier sink of this step decided

    def reselect(self) -> None:
        """Measure again at the next call, ignoring the decision made for this step before."""
        self._reset()
        self._use_decided = False

    def _reset(self) -> None:
        self.chosen: Windowed | None = None
        self.timings: dict[str, float] = {c.name: math.inf for c in self._candidates}
        self._first_trials: list[float] = []  # per step, of each trial of candidates[0]
        self._pending = [*self._candidates, self._first]  # A B A: see the module docstring
        self._trial_s, self._trial_steps = 0.0, 0  # of the trial under way
        self._one_step = False  # undecided, the last window was one step: not measured

    def pin(self, name: str) -> None:
        """Run the candidate called ``name`` from now on, measuring nothing."""
        self.chosen = next(c for c in self._candidates if c.name == name)

    @property
    def name(self) -> str:
        if self.chosen:
            return self.chosen.name
        return "auto (scan: one-step windows)" if self._one_step else "auto (measuring)"

    atomic = True  # every candidate compiles before a window's first dispatch
    feed = "stacked"  # as every candidate's

    @property
    def done(self) -> Any:
        return self._ran.done

    def dispatches(self, steps: int) -> int:
        return self._ran.dispatches(steps)

    def reported(self, steps: int) -> int:
        return self._ran.reported(steps)

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        if self._key is None:
            batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), chunk)
            self._key = (layout(state), layout(batch), placement.platform(placement.of(chunk)))
        if self.chosen is None and self._use_decided and self._key in self._decisions:
            self.pin(self._decisions[self._key])
        self._one_step = self.chosen is None and steps == 1  # (see the class docstring)
        if self.chosen is not None or self._one_step:
            self._ran = self.chosen or self._first
            return self._ran.run(state, chunk, offset, steps)
        return self._trial(state, chunk, offset, steps)

    def _trial(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        """Run the window with the candidate on trial, timed; judge the trial once it is long
        enough."""
        candidate = self._ran = self._pending[0]
        jax.block_until_ready(state)
        t0, compiled = self._clock(), self._compiler.seconds
        result = jax.block_until_ready(candidate.run(state, chunk, offset, steps))
        # a candidate compiles in its first window: not part of its speed
        self._trial_s += self._clock() - t0 - (self._compiler.seconds - compiled)
        self._trial_steps += steps
        if self._trial_s >= TRIAL_S:
            per_step = self._trial_s / self._trial_steps
            self.timings[candidate.name] = min(self.timings[candidate.name], per_step)
            if candidate is self._first:
                self._first_trials.append(per_step)
            self._pending.pop(0)
            self._trial_s, self._trial_steps = 0.0, 0
            if not self._pending or self._clearly_first():
                self.chosen = self._fastest()
                self._decisions[self._key] = self.chosen.name
        return result

    def _clearly_first(self) -> bool:
        rivals = [self.timings[c.name] for c in self._others]
        first = self.timings[self._first.name]
        return all(map(math.isfinite, rivals)) and min(rivals) > CLEAR_MARGIN * first

    def _fastest(self) -> Windowed:
        """The first candidate, unless another beats its best trial by :data:`PREFER_MARGIN`
        *and* by more than the first's own trials differ -- the noise of this machine in this
        window: two candidates within noise of each other always keep the first, so that the
        choice does not flip from run to run."""
        best = min(self._others, key=lambda c: self.timings[c.name])
        first, rival = self.timings[self._first.name], self.timings[best.name]
        noise = max(self._first_trials) - min(self._first_trials)
        if rival * PREFER_MARGIN < first and rival < first - noise:
            return best
        return self._first
