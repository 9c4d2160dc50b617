"""Placement, process-local feeding and the local launcher, in this (single-device) process."""

import sys
import time
import types

import jax
import numpy as np
import pytest

import sinkax
from sinkax import compat, distributed, launch, peers, placement
from sinkax.backend import backend_of
from sinkax.execution import choice as strategy


def test_device_and_sharding_together_is_an_error():
    device = jax.devices()[0]
    with pytest.raises(ValueError, match=r"either device= .* or sharding="):
        placement.resolve(device, jax.sharding.SingleDeviceSharding(device), jax.devices)
    with pytest.raises(ValueError, match="either device="):
        sinkax.data_sink(
            lambda s, b: (s, b),
            [np.zeros(2)],
            device=device,
            sharding=jax.sharding.SingleDeviceSharding(device),
        )


def test_one_device_sharding_is_the_device():
    device = jax.devices()[0]
    data = [{"x": np.float32(i)} for i in range(4)]
    step = lambda s, b: (s + b["x"], s)  # noqa: E731
    sharding = jax.sharding.SingleDeviceSharding(device)
    with sinkax.data_sink(step, data, 3, sharding=sharding) as sink:
        total, seen = sink(np.float32(0))
    assert float(total) == 3.0 and seen.tolist() == [0.0, 0.0, 1.0]
    assert total.sharding == sharding


def test_step_strategy_is_refused_on_many_devices_and_auto_avoids_it():
    cpu = backend_of(jax.devices("cpu")[0])
    with pytest.raises(ValueError, match="spans 4 devices"):
        strategy.resolve("step", jit=True, steps_per_call=1, backend=cpu, devices=4)
    assert strategy.resolve("auto", jit=True, steps_per_call=1, backend=cpu, devices=4) == "scan"
    assert strategy.resolve("auto", jit=True, steps_per_call=1, backend=cpu) == "step"
    assert strategy.resolve("auto", jit=True, steps_per_call=8, backend=cpu, processes=2) == (
        "scan"
    )


def test_positions_of_another_number_of_processes_continue_the_global_batches():
    position = {"epoch": 0, "step": 3, "source": {"epoch": 0, "step": 3, "fingerprint": "a"}}
    assert distributed.own_position(distributed.shared_position(position)) == position
    other = {**position, "source": {**position["source"], "fingerprint": "b"}}  # its own rows
    replayed = {"epoch": 0, "step": 3, "source": {"epoch": 0, "step": 3}}
    assert distributed.own_position({"processes": [position, other]}) == replayed
    loader = {"epoch": 0, "step": 3, "source": {"epoch": 0, "step": 3, "next_index": 7}}
    with pytest.raises(ValueError, match="2 process\\(es\\), which differ"):
        distributed.own_position({"processes": [position, loader]})


@pytest.mark.parametrize("key", ["iterator", "iterator_base64"])
def test_a_loaders_position_resumes_only_with_as_many_processes(monkeypatch, key):
    source = {"epoch": 0, "step": 3, key: "its own batches"}  # a DataLoader's, say
    saved = distributed.shared_position({"epoch": 0, "step": 3, "source": source})
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # a job of 2 resumes one of 1
    with pytest.raises(ValueError, match="batches each process's records itself"):
        distributed.own_position(saved)
    monkeypatch.setattr(jax, "process_count", lambda: 3)  # and of 3 one of 2, though alike
    with pytest.raises(ValueError, match=r"Resume it with 2 process\(es\)"):
        distributed.own_position({"processes": [saved, saved]})


def test_local_rows_refuses_an_uneven_split(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert distributed.local_rows({"x": np.arange(6)})["x"].tolist() == [2, 3]
    with pytest.raises(ValueError, match="8 rows cannot be split evenly over 3 processes"):
        distributed.local_rows({"x": np.arange(8)})


def test_launch_returns_the_failure_and_kills_the_rest():
    # process 1 fails at once; process 0 would sleep for a minute: the launcher kills it
    code = (
        "import os, sys, time; i = int(os.environ['SINKAX_PROCESS_ID']); "
        "assert os.environ['SINKAX_NUM_PROCESSES'] == '2'; "
        "sys.exit(3) if i == 1 else time.sleep(60)"
    )
    t0 = time.monotonic()
    assert launch.run([sys.executable, "-c", code], processes=2, grace=0.5) == 3
    assert time.monotonic() - t0 < 30
    assert launch.run([sys.executable, "-c", "pass"], processes=2) == 0


def test_a_one_device_mesh_is_placed_as_its_device():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    resolved = placement.resolve(None, batch, jax.devices)
    assert resolved == jax.sharding.SingleDeviceSharding(jax.devices()[0])


class FakeCoordination:
    """The coordination client of a one-process job: records each barrier's timeout."""

    def __init__(self):
        self.store: dict[str, str] = {}
        self.barrier_ms: list[int] = []

    def key_value_set(self, key, value, allow_overwrite=False):
        self.store[key] = value

    def key_value_dir_get(self, folder):
        return [(key, value) for key, value in self.store.items() if key.startswith(folder)]

    def wait_at_barrier(self, barrier_id, timeout_in_ms):
        self.barrier_ms.append(timeout_in_ms)


def test_a_round_gives_the_others_what_is_left_of_twice_the_timeout(monkeypatch):
    # the service decides a barrier's timeout only at its next check (once a second): a call
    # must hand it what is left of 2 x timeout, less that, counted from the call's start
    client, now = FakeCoordination(), [100.0]
    clock = types.SimpleNamespace(monotonic=lambda: now[0], perf_counter=lambda: now[0])
    monkeypatch.setattr(peers, "time", clock)
    monkeypatch.setattr(compat, "coordination_client", lambda: client)
    sink = peers.Peers("test/sink", timeout=10.0)

    def fetch(seconds):
        now[0] += seconds  # this process's own wait for its data: not counted
        return "chunk"

    sink.begin()
    now[0] += 0.5  # the call's own work before its first round (placing the state, ...)
    sink.agree(lambda: fetch(7.0), describe=lambda chunk: {})
    sink.agree(lambda: fetch(0.0), describe=lambda chunk: {})  # the call's second piece
    sink.begin()
    now[0] += 9.0  # busy for long: the others still get the timeout itself
    sink.agree(lambda: fetch(0.0), describe=lambda chunk: {})
    left = 2 * 10.0 - peers.VERDICT_S
    assert client.barrier_ms == [int(1000 * (left - 0.5)), int(1000 * left), 10_000]
