"""Backend choice: MindSpore-style device targets mapped onto JAX platforms and devices.

``"CPU"`` and ``"GPU"`` are JAX's own backends. ``"Ascend"`` is reached through a PJRT plugin
that registers an ``npu``/``ascend`` platform with JAX; sinkax has no such plugin bundled and it
has not been verified on Ascend hardware -- without one, asking for it raises the error below.

>>> resolve_device("CPU").platform
'cpu'
"""

from __future__ import annotations

import jax

TARGETS: dict[str, tuple[str, ...]] = {
    "CPU": ("cpu",),
    "GPU": ("cuda", "rocm", "gpu"),
    "Ascend": ("npu", "ascend"),
}


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


def resolve_device(target: str | None = None, device_id: int = 0) -> jax.Device:
    """The device ``device_id`` of ``target`` (default: JAX's default backend).

    Raises ``ValueError`` naming the targets and devices that are available.
    """
    reachable = available()
    listing = ", ".join(f"{t}: {len(d)} device(s)" for t, d in reachable.items())
    if target is None:
        devices = jax.local_devices()
    elif target not in TARGETS:
        raise ValueError(f"device_target must be one of {list(TARGETS)}, got {target!r}.")
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
