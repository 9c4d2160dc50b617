"""What only a GPU can check; every test here skips without one.

CI has no GPU: they run where one is lent, in benchmarks/gpu_check.py's ``tests`` part.
"""

import os

import jax
import numpy as np
import pytest
from conftest import init_state, reference_run, train_step

import sinkax


def gpus() -> list[jax.Device]:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this jaxlib, or no GPU
        return []


pytestmark = pytest.mark.skipif(not gpus(), reason="no GPU on this machine")


@pytest.mark.parametrize("sink_size", [1, 4])
def test_a_sink_on_the_gpu_matches_the_plain_loop(batches, sink_size):
    gpu = gpus()[0]
    state, losses = init_state(), []
    with sinkax.data_sink(train_step, batches, sink_size, device=gpu, strategy="scan") as sink:
        for _ in range(3):
            state, loss = sink(state)
            losses.append(np.asarray(loss))
        assert sink.stats.chunks_transferred >= 1
    assert all(leaf.devices() == {gpu} for leaf in jax.tree.leaves(state))
    _, ref_losses = reference_run(batches, 3 * sink_size)  # jit on the default device, the GPU
    np.testing.assert_allclose(np.concatenate(losses), ref_losses, rtol=1e-3, atol=1e-5)


def test_one_step_sinks_on_a_gpu_run_the_scan_over_the_device_ring(batches):
    with sinkax.data_sink(train_step, batches, 1, device=gpus()[0]) as sink:
        sink(init_state())
        assert sink.stats.strategy == "scan"  # "step" is for CPU devices, where it saves a copy


def test_auto_runs_scan_on_the_gpu_measuring_nothing(batches):
    with sinkax.data_sink(train_step, batches, 4, device=gpus()[0]) as sink:
        state, _ = sink(init_state())
        sink(state)
        assert sink.stats.strategy == "scan" and sink.stats.strategy_timings == {}


def test_a_gpu_sink_staged_in_pinned_memory_trains_as_a_numpy_staged_one(batches):
    results = []
    for pin in (True, False):
        state = init_state()
        with sinkax.data_sink(
            train_step, batches, 3, device=gpus()[0], strategy="scan", prefetch=1, pin_memory=pin
        ) as sink:
            for _ in range(5):  # slots reused, across epochs
                state, loss = sink(state)
            results.append((sink.config.staging, jax.tree.map(np.asarray, (state, loss))))
    assert results[0][0].memory_kind == "pinned_host" and results[1][0] is None
    jax.tree.map(np.testing.assert_array_equal, results[0][1], results[1][1])


def test_on_a_cuda_gpu_a_sink_compiles_its_loops_into_command_buffers(batches):
    gpu = gpus()[0]
    version, flags = gpu.client.platform_version, os.environ.get("XLA_FLAGS", "")
    if "rocm" in version.lower() or "xla_gpu_enable_command_buffer" in flags:  # not CUDA's
        pytest.skip("ROCm, or XLA_FLAGS sets xla_gpu_enable_command_buffer: XLA decides")
    with sinkax.data_sink(train_step, batches, 2, device=gpu) as sink:
        options = dict(sink.config.compiler_options)
    assert options["xla_gpu_enable_command_buffer"].split(",")[-1] == "WHILE"
