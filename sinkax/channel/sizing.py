"""``sink_size="auto"``: calls that size themselves to last about ``call_seconds``.

The producer plans an auto sink's data as *granules*, small calls of a power of two of steps
(:meth:`CallSizer.granule`; a granule never crosses an epoch's end), and a call takes whole
granules until it holds its share of what is left of the epoch, split evenly into calls of
about the target steps (:meth:`CallSizer.evened`, :attr:`CallSizer.target`), or reaches an
epoch's end: an epoch ends in calls of about the target rather than one of a few steps, and a
steady target cuts every epoch into the same calls (whose joins compile once). A
granule is one window of the strategy, so the executables are those of a few powers of two,
shared by every call size; once the target is the whole epoch (calls that an epoch's end cuts
short of ``call_seconds``), the granule is the epoch: each call one window. When a call starts,
its target follows the measured rate of the last :data:`WINDOW` calls: ``call_seconds`` times
their steps per second from the first one's start to this one's (so a caller that waits for each
call's results times each call whole, its compute included, whatever the device still ran when
it returned) less what they spent compiling, at most :data:`GROWTH` times the last target (or
:data:`SETTLED_GROWTH` times where that time is sure to cover their compute: the device had done
them when this call started, and they compiled nothing) and at least a :data:`GROWTH`-th of it,
never over an epoch, and kept while the measured one is within
:data:`KEPT_SIZE` of it but for the whole epoch (a call of several windows joins their outputs
in an executable compiled per size: a steady size compiles it once); a call that failed or
stopped early is not measured, nor the calls before it. The granule follows the target (an
:data:`GRANULES`-th of it, kept while a call of the target holds :data:`KEPT_GRANULES` of it, so
that a target drifting in steady state compiles nothing new), lagging by the chunks the producer
has read ahead.

The target and the granule are part of the data position (``DataPosition.call_steps``,
``call_granule``): a resumed sink starts at the size the saved one had reached, not small
again, in the granule it had. With ``total_steps`` (the steps the
sink will run, e.g. ``DatasetHelper``'s epochs) the plan ends there and so does the last call,
whatever its target: nothing is read past it.

>>> sizer = CallSizer(call_seconds=1.0, epoch_length=None)
>>> sizer.target, sizer.granule()
(1, 1)
>>> sizer.measured(steps=1, seconds=0.01); sizer.target   # 100 steps/s: at most GROWTH x
8
>>> sizer.measured(steps=8, seconds=0.08); sizer.target
64
>>> sizer.measured(steps=64, seconds=0.64); sizer.target, sizer.granule()
(100, 8)
>>> epoch_bound = CallSizer(call_seconds=1.0, epoch_length=50, target=50)
>>> epoch_bound.granule()
50
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
import time
from collections.abc import Callable
from typing import Any

import jax

from sinkax.channel.position import DataPosition
from sinkax.channel.source import Position

GROWTH = 8  # a call's target grows or shrinks at most this much per call
# ... or grows at most this much after calls timed whole (see CallSizer.started): a caller that
# does not wait for results may time a call's dispatch alone, but not then
SETTLED_GROWTH = 64
WINDOW = 2  # the calls a rate is measured over (more: steadier, slower to follow)
GRANULES = 8  # a call of the target holds at least this many granules (but for the first)
KEPT_GRANULES = (GRANULES // 2, GRANULES * 4)  # granules a call may hold before they change
KEPT_SIZE = 0.1  # a target is kept while the measured one is within this share of it
# A call holds at most this many windows: while the granule lags behind a grown target (the
# chunks read ahead), a call of small granules could hold thousands, and joining n windows'
# outputs compiles in more than linear time (on a 2-core CPU ~0.05 s for 100, ~1 s for 1,000).
MAX_WINDOWS = GRANULES * KEPT_GRANULES[1]
KEPT_SIZES = 64  # the sizes of the last calls that Sink.stats shows
now = time.perf_counter  # what a sizer times calls with, unless given a clock


def finished(work: Any) -> bool:
    """Whether the device has done ``work`` (a tree of arrays), without waiting for it; an
    array deleted since (donated), or a tree with no array, counts as not known to be done."""
    leaves = [leaf for leaf in jax.tree.leaves(work) if isinstance(leaf, jax.Array)]
    return bool(leaves) and all(not leaf.is_deleted() and leaf.is_ready() for leaf in leaves)


def check_call_seconds(call_seconds: Any) -> float:
    """``call_seconds`` as a float > 0, else a ``ValueError``."""
    if (
        isinstance(call_seconds, bool)
        or not isinstance(call_seconds, numbers.Real)
        or not 0 < call_seconds < float("inf")
    ):
        raise ValueError(
            f"call_seconds must be the seconds one call of sink_size='auto' should last (> 0), "
            f"got {call_seconds!r}."
        )
    return float(call_seconds)


class CallSizer:
    """The target steps of an auto sink's calls, from their measured times (see the module
    docstring); ``total_steps``: the steps the sink will run, if bounded; ``target`` to start
    from (a saved one), ``clock`` default :data:`now`."""

    def __init__(
        self,
        call_seconds: float,
        epoch_length: int | None,
        total_steps: int | None = None,
        target: int = 1,
        clock: Callable[[], float] | None = None,
    ):
        self.call_seconds, self.epoch_length = call_seconds, epoch_length
        self.total_steps, self.done = total_steps, 0  # done: the steps of the calls ended
        self.target = self._bounded(target)
        self.sizes: collections.deque[int] = collections.deque(maxlen=KEPT_SIZES)
        self._clock = clock or now
        self._calls: collections.deque[_Call] = collections.deque(maxlen=WINDOW)  # the latest
        self.kept_granule: int | None = None  # the last granule planned (by the producer)

    def restore(self, data_state: DataPosition) -> None:
        """Continue at the target and granule a saved position recorded, if it has them."""
        self._calls.clear()  # the time since the last call is the rewind's, not a call's
        if data_state.call_steps is not None:
            self.target = self._bounded(data_state.call_steps)
        if data_state.call_granule is not None:
            self.kept_granule = data_state.call_granule

    def steps_left(self) -> int | None:
        """The steps left to plan before ``total_steps`` (``None``: no bound)."""
        return None if self.total_steps is None else self.total_steps - self.done

    def enough(
        self, steps: int, position: Position, compiling: float = 0.0, windows: int = 1
    ) -> bool:
        """Whether a call that has run ``steps`` in ``windows`` up to ``position`` (the batch
        after its last granule) ends there: it holds its share of what is left of the epoch
        (:meth:`evened`) or :data:`MAX_WINDOWS`, an epoch ended, or the sink's steps did. A
        call that spent ``compiling`` seconds compiling holds that time's share of
        ``call_seconds`` less of its target: it lasts about ``call_seconds`` still."""
        if position.step == 0 or steps == self.steps_left() or windows >= MAX_WINDOWS:
            return True
        return steps >= self.evened(steps, position) * (1 - compiling / self.call_seconds)

    def evened(self, steps: int, position: Position) -> float:
        """The steps a call that has run ``steps`` up to ``position`` holds: what is left of
        the epoch (and of ``total_steps``) from the call's start, cut into as many equal calls
        as make each at most the target -- unless those fall more than :data:`KEPT_SIZE` short
        of it and one call fewer comes nearer it -- so that an epoch ends in calls of about the
        target, not with one of a few steps, and a steady target cuts every epoch alike; the
        target itself where neither bound is known.

        >>> sizer = CallSizer(call_seconds=1.0, epoch_length=500, target=240)
        >>> sizer.evened(16, Position(0, 16)), sizer.evened(16, Position(0, 272))
        (250.0, 244.0)
        """
        whole = self.steps_left()  # the call's steps, if it ran to the end
        if self.epoch_length is not None:
            in_epoch = steps + self.epoch_length - position.step
            whole = in_epoch if whole is None else min(whole, in_epoch)
        if whole is None:
            return self.target
        calls = -(-whole // self.target)  # the fewest calls of at most the target
        even, fewer = whole / calls, whole / max(1, calls - 1)
        if self.target - even <= KEPT_SIZE * self.target:
            return even  # at most the target: no more granules than a call of the target
        return min(even, fewer, key=lambda size: abs(size - self.target))

    def started(self, last: Any = None) -> None:
        """A call starts: the latest calls, timed from the first one's start to now less the
        seconds they spent compiling, set its target (those after the last that is not to be
        measured). ``last``: what the last call computed last, if known; if the device has
        done it, that time covers their compute (and, if they compiled nothing, no more than
        that): the target may grow :data:`SETTLED_GROWTH` times, not :data:`GROWTH`."""
        now = self._clock()
        timed: list[_Call] = []
        for call in reversed(self._calls):
            if call.compiling is None:  # it stopped early, or failed (it never ended)
                break
            timed.append(call)
        if timed:
            compiling = sum(call.compiling or 0.0 for call in timed)
            growth = GROWTH if compiling or not finished(last) else SETTLED_GROWTH
            steps = sum(call.steps for call in timed)
            self.measured(steps, now - timed[-1].start - compiling, growth)
        self._calls.append(_Call(now))

    def ended(self, steps: int, compiling: float | None) -> None:
        """The call :meth:`started` last ran ``steps``, ``compiling`` seconds of it spent
        compiling: the next calls' targets count it, less those; ``None``: it did not run as
        every call does (it stopped early), and they do not."""
        self._calls[-1].steps, self._calls[-1].compiling = steps, compiling
        self.sizes.append(steps)
        self.done += steps

    def _bounded(self, steps: float) -> int:
        steps = max(1, round(steps))
        return steps if self.epoch_length is None else min(steps, self.epoch_length)

    def granule(self) -> int:
        """Steps of the next granule the producer plans: the last one while a call of the
        target holds :data:`KEPT_GRANULES` of them, else the largest power of two at most an
        :data:`GRANULES`-th of the target; a target of the whole epoch, the epoch (each call
        the rest of one epoch, one window, as ``sink_size=-1`` runs it)."""
        target, (low, high), kept = self.target, KEPT_GRANULES, self.kept_granule
        if target == self.epoch_length:
            self.kept_granule = None  # a target below the epoch picks one anew
            return target
        if kept is None or not low * kept <= target <= high * kept:
            kept = self.kept_granule = 1 << max(0, (target // GRANULES).bit_length() - 1)
        return kept

    def measured(self, steps: int, seconds: float, growth: int = GROWTH) -> None:
        """A call of ``steps`` took ``seconds``: set the next target, at most ``growth`` times
        the last (kept if the measured one is within :data:`KEPT_SIZE` of it: a call of a size
        met before compiles nothing to join its windows' outputs)."""
        rate = steps / max(seconds, 1e-9)
        wanted = self.call_seconds * rate
        wanted = self._bounded(min(max(wanted, self.target / GROWTH), self.target * growth))
        if wanted == self.epoch_length or abs(wanted - self.target) > KEPT_SIZE * self.target:
            self.target = wanted  # (a whole epoch is one window a call: always taken)


@dataclasses.dataclass
class _Call:
    """A call as a sizer times it: when it started, and once it ended its steps and the
    seconds it spent compiling (``None``: it does not count for the target)."""

    start: float
    steps: int = 0
    compiling: float | None = None
