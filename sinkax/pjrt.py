"""sinkax's PJRT plugin layer: one forwarding plugin that counts host–device interactions, and
over XLA:CPU emulates a discrete accelerator.

The plugin (package ``sinkax-pjrt``, C++ under ``plugin/``) forwards every PJRT C API call to an
inner plugin and registers with jax as a platform of its own. It is never loaded unless asked,
once per process, **before jax initializes its backends** (before the first ``jax.devices()``,
``jax.device_put`` or computation):

* :func:`use_emulated` (or ``SINKAX_PJRT=<preset>`` in the environment): platform ``"emu"`` over
  the XLA:CPU plugin of ``xla-cpu-pjrt``, with its own device buffers (host data is copied,
  results read back), charging a preset's launch and transfer costs (:mod:`sinkax.presets`);
* :func:`use_plugin`: any PJRT plugin by path (e.g. a CUDA or an Ascend plugin), counted, under a
  platform name of your choice.

It stays a secondary backend: jax's default device does not change. :func:`interactions` reads
the counters (launches, transfers each way with their bytes, compiles).
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import logging
import os
import re

from sinkax import compat
from sinkax.presets import PRESETS, Preset, preset

EMULATED_PLATFORM = "emu"
ENV = "SINKAX_PJRT"  # a preset: the emulated device is registered when jax starts
_COUNTERS = 6


def env_preset() -> str | None:
    """The preset :data:`ENV` names, ``None`` if it is unset or empty; for any other value a
    ``ValueError`` listing the presets."""
    name = os.environ.get(ENV, "")
    if name and name not in PRESETS:
        raise ValueError(
            f"{ENV}={name!r} names no emulated-device preset; known: "
            f"{', '.join(sorted(PRESETS))}. Set it to one of them, or unset it to run without "
            "the emulated device."
        )
    return name or None


# At import, so that a misspelt value stops the program here: jax's plugin discovery, which
# reads it when the backends start, only logs the error and carries on without the device.
env_preset()


@dataclasses.dataclass(frozen=True)
class Interactions:
    """Host–device interactions counted by the plugin since the process loaded it.

    ``launches``: executables launched (one per ``Execute``, whatever the number of outputs);
    ``h2d``/``d2h``: transfers (one per array leaf) and their bytes; ``compiles``.
    Subtract two snapshots for what happened in between.
    """

    launches: int = 0
    h2d: int = 0
    h2d_bytes: int = 0
    d2h: int = 0
    d2h_bytes: int = 0
    compiles: int = 0

    def __sub__(self, other: Interactions) -> Interactions:
        return Interactions(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self))
        )


@dataclasses.dataclass(frozen=True)
class _Loaded:
    library: ctypes.CDLL
    platform: str
    inner_path: str
    discrete: bool


_loaded: list[_Loaded] = []  # the plugin, once loaded: one per process
_failed: set[str] = set()  # platform names a failed load left registered with jax


def _plugin_library_path() -> str:
    if importlib.util.find_spec("sinkax_pjrt") is None:
        raise ImportError(
            "sinkax's PJRT plugin is not installed: run `pip install ./plugin` in the sinkax "
            "checkout (`make .venv/.installed` does), which builds it with CMake."
        )
    import sinkax_pjrt

    return sinkax_pjrt.library_path()


def use_plugin(
    inner_path: str, platform: str, *, discrete: bool = True, costs: str | Preset = "counting"
) -> str:
    """Register sinkax's counting plugin over the PJRT plugin at ``inner_path`` as ``platform``.

    ``discrete``: present buffers as device memory (``Buffer_IsOnCpu`` false, host arrays always
    copied). Call before jax initializes its backends; calling again with the same arguments
    only updates the costs. Returns the platform name (for ``jax.devices(platform)``); one of
    jax's own (``"cpu"``, ``"cuda"``, ...) is refused.
    """
    _check_platform_name(platform)
    chosen = preset(costs)  # a bad preset stops here, before anything is loaded
    if _loaded:
        loaded, wanted = _loaded[0], (inner_path, platform, discrete)
        if (loaded.inner_path, loaded.platform, loaded.discrete) != wanted:
            raise RuntimeError(
                f"sinkax's PJRT plugin is already loaded as {loaded.platform!r} over "
                f"{loaded.inner_path} (discrete={loaded.discrete}); one process can load it once."
            )
        _set_costs(loaded.library, chosen)
        return platform
    if platform in _failed:
        raise RuntimeError(_TAKEN.format(platform=platform, why="An earlier, failed load"))
    if compat.backends_are_initialized():
        raise RuntimeError(
            "jax has already initialized its backends, so a plugin can no longer be added. Call "
            "sinkax.pjrt.use_emulated()/use_plugin() before the first jax.devices(), "
            "device_put or computation, or set SINKAX_PJRT=<preset> in the environment."
        )
    path = _plugin_library_path()
    library = ctypes.CDLL(path)
    library.sinkax_pjrt_set_costs.argtypes = [ctypes.c_double] * 5
    library.sinkax_pjrt_load_error.restype = ctypes.c_char_p
    library.sinkax_pjrt_pool_reuses.restype = ctypes.c_uint64
    if library.sinkax_pjrt_configure(inner_path.encode(), platform.encode(), int(discrete)):
        raise RuntimeError("sinkax's PJRT plugin was loaded outside sinkax.pjrt; reconfigure it.")
    _set_costs(library, chosen)
    logging.getLogger(compat.PLUGIN_LOGGER).addFilter(
        lambda record: f"'{platform}' is experimental" not in record.getMessage()
    )
    # jax donates buffers only on platforms it knows; XLA's PJRT plugins implement donation.
    compat.allow_donation(platform)
    try:
        compat.register_plugin(platform, library_path=path, priority=-100)
    except compat.JaxVersionError:
        raise
    except Exception as error:
        reason = library.sinkax_pjrt_load_error().decode()
        _failed.add(platform)
        raise RuntimeError(
            f"Could not load the PJRT plugin {inner_path}: {reason}. "
            + _TAKEN.format(platform=platform, why="The failed load")
        ) from error
    _loaded.append(_Loaded(library, platform, inner_path, discrete))  # loaded: not before
    return platform


_TAKEN = (
    "{why} left the platform name {platform!r} registered with jax for this process: load the "
    "plugin under another platform name, or in a new process."
)


def _check_platform_name(platform: str) -> None:
    """``ValueError`` if ``platform`` is not a lowercase identifier (jax looks platforms up by
    name, and the plugin names its devices after it), or is a name jax gives its own backends:
    the plugin would stand in for that backend or be shadowed by it."""
    if not isinstance(platform, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", platform):
        raise ValueError(
            f"platform {platform!r} must be a lowercase identifier (a letter, then letters, "
            "digits or '_'), e.g. 'counted_gpu'."
        )
    own = compat.jax_platform_names()
    if platform in own - {loaded_platform()}:
        raise ValueError(
            f"platform {platform!r} is one of jax's own platform names ({', '.join(sorted(own))})"
            f"; register the plugin under a name of its own, e.g. 'counted_{platform}'."
        )


def use_emulated(costs: str | Preset | None = None) -> str:
    """Register the emulated discrete accelerator (platform ``"emu"``) with ``costs``'s preset
    (by default the one :data:`ENV` names, else ``"pcie4-x16"``).

    Returns ``"emu"``; its devices are then ``jax.devices("emu")``. Figures measured on it are
    emulated: compute runs at this CPU's speed.
    """
    _plugin_library_path()  # an ImportError saying how to install it, if it is not
    import sinkax_pjrt

    costs = (env_preset() or "pcie4-x16") if costs is None else costs
    return use_plugin(sinkax_pjrt.cpu_plugin_path(), EMULATED_PLATFORM, costs=costs)


def compiles_with_xla_cpu(platform: str) -> bool:
    """Whether ``platform`` is the plugin's over XLA:CPU (the emulated device): XLA:CPU then
    compiles its programs, with what that implies (see :class:`sinkax.backend.Backend`)."""
    if not _loaded or _loaded[0].platform != platform:
        return False
    import sinkax_pjrt

    try:
        return _loaded[0].inner_path == sinkax_pjrt.cpu_plugin_path()
    except ImportError:  # no XLA:CPU plugin installed: the plugin forwards to another
        return False


def loaded_platform() -> str | None:
    """The platform the plugin registered in this process, or ``None``."""
    return _loaded[0].platform if _loaded else None


def set_costs(costs: str | Preset) -> None:
    """Charge ``costs`` (a preset name or :class:`~sinkax.presets.Preset`) from now on."""
    _set_costs(_library(), preset(costs))


def _set_costs(library: ctypes.CDLL, chosen: Preset) -> None:
    library.sinkax_pjrt_set_costs(
        chosen.launch_s,
        chosen.h2d_latency_s,
        chosen.h2d_bytes_per_s,
        chosen.d2h_latency_s,
        chosen.d2h_bytes_per_s,
    )


def interactions() -> Interactions:
    """The plugin's counters now (see :class:`Interactions`)."""
    values = (ctypes.c_uint64 * _COUNTERS)()
    _library().sinkax_pjrt_counters(values, _COUNTERS)
    return Interactions(*values)


