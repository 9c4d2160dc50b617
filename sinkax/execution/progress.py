"""Progress from inside a call (``data_sink(..., progress=hook, progress_every=k)``).

``hook(steps, out)`` is told that ``steps`` more steps are done, ``out`` being the output of the
latest of them (numpy). A ``"scan"`` window of ``k`` steps or more runs as blocks of ``k``
steps (of a multiple of ``k`` where a window would hold more than
:data:`~sinkax.execution.windowed.MAX_BLOCKS`), one executable each, dispatched back to back,
their outputs joined by one more (:class:`~sinkax.execution.windowed.Scan`). Each block's last
output is reported once the device has computed it, while the later blocks run: the device
never waits for the host. The steps no block covers -- a window's last ``steps % k``, every step
of another strategy (``"loop"``, ``"step"``, eager) -- are reported with the call's next block
(so that a report's output is always its latest step's), or else as the call returns, with its
last output; over the devices of several ``jax.distributed`` processes, every step is (a block's
outputs are not all in one process). So the reports add up to every step the sink ran.

Every report goes through one queue, in step order, told one at a time by the sink's reporting
thread: a slow hook holds up nothing but the reports after it (beyond :data:`QUEUED` queued,
the newest merge). :meth:`Progress.flush` -- ``Sink.block_until_ready()``, ``Sink.close()`` --
waits for every report handed over so far (telling them in the waiting thread if it gets to
them first). An error the hook raises is kept, and raised by the
next call to start after it, or by ``close()``. Off (the default), the sink compiles its plain
programs.
"""

from __future__ import annotations

import atexit
import collections
import numbers
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from sinkax.errors import warn

Hook = Callable[[int, Any], None]
# steps, pick the output, the output (device), the number of the last report it covers
Report = tuple[int, Callable[[Any], Any], Any, int]
IDLE_S = 1.0  # a reporting thread with nothing to report for this long ends (a later one starts)
QUEUED = 64  # reports queued at most before the newest merge (each holds a step's output)
_open: weakref.WeakSet[Progress] = weakref.WeakSet()  # closed at exit: no thread left in JAX


def check(hook: Any, every: Any) -> None:
    """``TypeError``/``ValueError`` naming a bad ``progress``/``progress_every``."""
    if hook is not None and not callable(hook):
        raise TypeError(
            "progress must be a function hook(steps, out), told that `steps` more steps are "
            f"done and given the latest one's output, or None; got {type(hook).__name__}."
        )
    if every is None:
        return
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
        raise ValueError(f"progress_every must be an int >= 1 (steps per report), got {every!r}.")


def _on_host(tree: Any) -> Any:
    """``tree`` with its arrays read to the host (waiting for them), but those numpy cannot
    hold (typed PRNG keys) or spread over other processes' devices too, which stay as they are."""

    def read(x: Any) -> Any:
        if not isinstance(x, jax.Array) or not x.is_fully_addressable:
            return x
        return x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) else np.asarray(x)

    return jax.tree.map(read, tree)


def _whole(out: Any) -> Any:
    """The output as it is (a call's own report: no flag to leave out)."""
    return out


@atexit.register
def _close_open() -> None:
    for progress in list(_open):
        progress.close()


