"""Quiet: the threads that feed a sink keep off the interpreter while one of its calls runs.

CPython runs one thread's Python at a time. A call lets go of the interpreter lock at each
dispatch and must take it back after; while a producer (or a copier) reads and copies batches
beside it, taking and dropping the lock around each copy, the call finds the lock taken and
sleeps until the other thread lets go, then until the system wakes it: even on a core of its
own, a refilling producer makes short calls take longer
(``benchmarks/quiet_feeders.py``, see ``docs/performance.md``, *Quiet feeders*).

So a call holds a :class:`Quiet` (``with quiet:``) and the feeders, between two batches
(:meth:`Quiet.pause`), wait until it ends -- for at most :data:`LIMIT_S` of it: a call that
waits inside for its data or its device lets them go on meanwhile (:meth:`Quiet.lifted`), and
any other wait (a compile, a strategy's trial) holds them back that long at most. Nothing
depends on it for correctness: a feeder that finds the lock in any state goes on in time, and
a call that finds it taken runs without it.

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
STUCK_S = 1.0  # the lock taken this long, by no call: left so by a Ctrl-C, replaced


class Quiet:
    """Between one consumer (the thread that calls a sink) and the threads that feed it.

    ``with quiet:`` around a call holds the feeders back while inside (unless a feeder holds
    the lock this instant: then that call goes without), while ``ahead()`` is not 0: the ring
    passes the number of chunks ready, so that a producer the calls wait for never pauses.
    """

    def __init__(self, ahead: Callable[[], int] = lambda: 1) -> None:
        self._ahead = ahead  # what is ready for the consumer: feeders pause only then
        self._lock = threading.Lock()  # held by the consumer while a call runs on the host
        self._since = 0.0  # when it last took it
        self._holder: int | None = None  # the consumer's thread, while it holds it

    def __enter__(self) -> Quiet:
        me, lock = threading.get_ident(), self._lock
        if not lock.acquire(blocking=False):
            if self._holder is not None or time.monotonic() - self._since < STUCK_S:
                return self  # another call holds it, or a feeder this instant: go without
            # Taken by no call since long: a Ctrl-C landed between an acquire and its holder.
            # A new lock then (a feeder that holds the old one releases that one).
            lock = self._lock = threading.Lock()
            lock.acquire()
        self._since = time.monotonic()
        self._holder = me
        return self

    def __exit__(self, *exc: object) -> None:
        if self._holder == threading.get_ident():  # (not a call refused as another runs)
            self._holder = None  # first: a Ctrl-C between the two never releases it twice
            self._lock.release()

    def lifted(self, lift: bool = True) -> AbstractContextManager[Any]:
        """Inside ``with quiet:``: let the feeders go on while the call waits for them or the
        device (if ``lift``)."""
        held = lift and self._holder == threading.get_ident()
        return _Lifted(self) if held else _NOTHING

    def pause(self) -> None:
        """For a feeder, between two batches: wait while a call runs, up to :data:`LIMIT_S`,
        if it is ahead (``ahead()``: chunks are ready); else the call may need its batches."""
        lock = self._lock
        if lock.locked() and self._holder != threading.get_ident() and self._ahead():
            left = self._since + LIMIT_S - time.monotonic()
            if left > 0 and lock.acquire(timeout=left):
                lock.release()


class _Lifted:
    def __init__(self, quiet: Quiet):
        self._quiet = quiet

    def __enter__(self) -> None:
        self._quiet.__exit__()

    def __exit__(self, *exc: object) -> None:
        self._quiet.__enter__()


_NOTHING = nullcontext()
