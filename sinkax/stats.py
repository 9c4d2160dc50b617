"""What a sink has done so far: :class:`SinkStats`, the snapshot ``Sink.stats`` returns."""

from __future__ import annotations

import dataclasses

from sinkax import pjrt


@dataclasses.dataclass(frozen=True)
class SinkStats:
    """What a sink has done so far.

    ``data_wait_s`` is time the caller waited for data (input-bound): not the part of a wait
    for a chunk during which the producer waited for the device to be done with a slot (calls
    dispatched ahead of the device, whose chunks in flight are bounded); ``slot_wait_s`` is time
    the producer waited for a free device slot (compute-bound). With the ``"step"`` strategy the
    chunks and bytes counted were handed over unstacked; XLA takes each batch at dispatch.
    ``chunks_padded``: chunks that moved only their batches, fewer than a slot holds (the first,
    one a waiting call cut short, the last), padded on the device by one small launch each.
    ``interactions``: on a device of sinkax's PJRT plugin (:mod:`sinkax.pjrt`), the process's
    host–device interactions since the sink was created (other work in between counts too).
    ``device_bytes`` and ``peak_device_bytes``: the bytes in use on the sink's devices now and at
    most, as their ``memory_stats()`` report them, summed over the devices (each device's own
    peak: over several devices, at least their peak together; every user of the devices counts;
    the emulated device and GPUs report them, ``None`` where a device does not, as XLA:CPU's).
    ``compiles``: the executables the sink built: its windows', and one per call size that
    joins the outputs of a call of several windows (executables an earlier sink of the same
    step built are reused, not counted).
    ``call_sizes``: with ``sink_size="auto"``, the steps of its last calls (up to 64).
    ``peer_wait_s``: across processes, time this one waited before dispatches for the others to
    get their data ready (:mod:`sinkax.peers`; 0 in one process). Time spent inside a
    collective, waiting for a process that dispatched later, counts as compute.
    """

    steps: int
    calls: int
    dispatches: int
    compiles: int
    chunks_transferred: int
    chunks_padded: int
    bytes_transferred: int
    max_chunks_on_device: int
    data_wait_s: float
    slot_wait_s: float
    strategy: str
    strategy_timings: dict[str, float]
    interactions: pjrt.Interactions | None = None
    device_bytes: int | None = None
    peak_device_bytes: int | None = None
    call_sizes: tuple[int, ...] | None = None
    peer_wait_s: float = 0.0

    @property
    def bound(self) -> str:
        """``"input"`` if the sink waited for data longer than the producer waited for room."""
        return "input" if self.data_wait_s > self.slot_wait_s else "compute"
