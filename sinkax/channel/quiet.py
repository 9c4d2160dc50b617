"""Quiet: the threads that feed a sink keep off the interpreter while one of its calls runs.

CPython runs one thread's Python at a time. A call lets go of the interpreter lock at each
dispatch and must take it back after; while a producer (or a copier) reads and copies batches
beside it, taking and dropping the lock around each copy, the call finds the lock taken and
sleeps until the other thread lets go, then until the system wakes it: even on a core of its
own, a refilling producer makes short calls take longer
(``benchmarks/quiet_feeders.py``, see ``docs/performance.md``, *Quiet feeders*).

So a call holds a :class:`Quiet` (``with quiet:``) and the feeders, between two batches
(:meth:`Quiet.pause`), wait until it ends -- for at most :data:`LIMIT_S` from the hold: a call
that waits inside for its data or its device lets them go on meanwhile (:meth:`Quiet.lifted`)
and holds them again after, and any other wait (a compile, a strategy's trial) holds them back
that long at most. Nothing depends on it for correctness: a feeder goes on in time whatever
state it finds the lock in, a call that finds it taken goes without, and a thread only ever
releases a lock it took.

>>> quiet = Quiet()
>>> with quiet:
...     quiet.pause()  # in the calling thread: a no-op
...     with quiet.lifted():
...         quiet.pause()  # no call is running on the host now: a no-op
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

LIMIT_S = 5e-4  # a feeder waits this long at most for one call (a call's host part: 20-60 µs)
STUCK_S = 1.0  # a lock found taken by no call twice this far apart: left so by a Ctrl-C


class Quiet:
    """Between one consumer (the thread that calls a sink) and the threads that feed it.

    ``with quiet:`` around a call holds the feeders back while inside, while ``ahead()`` is not
    0: the ring passes the number of chunks ready, so that a producer the calls wait for never
    pauses. A call that finds the lock taken goes without (another call holds it, or a feeder
    this instant) -- unless it was taken, by no call, when an earlier call found it so at least
    :data:`STUCK_S` before: a Ctrl-C left it so, and a new lock replaces it.
    """

    def __init__(self, ahead: Callable[[], int] = lambda: 1) -> None:
        self._ahead = ahead  # what is ready for the consumer: feeders pause only then
        self._lock = threading.Lock()  # held by the consumer while a call runs on the host
        self._since = 0.0  # when it last took it
        self._holder: tuple[int, threading.Lock] | None = None  # (thread, the lock it took)
        self._stuck: tuple[threading.Lock, float] | None = None  # taken by no call, seen when

    def __enter__(self) -> Quiet:
        me, lock = threading.get_ident(), self._lock
        if not lock.acquire(blocking=False):
            if self._holder is not None or not self._stuck_since_long(lock):
                return self
            lock = threading.Lock()  # a new one, taken before anyone else can see it (a
            lock.acquire()  # feeder that holds the old one releases that one)
            self._lock = lock
        self._since = time.monotonic()
        self._holder = (me, lock)  # a Ctrl-C just before leaves the lock stuck: see above
        return self

    def __exit__(self, *exc: object) -> None:
        holder = self._holder
        if holder is not None and holder[0] == threading.get_ident():  # (not a refused call)
            self._holder = None  # first: a Ctrl-C between the two never releases it twice
            holder[1].release()  # the lock this thread took, even if replaced since

    def lifted(self, lift: bool = True) -> AbstractContextManager[Any]:
        """Inside ``with quiet:``: let the feeders go on while the call waits for them or the
        device (if ``lift``); it holds them again after."""
        holder = self._holder
        held = lift and holder is not None and holder[0] == threading.get_ident()
        return _Lifted(self) if held else _NOTHING

    def pause(self) -> None:
        """For a feeder, between two batches: wait while a call runs, up to :data:`LIMIT_S`
        from the call's hold, if it is ahead (``ahead()``: chunks are ready); else the call may
        need its batches."""
        lock = self._lock
        if not lock.locked():  # (once a batch: the usual case first, and cheapest)
            return
        holder = self._holder
        if (holder is None or holder[0] != threading.get_ident()) and self._ahead():
            left = self._since + LIMIT_S - time.monotonic()
            if left > 0 and lock.acquire(timeout=left):
                lock.release()

    def _stuck_since_long(self, lock: threading.Lock) -> bool:
        """Whether ``lock``, taken by no call now, was so when a call found it at least
        :data:`STUCK_S` ago (this call's finding is recorded for a later one)."""
        now, seen = time.monotonic(), self._stuck
        if seen is None or seen[0] is not lock:
            self._stuck = (lock, now)
            return False
        return now - seen[1] >= STUCK_S


class _Lifted:
    def __init__(self, quiet: Quiet):
        self._quiet = quiet

    def __enter__(self) -> None:
        self._quiet.__exit__()

    def __exit__(self, *exc: object) -> None:
        self._quiet.__enter__()


_NOTHING = nullcontext()
