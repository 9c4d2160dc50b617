"""Packers: how the ring turns batches into the chunk a strategy runs on (its ``feed``).

* :class:`Stacked` (``"stacked"``, every strategy but ``"step"``): each slot of the ring owns
  reusable host staging buffers, one per leaf, ``steps`` batches deep; a chunk is written into
  them and put on the device(s), placed by the chunk's sharding (across processes as this
  process's part of the global chunk, :func:`sinkax.placement.put`). Fresh memory costs page
  faults that made the producer slower than the training it feeds, so buffers are allocated
  once. They are 64-byte aligned, which lets XLA:CPU use them as device buffers without a copy
  (``device_put`` aliases aligned host memory): on CPU a slot *is* the device memory, so the
  slot is freed only once the compute on its chunk has finished; on GPU ``device_put`` copies.
  With a ``staging`` sharding (``pin_memory``) the buffers are numpy views of jax arrays in the
  device's pinned host memory (:func:`pinned_zeros`): a whole chunk goes to the device by DMA,
  without the runtime's own copy of pageable memory into pinned memory. The producer copies
  each batch in before it reads the next (a dataset may refill the arrays it yielded once it
  runs again) -- unless the source keeps its batches (a list, a grain ``MapDataset``) and the
  device has memory of its own: then it holds them and hands them, in groups of up to
  :data:`COPY_GROUP` batches or :data:`COPY_BYTES` each, to :func:`spare_copiers` copier threads,
  so that its own thread only reads and checks; when a waiting call cuts the chunk, it copies
  the batches still held itself.
* :class:`Unstacked` (``"unstacked"``, the ``"step"`` strategy's one-step calls on CPU): each
  batch is copied (a dataset may refill the arrays it yielded once it runs again, and the
  producer reads ahead), from :data:`ALIGN_FROM_BYTES` on into 64-byte aligned memory, and a
  chunk is the tuple of them. The executable takes each batch at dispatch, as a plain jitted step
  does -- and, the batch being aligned, without the copy XLA:CPU makes of an unaligned array in
  the caller's thread. The chunk owns no memory the ring reuses.

>>> import jax, numpy as np
>>> from sinkax.spec import BatchSpec
>>> spec = BatchSpec.of({"x": np.float32(0)})
>>> packer = Stacked(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
>>> build = Build(packer.allocate(spec, steps=2), t0=0.0)
>>> for i in range(2):
...     packer.write(build, spec, [np.float32(i)]); build.filled += 1
>>> data, moved, padded = packer.pack(build, spec, steps=2)
>>> data["x"].tolist(), moved, padded
([0.0, 1.0], 8, False)
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from sinkax import placement
from sinkax.backend import backend_of
from sinkax.spec import BatchSpec

if TYPE_CHECKING:
    from sinkax.config import SinkConfig

ALIGN_FROM_BYTES = 4096  # smaller arrays XLA copies at dispatch for less than aligning costs
COPY_GROUP = 8  # batches handed to each copier at once (a hand-over costs about a copy)
COPY_BYTES = 4 << 20  # ... or fewer, of at most this many bytes (held batches are kept alive)


def _aligned(allocate: Any, shape: tuple[int, ...], dtype: np.dtype, align: int) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = allocate(nbytes + align, np.uint8)
    offset = -raw.__array_interface__["data"][0] % align  # (.ctypes builds an object: slower)
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def aligned_zeros(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """A zeroed array whose data starts on an ``align``-byte boundary."""
    return _aligned(np.zeros, shape, dtype, align)


def owned_copy(array: np.ndarray, align: int = 64) -> np.ndarray:
    """A copy of ``array``; from :data:`ALIGN_FROM_BYTES` on, starting on an ``align``-byte
    boundary, which XLA:CPU takes at dispatch as it is (an array that is not so aligned, as most
    numpy arrays are not, it copies again, in the caller's thread).

    >>> owned_copy(np.arange(1024.0)).ctypes.data % 64
    0
    """
    if array.nbytes < ALIGN_FROM_BYTES:
        return np.array(array)
    copy = _aligned(np.empty, array.shape, array.dtype, align)
    np.copyto(copy, array)
    return copy


def pinned_zeros(
    shape: tuple[int, ...], dtype: np.dtype, staging: jax.sharding.Sharding
) -> np.ndarray:
    """A zeroed, writable numpy view of a jax array placed by ``staging`` (host memory of one
    device, e.g. ``memory_kind="pinned_host"``), which the view keeps alive as ``.base.source``.

    The jax array is the view's to write: nothing else holds it, and the caller writes only
    while no copy from it is in flight.

    >>> staging = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    >>> view = pinned_zeros((2,), np.dtype(np.float32), staging); view[1] = 7
    >>> view.base.source.tolist()
    [0.0, 7.0]
    """
    # filled: a GPU fills it after device_put returns, which would overwrite what is written
    source = jax.block_until_ready(jax.device_put(np.zeros(shape, dtype), staging))
    nbytes = source.size * source.dtype.itemsize
    memory = (ctypes.c_uint8 * nbytes).from_address(source.unsafe_buffer_pointer())
    memory.source = source
    return np.ndarray(shape, dtype, buffer=memory)


@dataclasses.dataclass
class Build:
    """The chunk the producer is filling; the consumer may take its complete pieces (a cut)."""

    staging: list[np.ndarray]  # the slot's buffers (stacked packers)
    t0: float
    pieces: list[Any] = dataclasses.field(default_factory=list)
    batches: list[Any] = dataclasses.field(default_factory=list)  # unstacked packers
    filled: int = 0  # batches written
    taken: int | None = None  # pieces the consumer took, once it cut the chunk
    carry: list[Any] = dataclasses.field(default_factory=list)  # batches read past them
    held: list[tuple[int, list[np.ndarray]]] = dataclasses.field(default_factory=list)
    copying: list[Copy] = dataclasses.field(default_factory=list)  # handed to copiers
    pause: Callable[[], None] = lambda: None  # feeders' between batches (see channel.quiet)


class Packer(Protocol):
    """What the ring asks of a feed."""

    staged: bool  # chunks are built in a slot's staging, its memory: free it once computed on
    ragged_last: bool  # an epoch's last batch may have fewer rows (see spec.check)

    def check(self, spec: BatchSpec) -> None:
        """``BatchSpecError`` if batches of ``spec`` cannot be placed as the packer places them
        (see :func:`sinkax.placement.check_splits`)."""

    def allocate(self, spec: BatchSpec, steps: int) -> list[np.ndarray]:
        """A slot's staging buffers for ``steps`` batches of ``spec`` (if :attr:`staged`)."""

    def write(self, build: Build, spec: BatchSpec, leaves: list[np.ndarray]) -> None:
        """Add a checked batch, as its leaves, as batch ``build.filled``."""

    def pack(self, build: Build, spec: BatchSpec, steps: int) -> tuple[Any, int, bool]:
        """The chunk's data -- the first ``steps`` batches of ``build``, where the strategy
        runs --, the bytes moved to the device for it, and whether it was padded there."""

    def rows(self, build: Build, steps: int) -> list[list[np.ndarray]]:
        """Own copies of the leaves of the batches written past the first ``steps``."""


class Stacked:
    """Batches stacked on a leading axis in reusable aligned staging, put on the device(s),
    each batch placed by ``sharding`` (see :func:`sinkax.placement.stacked`)."""

    staged = True
    ragged_last = False  # a stacked chunk has one shape

    def __init__(
        self,
        sharding: jax.sharding.Sharding,
        staging: jax.sharding.Sharding | None = None,
        copiers: int = 0,
    ):
        self._batch_sharding, self._staging = sharding, staging
        sharding = self._sharding = placement.stacked(sharding)
        self._pad = jax.jit(padded, static_argnums=1, out_shardings=sharding)
        self._copiers = copiers
        self._pool = copy_pool(copiers, os.getpid()) if copiers else None
        self._share = COPY_GROUP  # batches each copier gets at once (see allocate)

    def check(self, spec: BatchSpec) -> None:
        placement.check_splits(self._batch_sharding, spec.paths, spec.shapes)

    def allocate(self, spec: BatchSpec, steps: int) -> list[np.ndarray]:
        # (here, not per batch: the spec's bytes are summed leaf by leaf)
        self._share = max(1, min(COPY_GROUP, COPY_BYTES // max(1, spec.nbytes)))
        shapes = [((steps, *leaf.shape), leaf.dtype) for leaf in spec.device_leaves]
        if self._staging is None:
            return [aligned_zeros(shape, dtype) for shape, dtype in shapes]
        return [pinned_zeros(shape, dtype, self._staging) for shape, dtype in shapes]

    def write(self, build: Build, spec: BatchSpec, leaves: list[np.ndarray]) -> None:
        if self._pool is None:
            copy_rows(build.staging, [(build.filled, leaves)])  # (paused before its read)
            return
        build.held.append((build.filled, leaves))  # the source keeps them: copied later
        if len(build.held) == self._share * self._copiers:
            self._hand_over(build, self._share)

    def _hand_over(self, build: Build, share: int) -> None:
        """The held batches to the copiers, ``share`` each (in the producer's thread, which
        starts them, and so lends them its CPU binding)."""
        for k in range(0, len(build.held), share):
            copy = Copy(build.staging, build.held[k : k + share], build.pause)
            self._pool.submit(copy.run)
            build.copying.append(copy)
        build.held = []

    def _copied(self, build: Build, by_copiers: bool) -> None:
        """Every written batch is in the staging: those still held handed to the copiers
        (``by_copiers``) or copied here, then the copies waited for (on plain locks: a Ctrl-C
        leaves nothing half done)."""
        if by_copiers and build.held:
            self._hand_over(build, -(-len(build.held) // self._copiers))
        copy_rows(build.staging, build.held, build.pause)
        build.held = []
        while build.copying:
            build.copying[0].wait()
            build.copying.pop(0)

    def pack(self, build: Build, spec: BatchSpec, steps: int) -> tuple[Any, int, bool]:
        self._copied(build, by_copiers=self._pool is not None)  # (a cut's rows: copied)
        # Executables see one chunk shape: a chunk with fewer batches than its slot holds (the
        # first, one cut short, the last) moves only its batches and is padded on the device,
        # except across processes, where every process moves its whole slot.
        capacity = len(build.staging[0])
        whole = steps == capacity or not self._sharding.is_fully_addressable
        rows = build.staging if whole else [buffer[:steps] for buffer in build.staging]
        if whole and self._staging is not None:  # by DMA from the pinned staging
            rows = [buffer.base.source for buffer in rows]
        data = placement.put(jax.tree_util.tree_unflatten(spec.treedef, rows), self._sharding)
        if not whole:
            data = self._pad(data, capacity)
        # not waiting for the transfer: the producer fills the next slot meanwhile, and a slot's
        # staging is reused only once the compute on its chunk (so its transfer) is done
        return data, sum(buffer.nbytes for buffer in rows), not whole

    def rows(self, build: Build, steps: int) -> list[list[np.ndarray]]:
        self._copied(build, by_copiers=False)  # (in the consumer's thread: a cut)
        return [[np.array(b[i]) for b in build.staging] for i in range(steps, build.filled)]


def copy_rows(
    staging: list[np.ndarray],
    rows: list[tuple[int, list[np.ndarray]]],
    pause: Callable[[], None] = lambda: None,
) -> None:
    """Each ``(i, leaves)`` of ``rows`` into row ``i`` of the ``staging`` buffers (numpy lets
    go of the interpreter lock while it copies), calling ``pause()`` before each."""
    for i, leaves in rows:
        pause()
        for buffer, leaf in zip(staging, leaves, strict=True):
            buffer[i] = leaf


class Copy:
    """Rows to copy into ``staging`` (see :func:`copy_rows`), by a copier thread: :meth:`run`
    there, :meth:`wait` for it -- on a plain lock, held until the rows are in, and a flag."""

    def __init__(
        self,
        staging: list[np.ndarray],
        rows: list[tuple[int, list[np.ndarray]]],
        pause: Callable[[], None],
    ):
        self._staging, self._rows, self._pause = staging, rows, pause
        self._done, self._finished = threading.Lock(), False
        self._done.acquire()
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            copy_rows(self._staging, self._rows, self._pause)
        except BaseException as error:  # raised by wait(), in the thread that packs
            self._error = error
        finally:
            self._finished = True
            self._done.release()

    def wait(self) -> None:
        if not self._finished and self._done.acquire():
            self._done.release()
        if self._error is not None:
            raise self._error


@functools.cache
def copy_pool(copiers: int, pid: int) -> concurrent.futures.ThreadPoolExecutor:
    """The threads that copy batches into staging, shared by the sinks of ``copiers`` in
    process ``pid`` (a forked child, whose copy of a pool has no threads, makes its own)."""
    return concurrent.futures.ThreadPoolExecutor(copiers, thread_name_prefix="sinkax-copier")


def spare_copiers() -> int:
    """Copier threads where cores are to spare: a quarter of the cores this thread may run on,
    at most 4, and none below 8 cores, where they would take the compute's."""
    if not hasattr(os, "sched_getaffinity"):
        return 0
    cores = len(os.sched_getaffinity(0))
    return 0 if cores < 8 else min(4, cores // 4)


class Unstacked:
    """Each batch an own, aligned copy on the host; a chunk is the tuple of them; with
    ``ragged_last``, an epoch's last batch may have fewer rows."""

    staged = False

    def __init__(self, ragged_last: bool = False):
        self.ragged_last = ragged_last

    def check(self, spec: BatchSpec) -> None:
        """Nothing to check: its batches go to one device (the ``"step"`` strategy)."""

    def allocate(self, spec: BatchSpec, steps: int) -> list[np.ndarray]:
        return []

    def write(self, build: Build, spec: BatchSpec, leaves: list[np.ndarray]) -> None:
        copies = [owned_copy(leaf) for leaf in leaves]
        build.batches.append(jax.tree_util.tree_unflatten(spec.treedef, copies))

    def pack(self, build: Build, spec: BatchSpec, steps: int) -> tuple[Any, int, bool]:
        return tuple(build.batches[:steps]), steps * spec.nbytes, False

    def rows(self, build: Build, steps: int) -> list[list[np.ndarray]]:
        return [jax.tree.leaves(batch) for batch in build.batches[steps:]]


def padded(chunk: Any, rows: int) -> Any:
    """``chunk`` with zero batches appended up to ``rows`` (made on the device)."""
    return jax.tree.map(lambda x: jnp.pad(x, [(0, rows - len(x))] + [(0, 0)] * (x.ndim - 1)), chunk)


def of(feed: str, config: SinkConfig, keeps_batches: bool = False) -> Packer:
    """The packer of a strategy's ``feed`` (``"stacked"`` or ``"unstacked"``) for a sink of
    ``config``: batches placed by its ``sharding``, built in its ``staging``, with its
    ``ragged_last`` (see :class:`Unstacked`); copied by :func:`spare_copiers` threads where the
    source ``keeps_batches`` and device memory is not host memory."""
    if feed == "stacked":
        off_host = not backend_of(config.sharding).host_is_device
        copiers = spare_copiers() if keeps_batches and off_host else 0
        return Stacked(config.sharding, config.staging, copiers)
    return Unstacked(config.ragged_last)
