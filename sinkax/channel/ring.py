"""The data sink: a producer thread that fills a bounded ring of device-resident chunks.

The producer pulls batches from a :class:`~sinkax.channel.source.Source`, checks each against
the first batch's :class:`~sinkax.spec.BatchSpec`, stacks ``steps`` of them per leaf into a host
staging buffer, puts it on the device and queues it, ahead of the consumer. There are
``prefetch + 1`` slots, each owning one staging buffer. A chunk holds its slot from the moment
the producer starts filling it until the consumer says its compute has finished
(:meth:`DeviceRing.release`), so at most ``prefetch + 1`` chunks are ever on the device:
``prefetch`` ready ahead and one being computed on.

Staging buffers are allocated once and reused: fresh memory costs page faults that made the
producer slower than the training it feeds. They are 64-byte aligned, which lets XLA:CPU use
them as device buffers without a copy (``device_put`` aliases aligned host memory), so on CPU a
slot *is* the device memory; on GPU ``device_put`` copies from it.

The producer follows a plan: an endless sequence of ``(steps, ends_call)`` pairs that says how
big each chunk is and which chunk completes a sink call. Nothing is read past what the plan
asks for, and every chunk records the source position and state after its last batch, so the
consumer can report (and checkpoint) an exact data position.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from sinkax.channel.source import Position, Source
from sinkax.errors import SinkTimeoutError
from sinkax.spec import BatchSpec, check

Plan = Callable[[BatchSpec, Position], Iterator[tuple[int, bool]]]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """``steps`` consecutive batches stacked on a leading axis, resident on the device."""

    data: Any
    steps: int
    ends_call: bool
    position: Position
    source_state: dict[str, Any]


@dataclasses.dataclass
class ChannelStats:
    """What the producer did; written by the producer thread only."""

    batches: int = 0
    chunks: int = 0
    bytes: int = 0
    busy_s: float = 0.0
    slot_wait_s: float = 0.0
    max_chunks_on_device: int = 0


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an ``align``-byte boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = -raw.ctypes.data % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class _Failure:
    error: BaseException


class DeviceRing:
    """Background producer of device chunks; ``get`` hands them out in order.

    >>> import jax, numpy as np
    >>> from sinkax.channel.source import as_source
    >>> ring = DeviceRing(as_source([{"x": np.array([i])} for i in range(4)]),
    ...                   plan=lambda spec, pos: iter(((2, True),) * 10), prefetch=1,
    ...                   device=jax.devices()[0])
    >>> chunk = ring.get(timeout=10.0)
    >>> chunk.data["x"].tolist(), chunk.position
    ([[0], [1]], Position(epoch=0, step=2))
    >>> ring.release(); ring.close()
    """

    def __init__(
        self,
        source: Source,
        plan: Plan,
        *,
        prefetch: int,
        device: jax.Device,
    ):
        self._source = source
        self._plan = plan
        self._device = device
        self._free: queue.Queue[list[np.ndarray] | None] = queue.Queue()
        for _ in range(prefetch + 1):
            self._free.put(None)  # a slot whose staging buffers are not allocated yet
        self._handed_out: collections.deque[list[np.ndarray]] = collections.deque()
        self._in_use = 0
        self._in_use_lock = threading.Lock()
        self._ready: queue.Queue[tuple[Chunk, list[np.ndarray]] | _Failure] = queue.Queue()
        self._stop = threading.Event()
        self._spec_ready = threading.Event()
        self.spec: BatchSpec | None = None
        self.failed = False
        self.stats = ChannelStats()
        self._thread = threading.Thread(target=self._produce, name="sinkax-producer", daemon=True)
        self._thread.start()

    # -- producer side -------------------------------------------------------------------
    def _produce(self) -> None:
        try:
            start = self._source.position
            first = next(self._source)
            self.spec = BatchSpec.of(first)
            self._spec_ready.set()
            pending = [first]
            plan = list(itertools.islice(self._plan(self.spec, start), 2))
            capacity = max(steps for steps, _ in plan)  # a call's chunks all fit the first two
            for steps, ends_call in self._plan(self.spec, start):
                staging = self._acquire_slot()
                if staging is None:
                    return
                if not staging or len(staging[0]) < steps:
                    staging = self._allocate(max(steps, capacity))
                self._ready.put(self._build(steps, ends_call, pending, staging))
                pending = []
        except _Stopped:
            return
        except BaseException as error:  # delivered to the consumer, raised there
            self._spec_ready.set()
            self._ready.put(_Failure(error))

    def _acquire_slot(self) -> list[np.ndarray] | None:
        """A free slot's staging buffers (``[]`` if not allocated yet); ``None`` once stopped."""
        t0 = time.perf_counter()
        while True:
            try:
                staging = self._free.get(timeout=0.05)
                break
            except queue.Empty:
                if self._stop.is_set():
                    return None
        self.stats.slot_wait_s += time.perf_counter() - t0
        with self._in_use_lock:
            self._in_use += 1
            self.stats.max_chunks_on_device = max(self.stats.max_chunks_on_device, self._in_use)
        return None if self._stop.is_set() else (staging or [])

    def _allocate(self, steps: int) -> list[np.ndarray]:
        spec = self.spec
        assert spec is not None
        return [
            aligned_empty((steps, *s), d) for s, d in zip(spec.shapes, spec.dtypes, strict=True)
        ]

    def _build(
        self, steps: int, ends_call: bool, pending: list[Any], staging: list[np.ndarray]
    ) -> tuple[Chunk, list[np.ndarray]]:
        t0 = time.perf_counter()
        spec = self.spec
        assert spec is not None
        host = [buffer[:steps] for buffer in staging]
        for i in range(steps):
            where = self._source.position
            batch = pending[i] if i < len(pending) else next(self._source)
            leaves = check(spec, batch, f"epoch {where.epoch}, step {where.step}")
            for buffer, leaf in zip(host, leaves, strict=True):
                buffer[i] = leaf
            if self._stop.is_set():
                raise _Stopped
        data = jax.device_put(jax.tree_util.tree_unflatten(spec.treedef, host), self._device)
        jax.block_until_ready(data)  # the copy happens here, overlapped with the consumer
        self.stats.batches += steps
        self.stats.chunks += 1
        self.stats.bytes += steps * spec.nbytes
        self.stats.busy_s += time.perf_counter() - t0
        chunk = Chunk(data, steps, ends_call, self._source.position, self._source.get_state())
        return chunk, staging

    # -- consumer side -------------------------------------------------------------------
    def first_spec(self, timeout: float) -> BatchSpec:
        """The spec of the first batch, waiting for it up to ``timeout`` seconds."""
        if not self._spec_ready.wait(timeout):
            raise SinkTimeoutError(f"No first batch arrived within {timeout:.1f} s.")
        if self.spec is None:
            failure = self._ready.get()
            assert isinstance(failure, _Failure)
            self._ready.put(failure)
            raise failure.error
        return self.spec

    def get(self, timeout: float) -> Chunk:
        """The next chunk; re-raises a producer error; ``SinkTimeoutError`` after ``timeout``."""
        try:
            item = self._ready.get(timeout=timeout)
        except queue.Empty:
            raise SinkTimeoutError(f"No data arrived within {timeout:.1f} s.") from None
        if isinstance(item, _Failure):
            self.failed = True
            self._ready.put(item)  # every later call fails the same way
            raise item.error
        chunk, staging = item
        self._handed_out.append(staging)
        return chunk

    def release(self) -> None:
        """The oldest handed-out chunk's compute has finished: its slot is free again."""
        with self._in_use_lock:
            self._in_use -= 1
        self._free.put(self._handed_out.popleft())

    def close(self) -> None:
        """Stop the producer, wait for it and drop the queued chunks."""
        self._stop.set()
        self._thread.join()
        self._source.close()
        while not self._ready.empty():
            self._ready.get_nowait()


class _Stopped(Exception):
    """The ring was closed while a chunk was being built."""
