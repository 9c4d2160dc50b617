"""Faults: Ctrl-C anywhere, timeouts, closing and restoring from another thread."""

import contextlib
import gc
import itertools
import signal
import threading
import time
import weakref

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_no_slot_leaked,
    collect_index,
    ctrl_c_at_check,
    indexed_map_dataset,
    thread_stacks,
)

import sinkax

BATCH = 2  # samples per batch of the indexed datasets: batch i holds samples 2i, 2i+1
CHUNKS = {  # strategy, sink_size, max_chunk_bytes (a batch is 24 bytes)
    "one-dispatch": ("scan", 4, 64 << 10),
    "step": ("step", 1, 64 << 10),
    "split-over-chunks": ("scan", 9, 4 * 24),
    "dispatch-per-step": ("loop", 3, 64 << 10),
}


def batch_numbers(outs) -> list[int]:
    return (np.asarray(outs).reshape(-1, BATCH)[:, 0] // BATCH).tolist()


def calls_until(sink, state, n, numbers):
    """Call ``sink`` until ``numbers`` holds ``n`` batches; a held Ctrl-C stops one call."""
    while len(numbers) < n:
        with contextlib.suppress(KeyboardInterrupt):
            state, outs = sink(state)
            numbers += batch_numbers(outs)
    return state


@pytest.mark.parametrize("case", CHUNKS, ids=list(CHUNKS))
def test_ctrl_c_in_any_sinkax_frame_of_a_call_loses_and_leaks_nothing(case):
    strategy, sink_size, max_chunk_bytes = CHUNKS[case]
    dataset = indexed_map_dataset(4000, BATCH, seed=None)
    options = {"strategy": strategy, "max_chunk_bytes": max_chunk_bytes, "prefetch": 1}
    options["timeout"] = 150.0  # a rewind waits for the producer: loaded machines are slow
    for k in itertools.count():
        with sinkax.data_sink(collect_index, dataset, sink_size, **options) as sink:
            state, outs = sink(jnp.int32(0))
            numbers = batch_numbers(outs)
            with contextlib.suppress(KeyboardInterrupt), ctrl_c_at_check(k) as checks:
                state, outs = sink(state)
                numbers += batch_numbers(outs)
            assert sinkax.interrupt.GUARD.state is None, f"Ctrl-C at check {k}: guard left open"
            try:
                state = calls_until(sink, state, 4 * sink_size, numbers)
            except sinkax.SinkTimeoutError as error:  # say where the producer is stuck
                pytest.fail(f"Ctrl-C at check {k}: {error}\n{thread_stacks('sinkax-producer')}")
            assert numbers == list(range(len(numbers))), f"Ctrl-C at check {k}"
            assert int(state) == len(numbers), f"Ctrl-C at check {k}: the state lost steps"
            assert_no_slot_leaked(sink)
        if next(checks) <= k:  # the call passed fewer checks: each one has had its Ctrl-C
            break


class Gated:
    """Batches ``{"index": [2i, 2i+1]}``; reading batch ``gate_at`` waits for ``gate``, and every
    batch takes ``delay`` seconds."""

    def __init__(self, n, gate_at=None, delay=0.0):
        self.n, self.gate_at, self.delay, self.gate = n, gate_at, delay, threading.Event()
        self.at_gate = threading.Event()  # a reader is waiting at the gate

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            if i == self.gate_at:
                self.at_gate.set()
                assert self.gate.wait(30.0)
            time.sleep(self.delay)
            yield {"index": np.array([BATCH * i, BATCH * i + 1], np.int32)}


def test_a_call_whose_batches_were_read_is_not_held_back_by_a_slow_batch_after_them():
    data = Gated(100, gate_at=4)  # batch 4 blocks until the gate opens
    with sinkax.data_sink(collect_index, data, 2, timeout=1.0) as sink:
        state, first = sink(jnp.int32(0))
        assert data.at_gate.wait(60.0)  # the producer has read batches 2-3 and blocks on 4
        state, second = sink(state)  # needs batches 2-3 only
        data.gate.set()
        state, third = sink(state)
    assert batch_numbers(first) + batch_numbers(second) + batch_numbers(third) == list(range(6))


def test_a_slow_but_steady_pipeline_never_times_out():
    # one epoch: 2.5 s, longer than the timeout, but a batch every 0.1 s; the timeout leaves a
    # loaded machine time to pack and move the chunk after the last batch
    data = Gated(25, delay=0.1)
    with sinkax.data_sink(collect_index, data, -1, timeout=2.0) as sink:
        _, outs = sink(jnp.int32(0))
    assert batch_numbers(outs) == list(range(25))


def test_a_timeout_means_no_batch_for_timeout_seconds_and_says_what_arrived():
    data = Gated(10, gate_at=5)  # 2 s: time for a loaded machine to pack and move the chunk
    with sinkax.data_sink(collect_index, data, -1, timeout=2.0) as sink:
        with pytest.raises(sinkax.SinkTimeoutError, match="delivered 5 batches"):
            sink(jnp.int32(0))
        data.gate.set()
        _, outs = sink(jnp.int32(0))  # nothing lost: the call runs from batch 0
    assert batch_numbers(outs) == list(range(10))


def test_close_from_another_thread_fails_a_waiting_call_at_once():
    data = Gated(100, gate_at=2)
    sink = sinkax.data_sink(collect_index, data, 2, timeout=30.0)
    state, _ = sink(jnp.int32(0))
    threading.Timer(0.2, sink.close).start()
    t0 = time.monotonic()
    with pytest.raises(sinkax.SinkClosedError):
        sink(state)  # waits for batch 2 until the sink is closed
    assert time.monotonic() - t0 < 10.0
    data.gate.set()
    sink.close()
    np.testing.assert_array_equal(state, 2)  # the state passed in stays valid


def test_restore_data_state_from_another_thread_during_a_call_is_refused():
    data = Gated(100, gate_at=2)
    with sinkax.data_sink(collect_index, data, 2, timeout=30.0) as sink:
        state, _ = sink(jnp.int32(0))
        position, results = sink.data_state(), []
        worker = threading.Thread(target=lambda: results.append(sink(state)))
        worker.start()
        deadline = time.monotonic() + 60.0
        while not sink._running:  # the worker's call has started; it waits for batch 2
            assert time.monotonic() < deadline, "the worker's call did not start"
            time.sleep(0.001)
        with pytest.raises(RuntimeError, match="already running a call"):
            sink.restore_data_state(position)
        data.gate.set()
        worker.join(30.0)
        _, outs = results[0]
        assert batch_numbers(outs) == [2, 3]


@pytest.mark.parametrize(
    "also",
    [(), pytest.param((threading.__file__,), marks=pytest.mark.slow)],
    ids=["sinkax", "and-threading"],
)
def test_ctrl_c_in_any_sinkax_frame_of_a_restore_leaves_a_working_sink_at_its_data_state(also):
    dataset = indexed_map_dataset(4000, BATCH, seed=None)
    for k in itertools.count():
        with sinkax.data_sink(collect_index, dataset, 3, strategy="scan", prefetch=1) as sink:
            state, _ = sink(jnp.int32(0))
            saved = sink.data_state()  # batch 3 next
            state, _ = sink(state)
            with contextlib.suppress(KeyboardInterrupt), ctrl_c_at_check(k, also=also) as checks:
                sink.restore_data_state(saved)
            start = sink.data_state()["step"]
            assert start in (3, 6), f"Ctrl-C at check {k}"
            numbers = []
            calls_until(sink, state, 6, numbers)
            assert numbers == list(range(start, start + len(numbers))), f"Ctrl-C at check {k}"
            assert_no_slot_leaked(sink)
        if next(checks) <= k:
            break


def test_ctrl_c_in_any_sinkax_frame_of_non_sink_mode_skips_and_repeats_no_batch():
    from sinkax.train import DatasetHelper, connect_network_with_dataset

    data = [{"index": np.array([BATCH * i, BATCH * i + 1], np.int32)} for i in range(6)]
    for k in itertools.count():
        with DatasetHelper(data, dataset_sink_mode=False, epoch_num=100) as helper:
            net = connect_network_with_dataset(collect_index, helper)
            state, numbers = jnp.int32(0), []
            with ctrl_c_at_check(k) as checks, contextlib.suppress(KeyboardInterrupt):
                for _ in helper:
                    state, outs = net(state)
                    numbers += batch_numbers(outs)
            while len(numbers) < 12:
                with contextlib.suppress(KeyboardInterrupt):
                    for _ in helper:
                        state, outs = net(state)
                        numbers += batch_numbers(outs)
        expected = [i % 6 for i in range(len(numbers))]
        assert numbers == expected, f"Ctrl-C at check {k}"
        assert int(state) == len(numbers), f"Ctrl-C at check {k}"
        if next(checks) <= k:
            break


def test_a_ctrl_c_handled_in_a_gc_callback_is_held_for_the_next_call():
    # CPython drops what a garbage-collection callback raises (jax has one, run at every
    # collection): while a sink is open, its handler holds such a Ctrl-C for the next call
    pressed = []

    def press_in_the_callback(phase, info):
        if not pressed:
            pressed.append(phase)
            signal.raise_signal(signal.SIGINT)  # handled right here, inside the callback

    with sinkax.data_sink(collect_index, indexed_map_dataset(40, BATCH, seed=None), 2) as sink:
        state, _ = sink(jnp.int32(0))  # the first call installs the sink's handler
        gc.callbacks.insert(0, press_in_the_callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(press_in_the_callback)
        with pytest.raises(KeyboardInterrupt):
            sink(state)  # stopped before it touched anything
        state, outs = sink(state)
    assert pressed == ["start"] and int(state) == 4 and batch_numbers(outs) == [2, 3]


@pytest.mark.parametrize("k", range(3))
def test_a_ctrl_c_while_jax_reads_a_new_executable_s_layouts_is_never_lost(k):
    # jax reads them inside a bare `except:`: a KeyboardInterrupt raised there would be lost
    def count(state, batch):  # a new function each time: its first call compiles
        return state + 1, batch["index"]

    layouts, state, steps = sinkax.compat._private("layouts_from_executable"), jnp.int32(0), 0
    with sinkax.data_sink(count, indexed_map_dataset(40, BATCH, seed=None), 2) as sink:
        with ctrl_c_at_check(k, layouts) as checks, contextlib.suppress(KeyboardInterrupt):
            state, _ = sink(state)  # compiles, reads the layouts: Ctrl-C there
            steps = 2  # ... held for the next call, which it must stop
            with pytest.raises(KeyboardInterrupt):
                sink(state)
        assert next(checks) > k  # the k-th check point in it was reached
        state, outs = sink(state)
    assert int(state) == steps + 2 and batch_numbers(outs) == list(range(steps, steps + 2))


def test_a_ctrl_c_during_close_does_not_count_a_live_producer_as_ended():
    from sinkax.channel.packers import Stacked
    from sinkax.channel.ring import DeviceRing
    from sinkax.channel.source import as_source

    data = Gated(100, gate_at=1)  # the producer blocks reading batch 1
    ring = DeviceRing(
        as_source(data),
        lambda spec, pos: iter([[(4, True)]] * 100),
        prefetch=1,
        packer=Stacked(jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])),
    )
    assert data.at_gate.wait(10.0)  # (a producer stopped before it got there would just end)
    main = threading.main_thread().ident
    threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        ring.close(timeout=10.0)  # waits for the blocked producer; Ctrl-C
    assert not ring.close(timeout=0.1)  # the producer is still inside the dataset
    data.gate.set()
    assert ring.close(timeout=10.0)


