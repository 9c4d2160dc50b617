"""The plan: how many steps each sink call runs, and how calls are grouped into chunks.

A chunk is the unit of transfer; a call runs over a window of one (or, when its data exceeds
``max_chunk_bytes``, over several consecutive chunks). The producer follows the plan, so nothing
is read past what the calls ask for (see :func:`plan`). A plan is an endless sequence of chunk
*layouts*, each a list of ``(steps, ends_call)`` pieces: several whole sink calls grouped into one
chunk (one transfer for many small calls), or a part of one call too large for a single chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from sinkax.channel.source import Position
from sinkax.spec import BatchSpec

Layout = list[tuple[int, bool]]
Plan = Callable[[BatchSpec, Position], Iterator[Layout]]

MIN_CHUNK_STEPS = 64
MIN_CHUNK_BYTES = 8 << 20  # a chunk this large moves at the link's full rate: group no further


def steps_of(layout: Layout) -> int:
    """The steps of a chunk of ``layout``."""
    return sum(steps for steps, _ in layout)


def call_sizes(
    sink_size: int | Callable[[], int],
    epoch_length: int | None,
    start_step: int,
    calls: int | None = None,
    steps: int | None = None,
) -> Iterator[int]:
    """Steps of successive calls: ``sink_size``, or (for ``-1``) the rest of each epoch, or (a
    function: ``sink_size="auto"``'s granules, see :mod:`sinkax.channel.sizing`) what it gives
    when asked, cut at each epoch's end; ``calls`` of them and ``steps`` in all (the last one
    cut there), or endlessly.

    >>> from itertools import islice
    >>> list(islice(call_sizes(-1, 10, start_step=3), 3)), list(call_sizes(4, None, 0, calls=2))
    ([7, 10, 10], [4, 4])
    >>> list(islice(call_sizes(lambda: 4, 10, start_step=0), 4))
    [4, 4, 2, 4]
    >>> list(call_sizes(lambda: 4, 10, start_step=0, steps=9))
    [4, 4, 1]
    """
    step, made, planned = start_step, 0, 0
    while (calls is None or made < calls) and (steps is None or planned < steps):
        if callable(sink_size):
            size = sink_size() if epoch_length is None else min(sink_size(), epoch_length - step)
        else:
            size = sink_size if sink_size > 0 else epoch_length - step  # type: ignore[operator]
        size = size if steps is None else min(size, steps - planned)
        yield size
        step, made, planned = (step + size) % (epoch_length or 1), made + 1, planned + size


def plan_chunks(
    calls: Iterator[int], max_steps: int, min_steps: int = MIN_CHUNK_STEPS, alike: bool = False
) -> Iterator[Layout]:
    """Chunk layouts, each a list of ``(steps, ends_call)`` pieces, for a stream of calls.

    Whole calls share a chunk (one transfer) until it holds ``min_steps``, never more than
    ``max_steps``; a call longer than ``max_steps`` is split over several chunks. With
    ``alike``, a chunk holds calls of one size only.

    >>> from itertools import islice, repeat
    >>> list(islice(plan_chunks(repeat(5), max_steps=12, min_steps=8), 2))
    [[(5, True), (5, True)], [(5, True), (5, True)]]
    >>> list(islice(plan_chunks(repeat(5), max_steps=2), 3))
    [[(2, False)], [(2, False)], [(1, True)]]
    >>> list(plan_chunks(iter([2, 2, 4, 4]), max_steps=12, min_steps=8, alike=True))
    [[(2, True), (2, True)], [(4, True), (4, True)]]
    """
    chunk: list[tuple[int, bool]] = []
    filled = 0  # steps in `chunk`
    for steps in calls:
        if alike and chunk and steps != chunk[-1][0]:
            yield chunk
            chunk, filled = [], 0
        if steps > max_steps:
            if chunk:
                yield chunk
                chunk, filled = [], 0
            while steps > max_steps:  # lazily: a call may span more chunks than fit in memory
                yield [(max_steps, False)]
                steps -= max_steps
            yield [(steps, True)]
            continue
        if filled + steps > max_steps:
            yield chunk
            chunk, filled = [], 0
        chunk.append((steps, True))
        filled += steps
        if filled >= min_steps:
            yield chunk
            chunk, filled = [], 0
    if chunk:  # the calls ended
        yield chunk


def chunk_steps(max_chunk_bytes: int, spec: BatchSpec) -> int:
    """Batches of layout ``spec`` that fit in ``max_chunk_bytes`` (at least one)."""
    return max(1, max_chunk_bytes // max(1, spec.nbytes))


def plan(
    sink_size: int | Callable[[], int],
    epoch_length: int | None,
    max_chunk_bytes: int,
    spec: BatchSpec,
    start: Position,
    calls: int | None = None,
    steps: int | None = None,
    group: bool = True,
) -> Iterator[Layout]:
    """The chunk layouts of a sink's ``calls`` and ``steps`` (endless if ``None``, see
    :func:`call_sizes`) from position ``start`` on (see :func:`plan_chunks`): whole calls
    grouped up to :data:`MIN_CHUNK_STEPS` steps or :data:`MIN_CHUNK_BYTES`, whichever comes
    first; or, without ``group``, one piece per chunk. ``sink_size="auto"``'s granules (powers
    of two) are grouped with their like, up to a power of two of steps: its chunks then come in
    few shapes -- each shape's executables are compiled anew -- as its granules grow.

    Across processes chunks are not grouped: a waiting consumer takes the complete pieces of the
    chunk being built (see :class:`~sinkax.channel.ring.DeviceRing`), which would make chunk
    boundaries -- and the offsets the processes' collectives meet with -- depend on each
    process's data speed. A chunk of one piece is the same whoever takes it.
    """
    sizes = call_sizes(sink_size, epoch_length, start.step, calls, steps)
    min_steps = min(MIN_CHUNK_STEPS, chunk_steps(MIN_CHUNK_BYTES, spec)) if group else 1
    auto = callable(sink_size)
    if auto:  # a power of two (at most the bound): whole granules fill it exactly
        min_steps = 1 << (min_steps.bit_length() - 1)
    return plan_chunks(sizes, chunk_steps(max_chunk_bytes, spec), min_steps, alike=auto)
