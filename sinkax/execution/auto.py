"""``"auto"``: measure ``"scan"`` against ``"loop"`` on the first call's own steps, keep the faster.

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
    feed = "stacked"  # as every candidate's

    def dispatches(self, steps: int) -> int:
        return (self.chosen or self._first).dispatches(steps)

    def run(self, state: Any, chunk: Any, offset: int, steps: int) -> tuple[Any, Any]:
        if self._key is None:
            batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), chunk)
            self._key = (layout(state), layout(batch), placement.platform(placement.of(chunk)))
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