@pytest.mark.parametrize("kind", ["map", "list"])
def test_resuming_onto_a_dataset_of_another_epoch_length_is_refused(kind):
    def dataset(batch_size):  # 40 samples: 10 or 20 batches an epoch
        data = indexed_map_dataset(40, batch_size, seed=None)
        return data if kind == "map" else [data[i] for i in range(len(data))]

    with sinkax.data_sink(collect_index, dataset(4), 5) as sink:
        for _ in range(5):
            sink(jnp.int32(0))
        saved = sink.data_state()  # epoch 2, step 5
    with pytest.raises(ValueError, match=r"another epoch length.*20 batches per epoch"):
        sinkax.data_sink(collect_index, dataset(2), 5, data_state=saved)
    with sinkax.data_sink(collect_index, dataset(2), 5) as sink:
        position = sink.data_state()
        old = {k: v for k, v in saved.items() if k != "epoch_length"}  # saved before it was kept
        with pytest.raises(ValueError, match="another epoch length"):
            sink.restore_data_state(dict(old, step=25) if kind == "list" else old)
        assert sink.data_state() == position
        _, outs = sink(jnp.int32(0))
        assert batch_numbers(outs) == [0, 1, 2, 3, 4]  # the sink stayed where it was


def test_resuming_a_sized_datasets_position_onto_one_without_len_names_the_len():
    batches = [{"index": np.arange(2 * i, 2 * i + 2)} for i in range(6)]
    with sinkax.data_sink(collect_index, batches, 2) as sink:
        sink(jnp.int32(0))
        saved = sink.data_state()

    class Unsized:  # the same 6 batches a pass, without a len()
        def __iter__(self):
            return iter(batches)

    with pytest.raises(ValueError, match=r"of 6 batches per epoch, and this one has no len\(\)"):
        sinkax.data_sink(collect_index, Unsized(), 2, data_state=saved)


