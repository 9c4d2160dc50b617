"""A :class:`Stopwatch`: the seconds one thread has spent inside its timed blocks, which any
other thread may read at any moment, the block under way included."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Stopwatch:
    """Seconds spent inside :meth:`timing` blocks (by one thread at a time) so far.

    >>> watch = Stopwatch()
    >>> with watch.timing():
    ...     inside = watch.seconds()
    >>> 0 <= inside <= watch.seconds()
    True
    """

    def __init__(self) -> None:
        self._state: tuple[float, float | None] = (0.0, None)  # done, and since when: one
        # attribute, so that a reader in another thread sees both of the same moment

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        self._state = (self._state[0], time.perf_counter())
        try:
            yield
        finally:
            self._state = (self.seconds(), None)

    @property
    def running(self) -> bool:
        """Whether a timed block is under way."""
        return self._state[1] is not None

    def seconds(self) -> float:
        done, since = self._state
        return done if since is None else done + time.perf_counter() - since
