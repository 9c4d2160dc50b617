"""sinkax's PJRT plugin: the emulated device, its interaction counters, its costs, device targets.

conftest.py registers the emulated device ("emu") before jax's backends start. The counts here
are MindSpore's claims about sinking, made exact: per-step training is one launch and one batch
transfer per step; a sink is one launch per call and one transfer per chunk; reading an output
is one transfer per leaf.
"""

import os
import resource
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import init_state, needs_plugin, reference_run, regression_batches, train_step
from jax.experimental.compilation_cache import compilation_cache

import sinkax
from sinkax import pjrt
from sinkax.backend import backend_of, resolve_device
from sinkax.execution.windowed import loop_body
from sinkax.presets import Preset
from sinkax.train import DatasetHelper, Model, connect_network_with_dataset

BATCH_LEAVES = 2  # {"x", "y"}
pytestmark = needs_plugin


@pytest.fixture
def emu():
    return jax.devices(pjrt.EMULATED_PLATFORM)[0]


@pytest.fixture
def counting():
    """No emulated costs during the test (the counts do not depend on them), and no persistent
    compilation cache (see conftest): a program read back from it is no compile to the device."""
    pjrt.set_costs("counting")
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # jax decides whether to use it once, at the next compile
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()
    pjrt.set_costs(os.environ.get("SINKAX_TEST_PRESET", "pcie4-x16"))


def on_device(tree, device):
    return jax.block_until_ready(jax.device_put(tree, device))


def test_the_emulated_device_is_a_regular_jax_device_but_not_the_default(emu):
    assert emu.platform == "emu" and jax.default_backend() == "cpu"
    x = jax.device_put(np.arange(6.0, dtype=np.float32), emu)
    y = jax.jit(lambda a: jnp.sin(a) * 2)(x)
    assert y.devices() == {emu}
    np.testing.assert_allclose(np.asarray(y), np.sin(np.arange(6.0)) * 2, rtol=1e-6)


def test_host_arrays_are_copied_to_the_emulated_device_never_aliased(emu):
    host = np.zeros((64, 1024), np.float32)  # 256 KiB: XLA:CPU would alias it if aligned
    device = jax.block_until_ready(jax.device_put(host, emu))
    host[:] = 7
    assert float(np.asarray(device).max()) == 0.0
    assert not backend_of(emu).aliases_host_buffers and not backend_of(emu).host_is_device


def test_a_copy_reuses_freed_device_memory_only_once_no_execution_reads_it(emu):
    rows = 49157  # 196,628 bytes: a size no other test frees
    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 400, lambda i, c: c + jnp.sin(x * i).sum(), 0.0))
    first = np.full(rows, 2.0, np.float32)
    expected = float(slow(on_device(first, emu)))  # compiled
    x = on_device(first, emu)
    held = x.unsafe_buffer_pointer()
    result = slow(x)
    x.delete()
    reading = not result.is_ready()
    y = on_device(np.full(rows, 7.0, np.float32), emu)
    if reading:  # x's memory is still read: not handed to y
        assert y.unsafe_buffer_pointer() != held
    assert float(result) == expected
    freed, reused = y.unsafe_buffer_pointer(), pjrt.reused_copies()
    del y
    z = on_device(np.arange(rows, dtype=np.float32), emu)
    assert z.unsafe_buffer_pointer() in (freed, held) and pjrt.reused_copies() > reused
    np.testing.assert_array_equal(np.asarray(z), np.arange(rows, dtype=np.float32))