def test_a_call_longer_than_memory_allows_is_planned_lazily():
    from sinkax.channel.plan import plan_chunks

    layouts = plan_chunks(itertools.repeat(10**15), max_steps=1)
    assert list(itertools.islice(layouts, 2)) == [[(1, False)], [(1, False)]]


@pytest.mark.parametrize("sink_size", [2**31, 2**63])
def test_a_sink_size_no_call_can_run_is_refused(sink_size):
    with pytest.raises(ValueError, match="sink_size must be a positive int"):
        sinkax.data_sink(collect_index, indexed_map_dataset(8, 2), sink_size)


def test_batches_with_no_arrays_are_explained():
    sink = sinkax.data_sink(lambda s, b: (s, s), [{}] * 4, 2)
    with sink, pytest.raises(sinkax.BatchSpecError, match="holds no arrays"):
        sink(jnp.int32(0))


def test_batches_with_no_rows_are_explained():
    empty = {"image": np.zeros((0, 3), np.float32), "label": np.zeros((0,), np.int32)}
    state = jnp.float32(0)
    with sinkax.data_sink(lambda s, b: (s + b["image"].sum(), s), [empty] * 4, 2) as sink:
        with pytest.raises(sinkax.BatchSpecError, match=r"first batch has no rows.*drop_remainder"):
            sink(state)
        assert float(state) == 0 and sink.step == 0


