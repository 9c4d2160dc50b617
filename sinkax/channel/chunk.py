"""What the ring hands out: a :class:`Chunk` of consecutive batches, in :class:`Piece` s (or a
:class:`Failure` of its producer, or :class:`Closed`).

A piece is the part of a chunk one sink call runs (or, for a call larger than a chunk, a part
of that call); it records the data position after its last batch, so the consumer can report
an exact position after every call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sinkax.channel.source import Position


@dataclasses.dataclass(frozen=True, slots=True)  # one per call a chunk holds: slots, cheap
class Piece:
    """``steps`` batches of a chunk; ``ends_call`` if a sink call ends with them."""

    steps: int
    ends_call: bool
    position: Position  # of the batch after this piece
    source_state: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Consecutive batches, in pieces: stacked on a leading axis and resident on the device, or
    (unstacked rings) a tuple of host batches."""

    data: Any
    pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True)
class Failure:
    """The producer's error, handed out in place of a chunk: raised in the consumer."""

    error: BaseException
    traceback: Any  # as the producer caught it: each re-raise starts from it again

    def reraise(self) -> None:
        raise self.error.with_traceback(self.traceback)


class Closed:
    """Handed out once the ring is closed: wakes a waiting consumer."""


@dataclasses.dataclass(frozen=True)
class Row:
    """A batch already checked, as its leaves: read into a chunk the consumer cut short, it
    starts the producer's next chunk."""

    leaves: list[Any]


@dataclasses.dataclass
class ChannelStats:
    """What the producer did, written by its thread only, and ``data_wait_s``, the consumer's
    wait for the data (see :meth:`~sinkax.channel.ring.DeviceRing.get`), by the consumer's."""

    batches: int = 0
    chunks: int = 0
    padded: int = 0  # chunks moved short of their slot and padded on the device: one launch each
    bytes: int = 0
    busy_s: float = 0.0
    slot_wait_s: float = 0.0
    max_chunks_on_device: int = 0
    data_wait_s: float = 0.0

    def counts(self) -> dict[str, Any]:
        """The producer's side of ``Sink.stats``, by :class:`~sinkax.stats.SinkStats`' names."""
        return {
            "chunks_transferred": self.chunks,
            "chunks_padded": self.padded,
            "bytes_transferred": self.bytes,
            "max_chunks_on_device": self.max_chunks_on_device,
            "slot_wait_s": self.slot_wait_s,
        }
