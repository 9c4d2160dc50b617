"""How a sink builds its chunks on the host: in numpy memory or the device's pinned host memory
(``pin_memory``), which a GPU reads by DMA; copied by the producer batch by batch, or by copier
threads in groups where the source keeps its batches. The CPU has a pinned host memory too, and
the tests give themselves copiers, so every path runs here; whether they are faster is a GPU
question (benchmarks/gpu_sink_sizes.py)."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
from conftest import init_state, needs_plugin, train_step

import sinkax
from sinkax.channel import packers
from sinkax.channel.packers import Build, Stacked
from sinkax.channel.ring import DeviceRing
from sinkax.channel.source import as_source
from sinkax.config import staging
from sinkax.spec import BatchSpec

CPU = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])


def numbered(n: int) -> list[dict]:
    return [{"x": np.full((3,), i, np.float32), "i": np.int32(i)} for i in range(n)]


def test_a_pinned_slot_is_written_through_its_view_and_moved_whole_from_the_jax_array():
    spec = BatchSpec.of(numbered(1)[0])
    packer = Stacked(CPU, staging(CPU, True))
    build = Build(packer.allocate(spec, steps=4), t0=0.0)
    assert {buffer.base.source.sharding.memory_kind for buffer in build.staging} == {"pinned_host"}
    for batch in numbered(4):
        packer.write(build, spec, jax.tree.leaves(batch))
        build.filled += 1
    data, moved, padded = packer.pack(build, spec, steps=4)
    assert data["i"].sharding.memory_kind == "device" and not padded
    assert data["i"].tolist() == [0, 1, 2, 3] and moved == 4 * spec.nbytes
    np.testing.assert_array_equal(build.staging[1], np.asarray(build.staging[1].base.source))
    part, moved, padded = packer.pack(build, spec, steps=3)  # a chunk cut short: padded
    assert part["i"].tolist() == [0, 1, 2, 0] and moved == 3 * spec.nbytes and padded


class Slow:
    """Batches, the ``slow``-th ones read (counted over every pass) taking ``pause`` s each: a
    call that waits for them cuts its chunk."""

    def __init__(self, batches: list, pause: float, slow: range):
        self.batches, self.pause, self.slow, self.read = batches, pause, slow, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            if self.read in self.slow:
                time.sleep(self.pause)
            self.read += 1
            yield batch


@pytest.mark.parametrize("sink_size", [3, 4, -1])
def test_pinned_and_numpy_staging_run_the_same_batches_in_order(sink_size):
    seen = {}
    for pin in (False, True):
        dataset = Slow(numbered(20), pause=0.03, slow=range(50, 60))  # in the third epoch
        with sinkax.data_sink(
            lambda s, b: (s + 1, b["i"]),
            dataset,
            sink_size,
            pin_memory=pin,
            prefetch=1,
            max_chunk_bytes=128,  # chunks of at most 8 batches: many
        ) as sink:
            assert (sink.config.staging is not None) == pin
            outs = [sink(np.int32(0))[1] for _ in range(12)]
            assert 0 < sink.stats.chunks_padded < sink.stats.chunks_transferred  # both paths
        seen[pin] = np.concatenate(outs).tolist()
    steps = 20 if sink_size == -1 else sink_size
    assert seen[True] == seen[False] == [i % 20 for i in range(12 * steps)]


def test_pin_memory_is_asked_for():
    assert staging(CPU, False) is None and staging(CPU, True).memory_kind == "pinned_host"
    with sinkax.data_sink(train_step, numbered(2), 1) as sink:
        assert sink.config.staging is None


def test_pin_memory_refuses_what_it_cannot_pin():
    with pytest.raises(TypeError, match="pin_memory must be True or False"):
        staging(CPU, None)
    mesh = jax.sharding.Mesh(jax.devices("cpu")[:1], ("data",))
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    with pytest.raises(ValueError, match="pinned host memory of the sink's one device"):
        staging(named, True)
    assert staging(named, False) is None


@needs_plugin
def test_the_emulated_device_does_not_pin_its_transfers_are_modelled_pageable():
    emulated = jax.sharding.SingleDeviceSharding(sinkax.backend.resolve_device("Emulated"))
    assert staging(emulated, False) is None
    with pytest.raises(ValueError, match="models pageable transfers only"):
        staging(emulated, True)


def test_a_pinned_sink_trains_as_a_numpy_staged_one(batches):
    results = []
    for pin in (False, True):
        state = init_state()
        with sinkax.data_sink(train_step, batches, 4, pin_memory=pin, prefetch=1) as sink:
            for _ in range(4):
                state, loss = sink(state)
        results.append((jax.tree.map(np.asarray, state), np.asarray(loss)))
    jax.tree.map(np.testing.assert_array_equal, *results)


@pytest.fixture
def copying_threads(monkeypatch) -> list[str]:
    """The threads that copy rows into staging, each copy made 5 ms slow: a chunk that went
    out before its copies were done would show it."""
    threads, copy_rows = [], packers.copy_rows

    def slow_copy_rows(staging, rows, *pause):
        time.sleep(0.005)
        threads.append(threading.current_thread().name)
        copy_rows(staging, rows, *pause)

    monkeypatch.setattr(packers, "copy_rows", slow_copy_rows)
    return threads


@pytest.mark.parametrize("pin", [False, True])
def test_copiers_fill_every_chunk_in_order_also_when_a_waiting_call_cuts_it(pin, copying_threads):
    dataset = Slow(numbered(40), pause=0.03, slow=range(30, 40))  # the last batches: cuts
    plan = lambda spec, position: iter([[(5, True)] * 4] * 100)  # noqa: E731  (chunks of 20)
    packer = Stacked(CPU, staging(CPU, pin), copiers=2)
    ring = DeviceRing(as_source(dataset), plan, prefetch=1, packer=packer)
    seen = []
    try:
        while len(seen) < 60:
            chunk = ring.get(timeout=10.0)
            steps = sum(piece.steps for piece in chunk.pieces)
            seen += np.asarray(chunk.data["i"][:steps]).tolist()
            np.testing.assert_array_equal(chunk.data["x"][:steps, 0], chunk.data["i"][:steps])
            ring.release(chunk.data)
    finally:
        ring.close(timeout=10.0)
    assert ring.stats.padded > 1  # cut chunks (the first goes out after its first piece)
    assert seen[:60] == [i % 40 for i in range(60)]
    assert any(name.startswith("sinkax-copier") for name in copying_threads)


@needs_plugin
@pytest.mark.parametrize("dataset", ["list", "generator"])
def test_a_sink_off_the_host_copies_with_spare_cores_only_batches_its_source_keeps(
    monkeypatch, copying_threads, dataset
):
    monkeypatch.setattr(packers, "spare_copiers", lambda: 2)  # as on a host of 8+ cores
    batches = numbered(40)
    data = batches if dataset == "list" else Regenerated(batches)
    emulated = sinkax.backend.resolve_device("Emulated")
    with sinkax.data_sink(lambda s, b: (s, b["i"]), data, 20, device=emulated) as sink:
        outs = np.concatenate([sink(np.int32(0))[1] for _ in range(5)]).tolist()
    assert outs == [i % 40 for i in range(100)]
    copiers = {name for name in copying_threads if name.startswith("sinkax-copier")}
    assert bool(copiers) == (dataset == "list")
    copying_threads.clear()
    with sinkax.data_sink(lambda s, b: (s, b["i"]), batches, 20, device="cpu") as sink:
        sink(np.int32(0))
    assert copying_threads and not any(n.startswith("sinkax-copier") for n in copying_threads)


class Regenerated:
    """A re-iterable that is no list: its batches may be refilled as it runs (none are)."""

    def __init__(self, batches: list):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        yield from self.batches