@pytest.mark.parametrize("bad", [float("inf"), None, "1MB", 0.5, True])
def test_max_chunk_bytes_that_is_no_byte_count_is_refused(bad):
    with pytest.raises(ValueError, match="max_chunk_bytes must be a number of bytes"):
        sinkax.data_sink(collect_index, indexed_map_dataset(8, 2), 2, max_chunk_bytes=bad)


def test_save_graphs_and_read_options_of_another_type_are_named():
    with pytest.raises(TypeError, match="save_graphs must be a folder"):
        sinkax.data_sink(collect_index, indexed_map_dataset(8, 2), 2, save_graphs=5)
    for options in ({"num_threads": 4}, 4):
        with pytest.raises(TypeError, match=r"read_options must be a grain.ReadOptions"):
            sinkax.data_sink(collect_index, indexed_map_dataset(8, 2), 2, read_options=options)
    threads = grain.ReadOptions(num_threads=2)
    iterable = indexed_map_dataset(8, 2).to_iter_dataset()  # read as it is: said so
    with pytest.warns(UserWarning, match=r"read_options apply to a grain MapDataset.*without them"):
        sinkax.data_sink(collect_index, iterable, 2, read_options=threads).close()


def test_a_prefetch_the_ring_cannot_set_up_is_refused_naming_the_limit():
    from sinkax.config import MAX_PREFETCH, SinkConfig

    assert SinkConfig.of(2, prefetch=MAX_PREFETCH).prefetch == MAX_PREFETCH
    with pytest.raises(ValueError, match=f"prefetch must be an int from 1 to {MAX_PREFETCH}"):
        SinkConfig.of(2, prefetch=10**9)  # data_sink would set up 10**9 + 1 device slots


@pytest.mark.parametrize("bad", [True, False, "5", 0, -1.0])
def test_a_timeout_that_is_no_number_of_seconds_is_refused(bad):
    with pytest.raises(ValueError, match="timeout must be seconds"):
        sinkax.data_sink(collect_index, indexed_map_dataset(8, 2), 2, timeout=bad)


def test_a_bad_first_batch_is_reported_at_its_own_position():
    batches = [{"index": np.array([2**40, 1])}] + [{"index": np.array([0, 1])}] * 3
    sink = sinkax.data_sink(collect_index, batches, 2)
    with sink, pytest.raises(sinkax.BatchSpecError, match="Batch at epoch 0, step 0, leaf"):
        sink(jnp.int32(0))


def test_a_device_may_be_a_platform_name_and_anything_else_is_refused():
    data = indexed_map_dataset(8, 2, seed=None)
    with sinkax.data_sink(collect_index, data, 2, device="cpu") as sink:
        assert sink.config.sharding.device_set == {jax.devices("cpu")[0]}
        _, outs = sink(jnp.int32(0))
    assert batch_numbers(outs) == [0, 1]
    with pytest.raises(ValueError, match="target name"):
        sinkax.data_sink(collect_index, indexed_map_dataset(8, 2), 2, device="tpu9")
    with pytest.raises(TypeError, match=r"jax\.Device"):
        sinkax.data_sink(collect_index, indexed_map_dataset(8, 2), 2, device=0)


