"""Ctrl-C that never costs the caller its state.

A call of one executable donates the caller's state to it. A ``KeyboardInterrupt`` raised after
that dispatch and before the call returns would lose both: the old state is gone and the new one
never reaches the caller. While :func:`guard` is open, a Ctrl-C is passed on at once if the
guarded state is still alive (nothing was donated yet: the call stops cleanly), and *held* once
it has been donated: the call then finishes and returns, and the held signal goes to its handler
at :func:`deliver_held` -- the start of the next call, or ``close()``. Once its steps have run,
every call guards :data:`DISPATCHED` (hold whatever comes) up to its return, so that its results
and its new data position reach the caller together. A call runs that sequence through one
:class:`Handoff`.

:func:`guard` installs a SIGINT handler that passes every signal it does not hold to the handler
it replaced (Python's ``default_int_handler``, a notebook kernel's, a user's), and puts itself
back if something replaced it in between; :func:`release` gives the old handler back. Only the
main thread ever receives ``KeyboardInterrupt``, so calls from other threads need no guard.

What no guard can cover: CPython checks for signals in the caller right after a call returns,
before the result is stored. A Ctrl-C arriving in the call's last few bytecodes (after its
:func:`checkpoint`) is raised there -- the window every donating ``jax.jit`` call has around its
whole dispatch, here a few bytecodes long.

A ``KeyboardInterrupt`` raised where something catches every exception is lost: in a
garbage-collection callback (jax has one; CPython prints what it raises and drops it), or in the
bare ``except:`` with which jax reads a new executable's layouts. A Ctrl-C handled in one of
those frames is held instead, as one after a dispatch is: the next call (or ``close()``) raises
it. Code that catches every exception elsewhere still loses it.

>>> import jax.numpy as jnp
>>> handoff = Handoff()
>>> handoff.donating(jnp.zeros(2))  # the next dispatch donates it
>>> handoff.dispatched()  # the steps have run: hold any Ctrl-C until the return
>>> handoff.state = None  # what a call does last, a plain store: nothing can interrupt it
>>> release()
"""

from __future__ import annotations

import _signal  # `signal.getsignal` wraps this in an enum lookup costing ~2 µs; this is per call
import contextlib
import gc
import signal
import threading
from collections.abc import Iterator
from typing import Any

from sinkax import compat
from sinkax.pytree import deleted_leaf


class _Guard:
    __slots__ = ("_state", "held", "previous")

    def __init__(self) -> None:
        self._state: Any = None  # a state, DISPATCHED, a Handoff, or None
        self.held = False  # a Ctrl-C arrived and was held, for deliver_held()
        self.previous: Any = None  # the handler ours replaced, and passes signals on to

    @property
    def state(self) -> Any:
        """What a running call may donate, :data:`DISPATCHED` once it has; or ``None``."""
        state = self._state
        return state.state if isinstance(state, Handoff) else state

    @state.setter
    def state(self, state: Any) -> None:
        self._state = state


GUARD = _Guard()


def _donated(state: Any) -> bool:
    return deleted_leaf(state) is not None


DISPATCHED: Any = object()  # guarded once a call's steps have run: hold any Ctrl-C


def _on_sigint(signum: int, frame: Any) -> None:
    state = GUARD.state
    if state is DISPATCHED or (state is not None and _donated(state)) or _swallowed_in(frame):
        GUARD.held = True
    else:
        GUARD.previous(signum, frame)


def _swallowed_in(frame: Any) -> bool:
    """Whether a ``KeyboardInterrupt`` raised in ``frame`` may be lost on its way up: ``frame``
    or a caller is a garbage-collection callback (CPython prints and drops what one raises; jax
    has one), or jax's code that catches every exception (:func:`compat.catching_everything`)."""
    swallowing = compat.catching_everything() | {
        callback.__code__ for callback in gc.callbacks if hasattr(callback, "__code__")
    }
    while frame is not None and frame.f_code not in swallowing:
        frame = frame.f_back
    return frame is not None


