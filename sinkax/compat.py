"""The private jax names sinkax uses, all in this one module.

jax has no public API for adding a PJRT plugin at run time, for the coordination client of
``jax.distributed``, or for telling where it would swallow a Ctrl-C, so sinkax reaches into
``jax._src`` for them -- and only here. Each name is
looked up when it is used: where jax has moved or removed it, the function below either falls back
(saying what is lost) or raises :class:`JaxVersionError`, which names the name, the installed jax
version and the versions sinkax was tested with. The rest of sinkax runs without any of them.

>>> isinstance(backends_are_initialized(), bool)
True
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import types
from typing import Any

import jax

TESTED_JAX = ("0.10.2", "0.11.2")

# (module, attribute) of each private name; tests/test_compat.py removes each in turn
PRIVATE: dict[str, tuple[str, str]] = {
    "backends_are_initialized": ("jax._src.xla_bridge", "backends_are_initialized"),
    "register_plugin": ("jax._src.xla_bridge", "register_plugin"),
    "platforms_with_donation": ("jax._src.interpreters.mlir", "_platforms_with_donation"),
    "distributed_state": ("jax._src.distributed", "global_state"),
    "backend_factories": ("jax._src.xla_bridge", "_backend_factories"),
    "platform_aliases": ("jax._src.xla_bridge", "_platform_aliases"),
    "layouts_from_executable": ("jax._src.interpreters.pxla", "_get_layouts_from_executable"),
}
# jax's own platform names, as far as a jax without those lists is concerned
KNOWN_PLATFORMS = frozenset({"cpu", "cuda", "rocm", "gpu", "tpu", "METAL", "iree"})
PLUGIN_LOGGER = "jax._src.xla_bridge"  # the logger that announces an experimental plugin

_log = logging.getLogger(__name__)


class JaxVersionError(RuntimeError):
    """A private jax name sinkax needs is missing from the installed jax."""


def _private(key: str) -> Any:
    """The private jax object ``PRIVATE[key]`` names, or ``None`` if this jax lacks it."""
    module, attribute = PRIVATE[key]
    try:
        return getattr(importlib.import_module(module), attribute, None)
    except ImportError:
        return None


def _missing(key: str, needed_for: str) -> JaxVersionError:
    module, attribute = PRIVATE[key]
    return JaxVersionError(
        f"{needed_for} needs jax's private {module}.{attribute}, which jax {jax.__version__} "
        f"does not have. sinkax was tested with jax {' and '.join(TESTED_JAX)}: install one of "
        "those (e.g. `pip install 'jax==0.11.2' 'jaxlib==0.11.2'`), or report the jax version "
        "to sinkax."
    )


def backends_are_initialized() -> bool:
    """Whether jax has started its backends (after which no plugin can be added).

    Without jax's own check this answers ``False``: a plugin added too late then fails when it
    is registered, or its platform stays unknown to ``jax.devices``.
    """
    check = _private("backends_are_initialized")
    if check is None:
        _log.warning(
            "jax %s cannot tell whether its backends started; assuming not.", jax.__version__
        )
        return False
    return bool(check())


def register_plugin(platform: str, library_path: str, priority: int) -> None:
    """Register the PJRT plugin at ``library_path`` as ``platform`` with jax (before its
    backends start). Raises :class:`JaxVersionError` where this jax has no way to."""
    register = _private("register_plugin")
    if register is None:
        raise _missing("register_plugin", "Loading a PJRT plugin (sinkax.pjrt)")
    register(platform, priority=priority, library_path=library_path)


def allow_donation(platform: str) -> None:
    """Let jax donate buffers on ``platform`` (it donates only on platforms it knows).

    Without jax's list, donation on ``platform`` is skipped: programs run, each donated input
    is copied instead, and jax warns that the donated buffers were not usable.
    """
    platforms = _private("platforms_with_donation")
    if platforms is None:
        _log.warning("jax %s: buffers are not donated on %r.", jax.__version__, platform)
    elif platform not in platforms:
        platforms.append(platform)


def jax_platform_names() -> frozenset[str]:
    """The platform names jax gives its own backends and their aliases (``cpu``, ``cuda``,
    ``gpu``, ``tpu``, ...); where this jax lacks its lists, a fixed set of them."""
    factories, aliases = _private("backend_factories"), _private("platform_aliases")
    if factories is None or aliases is None:
        return KNOWN_PLATFORMS
    return frozenset({*factories, *aliases, *aliases.values()})


def catching_everything() -> frozenset[types.CodeType]:
    """The code of jax's functions that catch every exception, ``KeyboardInterrupt`` included,
    at a point where a Ctrl-C can be handled: the bare ``except:`` around reading a new
    executable's layouts. Where this jax lacks the name, none (a Ctrl-C handled there is then
    lost, as it is without sinkax)."""
    code = getattr(_private("layouts_from_executable"), "__code__", None)
    return frozenset() if code is None else frozenset({code})


def coordination_client() -> Any:
    """The key-value client of the ``jax.distributed`` job this process joined. Raises
    :class:`JaxVersionError` where this jax does not expose it."""
    state = _private("distributed_state")
    if state is None or not hasattr(state, "client"):
        raise _missing("distributed_state", "Sharing data positions across processes")
    return state.client


def abandon_distributed() -> None:
    """Take the ``jax.distributed`` client and service (and preemption manager) away from jax
    without shutting them down, and keep them until the process ends, never destroyed: jax's
    shutdown (also the one their destruction runs) waits for every process of the job, then
    aborts this one, which a job with a process gone can never pass. After it
    ``jax.distributed.is_initialized()`` is ``False``. Raises :class:`JaxVersionError` where
    this jax does not expose them."""
    state = _private("distributed_state")
    if state is None or not hasattr(state, "client"):
        raise _missing("distributed_state", "Leaving a job with a process gone")
    for name in ("preemption_sync_manager", "client", "service"):
        kept = getattr(state, name, None)
        if kept is not None:  # one reference never given back: not even exiting destroys it
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))
            setattr(state, name, None)