def test_a_chunk_is_copied_into_kept_memory_without_a_page_fault_per_page(emu):
    chunk = np.ones((40 << 20) // 4, np.float32)  # 40 MiB: the C library maps it afresh
    jax.block_until_ready(on_device(chunk, emu)).delete()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        on_device(chunk, emu).delete()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    assert faults < 10 * chunk.nbytes / 4096 / 10  # a tenth of a fault per 4 KiB page at most


def test_backends_describe_what_each_platform_can_do(emu):
    cpu, emulated = backend_of(jax.devices("cpu")[0]), backend_of(emu)
    assert (cpu.host_is_device, cpu.aliases_host_buffers, cpu.python_callbacks) == (True,) * 3
    assert (emulated.python_callbacks, emulated.ffi) == (False, False)
    assert emulated.num_devices == len(jax.devices("emu"))
    # the emulated device's programs are compiled by XLA:CPU, so its loop bodies get the
    # convolution rewrite that XLA:CPU needs there; it is no CPU device for the rest
    assert cpu.xla_cpu and emulated.xla_cpu and not emulated.host_is_device

    def conv(x):
        return jax.lax.conv_general_dilated(x, x, (1, 1), "VALID")

    x = jax.ShapeDtypeStruct((1, 1, 4, 4), np.float32)
    for backend in (cpu, emulated):
        hlo = jax.jit(loop_body(conv, backend)).lower(x).as_text()
        assert "transpose" in hlo  # NHWC between transposes (sinkax.execution.rewrite)

    def with_callback(x):
        return jax.experimental.io_callback(lambda v: v, x, x)

    with pytest.raises(Exception, match="EmitPythonCallback` not supported on emu"):
        jax.jit(with_callback)(jax.device_put(np.float32(1), emu))


def test_transfers_count_one_per_leaf_with_their_bytes(emu, counting):
    tree = {"a": np.ones((3, 5), np.float32), "b": np.arange(7, dtype=np.int64), "c": np.int8(1)}
    before = pjrt.interactions()
    on_device(tree, emu)
    moved = pjrt.interactions() - before
    nbytes = sum(np.asarray(leaf).nbytes for leaf in tree.values())
    # int64 becomes int32 without jax_enable_x64
    assert (moved.h2d, moved.h2d_bytes) == (3, nbytes - 7 * 4)
    assert (moved.launches, moved.d2h, moved.compiles) == (0, 0, 0)


def test_a_jitted_call_is_one_launch_and_reading_it_one_transfer_per_leaf(emu, counting):
    f = jax.jit(lambda x: {"sum": x.sum(), "twice": x * 2, "rows": x[0]})
    x = on_device(np.ones((4, 3), np.float32), emu)
    before = pjrt.interactions()
    out = jax.block_until_ready(f(x))
    called = pjrt.interactions() - before
    assert (called.launches, called.compiles, called.h2d, called.d2h) == (1, 1, 0, 0)
    jax.block_until_ready(f(x))
    assert (pjrt.interactions() - before).compiles == 1  # cached
    before = pjrt.interactions()
    jax.device_get(out)
    read = pjrt.interactions() - before
    assert (read.d2h, read.d2h_bytes) == (3, 4 + 48 + 12)


def test_per_step_training_is_one_launch_and_one_batch_transfer_per_step(emu, counting):
    batches, steps = regression_batches(10), 7
    state = on_device(init_state(), emu)
    step = jax.jit(train_step)
    step(state, batches[0])  # compile
    before = pjrt.interactions()
    for i in range(steps):
        state, _ = step(state, batches[i])
    jax.block_until_ready(state)
    counted = pjrt.interactions() - before
    assert (counted.launches, counted.h2d, counted.d2h) == (steps, steps * BATCH_LEAVES, 0)
    assert counted.h2d_bytes == steps * sum(leaf.nbytes for leaf in batches[0].values())


def test_non_sink_mode_is_one_launch_and_one_batch_transfer_per_step(emu, counting):
    batches = regression_batches(6)
    state = on_device(init_state(), emu)
    before = pjrt.interactions()
    with DatasetHelper(batches, dataset_sink_mode=False, device=emu) as helper:
        net = connect_network_with_dataset(train_step, helper)
        for _ in helper:
            state, _ = net(state)
    counted = pjrt.interactions() - before
    assert counted.launches == len(batches)
    assert counted.h2d == len(batches) * BATCH_LEAVES and counted.d2h == 0


def test_batches_already_on_the_device_are_read_back_with_a_warning(emu, counting):
    batches = [{"x": on_device(np.full((3, 4), i, np.float32), emu)} for i in range(8)]
    before = pjrt.interactions()
    warned = pytest.warns(UserWarning, match=r"leaf \['x'\] \(1 of 1 leaves\) is a jax array")

    def step(s, b):
        return s + b["x"].sum(), b["x"][0, 0]

    with warned, sinkax.data_sink(step, batches, 4, device=emu, calls=2) as sink:
        state, first = sink(on_device(jnp.float32(0), emu))
        state, second = sink(state)
    assert np.concatenate([first, second]).tolist() == list(range(8))  # every batch, once
    assert (pjrt.interactions() - before).d2h >= len(batches)  # what the warning names
    with warnings.catch_warnings():  # on the CPU backend a jax array is host memory: no copy
        warnings.simplefilter("error")
        sinkax.data_sink(lambda b: b["x"], [{"x": jnp.zeros(2)}], calls=1)().block_until_ready()


@pytest.mark.parametrize("sink_mode", [False, True])
def test_model_train_adds_one_launch_and_one_read_back_per_run(emu, counting, sink_mode):
    data = [{"image": np.full((4, 8), i, np.float32), "label": np.zeros(4, np.int32)}
            for i in range(7)]  # fmt: skip
    with jax.default_device(emu):
        model = Model(lambda p, x: x @ p["w"], {"w": jnp.zeros((8, 2))}, optimizer=optax.sgd(0.1),
                      sink_options={"strategy": "scan"})  # fmt: skip
        jax.block_until_ready(model.state)
        before = pjrt.interactions()
        run = model.train(2, data, dataset_sink_mode=sink_mode, sink_size=-1)
        jax.block_until_ready(model.state)
    counted, stats = pjrt.interactions() - before, run.sink_stats
    helper = (run.step, run.step * 2)  # the table's: a step a launch, its batch's leaves put
    if sink_mode:
        helper = (stats.calls + stats.chunks_padded, stats.chunks_transferred * 2 + 1)
    # + a copy of the state (the sinks donate theirs), + its step counter read for the callbacks
    assert (counted.launches, counted.h2d, counted.d2h) == (helper[0] + 1, helper[1], 1)


@pytest.mark.parametrize("sink_size", [1, 4, 10])
@pytest.mark.parametrize("strategy", ["scan", "loop"])
def test_a_sink_is_one_launch_per_call_and_one_transfer_per_chunk(
    emu, counting, sink_size, strategy
):
    state, calls = on_device(init_state(), emu), 6
    before = pjrt.interactions()
    sink = sinkax.data_sink(
        train_step, regression_batches(40), sink_size, device=emu, strategy=strategy
    )
    for _ in range(calls):
        state, _ = sink(state)
    jax.block_until_ready(state)
    sink.close()  # the producer stops: no transfer after the snapshot below
    stats, counted = sink.stats, pjrt.interactions() - before
    chunks, steps = stats.chunks_transferred, calls * sink_size
    # nothing per call: the chunks, and a chunk's first position once (the next window starts
    # where the last one ended, on the device); output buffers are made on the device
    assert counted.h2d == chunks * BATCH_LEAVES + 1
    assert counted.h2d_bytes == stats.bytes_transferred + 4
    pads = stats.chunks_padded  # a chunk short of its slot is padded on the device (the first)
    if strategy == "scan":  # one program per call
        assert counted.launches == calls + pads
    else:  # one program per step, and one that starts the window
        assert counted.launches == steps + calls + pads
    assert counted.d2h == 0 and stats.interactions == sink.stats.interactions


def test_sink_stats_count_interactions_on_the_plugins_device_only(emu, counting, batches):
    # calls=1: the producer moves (and pads) no chunk past the call while it is counted
    with sinkax.data_sink(train_step, batches, 5, device=emu, strategy="scan", calls=1) as sink:
        state, loss = sink(init_state())
        jax.block_until_ready(state)
        np.asarray(loss)
        counted = sink.stats.interactions
    pads = sink.stats.chunks_padded
    assert counted.launches == 1 + pads and counted.d2h == 1 and counted.d2h_bytes == loss.nbytes
    assert counted.h2d >= len(jax.tree.leaves(state)) + BATCH_LEAVES  # state once, a chunk
    with sinkax.data_sink(train_step, batches, 5, device=jax.devices("cpu")[0]) as sink:
        sink(init_state())
        assert sink.stats.interactions is None


@pytest.mark.parametrize("strategy", ["scan", "loop"])
def test_a_sink_holds_at_most_prefetch_plus_one_chunks_in_device_memory(emu, counting, strategy):
    batch = np.zeros(1 << 18, np.float32)  # 1 MiB: the chunks dominate the device memory
    batches = [batch + i for i in range(8)]
    state = on_device(jnp.float32(0), emu)
    pjrt.memory(reset_peak=True)
    live = emu.memory_stats()["bytes_in_use"]  # the sink's device: other tests' may be busy
    with sinkax.data_sink(
        lambda s, b: (s + b[0], s), batches, 1, device=emu, prefetch=1,
        max_chunk_bytes=batch.nbytes, strategy=strategy,
    ) as sink:  # fmt: skip
        for _ in range(30):
            state, _ = sink(state)
        jax.block_until_ready(state)
        stats = sink.stats
    peak = emu.memory_stats()["peak_bytes_in_use"]
    assert stats.chunks_transferred >= 30 and stats.peak_device_bytes == peak
    assert peak - live <= 2 * batch.nbytes + 4096  # two chunks, a state, outputs, positions
    assert emu.memory_stats()["bytes_in_use"] <= live + 64  # freed on close, but the state


def test_a_sink_that_pads_short_chunks_holds_one_chunks_batches_more_at_most(emu, counting):
    batch = np.zeros(1 << 14, np.float32)  # 64 KiB: 64 a slot (4 MiB, under max_chunk_bytes)
    batches = [batch + i for i in range(100)]
    state = on_device(jnp.float32(0), emu)
    pjrt.memory(reset_peak=True)
    live = emu.memory_stats()["bytes_in_use"]
    with sinkax.data_sink(
        lambda s, b: (s + b[0], s), batches, 2, device=emu, prefetch=1, strategy="scan"
    ) as sink:
        for _ in range(60):  # chunks moved short (the first goes after one call's batches)
            state, _ = sink(state)
        jax.block_until_ready(state)
        stats = sink.stats
    peak, chunk = emu.memory_stats()["peak_bytes_in_use"] - live, 64 * batch.nbytes
    assert stats.chunks_padded >= 2 and stats.max_chunks_on_device == 2
    assert peak <= 2 * chunk + 63 * batch.nbytes + 4096  # 2 slots, a short chunk's batches


@pytest.mark.parametrize("sink_size", [-1, "auto"])
def test_a_helpers_epochs_move_each_batch_once_and_nothing_past_the_last(emu, counting, sink_size):
    batch = {"x": np.ones((500, 32, 32, 1), np.float32)}  # 2 MB: an eval set of 2 batches
    data, epochs = [batch, batch], 3
    before = pjrt.interactions()
    with DatasetHelper(data, True, sink_size, epoch_num=epochs, device=emu) as helper:
        net = connect_network_with_dataset(lambda b: b["x"].mean(), helper)
        for _ in range(epochs):
            for _ in helper:
                jax.block_until_ready(net())
        stats = helper.stats
    counted, nbytes = pjrt.interactions() - before, 2 * batch["x"].nbytes
    assert stats.bytes_transferred == epochs * nbytes  # no epoch prefetched past the last
    assert counted.h2d_bytes <= epochs * nbytes + 64  # and no row moved twice


def test_a_donating_call_returns_before_its_compute_ends(emu, counting):
    def slow(x):
        for _ in range(40):
            x = jnp.tanh(x @ x * 1e-3)
        return x

    step = jax.jit(slow, donate_argnums=0)
    x = jax.block_until_ready(step(on_device(jnp.ones((400, 400)), emu)))  # compiled
    t0 = time.perf_counter()
    for _ in range(5):  # each call donates what the last one is still computing
        x = step(x)
    launched = time.perf_counter() - t0
    jax.block_until_ready(x)
    computed = time.perf_counter() - t0
    assert launched < computed / 3  # as on a device stream: the host ran ahead


def test_calls_go_on_past_a_used_up_chunk_while_it_is_computed_on(emu, counting):
    """A call that uses up a chunk hands its slot back without waiting for the compute on it
    (the producer waits, before it refills the slot): the next calls dispatch meanwhile, as
    far as the ``prefetch`` chunks ready allow."""

    def slow(s, batch):
        x = jnp.ones((400, 400)) * batch[0]
        for _ in range(80):
            x = jnp.tanh(x @ x * 1e-3)
        return s + x.sum(), x[0, 0]

    batches = [np.full(8, i, np.float32) for i in range(16)]
    state = on_device(jnp.float32(0), emu)
    with sinkax.data_sink(
        slow, batches, 1, device=emu, prefetch=2, max_chunk_bytes=batches[0].nbytes
    ) as sink:  # a chunk per call
        state, _ = sink(state)  # compiled
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state, _ = sink(state)
        jax.block_until_ready(state)
        computed = time.perf_counter() - t0  # one call's
        t0 = time.perf_counter()
        for _ in range(3):  # each uses up a chunk and takes the next, ready one
            state, _ = sink(state)
        launched = time.perf_counter() - t0
        jax.block_until_ready(state)
    assert launched < computed  # not waiting for two computes in between


def test_emulated_transfers_complete_late_and_launches_cost_time(emu):
    slow = Preset("slow", launch_s=0.15, h2d_latency_s=0.3, d2h_latency_s=0.2)
    f = jax.jit(lambda x: x + 1)
    x = on_device(np.ones(4, np.float32), emu)
    jax.block_until_ready(f(x))  # compiled before the costs apply
    pjrt.set_costs(slow)
    try:
        t0 = time.perf_counter()
        y = jax.device_put(np.ones(4, np.float32), emu)
        t_put = time.perf_counter()
        jax.block_until_ready(y)
        t_arrived = time.perf_counter()
        z = jax.block_until_ready(f(y))
        t_launched = time.perf_counter()
        np.asarray(z)
        t_read = time.perf_counter()
    finally:
        pjrt.set_costs(os.environ.get("SINKAX_TEST_PRESET", "pcie4-x16"))
    assert t_put - t0 < 0.3 <= t_arrived - t0  # asynchronous: the host went on at once
    assert t_launched - t_arrived >= 0.15 and t_read - t_launched >= 0.2


def test_a_sink_on_the_emulated_device_matches_the_plain_loop_on_cpu(emu, batches):
    losses, state = [], init_state()
    with sinkax.data_sink(train_step, batches, 4, device=emu) as sink:
        for _ in range(3):
            state, loss = sink(state)
            losses.append(np.asarray(loss))
    with jax.default_device(jax.devices("cpu")[0]):
        ref_state, ref_losses = reference_run(batches, 12)
    np.testing.assert_allclose(np.concatenate(losses), ref_losses, rtol=1e-4, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4), state, ref_state)