def test_int64_values_that_would_wrap_to_32_bits_are_refused():
    if jax.config.jax_enable_x64:
        pytest.skip("with x64 the device holds int64")
    fits = [{"i": np.array([2**31 - 1], np.int64)}] * 2
    with sinkax.data_sink(lambda s, b: (s, b["i"]), fits, 2) as sink:
        _, outs = sink(jnp.int32(0))
    assert np.asarray(outs).ravel().tolist() == [2**31 - 1] * 2
    wraps = [{"i": np.array([2**31], np.int64)}] * 2
    sink = sinkax.data_sink(lambda s, b: (s, b["i"]), wraps, 2)
    with sink, pytest.raises(sinkax.BatchSpecError, match="would wrap"):
        sink(jnp.int32(0))


@pytest.mark.parametrize("piece", [0, 1], ids=["before-any-step", "after-a-chunk-ran"])
def test_a_second_ctrl_c_while_a_call_unwinds_from_the_first_does_not_wedge_the_sink(piece):
    # the first Ctrl-C lands while the call waits for its `piece`-th chunk; the second at each
    # point of the call after it, the error path included, in turn
    dataset = indexed_map_dataset(40000, BATCH, seed=None)
    options = {"strategy": "scan", "max_chunk_bytes": 4 * 24, "prefetch": 1}  # 3 chunks a call
    with sinkax.data_sink(collect_index, dataset, 9, **options) as sink:
        state, outs = sink(jnp.int32(0))
        numbers = batch_numbers(outs)
        next_piece, pieces = sink._cursor.next_piece, itertools.count()

        def interrupted_at_piece(*args):
            if next(pieces) == piece:
                raise KeyboardInterrupt  # the first Ctrl-C
            return next_piece(*args)

        for k in itertools.count():
            sink._cursor.next_piece, pieces = interrupted_at_piece, itertools.count()
            with contextlib.suppress(KeyboardInterrupt), ctrl_c_at_check(k) as checks:
                state, outs = sink(state)  # the second Ctrl-C at check k
            sink._cursor.next_piece = next_piece
            assert sinkax.interrupt.GUARD.state is None, f"second Ctrl-C at check {k}"
            with contextlib.suppress(KeyboardInterrupt):  # a Ctrl-C held for this call
                state, outs = sink(state)  # "already running a call" if wedged
                numbers += batch_numbers(outs)
            state = calls_until(sink, state, len(numbers) + 9, numbers)
            assert numbers == list(range(len(numbers))), f"second Ctrl-C at check {k}"
            assert int(state) == len(numbers), f"second Ctrl-C at check {k}: the state lost steps"
            if next(checks) <= k:
                break
        assert k > 10  # the call passed its error path's checks, each with a second Ctrl-C
        assert_no_slot_leaked(sink)


def test_a_call_holds_ctrl_c_even_if_the_handler_was_replaced_since_the_call_began():
    original = signal.getsignal(signal.SIGINT)
    handoff = sinkax.interrupt.Handoff.opened()
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a step traced meanwhile, say
        handoff.dispatched()  # every step has run: a Ctrl-C from here on is held
        signal.raise_signal(signal.SIGINT)
        handoff.state = None
        with pytest.raises(KeyboardInterrupt):
            sinkax.interrupt.deliver_held()  # where the next call passes it on
    finally:
        handoff.state = None
        signal.signal(signal.SIGINT, original)


def test_a_ctrl_c_while_a_call_frees_its_arrays_is_held_for_the_next_call(monkeypatch):
    # Freeing a device array may let go of the interpreter lock; a Ctrl-C that arrives then is
    # handled at the next check. Here it is handled as the window outputs a call joined are
    # freed: that must happen inside the guard (held), not after it closed.
    joined, pressed = sinkax.execution.executor.Executor.joined, []

    def joined_then_ctrl_c_when_freed(self, parts):
        if not pressed and len(parts) > 1:
            pressed.append(weakref.finalize(parts[0], signal.raise_signal, signal.SIGINT))
        return joined(self, parts)

    monkeypatch.setattr(sinkax.execution.executor.Executor, "joined", joined_then_ctrl_c_when_freed)
    dataset = indexed_map_dataset(100, BATCH, seed=None)
    strategy, sink_size, max_chunk_bytes = CHUNKS["split-over-chunks"]  # windows: a join
    with sinkax.data_sink(
        collect_index, dataset, sink_size, strategy=strategy, max_chunk_bytes=max_chunk_bytes
    ) as sink:
        state, outs = sink(jnp.int32(0))  # the Ctrl-C comes as it returns: it returns whole
        assert pressed and not pressed[0].alive and batch_numbers(outs) == list(range(9))
        with pytest.raises(KeyboardInterrupt):
            sink(state)  # held for the next call, which it stops before anything runs
        state, outs = sink(state)
        assert batch_numbers(outs) == list(range(9, 18)) and int(state) == 18
