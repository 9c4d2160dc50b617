"""Progress from inside a call (``data_sink(..., progress=hook, progress_every=k)``).

``hook(steps, out)`` is told that ``steps`` more steps are done, ``out`` being the output of the
latest of them. Where the platform runs Python host callbacks (CPU, GPU) a ``"scan"`` window
reports every ``k``-th step from the device while it runs, asynchronously
(:func:`~sinkax.execution.programs.reporting_scan_program`); the steps no device report covers
-- a window's last ``steps % k``, every step of another strategy (``"loop"``, ``"step"``,
eager) or of a platform without host callbacks (the emulated device: a warning says so) -- are
reported from the host when the call returns; over the devices of several ``jax.distributed``
processes, every step is (a device report would reach one process only). So the reports add up
to every step the sink ran; the host's may come before the device's of the same call. Off (the
default), the sink compiles its plain programs.
"""

from __future__ import annotations

import itertools
import numbers
import weakref
from collections.abc import Callable
from typing import Any

import jax

from sinkax.backend import backend_of
from sinkax.errors import warn

Hook = Callable[[int, Any], None]

_live: weakref.WeakValueDictionary[int, Progress] = weakref.WeakValueDictionary()
_tokens = itertools.count()

_NO_CALLBACKS = (
    "This sink's device ({platform}) runs no Python host callbacks, so progress= cannot report "
    "from inside a call: it reports once per call, when the call returns. For progress within "
    "a call, run on CPU or GPU, or use smaller sink sizes."
)


def check(hook: Any, every: Any) -> None:
    """``TypeError``/``ValueError`` naming a bad ``progress``/``progress_every``."""
    if hook is not None and not callable(hook):
        raise TypeError(
            "progress must be a function hook(steps, out), told that `steps` more steps are "
            f"done and given the latest one's output, or None; got {type(hook).__name__}."
        )
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
        raise ValueError(f"progress_every must be an int >= 1 (steps per report), got {every!r}.")


def _report(token: int, every: int, out: Any) -> None:
    """A device report, run by ``jax.debug.callback``: to the sink's hook while it lives (the
    compiled programs hold no reference to it)."""
    progress = _live.get(token)
    if progress is not None:
        progress.tell(every, out)


class Progress:
    """A sink's progress hook (see the module docstring), for a sink placed by ``sharding``."""

    def __init__(self, hook: Hook, every: int, sharding: jax.sharding.Sharding):
        self.hook, self.every = hook, int(every)
        backend = backend_of(sharding)
        # over other processes' devices too, a device report reaches one process only
        self.on_device = backend.python_callbacks and sharding.is_fully_addressable
        if not backend.python_callbacks:
            warn(_NO_CALLBACKS.format(platform=backend.platform), RuntimeWarning)
        self._token = next(_tokens)
        _live[self._token] = self
        self._unreported = 0
        self.error: Exception | None = None  # the hook's first, raised by the next call

    def tell(self, steps: int, out: Any) -> None:
        """Call the hook. An error it raises is kept for :meth:`raise_error`: raised here, on
        the device or once the call committed, it would lose the donated state and the call's
        results."""
        try:
            self.hook(steps, out)
        except Exception as error:  # kept (the first), and raised by the next call
            if self.error is None:
                warn(f"The progress hook raised {error!r}; the next call raises it", RuntimeWarning)
                self.error = error

    def raise_error(self) -> None:
        """Raise what the hook raised, if it did, as the next call starts (before it runs)."""
        error, self.error = self.error, None
        if error is not None:
            raise RuntimeError(
                f"The progress hook raised {type(error).__name__} during the last call: {error}. "
                "That call completed and returned its results; fix the hook to go on."
            ) from error

    def report(
        self, output: Callable[[Any], Any] = lambda out: out
    ) -> tuple[Any, int, Callable[[Any], None]] | None:
        """What a ``"scan"`` window reports through: ``(cache key, every, callback)``, or
        ``None`` where the device cannot call the host; ``output`` picks the step's output
        from what the window's step returns (a guarded step returns it with its flag)."""
        if not self.on_device:
            return None
        token, every = self._token, self.every
        return ("progress", token), every, lambda out: _report(token, every, output(out))

    def ran(self, steps: int, reported: int) -> None:
        """A window of ``steps`` ran, ``reported`` of them reported from the device."""
        self._unreported += steps - reported

    def call_ended(self, outs: Any, stopped: Any = None) -> None:
        """Report the call's steps that no device report covered, with its last output (or,
        if a stop at a non-finite step kept none, with ``stopped``, that step's)."""
        steps, self._unreported = self._unreported, 0
        leaves = jax.tree.leaves(outs)  # a step may output nothing
        if steps:
            kept = not leaves or len(leaves[0])
            self.tell(steps, jax.tree.map(lambda o: o[-1], outs) if kept else stopped)
