"""The data sink: a producer thread that fills a bounded ring of device-resident chunks.

The producer pulls batches from a :class:`~sinkax.channel.source.Source`, checks each against
the first batch's :class:`~sinkax.spec.BatchSpec` (``ragged_last``: widened by the next, if the
first ends an epoch), hands it to the ring's packer (:mod:`sinkax.channel.packers`: stacked into a
slot's staging buffers and put on the device, or copied and handed over unstacked, as the
strategy's ``feed`` asks) and queues the chunk, ahead of the consumer. A chunk holds one of the
``prefetch + 1`` slots from the moment the producer starts filling it until the compute on it
has finished (the consumer hands the slot back with what that compute makes,
:meth:`DeviceRing.release`, and the producer waits for it): at most ``prefetch + 1`` chunks on the
device, ``prefetch`` ready, and while one moved short is padded there, its batches once more.

It follows a plan (:mod:`sinkax.channel.plan`), reading nothing past it; each piece records
the source position and state after its last batch.

A consumer that finds no chunk ready within :data:`CUT_AFTER_S` takes the complete pieces of the
chunk being filled (a *cut*; the producer carries the batches it read past them over to its next
chunk), so a slow batch never holds back a call whose batches were all read; its wait lasts
until the producer has read no batch for ``timeout`` seconds. In both, the producer's waits for
the device to free a slot do not count (the device has work queued then). While a call runs
on the host a producer ahead pauses between batches (:attr:`DeviceRing.quiet`). The consumer side
uses C queues and plain locks only, never an ``Event`` or ``Condition``, whose Python code a
Ctrl-C in the consumer can interrupt half done.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import threading
import time
from typing import Any

import jax
import numpy as np

from sinkax import affinity
from sinkax.channel.chunk import ChannelStats, Chunk, Closed, Failure, Piece, Row
from sinkax.channel.packers import Build, Packer
from sinkax.channel.plan import Layout, Plan, steps_of
from sinkax.channel.quiet import Quiet
from sinkax.channel.source import Source
from sinkax.channel.stopwatch import Stopwatch
from sinkax.errors import SinkClosedError, SinkExhaustedError, SinkTimeoutError
from sinkax.spec import BatchSpec, check, widened

CUT_AFTER_S = 0.02  # a consumer waits this long for a whole chunk before it takes a part
_Item = tuple[Chunk, list[np.ndarray]] | Failure | Closed  # what the consumer is handed


class DeviceRing:
    """Background producer of device chunks; ``get`` hands them out in order.

    >>> import jax, numpy as np
    >>> from sinkax.channel.packers import Stacked
    >>> from sinkax.channel.source import as_source
    >>> ring = DeviceRing(as_source([{"x": np.array([i])} for i in range(4)]),
    ...                   plan=lambda spec, pos: iter([[(1, True), (2, True)]] * 10), prefetch=1,
    ...                   packer=Stacked(jax.sharding.SingleDeviceSharding(jax.devices()[0])))
    >>> first = ring.get(timeout=10.0)  # the first chunk goes out after its first piece
    >>> ring.release(); second = ring.get(timeout=10.0)
    >>> second.data["x"][:2].tolist(), [p.position for p in second.pieces]
    ([[1], [2]], [Position(epoch=0, step=3)])
    >>> ring.release(); ring.close(timeout=10.0)
    True
    """

    def __init__(self, source: Source, plan: Plan, *, prefetch: int, packer: Packer):
        self._source, self._plan, self.packer = source, plan, packer
        # C queues: a Ctrl-C in the consumer cannot leave them half-updated
        # slots as (staging buffers, what the compute on their last chunk makes)
        self._free: queue.SimpleQueue[tuple[list[np.ndarray] | None, Any]] = queue.SimpleQueue()
        for _ in range(prefetch + 1):
            self._free.put((None, None))  # a slot whose staging is not allocated yet
        self._handed_out: collections.deque[list[np.ndarray]] = collections.deque()
        self._taken = self._released = 0  # slots: one writer each, so the consumer takes no lock
        self._lock = threading.Lock()  # the chunk being built, the stats
        self._building: Build | None = None
        self._ready: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        # No Event or Condition on the consumer side: their Python code, interrupted by a Ctrl-C,
        # can leave their lock released under the producer ('release unlocked lock'). A flag
        # plus a plain lock (C code) held until the flag is set serve instead; the flag is the
        # truth, the lock only a way to wait for it.
        self._stopped = False
        self._spec_known = False  # `spec`, or a failure, is ready
        self._spec_pending, self._running = threading.Lock(), threading.Lock()  # held until
        self._spec_pending.acquire(), self._running.acquire()  # the spec is known, it ended
        self._ended = self._consumer_waiting = False  # the producer closed the source and ends
        self.last_progress = time.monotonic()  # the producer's last batch read, or slot freed
        self._on_device = Stopwatch()  # the producer waiting for the device to free a slot
        self.spec: BatchSpec | None = None
        self.failed = False
        self.quiet = Quiet(ahead=self._ready.qsize)  # a call holds it: its feeders pause
        self.stats = ChannelStats()
        self._thread = threading.Thread(target=self._produce, name="sinkax-producer", daemon=True)
        self._thread.start()

    # -- producer side -------------------------------------------------------------------
    def _produce(self) -> None:
        with affinity.data_thread():  # on the data CPUs, if sinkax.set_cpu_affinity asked
            try:
                self._run_producer()
            finally:  # by the thread that reads it, also when close() stopped waiting for it
                try:
                    self._source.close()
                finally:  # (an interrupted Thread.join marks a live thread ended: not this)
                    self._ended = True
                    self._running.release()

    def _run_producer(self) -> None:
        try:
            start, first = self._source.position, self._read()
            spec = BatchSpec.of(first)
            self.packer.check(spec)  # that it splits over the devices as the sharding asks
            self.spec = spec
            self._spec_known = True
            self._spec_pending.release()
            pending = [Row(check(spec, first, start))]  # checked here, at its position
            layouts = self._plan(self.spec, start)
            # ragged_last from an epoch's last batch, maybe short: the next full batch sets the
            # layout (read in turn: nothing read ahead), the plan, by the first, one batch a chunk
            self._short = self.packer.ragged_last and self._source.position.step == 0 < start.step
            if self._short:
                layouts = ([piece] for layout in layouts for piece in layout)
            head = list(itertools.islice(layouts, 3))
            capacity = max(map(steps_of, head), default=0)  # later layouts are alike
            layouts = itertools.chain(head, layouts)
            leftover: Layout = []
            while True:
                layout = leftover or next(layouts, None)
                if layout is None:  # the plan's calls are all read
                    raise SinkExhaustedError()
                staging = self._acquire_slot()
                if staging is None:
                    return
                if self.packer.staged and (not staging or len(staging[0]) < steps_of(layout)):
                    capacity = max(capacity, steps_of(layout))
                    staging = self.packer.allocate(self.spec, capacity)
                leftover, pending = self._build(layout, pending, staging)
        except _Stopped:
            return
        except BaseException as error:  # delivered to the consumer, raised there
            self._ready.put(Failure(error, error.__traceback__))
            if not self._spec_known:
                self._spec_known = True
                self._spec_pending.release()

    def _read(self) -> Any:
        batch = next(self._source)
        self.stats.batches, self.last_progress = self.stats.batches + 1, time.monotonic()
        return batch

    def _acquire_slot(self) -> list[np.ndarray] | None:
        """A free slot's staging buffers (``[]`` if not allocated yet), once the compute on its
        last chunk is done; ``None`` once stopped."""
        t0 = time.perf_counter()
        while True:
            try:
                staging, computing = self._free.get(timeout=0.05)
                break
            except queue.Empty:
                if self._stopped:
                    return None
        if computing is not None:  # the device's time, not the data's (see get, _wait)
            with self._on_device.timing(), contextlib.suppress(RuntimeError):  # deleted: the
                jax.block_until_ready(computing)  # sink was closed
            self.last_progress = time.monotonic()  # the data's timeout starts again here
        self.stats.slot_wait_s += time.perf_counter() - t0
        self._taken += 1
        in_use = self._taken - self._released  # released before it was put back: exact
        self.stats.max_chunks_on_device = max(self.stats.max_chunks_on_device, in_use)
        return None if self._stopped else (staging or [])

    def _build(
        self, layout: Layout, pending: list[Any], staging: list[np.ndarray]
    ) -> tuple[Layout, list[Any]]:
        """Fill ``staging`` per ``layout``, put it on the device and queue it (unless the
        consumer cut it short and took it, see :meth:`_cut`): returns the pieces left over and
        the batches read for them.

        A chunk goes out early, after any complete piece, when it is the first or the consumer
        has waited :data:`CUT_AFTER_S`; such a consumer also takes the complete pieces itself
        while the producer is inside the dataset. So a slow batch never holds back a call whose
        batches were all read. If reading fails, the pieces completed so far still go out
        before the error. (The packer pads a short chunk to one shape on the device.)
        """
        spec = self.spec
        assert spec is not None
        build = Build(staging, time.perf_counter(), pause=self.quiet.pause)
        with self._lock:
            self._building = build
        pending = collections.deque(pending)
        source, write, ragged = self._source, self.packer.write, self.packer.ragged_last
        try:
            for piece_steps, ends_call in layout:
                for _ in range(piece_steps):  # per batch: kept to the least Python
                    build.pause()
                    where = source.position
                    batch = pending.popleft() if pending else self._read()
                    if type(batch) is Row:  # checked when it was first read
                        leaves = batch.leaves
                    else:
                        last = ragged and where.step + 1 == source.epoch_length
                        if self._short and not last:
                            spec = self.spec = widened(spec, batch, where)
                            self._short = False
                        leaves = check(spec, batch, where, last)
                    with self._lock:
                        if build.taken is not None:  # the batch starts the next chunk
                            self._building = None
                            return layout[build.taken :], [*build.carry, Row(leaves), *pending]
                        write(build, spec, leaves)
                        build.filled += 1
                    if self._stopped:
                        raise _Stopped
                piece = Piece(piece_steps, ends_call, source.position, source.get_state())
                with self._lock:
                    if build.taken is not None:
                        self._building = None
                        return layout[build.taken :], [*build.carry, *pending]
                    build.pieces.append(piece)
                    if self.stats.chunks == 0 or (self._consumer_waiting and self._ready.empty()):
                        break
            with self._lock:
                self._building = None
                if build.taken is not None:
                    return layout[build.taken :], [*build.carry, *pending]
                self._ready.put(self._transfer(build))  # under the lock: no cut overtakes it
        except _Stopped:
            raise
        except BaseException:
            with self._lock:
                self._building = None
                if build.pieces and build.taken is None:
                    self._ready.put(self._transfer(build))
            raise
        return layout[len(build.pieces) :], list(pending)

    def _transfer(self, build: Build) -> tuple[Chunk, list[np.ndarray]]:
        """``build``'s complete pieces as a chunk on the device; under ``_lock``."""
        spec = self.spec
        assert spec is not None
        steps = sum(piece.steps for piece in build.pieces)
        data, moved, padded = self.packer.pack(build, spec, steps)
        self.stats.chunks += 1
        self.stats.padded += padded
        self.stats.bytes += moved
        self.stats.busy_s += time.perf_counter() - build.t0
        return Chunk(data, tuple(build.pieces)), build.staging

    # -- consumer side -------------------------------------------------------------------
    def _cut(self) -> tuple[Chunk, list[np.ndarray]] | None:
        """The complete pieces of the chunk being built, taken by the waiting consumer (the
        producer carries the batches it read past them over to its next chunk); or ``None``."""
        with self._lock:
            build = self._building
            taken = build is None or build.taken is not None
            if taken or not build.pieces or not self._ready.empty():
                return None
            steps = sum(piece.steps for piece in build.pieces)
            # rows past the pieces, copied before the slot can be reused (and before the build
            # is marked taken: a Ctrl-C in the copy leaves the producer to go on with it)
            build.carry = [Row(leaves) for leaves in self.packer.rows(build, steps)]
            build.taken = len(build.pieces)
            return self._transfer(build)

    def first_spec(self, timeout: float) -> BatchSpec:
        """The spec of the first batch, waiting for it up to ``timeout`` seconds."""
        with self.quiet.lifted(not self._spec_known):
            if not self._spec_known and self._spec_pending.acquire(timeout=timeout):
                self._spec_pending.release()
        if not self._spec_known:
            raise SinkTimeoutError(f"No first batch arrived within {timeout:.1f} s.")
        if self.spec is None:
            failure = self._ready.get()
            assert isinstance(failure, Failure)
            self._ready.put(failure)
            failure.reraise()
        return self.spec

    def get(self, timeout: float) -> Chunk:
        """The next chunk, its wait in ``stats.data_wait_s`` less the producer's meanwhile for the
        device to free a slot (the device's); re-raises a producer error; ``SinkTimeoutError``
        after ``timeout`` s with no batch read; ``SinkClosedError`` once closed."""
        t0, device = time.perf_counter(), self._on_device.seconds()
        try:
            with self.quiet.lifted(self._ready.empty()):
                item = self._wait(timeout)
        finally:
            self._consumer_waiting = False
            waited = time.perf_counter() - t0 - (self._on_device.seconds() - device)
            self.stats.data_wait_s += max(0.0, waited)
        if isinstance(item, Closed):
            self._ready.put(item)
            raise SinkClosedError("The sink was closed while a call waited for its data.")
        if isinstance(item, Failure):
            self.failed = True
            self._ready.put(item)  # every later call fails the same way
            item.reraise()
        chunk, staging = item
        self._handed_out.append(staging)
        return chunk

    def _wait(self, timeout: float) -> Any:
        start, device = time.monotonic(), self._on_device.seconds()
        cut_after = min(CUT_AFTER_S, timeout)  # of the data's time, not the device's: see above
        while (data_s := time.monotonic() - start - self._on_device.seconds() + device) < cut_after:
            with contextlib.suppress(queue.Empty):
                return self._ready.get(timeout=cut_after - data_s)
        self._consumer_waiting = True  # from here on the producer sends complete pieces
        if (cut := self._cut()) is not None:
            return cut
        while True:  # the wait starts again whenever a batch arrives, or the device frees a slot
            left = max(self.last_progress, start) + timeout - time.monotonic()
            if left <= 0 and not self._on_device.running:  # (while it computes: no timeout)
                raise SinkTimeoutError(f"No data arrived within {timeout:.1f} s.")
            with contextlib.suppress(queue.Empty):
                return self._ready.get(timeout=left if left > 0 else min(timeout, 1.0))

    def release(self, computing: Any = None) -> None:
        """The oldest handed-out chunk's slot is free again once ``computing`` (arrays the last
        compute on the chunk makes, or ``None``) is ready; the consumer does not wait."""
        self._released += 1
        self._free.put((self._handed_out.popleft(), computing))

    def close(self, timeout: float) -> bool:
        """Stop the producer, drop the queued chunks; whether the producer ended in ``timeout`` s.

        The producer stops between two batches; one blocked in the dataset's ``next`` (a daemon
        thread: it never holds up the interpreter's exit) closes the source and ends once that
        returns. A call waiting in :meth:`get` fails with :class:`~sinkax.SinkClosedError`.
        """
        self._stopped = True
        self._free.put((None, None))  # wakes a producer waiting for a slot now
        self._ready.put(Closed())  # wakes a waiting consumer now, not after the join
        waits = threading.current_thread() is not self._thread  # (collected in its own thread)
        if waits and not self._ended and self._running.acquire(timeout=timeout):
            self._running.release()
        while not self._ready.empty():
            self._ready.get_nowait()
        self._ready.put(Closed())
        return self._ended


class _Stopped(Exception):
    """The ring was closed while a chunk was being built."""