def guard(state: Any) -> bool:
    """Hold Ctrl-C once ``state`` is donated (at once for :data:`DISPATCHED`; for a
    :class:`Handoff`, as its ``state`` says), until the caller stores ``GUARD.state = None`` (or
    the handoff's ``state = None``).

    Returns whether the guard opened, and so whether that caller must close it: not off the main
    thread (another thread's call must not close the main thread's guard), nor where SIGINT has
    no Python handler (ignored, or the OS default): no ``KeyboardInterrupt`` can arise there.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    installed = _signal.getsignal(signal.SIGINT)
    if installed is not _on_sigint:
        if not callable(installed):
            return False
        GUARD.previous = installed
        signal.signal(signal.SIGINT, _on_sigint)
    GUARD.state = state
    return True


def deliver_held() -> None:
    """Pass a held Ctrl-C on to its handler (by default: raise ``KeyboardInterrupt`` here).

    Only on the main thread, where the signal was meant to land; other threads leave it held.
    """
    if GUARD.held and threading.current_thread() is threading.main_thread():
        GUARD.held = False
        GUARD.previous(signal.SIGINT, None)


def release() -> None:
    """Put back the SIGINT handler :func:`guard` replaced (if ours is still installed), then
    :func:`deliver_held`: what closing a channel does."""
    main = threading.current_thread() is threading.main_thread()
    if main and _signal.getsignal(signal.SIGINT) is _on_sigint:
        signal.signal(signal.SIGINT, GUARD.previous)
    deliver_held()


def checkpoint() -> None:
    """Run pending signal handlers: entering a Python function is a point where CPython does.

    A guarded call ends with it, after everything else, so that a Ctrl-C which came meanwhile is
    handled -- and held -- inside the guard rather than in the caller after the return. It
    enters two functions: at such a point CPython runs the handlers first and then, if another
    thread asked for the interpreter lock, waits for it; a signal arriving during that wait
    is handled at the next point -- the second entry, not the caller's first check.
    """
    _point()


def _point() -> None:
    """Nothing: entering it is a point where CPython runs pending signal handlers."""


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold Ctrl-C through the block -- a step that must not stop half done, such as starting a
    thread and recording it -- and pass it on once the block is over (if no guard encloses it).

    >>> with held():
    ...     pass
    """
    outer = GUARD._state
    opened = guard(DISPATCHED)
    try:
        yield
    finally:
        if opened:
            GUARD.state = outer
            if GUARD.state is None:
                deliver_held()


class Handoff:
    """One call's Ctrl-C hand-off: what :func:`guard` guards for it, as a token the call owns.

    :meth:`donating` before the dispatch that donates the caller's state; :meth:`dispatched`
    once every step has run, then whatever takes time (freeing the last state) and
    :func:`checkpoint`; in the error path, the store ``state = DISPATCHED`` first (a call made
    with :meth:`opened` is guarded from its start, so a second Ctrl-C is held from there), the
    cleanup, then :meth:`failed`. The call closes the guard as its last
    step with the plain store ``handoff.state = None``: a call there would be a point where a
    Ctrl-C is raised after the guard closed and before the results reach the caller. A Ctrl-C
    that arrives meanwhile stops the call while the state is alive, and is held for
    :func:`deliver_held` once it was donated or once the steps ran. Off the main thread nothing
    is guarded (only the main thread receives ``KeyboardInterrupt``).
    """

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: Any = None  # what the call may donate, DISPATCHED once it has; or None

    @classmethod
    def opened(cls) -> Handoff:
        """A handoff already guarded (passing every Ctrl-C on while its ``state`` is ``None``),
        so that the call's error path can hold a second Ctrl-C with a plain store
        ``handoff.state = DISPATCHED``, leaving no point where one could skip its cleanup."""
        handoff = cls()
        guard(handoff)
        return handoff

    def donating(self, state: Any) -> None:
        """The next dispatch donates ``state``: hold a Ctrl-C from then on."""
        self.state = state
        self._hold()

    def dispatched(self) -> None:
        """Every step has run: hold any Ctrl-C until the guard is closed."""
        self.state = DISPATCHED
        self._hold()

    def _hold(self) -> None:
        """Guard this handoff: nothing to do where opened() did and our handler is still the
        one installed (a step traced meanwhile may have replaced it)."""
        if GUARD._state is not self or _signal.getsignal(signal.SIGINT) is not _on_sigint:
            guard(self)

    def failed(self) -> None:
        """Close the guard on the error path, once the failed call has cleaned up; a Ctrl-C held
        meanwhile is passed on here (it stops the unwinding call, not a later one)."""
        self.state = None
        deliver_held()