class Progress:
    """A sink's progress hook (see the module docstring), for a sink placed by ``sharding``."""

    def __init__(self, hook: Hook, every: int, sharding: jax.sharding.Sharding):
        self.hook, self.every = hook, int(every)
        # over other processes' devices, a block's outputs are not all here to report
        self.within_calls = sharding.is_fully_addressable
        self._unreported = 0
        self.error: Exception | None = None  # the hook's first, raised by the next call
        self._pending: collections.deque[Report] = collections.deque()  # in step order
        self._handed = self._told = 0  # reports handed over, and the last one told
        self._changed = threading.Condition()  # guards _pending and _reporter
        self._delivering = threading.Lock()  # one report at a time, in order
        self._reporter: threading.Thread | None = None
        self._telling: int | None = None  # the thread in the hook now
        self._closed = False  # nothing is handed over after: the thread ends once idle
        _open.add(self)

    def _tell(self, steps: int, out: Any) -> None:
        """Call the hook. An error it raises is kept for :meth:`raise_error`: raised here, in a
        block's report or once the call committed, it would lose the call's results."""
        try:
            self.hook(steps, out)
        except Exception as error:  # kept (the first), and raised by the next call
            self._keep(error)

    def _keep(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
            warn(f"The progress hook raised {error!r}; the next call raises it", RuntimeWarning)

    def raise_error(self) -> None:
        """Raise what the hook raised, if it did, as the next call starts (before it runs)."""
        error, self.error = self.error, None
        if error is not None:
            raise RuntimeError(
                f"The progress hook raised {type(error).__name__} during the last call: {error}. "
                "That call completed and returned its results; fix the hook to go on."
            ) from error

    def report(self, output: Callable[[Any], Any] = _whole) -> tuple[int, Any] | None:
        """How a ``"scan"`` window reports: ``(every, submit)``, ``submit(steps, last)``
        handing over a block's steps and last output, or ``None`` where blocks are not
        reported (see :attr:`within_calls`); ``output`` picks the step's output from what the
        window's step returns (a guarded step returns it with its flag)."""
        if not self.within_calls:
            return None
        return self.every, lambda steps, last: self._block(steps, output, last)

    def _block(self, steps: int, output: Callable[[Any], Any], last: Any) -> None:
        """Hand over a block's report, with the call's steps before it that none covered."""
        steps, self._unreported = steps + self._unreported, 0
        self._submit(steps, output, last)

    def ran(self, steps: int, reported: int) -> None:
        """A window of ``steps`` ran, ``reported`` of them reported by its blocks."""
        self._unreported += steps - reported

    def call_ended(self, outs: Any, stopped: Any = None) -> None:
        """Report the call's steps that no block report covered, with its last output (or, if
        a stop at a non-finite step kept none, with ``stopped``, that step's)."""
        steps, self._unreported = self._unreported, 0
        leaves = jax.tree.leaves(outs)  # a step may output nothing
        if steps:
            kept = not leaves or len(leaves[0])
            last = jax.tree.map(lambda o: o[-1], outs) if kept else stopped
            self._submit(steps, _whole, last)

    def flush(self) -> None:
        """Wait until every report handed over so far is told (telling them here if this thread
        gets to them first), not those handed over meanwhile; at once from inside the hook,
        which would wait for itself."""
        if self._telling == threading.get_ident():
            return
        with self._changed:
            handed = self._handed
        while self._told < handed and (item := self._head()) is not None:
            self._deliver(item)

    def close(self) -> None:
        """:meth:`flush`, then end the reporting thread (none is left inside JAX at exit); from
        inside the hook, only mark it closed (the report it is in would wait for itself)."""
        self.flush()
        with self._changed:
            self._closed, reporter = True, self._reporter
            self._changed.notify_all()
        if reporter is not None and self._telling != threading.get_ident():
            reporter.join()

    # -- the reporting thread --------------------------------------------------------------
    def _submit(self, steps: int, output: Callable[[Any], Any], last: Any) -> None:
        """Queue a report; beyond :data:`QUEUED` queued, it merges into the last one, told as
        one: a hook slower than the device holds that many outputs, not one per report."""
        with self._changed:
            self._handed += 1
            if len(self._pending) > QUEUED and self._pending[-1][1] is output:
                steps += self._pending.pop()[0]
            self._pending.append((steps, output, last, self._handed))
            if self._reporter is None:
                self._start_reporter()
            self._changed.notify_all()

    def _start_reporter(self) -> None:  # (under _changed)
        self._reporter = threading.Thread(
            target=self._report_all, name="sinkax-progress", daemon=True
        )
        self._reporter.start()

    def _report_all(self) -> None:
        """The reporting thread: each report in turn, once computed; ends when idle."""
        try:
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self._pending or self._closed, IDLE_S)
                    if not self._pending:  # (a report handed over later starts another)
                        self._reporter = None
                        return
                    item = self._pending[0]
                self._deliver(item)
        except BaseException:  # a hook's SystemExit, say: the reports after it go on
            with self._changed:
                self._reporter = None
                if self._pending:
                    self._start_reporter()
            raise

    def _head(self) -> Report | None:
        with self._changed:
            return self._pending[0] if self._pending else None

    def _deliver(self, item: Report) -> None:
        """Tell ``item`` if it is still the next to tell (the other thread may have)."""
        steps, output, last, number = item
        try:  # outside the lock: the other thread may tell meanwhile
            jax.block_until_ready(last)
            computed = True
        except Exception:  # its compute failed, which its call raised: nothing to tell
            computed = False
        with self._delivering:
            if self._head() is not item:
                return
            self._telling = threading.get_ident()
            try:
                if computed:
                    try:
                        out = output(_on_host(last))
                    except Exception as error:  # kept as the hook's would be
                        self._keep(error)
                    else:
                        self._tell(steps, out)
            finally:  # told once, even if a Ctrl-C stops the hook
                self._telling = None
                with self._changed:
                    self._pending.popleft()
                    self._told = number
