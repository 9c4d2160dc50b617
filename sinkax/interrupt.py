"""Ctrl-C that never costs the caller its state.

A call of one executable donates the caller's state to it. A ``KeyboardInterrupt`` raised after
that dispatch and before the call returns would lose both: the old state is gone and the new one
never reaches the caller. While :func:`guard` is open, a Ctrl-C is passed on at once if the
guarded state is still alive (nothing was donated yet: the call stops cleanly), and *held* once
it has been donated: the call then finishes and returns, and the held signal goes to its handler
at :func:`deliver_held` -- the start of the next call, or ``close()``. Once its steps have run,
every call guards :data:`DISPATCHED` (hold whatever comes) up to its return, so that its results
and its new data position reach the caller together.

:func:`guard` installs a SIGINT handler that passes every signal it does not hold to the handler
it replaced (Python's ``default_int_handler``, a notebook kernel's, a user's), and puts itself
back if something replaced it in between; :func:`release` gives the old handler back. Only the
main thread ever receives ``KeyboardInterrupt``, so calls from other threads need no guard.

What no guard can cover: CPython checks for signals in the caller right after a call returns,
before the result is stored. A Ctrl-C arriving in the call's last few bytecodes (after its
:func:`checkpoint`) is raised there -- the window every donating ``jax.jit`` call has around its
whole dispatch, here a few bytecodes long.

>>> import jax.numpy as jnp
>>> state = jnp.zeros(2)
>>> guard(state)
True
>>> guard(DISPATCHED)  # the steps have run: hold any Ctrl-C
True
>>> GUARD.state = None  # what a call does last, a plain store: nothing can interrupt it
>>> release()
"""

from __future__ import annotations

import _signal  # `signal.getsignal` wraps this in an enum lookup costing ~2 µs; this is per call
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from sinkax.pytree import deleted_leaf


class _Guard:
    __slots__ = ("held", "previous", "state")

    def __init__(self) -> None:
        self.state: Any = None  # what a running call may donate, DISPATCHED once it has; or None
        self.held = False  # a Ctrl-C arrived and was held, for deliver_held()
        self.previous: Any = None  # the handler ours replaced, and passes signals on to


GUARD = _Guard()


def _donated(state: Any) -> bool:
    return deleted_leaf(state) is not None


DISPATCHED: Any = object()  # guarded once a call's steps have run: hold any Ctrl-C


def _on_sigint(signum: int, frame: Any) -> None:
    state = GUARD.state
    if state is DISPATCHED or (state is not None and _donated(state)):
        GUARD.held = True
    else:
        GUARD.previous(signum, frame)


def guard(state: Any) -> bool:
    """Hold Ctrl-C once ``state`` is donated (at once for :data:`DISPATCHED`), until the caller
    stores ``GUARD.state = None``.

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
    """Nothing: entering a Python function is a point where CPython runs pending handlers.

    A guarded call ends with it, after the last thing that takes time (freeing the previous
    state, or a batch), so that a Ctrl-C which came meanwhile is handled -- and held -- inside the
    guard rather than in the caller after the return.
    """


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold Ctrl-C through the block -- a step that must not stop half done, such as starting a
    thread and recording it -- and pass it on once the block is over (if no guard encloses it).

    >>> with held():
    ...     pass
    """
    outer = GUARD.state
    opened = guard(DISPATCHED)
    try:
        yield
    finally:
        if opened:
            GUARD.state = outer
            if outer is None:
                deliver_held()
