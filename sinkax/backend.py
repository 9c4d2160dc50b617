"""Backend choice: MindSpore-style device targets mapped onto JAX platforms and devices, and
what each platform can do (:class:`Backend`).

``"CPU"`` and ``"GPU"`` are JAX's own backends. ``"Emulated"`` is sinkax's emulated discrete
accelerator (:func:`sinkax.pjrt.use_emulated`, loaded on demand). ``"Ascend"`` is reached through
a PJRT plugin that registers an ``npu``/``ascend`` platform with JAX, or one named by path in
``SINKAX_ASCEND_PJRT`` (loaded through sinkax's plugin layer); sinkax bundles none and it has not
been verified on Ascend hardware, nor GPU -- without one, asking for it raises an error saying
what is missing.

>>> resolve_device("CPU").platform
'cpu'
>>> backend_of(resolve_device("CPU")).host_is_device
True
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax

from sinkax import pjrt

TARGETS: dict[str, tuple[str, ...]] = {
    "CPU": ("cpu",),
    "GPU": ("cuda", "rocm", "gpu"),
    "Ascend": ("npu", "ascend"),
    "Emulated": (pjrt.EMULATED_PLATFORM,),
}
ASCEND_PLUGIN_VARIABLE = "SINKAX_ASCEND_PJRT"


@dataclasses.dataclass(frozen=True)
class Backend:
    """What a platform can do, as the sink needs to know it.

    ``host_is_device``: device memory is host memory (XLA:CPU), so a batch needs no transfer
    and results are read in place; ``aliases_host_buffers``: an aligned host array becomes a
    device buffer without a copy; ``python_callbacks``: ``io_callback``/``pure_callback`` compile
    for it; ``ffi``: custom calls registered with ``jax.ffi`` reach its compiler;
    ``num_devices``: its devices in this process; ``xla_cpu``: XLA:CPU compiles its programs,
    whose convolution canonicalization reaches only a program's entry computation, not a loop
    body (see :mod:`sinkax.execution.rewrite`), and whose devices' collectives deadlock with
    many steps in flight; ``compiler_options``: the XLA options sinkax compiles its programs
    with there (see :func:`compiler_options`).
    """

    platform: str
    host_is_device: bool
    aliases_host_buffers: bool
    python_callbacks: bool
    ffi: bool
    num_devices: int
    xla_cpu: bool
    compiler_options: tuple[tuple[str, str], ...] = ()


# XLA's default command-buffer kinds on CUDA (DebugOptions' xla_gpu_enable_command_buffer), and
# WHILE, which the default leaves out
CUDA_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE"


def compiler_options(platform_version: str, xla_flags: str) -> tuple[tuple[str, str], ...]:
    """The XLA options for sinkax's programs on a platform of ``platform_version`` (a PJRT
    client's), given the ``XLA_FLAGS`` environment variable.

    On a CUDA GPU, loops go into command buffers (CUDA graphs) too: a window's loop of steps
    is then one graph, launched once per call, where XLA's default has the host launch every
    trip's kernels itself -- the calls of short windows wait on those launches. Unless
    ``XLA_FLAGS`` sets ``xla_gpu_enable_command_buffer``: the user's choice stands. Elsewhere
    none (XLA's defaults).

    >>> dict(compiler_options("cuda 12080", ""))["xla_gpu_enable_command_buffer"] == (
    ...     CUDA_COMMAND_BUFFERS)
    True
    >>> compiler_options("cuda 12080", "--xla_gpu_enable_command_buffer=FUSION")
    ()
    >>> compiler_options("rocm 60302", ""), compiler_options("cpu", "")
    ((), ())
    """
    if "cuda" not in platform_version.lower() or "xla_gpu_enable_command_buffer" in xla_flags:
        return ()
    return (("xla_gpu_enable_command_buffer", CUDA_COMMAND_BUFFERS),)


@functools.cache
def _backend(platform: str) -> Backend:
    cpu, jax_own = platform == "cpu", platform in ("cpu", "cuda", "rocm", "gpu")
    devices = jax.devices(platform)
    return Backend(
        platform=platform,
        host_is_device=cpu,
        aliases_host_buffers=cpu,
        python_callbacks=jax_own,  # jax refuses them on a plugin's own platform name
        ffi=jax_own,  # a plugin's handlers go through its FFI extension, not jax.ffi
        num_devices=len(devices),
        xla_cpu=cpu or pjrt.compiles_with_xla_cpu(platform),  # the emulated device too
        compiler_options=compiler_options(
            devices[0].client.platform_version, os.environ.get("XLA_FLAGS", "")
        ),
    )


def backend_of(where: jax.Device | jax.sharding.Sharding) -> Backend:
    """The :class:`Backend` of the platform of a device, or of a sharding's devices (resolved
    once per platform)."""
    device = where if isinstance(where, jax.Device) else next(iter(where.device_set))
    return _backend(device.platform)


_PLUGGED = {"Emulated": pjrt.EMULATED_PLATFORM, "Ascend": "ascend"}  # platforms sinkax loads


def _load_on_demand(target: str | None) -> None:
    """Register the plugin ``target`` needs through sinkax's plugin layer, if it is not yet."""
    if target == "Emulated" and pjrt.loaded_platform() is None:
        pjrt.use_emulated()
    ascend_plugin = os.environ.get(ASCEND_PLUGIN_VARIABLE)
    if target == "Ascend" and ascend_plugin and pjrt.loaded_platform() is None:
        pjrt.use_plugin(ascend_plugin, _PLUGGED["Ascend"])


