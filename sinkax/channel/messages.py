"""What a cursor says when its data stops coming: the messages of its timeouts, naming the
pipeline's rate against the sink's and what to try."""

from __future__ import annotations

from typing import Any

from sinkax.channel.chunk import ChannelStats


def timed_out(ring: ChannelStats, cursor: Any) -> str:
    """Why a call waited ``cursor.timeout`` seconds for data in vain: where the data stands
    (``cursor.epoch``, ``.step``), what the pipeline delivered (``ring``) and the sink consumed
    (``cursor.steps`` in ``cursor.busy_s``), and what to try; rates once known.

    >>> from types import SimpleNamespace
    >>> cursor = SimpleNamespace(timeout=2.0, epoch=0, step=0, steps=0, busy_s=0.0)
    >>> timed_out(ChannelStats(batches=3), cursor).split(". ")[1]
    'So far it has delivered 3 batches'
    """
    produced = f", at {ring.batches / ring.busy_s:.1f} batches/s" if ring.busy_s else ""
    rate = cursor.steps / cursor.busy_s if cursor.busy_s else None
    consumed = "" if rate is None else f"; the sink consumes {rate:.1f} steps/s"
    return (
        f"The input pipeline delivered no batch for {cursor.timeout:.1f} s while the sink "
        f"waited for data (epoch {cursor.epoch}, step {cursor.step}). So far it has delivered "
        f"{ring.batches} batches{produced}{consumed}. The pipeline "
        "is stuck or very slow per batch: speed it up (grain ReadOptions(num_threads=...), "
        "batch before heavy transforms, vectorise them), raise `timeout=` if single batches "
        "can take that long, or iterate the dataset directly (or dataset_sink_mode=False) "
        "to find the slow sample."
    )


def stuck_producer(timeout: float, doing: str) -> str:
    """Why the producer thread did not stop within ``timeout`` seconds of ``doing`` asking.

    >>> stuck_producer(2.0, "close()")[:62]
    "The producer thread is still inside the dataset's iterator 2.0"
    """
    return (
        f"The producer thread is still inside the dataset's iterator {timeout:.1f} s "
        f"after {doing} asked it to stop: the dataset is slow or blocked. The thread is a "
        "daemon and ends as soon as the dataset returns; a dataset that can block "
        "indefinitely should time out by itself."
    )