def test_device_targets_reach_the_emulated_device_and_explain_a_missing_ascend(monkeypatch):
    assert resolve_device("Emulated").platform == "emu"
    monkeypatch.delenv("SINKAX_ASCEND_PJRT", raising=False)
    with pytest.raises(ValueError, match=r"needs an Ascend PJRT plugin.*SINKAX_ASCEND_PJRT"):
        resolve_device("Ascend")


def test_the_plugin_loads_in_a_fresh_process_only_when_asked():
    code = "import jax; print({d.platform for d in jax.devices('emu')})"
    asked = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "SINKAX_PJRT": "counting"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert asked.stdout.strip() == "{'emu'}"
    env = {k: v for k, v in os.environ.items() if k != "SINKAX_PJRT"}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert plain.returncode != 0 and "Unknown backend" in plain.stderr


def test_a_failed_plugin_load_says_to_retry_under_another_name_which_works():
    code = """if True:
        import sinkax_pjrt
        from sinkax import pjrt
        for inner, name in [("/missing/plugin.so", "first"), (sinkax_pjrt.cpu_plugin_path(),
                "first"), (sinkax_pjrt.cpu_plugin_path(), "second")]:
            try:
                print(pjrt.use_plugin(inner, name))
            except RuntimeError as error:
                print(error)
        import jax
        print(jax.devices("second")[0].platform)
    """
    env = {k: v for k, v in os.environ.items() if k != "SINKAX_PJRT"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    first, again, second, platform = run.stdout.strip().splitlines()
    assert first.startswith("Could not load the PJRT plugin /missing/plugin.so")
    assert "under another platform name, or in a new process" in first
    assert again.startswith("An earlier, failed load left the platform name 'first'")
    assert (second, platform) == ("second", "second")


def test_a_misspelt_sinkax_pjrt_stops_the_program_with_the_presets(monkeypatch):
    code = "import jax; print(jax.devices()); import sinkax; print('carried on')"
    env = {**os.environ, "SINKAX_PJRT": "pcie4-x61"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "carried on" not in run.stdout
    assert "SINKAX_PJRT='pcie4-x61' names no emulated-device preset" in run.stderr
    assert "pcie4-x16" in run.stderr.splitlines()[-1]  # the presets, in the error itself
    monkeypatch.setenv("SINKAX_PJRT", "pcie4-x61")
    with pytest.raises(ValueError, match="known: ascend910-pcie4, counting, pcie4-x16"):
        pjrt.env_preset()  # what device="Emulated" loads, instead of the default preset
    monkeypatch.setenv("SINKAX_PJRT", "pcie5-x16")
    assert pjrt.env_preset() == "pcie5-x16"


@pytest.mark.parametrize("platform", ["cpu", "cuda", "gpu", "tpu"])
def test_the_plugin_is_not_registered_under_a_platform_jax_has(platform):
    with pytest.raises(ValueError, match=f"platform {platform!r} is one of jax's own"):
        pjrt.use_plugin("/some/plugin.so", platform)


def test_misuse_of_the_plugin_layer_is_explained():
    with pytest.raises(ValueError, match="Unknown emulated-device preset 'nope'"):
        pjrt.use_emulated("nope")
    with pytest.raises(ValueError, match=r"Unknown emulated-device preset \{'launch_s': 0\}"):
        pjrt.set_costs({"launch_s": 0})  # a dict is no Preset: not "unhashable type"
    with pytest.raises(RuntimeError, match="already loaded as 'emu'"):
        pjrt.use_plugin("/elsewhere/plugin.so", "ascend")


def test_only_device_memory_is_counted_the_copy_from_a_host_memory_kind_is_the_transfer(
    emu, counting
):
    host = np.ones(1 << 18, np.float32)  # 1 MiB
    pinned = jax.sharding.SingleDeviceSharding(emu, memory_kind="pinned_host")
    live = emu.memory_stats()["bytes_in_use"]
    before = pjrt.interactions()
    staged = on_device(host, pinned)  # a copy on the host: no transfer, no device memory
    assert pjrt.interactions() - before == pjrt.Interactions()
    assert emu.memory_stats()["bytes_in_use"] == live
    before = pjrt.interactions()
    device = jax.sharding.SingleDeviceSharding(emu, memory_kind="device")
    moved = on_device(staged, device)  # the transfer: by DMA from pinned memory, on a GPU
    assert (pjrt.interactions() - before).h2d_bytes == host.nbytes
    assert emu.memory_stats()["bytes_in_use"] == live + host.nbytes
    before = pjrt.interactions()
    back = on_device(moved, pinned)
    assert (pjrt.interactions() - before).d2h_bytes == host.nbytes
    np.testing.assert_array_equal(np.asarray(back), host)  # (a host kind: read, not moved)
    assert (pjrt.interactions() - before).d2h == 1
    del moved
    assert emu.memory_stats()["bytes_in_use"] == live


def test_a_copy_to_another_device_counts_in_that_devices_memory(emu, counting):
    other = jax.devices(pjrt.EMULATED_PLATFORM)[1]
    x = on_device(np.ones(1 << 18, np.float32), emu)
    live = other.memory_stats()["bytes_in_use"]
    before = pjrt.interactions()
    y = on_device(x, other)  # device to device: no host interaction
    assert pjrt.interactions() - before == pjrt.Interactions()
    assert other.memory_stats()["bytes_in_use"] == live + x.nbytes
    del y
    assert other.memory_stats()["bytes_in_use"] == live


@pytest.mark.parametrize(
    "field, value",
    [("launch_s", float("nan")), ("h2d_latency_s", -0.5), ("d2h_bytes_per_s", float("inf"))],
)
def test_a_preset_takes_finite_costs_only(field, value):
    with pytest.raises(ValueError, match=f"Preset 'mine': {field} must be a finite number >= 0"):
        Preset("mine", **{field: value})


def test_a_preset_takes_numpy_and_int_costs_as_floats():
    preset = Preset("measured", launch_s=np.float32(1e-5), h2d_bytes_per_s=np.int64(25_000_000_000))
    assert type(preset.launch_s) is float and preset.h2d_bytes_per_s == 25e9
    with pytest.raises(ValueError, match="h2d_latency_s must be a finite number"):
        Preset("measured", h2d_latency_s=True)


@pytest.mark.parametrize("platform", ["", "my dev", "Emu2"])
def test_a_platform_name_is_a_lowercase_identifier(platform):
    with pytest.raises(ValueError, match="must be a lowercase identifier"):
        pjrt.use_plugin("/some/plugin.so", platform)


def test_the_plugin_loaded_once_refuses_another_configuration():
    import sinkax_pjrt

    with pytest.raises(RuntimeError, match=r"already loaded as 'emu' .*\(discrete=True\)"):
        pjrt.use_plugin(sinkax_pjrt.cpu_plugin_path(), "emu", discrete=False)


FRESH_PROCESS = """
import time
import sinkax
from sinkax import pjrt
from sinkax.presets import Preset
for call in ({first}):
    try:
        call()
    except Exception as error:
        print("refused:", type(error).__name__)
import jax
x = jax.device_put(1.0, jax.devices("emu")[0])
add = jax.jit(lambda v: v + 1)
jax.block_until_ready(add(x))  # compiled: the next call is a launch only
start = time.perf_counter(); jax.block_until_ready(add(x))
print("launch took", time.perf_counter() - start)
"""


def run_fresh(first, **env):
    code = FRESH_PROCESS.format(first=first)
    base = {k: v for k, v in os.environ.items() if k != "SINKAX_PJRT"}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_load_that_failed_can_be_made_again():
    out = run_fresh(
        "lambda: pjrt.use_emulated('pcie4x16'), "  # a misspelt preset: nothing loaded
        "lambda: pjrt.use_plugin('/no/such/plugin.so', 'counted'), "
        "lambda: pjrt.use_plugin('/no/such/plugin.so', 'counted'), "  # refused again
        "lambda: pjrt.use_emulated('counting')"
    )
    assert out.count("refused:") == 3 and "launch took" in out


def test_the_programs_own_costs_win_over_sinkax_pjrt():
    out = run_fresh(
        "lambda: pjrt.use_emulated(Preset('slow', launch_s=0.3)),", SINKAX_PJRT="counting"
    )
    assert "refused" not in out and float(out.split("launch took")[1]) >= 0.25


def test_a_read_back_counts_the_bytes_its_transfer_counted(emu, counting):
    host = np.zeros(1000, jnp.int4)  # packed two to a byte on the device
    before = pjrt.interactions()
    np.asarray(on_device(host, emu))
    moved = pjrt.interactions() - before
    assert moved.h2d_bytes == moved.d2h_bytes == 500


def test_a_copy_into_a_host_memory_kind_is_read_no_sooner_than_its_read_back_costs(emu):
    pjrt.set_costs(Preset("slow read-back", d2h_latency_s=0.2))
    try:
        on_device_memory = on_device(np.ones(1024, np.float32), emu)
        start = time.perf_counter()
        pinned = jax.sharding.SingleDeviceSharding(emu, memory_kind="pinned_host")
        np.asarray(jax.device_put(on_device_memory, pinned))
        assert time.perf_counter() - start >= 0.2  # (a bound from below: a wait is no shorter)
    finally:
        pjrt.set_costs(os.environ.get("SINKAX_TEST_PRESET", "pcie4-x16"))