def _plugin_blocked(target: str) -> str | None:
    """Why sinkax's plugin cannot give ``target`` in this process, if that is why it is not
    here: loaded already under the other platform, or left out of ``JAX_PLATFORMS``."""
    wanted, loaded = _PLUGGED.get(target), pjrt.loaded_platform()
    if wanted is None or (target == "Ascend" and not os.environ.get(ASCEND_PLUGIN_VARIABLE)):
        return None  # no plugin of sinkax's would give it here
    if loaded not in (None, wanted):
        return (
            f"sinkax's PJRT plugin is loaded in this process as {loaded!r} already, and a "
            f"process loads it once: use device_target={target!r} in a new process"
        )
    platforms = jax.config.jax_platforms  # (the plugin loaded, but jax did not start it)
    if loaded == wanted and platforms and wanted not in platforms.split(","):
        return f"JAX_PLATFORMS={platforms!r} leaves it out: set JAX_PLATFORMS={platforms},{wanted}"
    return None


def available() -> dict[str, list[jax.Device]]:
    """Every device target that JAX can reach here, with this process's devices of it."""
    found = {}
    for target, platforms in TARGETS.items():
        for platform in platforms:
            try:
                found[target] = jax.local_devices(backend=platform)
                break
            except RuntimeError:
                continue
    return found


def default_device() -> jax.Device:
    """The device sinkax uses when given none: JAX's default device, ``jax_default_device``
    when set (by :func:`sinkax.set_context`, ``jax.config.update`` or ``jax.default_device``),
    else the emulated device where ``SINKAX_PJRT`` selects it, else the first local device.

    >>> with jax.default_device(jax.devices("cpu")[0]):
    ...     print(default_device().platform)
    cpu
    """
    device = jax.config.jax_default_device
    if isinstance(device, str):  # a platform name
        return jax.local_devices(backend=device)[0]
    return device or resolve_device()


def resolve_device(target: str | None = None, device_id: int = 0) -> jax.Device:
    """The device ``device_id`` of ``target`` (default: the emulated device where ``SINKAX_PJRT``
    selects it, else JAX's default backend).

    Raises ``ValueError`` naming the targets and devices that are available.
    """
    if target is None and pjrt.env_preset():  # SINKAX_PJRT selects the emulated device
        target = "Emulated"
    if target is not None and target not in TARGETS:  # before anything starts jax's backends
        raise ValueError(f"device_target must be one of {list(TARGETS)}, got {target!r}.")
    _load_on_demand(target)
    reachable = available()
    listing = ", ".join(f"{t}: {len(d)} device(s)" for t, d in reachable.items())
    if target is None:
        devices = jax.local_devices()
    elif target not in reachable and (blocked := _plugin_blocked(target)):
        raise ValueError(f"device_target={target!r} is not available: {blocked}.")
    elif target == "Ascend" and target not in reachable:
        raise ValueError(
            "device_target='Ascend' needs an Ascend PJRT plugin, and none is here: no JAX "
            f"backend has platform 'npu' or 'ascend', and {ASCEND_PLUGIN_VARIABLE} does not name "
            "a plugin library (a .so exporting GetPjrtApi, e.g. a vendor's Ascend PJRT plugin, "
            "which needs Huawei's CANN runtime). Set "
            f"{ASCEND_PLUGIN_VARIABLE}=/path/to/plugin.so, or install a package that registers "
            f"one with jax (available: {listing})."
        )
    elif target not in reachable:
        raise ValueError(
            f"device_target={target!r} is not available in this JAX installation "
            f"(available: {listing}). Install the JAX build or PJRT plugin for it, or choose "
            "an available target."
        )
    else:
        devices = reachable[target]
    if isinstance(device_id, bool) or not isinstance(device_id, int):
        raise ValueError(f"device_id must be an int (a device number), got {device_id!r}.")
    if not 0 <= device_id < len(devices):
        raise ValueError(
            f"device_id={device_id} is out of range: {target or devices[0].platform} has "
            f"{len(devices)} device(s) (available: {listing})."
        )
    return devices[device_id]
