"""The cursor: a sink's data position, and the ring that reads ahead of it.

The cursor hands out the pieces of the ring's chunks one call at a time and knows two
positions: where the ring has read to (handed out) and where the caller has been given results
up to (*committed*, what ``Sink.data_state()`` reports). A call that takes data and does not
deliver its results leaves the cursor out of step; the next call first rewinds the ring to the
committed position (a *resync*), so no batch is skipped and none repeated.

>>> import numpy as np
>>> from sinkax.channel.source import as_source
>>> from sinkax.config import AUTO, SinkConfig
>>> cursor = Cursor(as_source([{"x": np.float32(i)} for i in range(3)]), SinkConfig.of(2))
>>> data, piece, offset = cursor.next_piece()
>>> data["x"][offset : offset + piece.steps].tolist(), piece.ends_call
([0.0, 1.0], True)
>>> cursor.ran(piece, data); cursor.commit(piece); (cursor.epoch, cursor.step)
(0, 2)
>>> cursor.close(running=False)
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax

from sinkax import interrupt
from sinkax.channel import messages, packers
from sinkax.channel.chunk import Chunk, Piece
from sinkax.channel.plan import plan
from sinkax.channel.position import DataPosition, check_fits, move_to
from sinkax.channel.ring import DeviceRing
from sinkax.channel.sizing import CallSizer
from sinkax.channel.source import Source
from sinkax.config import AUTO, SinkConfig
from sinkax.errors import SinkTimeoutError, warn
from sinkax.spec import BatchSpec

# takes the next chunk, across processes once they all agree on its description
Agree = Callable[[Callable[[], Chunk], Callable[[Chunk], dict[str, Any]]], Chunk]


class Cursor:
    """The data position of a sink over ``source``, configured by ``config`` (steps per call,
    prefetch, chunk bytes, timeout, sharding), fed by a :class:`~sinkax.channel.ring.DeviceRing`
    whose chunks are packed as the strategy's ``feed`` asks (:mod:`sinkax.channel.packers`);
    starting at ``data_state`` if given. Owns ``source`` from then on.
    """

    def __init__(
        self,
        source: Source,
        config: SinkConfig,
        *,
        feed: str = "stacked",
        data_state: DataPosition | None = None,
    ):
        self._source, self._packer = source, packers.of(feed, config, source.keeps_batches)
        self.sizer, self._total = None, config.total_steps  # sink_size="auto"; steps it runs
        if config.sink_size == AUTO:
            self.sizer = CallSizer(config.call_seconds, source.epoch_length, config.total_steps)
        sizes = self.sizer.granule if self.sizer else config.sink_size
        one_process = config.sharding.is_fully_addressable
        self._plan = functools.partial(
            plan, sizes, source.epoch_length, config.max_chunk_bytes, group=one_process
        )
        self._calls = config.calls  # the calls the sink will make, if known
        self.prefetch, self.timeout = config.prefetch, config.timeout
        if data_state is not None:
            move_to(source, data_state)
            if self.sizer:
                self.sizer.restore(data_state)
        self._committed_piece: Piece | None = None  # committed since _position was set
        self._made: tuple[Piece | None, Any] = (None, None)  # a piece and its position
        self._committed = DataPosition.of(source)
        self._chunk: Chunk | None = None  # being consumed, piece by piece
        self._piece = self._offset = 0
        # (what is ready once the last window dispatched has computed,), or None: none is
        self._in_flight: tuple[Any] | None = None
        self._resync = False  # data was taken and not delivered: rewind before the next call
        self.steps = self.calls = self._stops = self._done = 0  # _done: delivered steps
        self.data_wait_s = self.busy_s = 0.0
        self._call_started = (0.0, 0.0)  # the clock and the data wait at the call's start
        self._call_steps = self._call_windows = 0  # the steps this call kept, its windows
        self._closed = False  # once closed, no producer starts (a running call's stop, rewind)
        self._start_ring()

    # -- where the data stands -----------------------------------------------------------
    @property
    def _committed(self) -> DataPosition:
        """Where the next call starts: after the last committed piece (made once per piece, and
        nothing cleared: another thread may read while a call commits)."""
        piece, (made, position) = self._committed_piece, self._made
        if piece is not None and made is not piece:
            where, length = piece.position, self.epoch_length
            position = DataPosition(where.epoch, where.step, piece.source_state, length)
            self._made = (piece, position)
        return self._position if piece is None else position

    @_committed.setter
    def _committed(self, position: DataPosition) -> None:
        self._position, self._committed_piece = position, None

    epoch = property(lambda self: self._committed.epoch, doc="Epoch of the next batch (from 0).")
    step = property(lambda self: self._committed.step, doc="Step in the epoch of the next batch.")
    epoch_length = property(
        lambda self: self._source.epoch_length, doc="Batches per epoch, if the dataset knows."
    )
    call_steps = property(lambda self: self._call_steps, doc="Steps this call (or the last) kept.")
    ring = property(lambda self: self._ring, doc="The ring that reads ahead.")

    def counts(self) -> dict[str, Any]:
        """The data side of ``Sink.stats``."""
        sizes = tuple(self.sizer.sizes) if self.sizer else None
        mine = {"steps": self.steps, "calls": self.calls, "data_wait_s": self.data_wait_s}
        return {**mine, **self._ring.stats.counts(), "call_sizes": sizes}

    @property
    def position(self) -> DataPosition:
        """The committed position (``Sink.data_state``), with an auto sink's size and granule."""
        if self.sizer is None:
            return self._committed
        sized = {"call_steps": self.sizer.target, "call_granule": self.sizer.kept_granule}
        return dataclasses.replace(self._committed, **sized)

    def first_spec(self) -> BatchSpec:
        """The layout of every batch, waiting up to ``timeout`` for the first."""
        return self._ring.first_spec(self.timeout)

    # -- one call ------------------------------------------------------------------------
    def resync(self) -> None:
        """Rewind to the committed position if an interrupted call took data it never delivered."""
        if self._resync:
            self.rewind(self._committed, own=True)

    def begin(self) -> None:
        """A call starts (its time, less its wait for data, is the sink's busy time)."""
        self._call_started = (time.perf_counter(), self.data_wait_s)
        self._call_steps = self._call_windows = 0
        if self.sizer:  # with the last call's last window: its compute may be done
            self.sizer.started(self._in_flight)

    def next_piece(self, agree: Agree | None = None) -> tuple[Any, Piece, int]:
        """The next piece: ``(chunk data, piece, offset of its first batch in the chunk)``.

        ``agree(take, describe)``, if given, takes the chunk (across processes: once all agree
        that ``describe`` of it is the same everywhere, see :class:`sinkax.peers.Peers`).
        """
        chunk = agree(self._current_chunk, self._describe) if agree else self._current_chunk()
        return chunk.data, chunk.pieces[self._piece], self._offset

    def _describe(self, chunk: Chunk) -> dict[str, Any]:
        """What the processes' next dispatch meets with: the piece, where it ends in the data,
        its offset in the chunk, the chunk's shape (see :func:`sinkax.channel.plan.plan`)."""
        piece = chunk.pieces[self._piece]
        return {
            "piece": [piece.position.epoch, piece.position.step, piece.steps, piece.ends_call],
            "offset": self._offset,
            "chunk_shape": list(jax.tree.leaves(chunk.data)[0].shape),
        }

    def ran(self, piece: Piece, in_flight: Any, steps: int | None = None) -> None:
        """``piece`` was dispatched, and the first ``steps`` of its batches (default: all) were
        kept; ``in_flight`` is ready once its compute is done (its chunk's slot is refilled only
        then)."""
        steps = piece.steps if steps is None else steps
        self._in_flight = (in_flight,)
        self._piece += 1
        self._offset += piece.steps
        self.steps += steps
        self._call_steps += steps
        self._call_windows += 1

    def ends_call(self, piece: Piece, compiling: float = 0.0, *, ahead: bool = False) -> bool:
        """Whether the call ends with ``piece``, just run (``ahead``: about to run): where the
        plan ends a call (auto: a granule) and, auto, it is long enough, ``compiling`` seconds
        spent compiling (see :meth:`CallSizer.enough`; compiling only ends a call sooner)."""
        if self.sizer is None or not piece.ends_call:
            return piece.ends_call
        steps, windows = self._call_steps + ahead * piece.steps, self._call_windows + ahead
        return self.sizer.enough(steps, piece.position, compiling, windows)

    def commit(self, piece: Piece, compiling: float = 0.0) -> None:
        """The call that ended with ``piece`` delivers its results: its position is committed;
        an auto sink measures it, less the ``compiling`` seconds it spent compiling."""
        self._count_call(compiling)
        self._committed_piece = piece  # made a DataPosition where read: few calls read it

    def stop(self) -> None:
        """The call ends early, its results delivered: commit the position after the batches it
        kept (see :meth:`ran`), the first it did not, and read ahead from there again: the
        source is moved to the call's start and read up to that batch (a grain ``MapDataset``
        reads those elements again; see :mod:`sinkax.channel.source`). ``SinkTimeoutError`` if
        the producer does not stop (the next call then rewinds to the call's start)."""
        start, kept = self._committed, self._call_steps
        self._resync = True  # until a producer runs from the new position
        if not self._stop_ring():
            raise SinkTimeoutError(
                messages.stuck_producer(self.timeout, "a stop at a non-finite step")
                + " Call again once it has returned (the call's batches are read again)."
            )
        move_to(self._source, start, own=True)
        for _ in range(kept):
            next(self._source)
        self._count_call()
        self._committed, self._stops = DataPosition.of(self._source), self._stops + (not kept)
        self._start_ring()
        self._resync = False

    def _count_call(self, compiling: float | None = None) -> None:
        started, waited = self._call_started
        self.busy_s += time.perf_counter() - started - (self.data_wait_s - waited)
        self.calls, self._done = self.calls + 1, self._done + self._call_steps
        if self.sizer:
            self.sizer.ended(self._call_steps, compiling)

    def failed(self, consumed: bool) -> None:
        """A call failed; if it ``consumed`` data, the next call rewinds first -- unless the
        producer failed, which every later call reports the same way."""
        if consumed:
            self._resync = True
        if self._ring.failed:
            self._resync = False

    def _current_chunk(self) -> Chunk:
        """The chunk holding the next piece, taking the next one when this is used up."""
        if self._chunk is None or self._piece == len(self._chunk.pieces):
            # Taking a chunk moves the ring: if anything interrupts this before the chunk is
            # recorded, the next call rewinds to the committed position (nothing is lost).
            self._resync = True
            self._chunk = None  # no reference past its slot: at most prefetch + 1 chunks live
            self._release_in_flight()  # the used-up chunk's slot, refilled once computed on
            try:
                chunk = self._next_chunk()
            except Exception:  # a timeout or the producer's error: nothing was taken
                self._resync = False
                raise
            self._chunk = chunk
            self._piece = self._offset = 0
            self._resync = False
        return self._chunk

    def _next_chunk(self) -> Chunk:
        waited = self._ring.stats.data_wait_s
        try:
            return self._ring.get(self.timeout)
        except SinkTimeoutError:
            raise SinkTimeoutError(messages.timed_out(self._ring.stats, self)) from None
        finally:
            self.data_wait_s += self._ring.stats.data_wait_s - waited

    def _release_in_flight(self, wait: bool = False) -> None:
        """Free the last dispatched window's chunk's slot: the producer refills it once the
        window's compute is done (``wait``: wait for that here); an unstacked ring's at once
        (its chunks own no memory the ring reuses: the batches were handed over one by one)."""
        if self._in_flight is None:
            return
        done = self._in_flight[0] if self._ring.packer.staged else None
        if wait and done is not None:
            jax.block_until_ready(done)
        self._in_flight = None
        self._ring.release(done)

    def abandon(self) -> None:
        """Forget the last dispatched window without waiting for it: it may wait in a
        collective for a process that is gone. Its chunk's slot stays taken."""
        self._in_flight = None

    # -- the ring ------------------------------------------------------------------------
    def _start_ring(self) -> None:
        if self._closed:  # by another thread, while a call stopped or rewound
            return
        with interrupt.held():  # a producer started is a producer recorded (and closed)
            # calls that a stop ended before they kept a step do not count (_stops)
            left = None if self._calls is None else self._calls - self.calls + self._stops
            steps = (
                self.sizer.steps_left() if self.sizer else self._total and self._total - self._done
            )
            self._ring = DeviceRing(
                self._source,
                # holds no reference to the cursor: an unclosed sink is collected
                functools.partial(self._plan, calls=left, steps=steps),
                prefetch=self.prefetch,
                packer=self._packer,
            )
            ring = weakref.ref(self._ring)  # not kept alive by it: an error it holds may
            self._finalizer = weakref.finalize(self, _close, ring, self.timeout)  # hold us
        if self._closed:  # meanwhile, from another thread: it closed the ring before this one
            self._ring.close(self.timeout)

    def _stop_ring(self) -> bool:
        """Stop the producer; whether it ended within ``timeout`` (see :meth:`DeviceRing.close`)."""
        self._chunk = None  # before its slot is freed: see _current_chunk
        self._release_in_flight(wait=True)
        self._finalizer.detach()
        return self._ring.close(self.timeout)

    def rewind(self, state: DataPosition, own: bool = False) -> None:
        """Continue from the position ``state`` (see ``Sink.data_state``; ``own``: one this cursor
        recorded), dropping the prefetched chunks; ``ValueError`` if it does not fit the dataset,
        the cursor then back where it was -- or, if it cannot go back (an epoch read again differs)
        or is interrupted, the next :meth:`resync` rewinds to the committed position."""
        check_fits(self._source, state)  # first: a one-shot iterator's producer cannot restart
        self._resync = True  # until a producer runs from `_committed` again
        if not self._stop_ring():  # its source is in use: rewinding it now would corrupt it
            raise SinkTimeoutError(
                messages.stuck_producer(self.timeout, "rewinding the data")
                + " Call again once it has returned, or create a new sink."
            )
        try:
            move_to(self._source, state, own)
            if self.sizer:
                self.sizer.restore(state)
        except ValueError:  # the cursor stays where it was, its producer running
            try:  # (a one-shot iterator reads on as it is)
                if self._source.rereadable:
                    self._source.set_state(dict(self._committed.source), own=True)
            except Exception:  # not back there (its epoch read again differs): the next
                pass  # call's resync tries again, and raises why it cannot
            else:
                self._start_ring()
                self._resync = False
            raise
        self._committed = DataPosition.of(self._source)
        self._start_ring()
        self._resync = False

    def close(self, running: bool) -> None:
        """Stop the producer and free the device chunks. While a call is ``running`` (in another
        thread) it owns the chunks: it is only woken (it fails with
        :class:`~sinkax.SinkClosedError`). Warns if the producer is stuck in the dataset."""
        self._closed = True
        if running:
            self._finalizer.detach()
            self._ring.close(self.timeout)
        elif not self._stop_ring():
            warn(messages.stuck_producer(self.timeout, "close()"), RuntimeWarning)


def _close(ring: weakref.ref[DeviceRing], timeout: float) -> None:
    """Close the ring, if it still lives (its producer thread keeps it while it runs)."""
    if (live := ring()) is not None:
        live.close(timeout)
