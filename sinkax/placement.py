"""Placement: where a sink's batches, chunks and state live, as a ``jax.sharding.Sharding``.

A sink is placed by the sharding of one *batch*. ``SingleDeviceSharding(device)`` puts
everything on one device. A ``NamedSharding(mesh, P("data"))`` splits each batch's leading
axis over the mesh's ``"data"`` axis: data parallelism. From the batch sharding follow

* the *chunk* sharding (:func:`stacked`): batches stacked on a new leading steps axis, which is
  never split, each batch split as the batch sharding says;
* the *state* placement (:func:`place_state`): every leaf replicated over the mesh, unless the
  caller already put it on the mesh's devices (then it stays as the caller sharded it).

Across processes (``jax.distributed``) a sharding spans devices this process cannot address;
each process then supplies only its part of every batch and :func:`put` assembles the global
array with ``jax.make_array_from_process_local_data``.

>>> import jax
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
>>> stacked(NamedSharding(mesh, P("data"))).spec
P(None, 'data')
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from sinkax.errors import BatchSpecError


def resolve(
    device: jax.Device | None, sharding: Sharding | None, default: Callable[[], jax.Device]
) -> Sharding:
    """The batch sharding of a sink given ``device=`` or ``sharding=`` (not both); the device
    ``default()`` when neither is given."""
    if device is not None and sharding is not None:
        raise ValueError(
            "Give either device= (one device) or sharding= (a batch sharding), not both: "
            "sharding=jax.sharding.SingleDeviceSharding(device) is the same as device=device."
        )
    if sharding is None:
        return SingleDeviceSharding(device or default())
    if not isinstance(sharding, SingleDeviceSharding | NamedSharding):
        raise TypeError(
            f"sharding must be a jax.sharding.NamedSharding (e.g. NamedSharding(mesh, "
            f"P('data')) to split the batch axis) or a SingleDeviceSharding, got "
            f"{type(sharding).__name__}."
        )
    if len(sharding.device_set) == 1:  # one device: placed as such, which XLA:CPU aliases
        return SingleDeviceSharding(*sharding.device_set)  # (a NamedSharding's put copies)
    return sharding


def of(tree: Any) -> Sharding:
    """Where ``tree`` is placed: the sharding of its first leaf (a chunk's leaves, or a
    state's, are placed alike)."""
    return jax.tree.leaves(tree)[0].sharding


def devices(sharding: Sharding) -> int:
    """How many devices ``sharding`` spans, in every process."""
    return len(sharding.device_set)


def platform(sharding: Sharding) -> str:
    """The platform of ``sharding``'s devices (``"cpu"``, ``"gpu"``, ...)."""
    return next(iter(sharding.device_set)).platform


def describe(sharding: Sharding) -> str:
    """``sharding`` and its devices in order, which its ``str`` leaves out: what the processes
    of a job compare (a mesh of the same devices in another order runs other collectives)."""
    if isinstance(sharding, NamedSharding):
        ids = [device.id for device in sharding.mesh.devices.flat]
    else:
        ids = sorted(device.id for device in sharding.device_set)
    return f"devices {ids} in order, {sharding}"


def planned(state: Any, sharding: Sharding) -> str:
    """What :func:`place_state` makes of ``state`` for the batch sharding ``sharding``, without
    placing anything: each leaf's shape, dtype and sharding (with its devices in order). The
    processes of a job compare it before a call places their states (a collective)."""
    target = replicated(sharding)

    def planned_leaf(leaf: Any) -> tuple[Any, ...]:
        kept = isinstance(leaf, jax.Array) and leaf.sharding.device_set == sharding.device_set
        where = leaf.sharding if kept else target
        return np.shape(leaf), str(jnp.result_type(leaf)), describe(where)

    return str(jax.tree.map(planned_leaf, state))


def stacked(sharding: Sharding) -> Sharding:
    """The sharding of batches stacked on a new leading axis, each placed as ``sharding``."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return sharding


def check_splits(sharding: Sharding, paths: tuple[str, ...], shapes: Any) -> None:
    """``BatchSpecError`` naming the leaf if a batch of leaves ``paths`` of ``shapes`` (this
    process's part of it) cannot be placed as the batch sharding ``sharding``: an axis it
    splits must exist and divide evenly over this process's devices along it."""
    if not isinstance(sharding, NamedSharding):
        return
    mine = np.vectorize(lambda d: d.process_index == jax.process_index())(sharding.mesh.devices)

    def held(name: str) -> int:  # positions along the mesh axis `name` this process holds
        k = sharding.mesh.axis_names.index(name)
        return int(np.any(mine, axis=tuple(i for i in range(mine.ndim) if i != k)).sum())

    def parts(entry: Any) -> int:
        return math.prod(held(name) for name in ((entry,) if isinstance(entry, str) else entry))

    split = [(axis, parts(e)) for axis, e in enumerate(sharding.spec) if isinstance(e, str | tuple)]
    for path, shape in zip(paths, shapes, strict=True):
        for axis, n in split:
            if axis >= len(shape):
                raise BatchSpecError(
                    f"Batch leaf {path} has shape {tuple(shape)}, but the sharding "
                    f"{sharding.spec} splits its axis {axis} over {n} devices. Give every batch "
                    "leaf the batch axis (a per-example value of shape (batch,), not a scalar), "
                    "and keep values shared by the whole batch out of it (in the state, or in "
                    "the step function)."
                )
            if shape[axis] % n:
                raise BatchSpecError(
                    f"Batch leaf {path} has shape {tuple(shape)}, whose axis {axis} the sharding "
                    f"{sharding.spec} splits over {n} devices: {shape[axis]} does not divide "
                    f"by {n}. Make the batch size (per process) a multiple of {n}, e.g. "
                    f"batch({max(n, shape[axis] // n * n)}, drop_remainder=True), or shard over "
                    "fewer devices."
                )


def replicated(sharding: Sharding) -> Sharding:
    """A full copy on every device of ``sharding``."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return sharding


def pinned_host(sharding: Sharding) -> Sharding | None:
    """``sharding``'s one device's pinned (page-locked) host memory, from which the device copies
    by DMA; ``None`` if ``sharding`` spans several devices or its device has no such memory.

    >>> pinned_host(SingleDeviceSharding(jax.devices("cpu")[0])).memory_kind
    'pinned_host'
    """
    if not isinstance(sharding, SingleDeviceSharding):
        return None
    (device,) = sharding.device_set
    if "pinned_host" not in {memory.kind for memory in device.addressable_memories()}:
        return None
    return SingleDeviceSharding(device, memory_kind="pinned_host")


def put(tree: Any, sharding: Sharding) -> Any:
    """``tree`` of host arrays placed as ``sharding``; when ``sharding`` spans other processes,
    ``tree`` is this process's part and the result the global arrays (every process calls)."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)


def place_state(state: Any, sharding: Sharding) -> Any:
    """``state`` on the devices of the batch sharding ``sharding``: each leaf as the caller
    sharded it over those devices, any other replicated."""
    if isinstance(sharding, SingleDeviceSharding):
        return jax.device_put(state, sharding)  # one walk over the tree
    target = replicated(sharding)

    def place(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and leaf.sharding.device_set == sharding.device_set:
            return leaf
        if not target.is_fully_addressable:  # every process holds the same host value
            leaf = np.asarray(leaf)
        return jax.device_put(leaf, target)

    return jax.tree.map(place, state)


def memory(sharding: Sharding) -> dict[str, int | None]:
    """``device_bytes`` and ``peak_device_bytes`` of ``sharding``'s devices in this process,
    summed, from their ``memory_stats()``; ``None`` where a device reports none."""
    stats = [device.memory_stats() for device in sharding.addressable_devices]
    if not stats or any(not s or "bytes_in_use" not in s for s in stats):
        return {"device_bytes": None, "peak_device_bytes": None}
    return {
        "device_bytes": sum(s["bytes_in_use"] for s in stats),
        "peak_device_bytes": sum(s.get("peak_bytes_in_use", s["bytes_in_use"]) for s in stats),
    }