def memory(reset_peak: bool = False) -> tuple[int, int]:
    """``(live, peak)`` bytes of the buffers on the plugin's devices, all together (the peak since
    the plugin loaded, or since the last ``reset_peak=True``, which then starts a new peak at
    the live bytes). ``jax.Device.memory_stats()`` gives the same per device."""
    values = (ctypes.c_int64 * 2)()
    _library().sinkax_pjrt_memory(values, int(reset_peak))
    return values[0], values[1]


def reused_copies() -> int:
    """Host->device copies the plugin made into device memory kept from a freed buffer of the
    same size, as a device's allocator reuses its memory (copies of 64 KiB or more to a discrete
    device over XLA:CPU, as the emulated device), not into memory the C library maps afresh,
    whose pages each fault on first touch."""
    return int(_library().sinkax_pjrt_pool_reuses())


def _library() -> ctypes.CDLL:
    if not _loaded:
        raise RuntimeError(
            "sinkax's PJRT plugin is not loaded in this process: call "
            "sinkax.pjrt.use_emulated() (or use_plugin()) before jax initializes its backends."
        )
    return _loaded[0].library


def counted(platform: str) -> Interactions | None:
    """:func:`interactions` now if ``platform`` is the plugin's, else ``None``."""
    return interactions() if _loaded and platform == _loaded[0].platform else None


def since(start: Interactions | None) -> Interactions | None:
    """What was counted since ``start`` (a :func:`counted` snapshot; ``None`` stays ``None``)."""
    return None if start is None else interactions() - start
