"""Semantics of ``data_sink``: results, data order, errors and lifetime."""

import collections
import collections.abc
import contextlib
import functools
import gc
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import types
import weakref

import grain
import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    auto_measures,
    collect_index,
    ctrl_c_at_check,
    default_backend,
    indexed_map_dataset,
    init_state,
    one_step_strategy,
    producer_threads,
    producers_left,
    reference_run,
    regression_batches,
    threads_but_copiers,
    threads_left,
    train_step,
)

import sinkax
from sinkax.backend import backend_of
from sinkax.channel.packers import Stacked, Unstacked
from sinkax.channel.ring import DeviceRing
from sinkax.channel.source import as_source
from sinkax.config import SinkConfig
from sinkax.execution.compiler import Compiler
from sinkax.execution.programs import concat_program
from sinkax.spec import BatchSpec, check


def run_sink(batches, sink_size, calls, step=None, **options):
    state, losses = init_state(), []
    step = step or functools.partial(train_step)  # a new function: nothing cached for it yet
    with sinkax.data_sink(step, batches, sink_size, **options) as sink:
        for _ in range(calls):
            state, loss = sink(state)
            losses.append(np.asarray(loss))
        stats = sink.stats
    return state, np.concatenate(losses), stats


@pytest.mark.parametrize("strategy", ["scan", "loop", "auto"])
@pytest.mark.parametrize("sink_size", [1, 3, 7, -1])
def test_same_result_as_a_per_step_loop(batches, strategy, sink_size):
    calls = {1: 12, 3: 5, 7: 3, -1: 2}[sink_size]
    steps = calls * (len(batches) if sink_size == -1 else sink_size)
    state, losses, stats = run_sink(batches, sink_size, calls, strategy=strategy)
    ref_state, ref_losses = reference_run(batches, steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state, ref_state
    )
    assert stats.steps == steps and stats.calls == calls


def test_eager_mode_matches_compiled(batches):
    compiled, losses, _ = run_sink(batches, 4, 3, jit=True)
    eager, eager_losses, stats = run_sink(batches, 4, 3, jit=False)
    np.testing.assert_allclose(eager_losses, losses, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), eager, compiled)
    assert stats.strategy == "eager" and stats.compiles == 0


def test_pynative_context_makes_sinks_eager(batches):
    sinkax.set_context(mode=sinkax.PYNATIVE_MODE)
    try:
        with sinkax.data_sink(train_step, batches, 2) as sink:
            sink(init_state())
            assert sink.stats.strategy == "eager"
    finally:
        sinkax.set_context(mode=sinkax.GRAPH_MODE)


def test_chunked_sinks_match_one_chunk(batches):
    one_chunk = run_sink(batches, 9, 2, strategy="scan")
    batch_bytes = sum(v.nbytes for v in batches[0].values())
    chunked = run_sink(batches, 9, 2, max_chunk_bytes=4 * batch_bytes, strategy="scan")
    np.testing.assert_allclose(chunked[1], one_chunk[1], rtol=1e-6)
    assert chunked[2].chunks_transferred >= 6  # 9 steps in chunks of 4, 4, 1 per call
    assert chunked[2].compiles == 3  # one window per distinct chunk length, one joins them


def test_a_split_call_copies_the_callers_state_once(batches, monkeypatch):
    copies = []
    copy_tree = sinkax.sink.copy_tree
    monkeypatch.setattr(sinkax.sink, "copy_tree", lambda tree: copies.append(1) or copy_tree(tree))
    batch_bytes = sum(v.nbytes for v in batches[0].values())
    state = init_state()
    with sinkax.data_sink(
        train_step, batches, 9, max_chunk_bytes=4 * batch_bytes, strategy="scan"
    ) as sink:
        new_state, _ = sink(state)  # pieces of 4, 4 and 1 steps
        assert sink.stats.dispatches == 3
    assert len(copies) == 1  # later pieces donate the sink's own intermediate state
    jax.tree.map(np.asarray, state)  # the caller's state was not donated
    assert not np.allclose(np.asarray(jax.tree.leaves(new_state)[0]), jax.tree.leaves(state)[0])


def test_stateless_form_returns_every_output(batches):
    with sinkax.data_sink(lambda b: b["x"].sum(), batches, sink_size=4) as sink:
        outs = sink()
        more = sink()
    expected = [b["x"].sum() for b in batches[:8]]
    np.testing.assert_allclose(np.concatenate([outs, more]), expected, rtol=1e-5)


def test_calls_must_keep_their_form(batches):
    with sinkax.data_sink(lambda b: b["x"].sum(), batches, 2) as sink:
        sink()
        with pytest.raises(TypeError, match=r"first called as sink\(\)"):
            sink(1.0)


# -- exactly once -------------------------------------------------------------------------
def indices_per_epoch(samples, epoch_size):
    seen = collections.defaultdict(list)
    for position, index in enumerate(samples):
        seen[position // epoch_size].append(int(index))
    return seen


@pytest.mark.parametrize("seed", [0, None])
def test_every_sample_exactly_once_per_epoch_across_calls_and_sink_sizes(seed):
    num_samples, batch_size = 60, 4  # 15 batches an epoch
    dataset = indexed_map_dataset(num_samples, batch_size, seed=seed)
    plan = [(4, 3), (7, 2), (-1, 1), (1, 5), (-1, 2), (11, 3), (2, 1)]
    samples, data_state = [], None
    for sink_size, calls in plan:  # a new sink per size, continuing from the last position
        with sinkax.data_sink(collect_index, dataset, sink_size, data_state=data_state) as sink:
            for _ in range(calls):
                _, indices = sink(jnp.int32(0))
                samples.extend(np.asarray(indices).reshape(-1))
            data_state = sink.data_state()
    epochs = indices_per_epoch(samples, num_samples)
    assert len(epochs) > 5
    for epoch, indices in epochs.items():
        if len(indices) == num_samples:
            assert sorted(indices) == list(range(num_samples)), f"epoch {epoch}"
        else:  # the unfinished last epoch: no repeats
            assert len(set(indices)) == len(indices)
    if seed is not None:  # grain reshuffles each epoch
        assert epochs[0] != epochs[1]


def test_sink_size_minus_one_runs_the_rest_of_the_epoch_then_whole_epochs():
    dataset = indexed_map_dataset(40, 4)  # 10 batches
    with sinkax.data_sink(collect_index, dataset, 3) as sink:
        sink(jnp.int32(0))
        state = sink.data_state()
    with sinkax.data_sink(collect_index, dataset, -1, data_state=state) as sink:
        steps = [sink(jnp.int32(0))[0] for _ in range(3)]
        assert [int(s) for s in steps] == [7, 10, 10]
        assert (sink.epoch, sink.step) == (3, 0)


def test_position_and_epoch_crossing():
    with sinkax.data_sink(collect_index, indexed_map_dataset(20, 4), 7) as sink:  # 5 per epoch
        assert (sink.epoch, sink.step, sink.epoch_length) == (0, 0, 5)
        sink(jnp.int32(0))
        assert (sink.epoch, sink.step) == (1, 2)
        sink(jnp.int32(0))
        assert (sink.epoch, sink.step) == (2, 4)


def test_plain_iterables_resume_by_replaying_the_epoch(batches):
    with sinkax.data_sink(train_step, batches, 13) as sink:
        state, _ = sink(init_state())
        saved = sink.data_state()
        _, expected = sink(state)
    state, _ = run_sink(batches, 13, 1)[:2]
    with sinkax.data_sink(train_step, batches, 13, data_state=saved) as sink:
        _, resumed = sink(state)
    np.testing.assert_allclose(resumed, expected, rtol=1e-6)


# -- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("sink_size", [0, -2, 1.5, True, "3"])
def test_bad_sink_size_is_a_value_error(batches, sink_size):
    with pytest.raises(ValueError, match="sink_size"):
        sinkax.data_sink(train_step, batches, sink_size)
    with pytest.raises(ValueError, match="sink_size"):  # the Model layer's helper too
        sinkax.DatasetHelper(batches, dataset_sink_mode=True, sink_size=sink_size)


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), 1e12, None, "5"])
def test_bad_timeout_is_a_value_error(batches, timeout):
    with pytest.raises(ValueError, match="timeout must be seconds"):
        sinkax.data_sink(train_step, batches, 2, timeout=timeout)


def test_epoch_sinks_need_a_known_length():
    class Unsized:
        def __iter__(self):
            return iter(regression_batches(3))

    with pytest.raises(ValueError, match="known length"):
        sinkax.data_sink(train_step, Unsized(), -1)


def test_unknown_strategy_is_a_value_error(batches):
    with pytest.raises(ValueError, match="strategy must be one of"):
        sinkax.data_sink(train_step, batches, 2, strategy="fast")


def _indices(dataset, sink_size, calls, bad_state):
    """Indices seen over ``calls`` calls, trying to restore ``bad_state`` after the first."""
    seen = []
    with sinkax.data_sink(collect_index, dataset, sink_size) as sink:
        for call in range(calls):
            seen += np.asarray(sink(jnp.int32(0))[1]).ravel().tolist()
            if call == 0:
                with pytest.raises(ValueError, match="data_state"):
                    sink.restore_data_state(bad_state)
    return seen


@pytest.mark.parametrize(
    "bad_state",
    [
        {},  # not a data_state at all
        {"epoch": 0, "step": 1, "source": {"epoch": 0, "step": 1}},  # a list's, for a grain one
        {"epoch": 0, "step": 1, "source": {"next_index": -3}},
        {"epoch": 0, "step": 1, "source": {"next_index": "x"}},
    ],
)
def test_a_data_state_that_does_not_fit_is_refused_and_loses_nothing(bad_state):
    dataset = indexed_map_dataset(40, 4, seed=None)
    expected = list(range(40)) + list(range(8))
    assert _indices(dataset, 4, 3, bad_state) == expected  # 12 batches of 4


def test_a_list_refuses_a_grain_data_state_and_loses_nothing():
    dataset = [{"index": np.array([i], np.int32)} for i in range(6)]
    seen = _indices(dataset, 2, 5, {"epoch": 0, "step": "x", "source": {"next_index": 2}})
    assert seen == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]


def test_a_generators_sink_survives_a_refused_data_state():
    # a one-shot iterator cannot be rewound: the state is refused before the producer stops
    batches = ({"index": np.array([i], np.int32)} for i in range(100))
    with sinkax.data_sink(collect_index, batches, 2) as sink:
        sink(jnp.int32(0))
        with pytest.raises(ValueError, match="does not fit the dataset"):
            sink.restore_data_state({"epoch": 0, "step": 0, "source": {"next_index": 0}})
        assert np.asarray(sink(jnp.int32(0))[1]).ravel().tolist() == [2, 3]


def test_a_one_shot_iterator_is_never_rewound_past_what_it_yielded():
    batches = iter([{"index": np.array([i], np.int32)} for i in range(200)])  # iter(list)
    with sinkax.data_sink(collect_index, batches, 2) as sink:
        sink(jnp.int32(0))
        saved = sink.data_state()  # step 2: the producer has read past it
        with pytest.raises(ValueError, match=r"one-shot iterator.*cannot go back.*step 2"):
            sink.restore_data_state(saved)  # (it read on from where the producer was)
        assert np.asarray(sink(jnp.int32(0))[1]).ravel().tolist() == [2, 3]

    class Counter(collections.abc.Iterator):  # __iter__ is the ABC's: `return self`
        def __next__(self):
            return np.float32(0)

    for one_shot in (iter(range(4)), (np.float32(i) for i in range(4)), Counter()):  # a stop
        with pytest.raises(ValueError, match=r"stop_if_nonfinite.*one-shot iterator"):
            sinkax.data_sink(lambda s, b: (s + b, s), one_shot, 2, stop_if_nonfinite=True)


def test_a_generator_fails_at_its_second_epoch_with_the_fix():
    batches = ({"index": np.array([i], np.int32)} for i in range(4))
    with sinkax.data_sink(collect_index, batches, 2) as sink:
        sink(jnp.int32(0))
        sink(jnp.int32(0))
        with pytest.raises(ValueError, match=r"one-shot iterator.*re-iterable"):
            sink(jnp.int32(0))


def test_an_iterable_whose_iter_restarts_itself_runs_every_epoch():
    class Restarts:  # __iter__ rewinds and returns self: a new pass every time
        def __iter__(self):
            self.i = 0
            return self

        def __next__(self):
            if self.i == 3:
                raise StopIteration
            self.i += 1
            return {"index": np.array([self.i - 1], np.int32)}

    with sinkax.data_sink(collect_index, Restarts(), 2) as sink:
        seen = [i for _ in range(3) for i in np.asarray(sink(jnp.int32(0))[1]).ravel()]
    assert seen == [0, 1, 2, 0, 1, 2]


def test_a_pass_shorter_than_its_len_is_refused_by_name():
    class Overstated:
        def __len__(self):
            return 5

        def __iter__(self):
            return iter([{"index": np.array([i], np.int32)} for i in range(3)])

    with sinkax.data_sink(collect_index, Overstated(), 3) as sink:
        assert np.asarray(sink(jnp.int32(0))[1]).ravel().tolist() == [0, 1, 2]
        with pytest.raises(ValueError, match=r"ended its pass after 3 batches.*len\(\) is 5"):
            sink(jnp.int32(0))


def test_an_empty_dataset_says_so():
    sink = sinkax.data_sink(collect_index, iter([]), 2)
    with sink, pytest.raises(ValueError, match="yielded no batch: it is empty"):
        sink(jnp.int32(0))


def _evens(n):
    return (
        grain.MapDataset.range(n)
        .filter(lambda i: i % 2 == 0)
        .map(lambda i: {"index": np.array([i], np.int32)})
    )


def test_a_filtering_map_dataset_is_refused_at_its_first_skip():
    # its len() counts the filtered elements: epochs and positions would be wrong
    with sinkax.data_sink(collect_index, _evens(8), 1) as sink:
        assert np.asarray(sink(jnp.int32(0))[1]).ravel().tolist() == [0]
        with pytest.raises(ValueError, match=r"skipped 1 element.*to_iter_dataset\(\)"):
            sink(jnp.int32(0))
        assert (sink.epoch, sink.step) == (0, 1)


def test_a_filtered_iter_dataset_counts_epochs_as_it_goes_and_resumes_exactly():
    dataset = _evens(8).to_iter_dataset()
    with sinkax.data_sink(collect_index, dataset, 3) as sink:
        first = np.asarray(sink(jnp.int32(0))[1]).ravel().tolist()
        saved = sink.data_state()
        second = np.asarray(sink(jnp.int32(0))[1]).ravel().tolist()
        assert (sink.epoch, sink.step) == (1, 2)
    with sinkax.data_sink(collect_index, dataset, 3, data_state=saved) as sink:
        assert np.asarray(sink(jnp.int32(0))[1]).ravel().tolist() == second
    assert first + second == [0, 2, 4, 6, 0, 2]


class _AsIndex(grain.transforms.Map):
    def map(self, element):
        return {"index": np.array([element], np.int32)}


def test_a_data_loaders_position_is_json_and_resumes_exactly():
    loader = grain.DataLoader(
        data_source=list(range(6)),
        sampler=grain.samplers.IndexSampler(6, num_epochs=1, shuffle=False, seed=0),
        operations=[_AsIndex()],
        worker_count=0,
    )
    with sinkax.data_sink(collect_index, loader, 4) as sink:
        sink(jnp.int32(0))
        saved = json.loads(json.dumps(sink.data_state()))  # e.g. into a checkpoint
        expected = np.asarray(sink(jnp.int32(0))[1]).ravel().tolist()
    with sinkax.data_sink(collect_index, loader, 4, data_state=saved) as sink:
        assert np.asarray(sink(jnp.int32(0))[1]).ravel().tolist() == expected == [4, 5, 0, 1]


def test_close_stops_a_data_loaders_reader_threads():
    def readers():
        return {t for t in threading.enumerate() if t.name.startswith("grain-prefetch")}

    loader = grain.DataLoader(
        data_source=list(range(60)),
        sampler=grain.samplers.IndexSampler(60, num_epochs=None, shuffle=True, seed=0),
        operations=[_AsIndex()],
        worker_count=0,  # read by grain's threads in this process
    )
    before = readers()
    with sinkax.data_sink(collect_index, loader, 4) as sink:
        sink(jnp.int32(0))
        assert readers() - before  # (else this test proves nothing)
    deadline = time.monotonic() + 20  # they end once their batch in hand is read
    while readers() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert readers() - before == set()  # with the sink still referenced (it ends them)


@pytest.mark.skipif(not default_backend().python_callbacks, reason="the step calls the host")
def test_a_step_with_an_ordered_callback_runs_in_every_strategy():
    def step(total, batch):  # an ordered effect: jax gives its programs no out_info
        doubled = jax.experimental.io_callback(
            lambda x: np.float32(2 * x), jax.ShapeDtypeStruct((), jnp.float32), batch["x"],
            ordered=True,
        )  # fmt: skip
        return total + doubled, doubled

    data = [{"x": np.float32(i)} for i in range(5)]
    for strategy in ("scan", "loop", "auto"):
        with sinkax.data_sink(step, data, 3, strategy=strategy) as sink:
            total, outs = sink(jnp.float32(0))
        assert float(total) == 6.0 and np.asarray(outs).tolist() == [0.0, 2.0, 4.0], strategy


def test_close_joins_the_reader_threads_of_a_dataset_chained_after_them():
    def readers():
        return {t for t in threading.enumerate() if t.name.startswith("grain-prefetch")}

    def slow(i):  # the readers are inside an element when the sink closes
        time.sleep(0.02)
        return {"index": np.int32(i)}

    threads = grain.ReadOptions(num_threads=3, prefetch_buffer_size=8)
    data = (
        grain.MapDataset.range(64).map(slow).to_iter_dataset(threads).batch(2)
    )  # pool: a parent's
    before = readers()
    with sinkax.data_sink(lambda b: b["index"], data, 2) as sink:
        assert np.asarray(sink()).tolist() == [[0, 1], [2, 3]]
        assert readers() - before  # (else this test proves nothing)
    assert readers() - before == set()  # joined by close(), none left to end on its own


def test_a_drifting_batch_names_the_leaf_and_the_fix(batches):
    ragged = [*batches[:5], {"x": batches[5]["x"][:3], "y": batches[5]["y"][:3]}]
    state = init_state()
    with sinkax.data_sink(train_step, ragged, 4) as sink:
        state, _ = sink(state)
        with pytest.raises(sinkax.BatchSpecError, match=r"leaf \['x'\].*\(8, 4\).*\(3, 4\)") as err:
            sink(state)
        assert "drop_remainder=True" in str(err.value)
        assert sink.data_state()["step"] == 4  # the failed call consumed nothing
        with pytest.raises(sinkax.BatchSpecError):  # and it keeps failing the same way
            sink(state)
    jax.block_until_ready(state)  # the state of the last finished call is intact


@pytest.mark.parametrize(
    "drift, named",
    [
        (lambda b: {**b, "x": b["x"].astype(np.float64)}, r"leaf \['x'\].*float32.*float64"),
        (lambda b: {**b, "y": b["y"][:, 0]}, r"leaf \['y'\].*\(8, 1\).*\(8,\)"),
        (lambda b: {"x": b["x"]}, "tree structure"),
    ],
    ids=["dtype", "shape", "tree"],
)
def test_every_batch_is_checked_against_the_first_leaf_by_leaf(batches, drift, named):
    spec = BatchSpec.of(batches[0])
    leaves = check(spec, batches[1], "epoch 0, step 1")
    assert all(a is b for a, b in zip(leaves, jax.tree.leaves(batches[1]), strict=True))
    with pytest.raises(sinkax.BatchSpecError, match=named):
        check(spec, drift(batches[1]), "epoch 0, step 1")


@pytest.mark.parametrize("sink_size", [1, 3])
@pytest.mark.parametrize("name", ["img_0.png", None, np.datetime64("2026-01-01")])
def test_a_leaf_no_device_array_can_hold_names_the_leaf_and_the_fix(batches, sink_size, name):
    named = [{**b, "name": np.array([name] * 8)} for b in batches]
    sink = sinkax.data_sink(train_step, named, sink_size)
    with sink, pytest.raises(sinkax.BatchSpecError, match=r"leaf \['name'\].*numbers and booleans"):
        sink(init_state())


def test_a_record_dtype_leaf_is_refused_by_name_and_jaxs_own_extra_dtypes_are_not(batches):
    record = np.dtype([("a", np.float32), ("b", np.int32)])  # numpy kind "V", as bfloat16's
    named = [{**b, "name": np.zeros(8, record)} for b in batches]
    refused = pytest.raises(sinkax.BatchSpecError, match=r"leaf \['name'\].*numbers and booleans")
    with sinkax.data_sink(lambda b: b["x"].sum(), named) as sink, refused:
        sink()
    halves = [{"x": b["x"].astype(jnp.bfloat16)} for b in batches]
    with sinkax.data_sink(lambda b: b["x"].sum(), halves) as sink:
        assert sink().dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "dataset, items", [({"x": np.ones((4, 2))}, "keys"), ("abcd", "characters")]
)
def test_a_dict_or_string_as_the_dataset_is_refused_with_how_to_give_batches(dataset, items):
    # they iterate as keys or characters: no batch of arrays among them
    with pytest.raises(TypeError, match=rf"yields its {items}\. Give a sequence of batches"):
        sinkax.data_sink(train_step, dataset, 2)


def test_a_misspelled_option_is_named_with_the_closest_one(batches):
    with pytest.raises(TypeError, match=r"no option 'prefech' \(did you mean 'prefetch'\?\)"):
        sinkax.data_sink(train_step, batches, 2, prefech=2)
    with pytest.raises(TypeError, match=r"no option 'enable_profiling'\. Its options: .*timeout"):
        sinkax.data_sink(train_step, batches, 2, enable_profiling=True)
    with pytest.raises(TypeError, match=r"no option 'prefech' \(did you mean 'prefetch'\?\)"):
        helper = sinkax.DatasetHelper(batches, dataset_sink_mode=False, prefech=2)  # non-sink
        net = sinkax.connect_network_with_dataset(train_step, helper)
        for _ in helper:  # (its sinks are made as it goes)
            net(init_state())


def test_a_dataset_error_reaches_the_caller_with_its_traceback(batches):
    class Broken:
        def __iter__(self):
            for i, batch in enumerate(batches):
                if i == 6:
                    raise_from_the_dataset()
                yield batch

    def raise_from_the_dataset():
        raise OSError("disk went away")

    with sinkax.data_sink(train_step, Broken(), 4) as sink:
        state, _ = sink(init_state())
        depths = []
        for _ in range(3):  # it keeps failing the same way, the traceback as deep each time
            with pytest.raises(OSError, match="disk went away") as err:
                sink(state)
            depths.append(len(err.traceback))
    assert "raise_from_the_dataset" in [frame.name for frame in err.traceback]
    assert depths[0] == depths[1] == depths[2]


def test_a_stalled_pipeline_times_out_with_a_diagnosis(batches):
    stall = threading.Event()  # (a slow batch would now and then arrive within the timeout)

    class Stalls:
        def __iter__(self):
            for i, batch in enumerate(batches):
                if i == 2:
                    stall.wait(10.0)
                yield batch

    # (the first call's 2 batches arrive within the timeout on a loaded machine too)
    sink = sinkax.data_sink(train_step, Stalls(), 2, timeout=2.0)
    state, _ = sink(init_state())
    with pytest.raises(sinkax.SinkTimeoutError) as err:
        sink(state)
    with pytest.warns(RuntimeWarning, match="slow or blocked"):  # mid-batch
        sink.close()
    stall.set()
    message = str(err.value)
    assert "2.0 s" in message and "batches/s" in message and "steps/s" in message
    assert "num_threads" in message


class BlocksAfter:
    """The batches, but reading the ``n``-th blocks until ``unblock`` is set (``at_gate`` says
    a reader got there)."""

    def __init__(self, batches, n):
        self.batches, self.n, self.unblock = batches, n, threading.Event()
        self.at_gate = threading.Event()

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i == self.n:
                self.at_gate.set()
                self.unblock.wait()
            yield batch


def test_close_does_not_wait_forever_for_a_blocked_dataset(batches):
    before, dataset = producer_threads(), BlocksAfter(batches, 3)
    sink = sinkax.data_sink(train_step, dataset, 1, timeout=0.3)
    assert dataset.at_gate.wait(60)  # batches 0-2 are read, however slow the machine
    state = init_state()
    with pytest.raises(sinkax.SinkTimeoutError):
        for _ in range(4):
            state, _ = sink(state)
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="still inside the dataset's iterator 0.3 s"):
        sink.close()
    assert time.perf_counter() - t0 < 30  # it waited its timeout, 0.3 s, not for the dataset
    dataset.unblock.set()  # the dataset returns: the daemon producer ends on its own
    assert not producers_left(before)


def test_close_during_a_restore_in_another_thread_leaves_no_producer():
    class GatedReplay:  # a re-iterable whose replay (its second pass) waits at batch 30
        passes, at_gate, unblock = 0, threading.Event(), threading.Event()

        def __len__(self):
            return 100

        def __iter__(self):
            self.passes += 1
            for i in range(100):
                if self.passes > 1 and i == 30:
                    self.at_gate.set()
                    self.unblock.wait()
                yield {"index": np.array([i], np.int32)}

    before, dataset = producer_threads(), GatedReplay()
    sink = sinkax.data_sink(lambda s, b: (s + 1, b["index"][0]), dataset, 4)
    sink(jnp.int32(0))
    saved = {**sink.data_state(), "step": 60, "source": {"epoch": 0, "step": 60}}
    restore = threading.Thread(target=sink.restore_data_state, args=(saved,))
    restore.start()
    assert dataset.at_gate.wait(60)  # the restore replays batches 0-59, its producer stopped
    sink.close()
    dataset.unblock.set()
    restore.join(60)
    assert not restore.is_alive() and not producers_left(before)  # none started after close


def test_close_while_a_restore_starts_its_producer_leaves_none(monkeypatch):
    before, sink = producer_threads(), None

    class RingClosedAsItStarts(DeviceRing):  # a close() from another thread lands meanwhile
        def __init__(self, *args, **kwargs):
            if sink is not None and not sink._closed:
                closing = threading.Thread(target=sink.close)
                closing.start()
                closing.join()
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(sinkax.channel.cursor, "DeviceRing", RingClosedAsItStarts)
    data = [{"index": np.array([i], np.int32)} for i in range(100)]
    sink = sinkax.data_sink(lambda s, b: (s + 1, b["index"][0]), data, 4)
    sink(jnp.int32(0))
    sink.restore_data_state(sink.data_state())  # stops the producer, starts a new one
    assert sink._closed and not producers_left(before)


def test_a_one_epoch_sink_bounded_by_total_steps_runs_them_all_after_a_failed_call():
    class Gated:  # batch 2 waits for the gate the first time
        gate, reads = threading.Event(), 0

        def __len__(self):
            return 4

        def __iter__(self):
            for i in range(4):
                self.reads += i == 2
                if i == 2 and self.reads == 1:
                    self.gate.wait()
                yield {"x": np.float32(i)}

    dataset, step = Gated(), lambda total, b: (total + b["x"], b["x"])
    options = {"total_steps": 4, "timeout": 0.3, "max_chunk_bytes": 4, "strategy": "scan"}
    with sinkax.data_sink(step, dataset, -1, **options) as sink:
        total = jnp.float32(0)
        with pytest.raises(sinkax.SinkTimeoutError):  # batches 0 and 1 ran, then it waited
            sink(total)
        dataset.gate.set()
        total, xs = sink(total)  # the failed call's steps are not taken off total_steps
    assert xs.tolist() == [0, 1, 2, 3] and float(total) == 6


def test_rewinding_waits_for_a_blocked_dataset_and_loses_nothing(batches):
    dataset = BlocksAfter(batches, 3)
    with sinkax.data_sink(train_step, dataset, 1, timeout=0.3) as sink:
        state, first = sink(init_state())
        assert dataset.at_gate.wait(60)  # the producer reads ahead, into the blocking batch
        with pytest.raises(sinkax.SinkTimeoutError, match="rewinding the data"):
            sink.restore_data_state(sink.data_state())
        dataset.unblock.set()
        sink.restore_data_state(sink.data_state())  # the producer has ended: now it rewinds
        losses = [first]
        for _ in range(5):
            state, loss = sink(state)
            losses.append(loss)
    np.testing.assert_allclose(np.concatenate(losses), reference_run(batches, 6)[1], rtol=1e-5)


def test_a_call_that_cuts_the_chunk_while_the_ragged_last_batch_is_read_keeps_that_batch():
    class RaggedLastBlocks:  # 5 batches, the last of 2 rows, read once the gate opens
        at_gate, unblock = threading.Event(), threading.Event()

        def __len__(self):
            return 5

        def __iter__(self):
            for i in range(5):
                if i == 4:
                    self.at_gate.set()
                    self.unblock.wait()
                yield {"x": np.full((2 if i == 4 else 4,), float(i), np.float32)}

    dataset, step = RaggedLastBlocks(), lambda total, b: (total + b["x"].sum(), b["x"][0])
    with sinkax.data_sink(step, dataset, 1, strategy="step", ragged_last=True) as sink:
        state, firsts = jnp.float32(0), []
        assert dataset.at_gate.wait(60)
        for _ in range(4):  # batches 0-3: the calls cut the chunk the producer builds
            state, first = sink(state)
            firsts.append(float(first[0]))
        dataset.unblock.set()  # batch 4 comes, after the cut: it is checked as the last
        for _ in range(6):
            state, first = sink(state)
            firsts.append(float(first[0]))
    assert firsts == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4] and float(state) == 2 * (4 * 6 + 2 * 4)


def press_ctrl_c_once_waiting_after_a_dispatch(sink, deadline_s=60.0):
    """A thread that presses Ctrl-C once the main thread waits for a chunk, after the sink's
    first dispatch: a point it finds by looking, not by timing."""
    main, wait = threading.main_thread().ident, DeviceRing._wait.__code__

    def waiting():
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code is not wait:
            frame = frame.f_back
        return frame is not None

    def press():
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if sink.stats.dispatches and waiting():
                return signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.005)

    presser = threading.Thread(target=press)
    presser.start()
    return presser


def test_interrupted_call_keeps_the_state_and_loses_no_batch(batches):
    stalled = threading.Event()  # batch 6 is read once the test lets it

    class StallsAtBatchSix:
        def __iter__(self):
            for i, batch in enumerate(batches):
                if i == 6:
                    assert stalled.wait(60)
                yield batch

    batch_bytes = sum(v.nbytes for v in batches[0].values())
    state = init_state()
    with sinkax.data_sink(
        train_step, StallsAtBatchSix(), 8, max_chunk_bytes=4 * batch_bytes, strategy="scan"
    ) as sink:
        presser = press_ctrl_c_once_waiting_after_a_dispatch(sink)
        with pytest.raises(KeyboardInterrupt):
            sink(state)  # chunk 1 (4 steps) runs, then the call waits for batch 6: Ctrl-C
        presser.join()
        stalled.set()
        assert sink.data_state()["step"] == 0
        state, losses = sink(state)  # the caller's state is still valid; data rewinds
    _, ref_losses = reference_run(batches, 8)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def ctrl_c_after_second_dispatch(monkeypatch, strategy_class):
    """Make the second run of ``strategy_class`` press Ctrl-C right after it dispatched."""
    dispatch, runs = strategy_class.run, []

    def run(self, *args):
        out = dispatch(self, *args)
        runs.append(None)
        if len(runs) == 2:
            signal.raise_signal(signal.SIGINT)  # the state is donated by now
        return out

    monkeypatch.setattr(strategy_class, "run", run)


@pytest.mark.parametrize(
    "strategy, sink_size, strategy_class",
    [("scan", 4, sinkax.execution.windowed.Scan), ("step", 1, sinkax.execution.single.Step)],
)
def test_ctrl_c_after_the_dispatch_is_held_for_the_next_call(
    batches, monkeypatch, strategy, sink_size, strategy_class
):
    ctrl_c_after_second_dispatch(monkeypatch, strategy_class)
    handler = signal.getsignal(signal.SIGINT)
    with sinkax.data_sink(train_step, batches, sink_size, strategy=strategy) as sink:
        state, first = sink(init_state())
        try:
            state, second = sink(state)  # Ctrl-C lands here, after the state was donated
        except KeyboardInterrupt:
            pytest.fail("a Ctrl-C after the dispatch escaped the call, losing the state")
        position = sink.data_state()
        with pytest.raises(KeyboardInterrupt):
            sink(state)  # ... and stops the next call before it touches anything
        assert sink.data_state() == position
        state, third = sink(state)
    assert signal.getsignal(signal.SIGINT) is handler  # close() gave the handler back
    ref_state, ref_losses = reference_run(batches, 3 * sink_size)
    np.testing.assert_allclose(np.concatenate([first, second, third]), ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), state, ref_state)


@pytest.mark.parametrize(
    "strategy, sink_size, chunk_batches",
    [("scan", 4, None), ("step", 1, None), ("scan", 9, 4), ("loop", 3, None)],
    ids=["one-dispatch", "step", "split-over-chunks", "dispatch-per-step"],
)
def test_ctrl_c_anywhere_in_a_call_keeps_the_state_and_every_batch(
    batches, strategy, sink_size, chunk_batches
):
    batch_bytes = sum(v.nbytes for v in batches[0].values())
    options = {"strategy": strategy, "max_chunk_bytes": (chunk_batches or 64) * batch_bytes}
    _, ref_losses = reference_run(batches, 3 * sink_size)
    for k in itertools.count():
        with sinkax.data_sink(train_step, batches, sink_size, **options) as sink:
            state, losses = sink(init_state())
            with (
                contextlib.suppress(KeyboardInterrupt),
                ctrl_c_at_check(k, sinkax.Sink.__call__) as checks,
            ):
                state, more = sink(state)
                losses = np.concatenate([losses, more])
            while len(losses) < len(ref_losses):  # a held Ctrl-C stops the first of these
                with contextlib.suppress(KeyboardInterrupt):
                    state, more = sink(state)
                    losses = np.concatenate([losses, more])
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f"Ctrl-C at check {k}")
        if next(checks) <= k:  # the call passed fewer checks: each one has had its Ctrl-C
            break


def test_a_sink_runs_off_the_main_thread_and_leaves_its_guard_alone(batches):
    guarded, results = jnp.zeros(1), []
    assert sinkax.interrupt.guard(guarded)  # as a main-thread call in progress would
    sinkax.interrupt.GUARD.held = True  # ... with a Ctrl-C held for the main thread
    try:
        worker = threading.Thread(target=lambda: results.append(run_sink(batches, 1, 3)))
        worker.start()
        worker.join()
        assert sinkax.interrupt.GUARD.state is guarded
        assert sinkax.interrupt.GUARD.held
    finally:
        sinkax.interrupt.GUARD.state = None
        with pytest.raises(KeyboardInterrupt):  # delivered here, on the main thread
            sinkax.interrupt.release()
    np.testing.assert_allclose(results[0][1], reference_run(batches, 3)[1], rtol=1e-5)


# -- lifetime, stats, graphs ----------------------------------------------------------------
def test_a_second_thread_calling_a_running_sink_is_refused_and_loses_nothing():
    started, go_on = threading.Event(), threading.Event()

    def slow(total, batch):  # eager: Python runs inside the call
        started.set()
        go_on.wait(10.0)
        return total + 1, batch["index"]

    seen = []
    with sinkax.data_sink(slow, indexed_map_dataset(16, 2, seed=None), 2, jit=False) as sink:
        worker = threading.Thread(target=lambda: seen.append(sink(jnp.int32(0))[1]))
        worker.start()
        started.wait(10.0)
        with pytest.raises(RuntimeError, match="already running a call, from another thread"):
            sink(jnp.int32(0))
        go_on.set()
        worker.join(10.0)
        seen.append(sink(jnp.int32(0))[1])
        assert (sink.epoch, sink.step) == (0, 4)
    assert np.concatenate([np.asarray(s).ravel() for s in seen]).tolist() == list(range(8))


def test_close_leaves_no_thread_and_blocks_further_calls(batches):
    before = threads_but_copiers()
    sink = sinkax.data_sink(train_step, indexed_map_dataset(40, 4), 3)
    assert threads_but_copiers() - before  # the producer runs
    sink.close()
    sink.close()
    assert threads_left(before, timeout=10.0) == set()
    with pytest.raises(sinkax.SinkClosedError):
        sink(init_state())


def test_a_sink_nobody_closed_stops_its_producer_when_collected(batches):
    before = threads_but_copiers()
    sink = sinkax.data_sink(train_step, batches, 3)
    sink(init_state())
    collected = weakref.ref(sink)
    del sink
    gc.collect()
    assert collected() is None  # the producer thread holds nothing that reaches the sink
    assert threads_left(before, timeout=10.0) == set()


@pytest.mark.parametrize("calls_after", [0, 2])
def test_a_sink_nobody_closed_whose_dataset_failed_is_collected(batches, calls_after):
    class Fails(Exception):  # raised by the dataset: the ring keeps it for every later call
        def __init__(self, name):
            super().__init__(f"bad record {name}")

    def failing():
        yield from batches[:4]
        raise Fails("7")

    class Dataset:
        def __iter__(self):
            return failing()

    before = producer_threads()
    sink = sinkax.data_sink(train_step, Dataset(), 3)
    state, _ = sink(init_state())
    for _ in range(1 + calls_after):  # each raise's traceback holds the sink's frame
        with pytest.raises(Fails) as error:
            state, _ = sink(state)
        assert str(error.value) == "bad record 7"  # as raised: not made again
    del error  # (its traceback holds the sink, as the caller's would while it keeps it)
    assert producers_left(before) == []  # (a live producer would hold its ring)
    collected = weakref.ref(sink)
    del sink
    gc.collect()
    assert collected() is None


def test_at_most_prefetch_plus_one_chunks_on_the_device():
    with sinkax.data_sink(collect_index, indexed_map_dataset(400, 4), 2, prefetch=2) as sink:
        for _ in range(20):
            sink(jnp.int32(0))
            time.sleep(0.01)  # let the producer run ahead
        stats = sink.stats
    assert stats.max_chunks_on_device == 3
    assert stats.chunks_transferred <= stats.calls + 3


def test_loop_sinks_of_one_step_make_outputs_of_their_own_layout():
    def step(state, batch):
        return state + 1, batch

    for width in (1, 4):  # one step function: its executables are shared, by layout
        data = [np.full(width, i, np.int32) for i in range(6)]
        with sinkax.data_sink(step, data, 3, strategy="loop") as sink:
            _, outs = sink(jnp.int32(0))
        np.testing.assert_array_equal(outs, np.repeat(np.arange(3)[:, None], width, 1))


def test_a_sink_of_known_calls_reads_nothing_past_them(batches):
    read = []

    def counted():
        for i, batch in enumerate(batches):
            read.append(i)
            yield batch

    dataset = type("Counted", (), {"__iter__": lambda self: counted()})()
    state = init_state()
    with sinkax.data_sink(train_step, dataset, 3, calls=2, prefetch=4) as sink:
        for _ in range(2):
            state, _ = sink(state)
        with pytest.raises(sinkax.SinkExhaustedError, match="calls="):
            sink(state)
        assert (sink.epoch, sink.step) == (0, 6)  # the failed call took nothing
    assert read == list(range(6))  # prefetch 4 calls ahead, but there were only 2
    with pytest.raises(ValueError, match="calls must be an int >= 1"):
        sinkax.data_sink(train_step, batches, 3, calls=0)


def test_a_new_sink_of_the_same_step_compiles_nothing(batches):
    step = functools.partial(train_step)
    assert run_sink(batches, 3, 2, step=step, strategy="scan")[2].compiles == 1
    assert run_sink(batches, 3, 2, step=step, strategy="scan")[2].compiles == 0
    assert run_sink(batches, 4, 2, step=step, strategy="scan")[2].compiles == 1


def measured(sink, state):
    """Calls ``sink`` until ``"auto"`` has decided (trials of one window each with TRIAL_S=0:
    scan, loop, then scan again unless loop was clearly slower): the state and the calls made."""
    calls = 0
    while sink.stats.strategy.startswith("auto"):
        state, _ = sink(state)
        calls += 1
    return state, calls


@auto_measures
def test_auto_decides_after_a_window_of_each_and_compiles_one_executable_each(batches, monkeypatch):
    monkeypatch.setattr(sinkax.execution.auto, "TRIAL_S", 0.0)  # a trial is one window
    with sinkax.data_sink(functools.partial(train_step), batches, 12) as sink:
        state = init_state()
        assert sink.stats.strategy == "auto"
        state, calls = measured(sink, state)
        decided = sink.stats
        state, _ = sink(state)
        stats = sink.stats
    assert calls in (2, 3)  # scan, loop (and scan again unless loop was clearly slower)
    assert decided.strategy in ("scan", "loop")
    assert set(decided.strategy_timings) == {"scan", "loop"}
    assert stats.dispatches - decided.dispatches == {"scan": 1, "loop": 13}[stats.strategy]
    # scan's window, loop's step and the small program that starts its window: for any
    # position in the chunk
    assert stats.compiles == 3 and stats.steps == 12 * (calls + 1)
    assert stats.bound in ("input", "compute")
    assert run_sink(batches, 5, 2, strategy="loop")[2].dispatches == 12  # 2 x (5 + 1)
    assert run_sink(batches, 5, 2, strategy="scan")[2].dispatches == 2


@auto_measures
def test_auto_carries_its_trials_over_calls_too_short_for_them(batches):
    with sinkax.data_sink(functools.partial(train_step), batches, 4) as sink:
        state, _ = sink(init_state())  # a window far shorter than a trial
        assert sink.stats.strategy == "auto (measuring)"
        while sink.stats.strategy.startswith("auto") and sink.stats.calls < 10_000:
            state, _ = sink(state)
        stats = sink.stats
    assert stats.strategy in ("scan", "loop") and stats.calls > 1
    assert set(stats.strategy_timings) == {"scan", "loop"}


@auto_measures
def test_auto_reuses_the_decision_for_the_step_until_reselect(batches, monkeypatch):
    monkeypatch.setattr(sinkax.execution.auto, "TRIAL_S", 0.0)  # a trial is one window
    step = functools.partial(train_step)
    with sinkax.data_sink(step, batches, 12) as first:
        measured(first, init_state())
        chosen = first.stats.strategy
    with sinkax.data_sink(step, batches, 12) as second:
        state, _ = second(init_state())
        assert second.stats.strategy == chosen and second.stats.strategy_timings == {}
        second.reselect()
        assert second.stats.strategy == "auto (measuring)"
        measured(second, state)
        assert set(second.stats.strategy_timings) == {"scan", "loop"}
    with sinkax.data_sink(step, batches, 12) as third:
        third.reselect()  # before the first call: measures from it on
        state, calls = measured(third, init_state())
        assert set(third.stats.strategy_timings) == {"scan", "loop"} and calls in (2, 3)
    with (
        sinkax.data_sink(step, batches, 12, strategy="scan") as pinned,
        pytest.raises(ValueError, match="reselect"),
    ):
        pinned.reselect()


@pytest.mark.parametrize("strategy", ["auto", "scan", "loop"])
def test_the_callers_state_is_donated_alike_while_measuring_and_after(batches, strategy):
    state = init_state()
    with sinkax.data_sink(functools.partial(train_step), batches, 12, strategy=strategy) as sink:
        for _ in range(2):
            given = state
            state, _ = sink(given)
            assert all(x.is_deleted() for x in jax.tree.leaves(given))


@auto_measures
def test_the_strategy_is_recorded_with_the_data_position(batches, monkeypatch):
    monkeypatch.setattr(sinkax.execution.auto, "TRIAL_S", 0.0)  # a trial is one window
    with sinkax.data_sink(functools.partial(train_step), batches, 12) as sink:
        assert "strategy" not in sink.data_state()  # not known before the first call
        sink(init_state())
        assert "strategy" not in sink.data_state()  # nor while measuring
        measured(sink, init_state())
        saved = json.loads(json.dumps(sink.data_state()))
    assert saved["strategy"] == sink.stats.strategy
    for recorded in ("scan", "loop"):
        data_state = {**saved, "strategy": recorded}
        with sinkax.data_sink(train_step, batches, 12, data_state=data_state) as resumed:
            assert resumed.stats.strategy == recorded  # not measured again
    with sinkax.data_sink(functools.partial(train_step), batches, 12) as restored:
        restored.restore_data_state({**saved, "strategy": "loop"})
        with pytest.raises(ValueError, match=r"data_state\['strategy'\] must be one of"):
            restored.restore_data_state({**saved, "strategy": "fast"})
        restored(init_state())
        assert restored.stats.strategy == "loop" and restored.stats.strategy_timings == {}
    monkeypatch.setenv("SINKAX_STRATEGY", "loop")
    with sinkax.data_sink(train_step, batches, 12) as pinned:
        assert pinned.stats.strategy == "loop"
        state, _ = pinned(init_state())  # a recorded strategy comes before the variable's,
        pinned.restore_data_state({**saved, "strategy": "scan"})  # a call ran or not
        pinned(state)
        assert pinned.stats.strategy == "scan" and pinned.data_state()["strategy"] == "scan"
    with sinkax.data_sink(train_step, batches, 12, strategy="scan") as explicit:
        explicit.restore_data_state({**saved, "strategy": "loop"})  # strategy= comes first
        assert explicit.stats.strategy == "scan"
    monkeypatch.setenv("SINKAX_STRATEGY", "fast")
    with pytest.raises(ValueError, match="SINKAX_STRATEGY='fast'"):
        sinkax.data_sink(train_step, batches, 12)


class _Timed:
    """A candidate whose windows take ``costs[i]`` seconds per step on a fake clock."""

    atomic = True

    def __init__(self, name, costs, clock):
        self.name, self._costs, self._clock = name, iter(costs), clock

    def dispatches(self, steps):
        return 1

    def run(self, state, chunk, offset, steps):
        self._clock.now += next(self._costs) * steps
        return state, None


@pytest.mark.parametrize(
    ("scan_trials", "loop_trials", "chosen", "trials_run"),
    [
        ([1], [2], "scan", 2),  # scan clearly faster: stops after A, B
        ([4, 1], [2], "scan", 3),  # a slow spell in scan's first trial: not decided
        ([3, 3], [1], "loop", 3),  # loop faster than scan's best trial
        ([3, 1.05], [1], "scan", 3),  # loop barely faster: the loop sink proper is kept
        ([3, 2], [1.7], "scan", 3),  # loop's lead (0.3) is within scan's own spread (1): noise
        ([2, 2.1], [1.7], "loop", 3),  # ... and beyond it (0.1): loop is faster
    ],
)
def test_auto_keeps_scan_unless_loop_beats_its_best_trial(
    monkeypatch, scan_trials, loop_trials, chosen, trials_run
):
    monkeypatch.setattr(sinkax.execution.auto, "TRIAL_S", 10)  # a window of 10 steps a trial
    clock = types.SimpleNamespace(now=0.0)
    rest = [1] * 10  # windows after the decision
    scan = _Timed("scan", [*scan_trials, *rest], clock)
    loop = _Timed("loop", [*loop_trials, *rest], clock)
    compiler = sinkax.execution.compiler.Compiler(None, "fake")
    auto = sinkax.execution.auto.Auto([scan, loop], compiler, clock=lambda: clock.now)
    while auto.chosen is None:
        auto.run(None, jnp.zeros(10), 0, 10)
    assert auto.chosen.name == chosen
    assert sum(map(math.isfinite, auto.timings.values())) == 2
    assert next(scan._costs) == next(loop._costs) == 1  # every trial ran, none twice
    assert trials_run == 3 - len(auto._pending)


def test_auto_times_its_candidates_without_their_compiles(monkeypatch):
    monkeypatch.setattr(sinkax.execution.auto, "TRIAL_S", 10)  # a window of 10 steps a trial
    clock = types.SimpleNamespace(now=0.0)
    compiler = sinkax.execution.compiler.Compiler(None, "fake")

    class Compiling(_Timed):  # its first window compiles for 100 s on the clock first
        def run(self, state, chunk, offset, steps):
            if not getattr(self, "compiled", False):
                self.compiled, clock.now, compiler.seconds = True, clock.now + 100, 100
            return super().run(state, chunk, offset, steps)

    scan = _Timed("scan", [2, 2, 1], clock)
    loop = Compiling("loop", [1, 1], clock)  # compiled in its one trial: still faster
    auto = sinkax.execution.auto.Auto([scan, loop], compiler, clock=lambda: clock.now)
    while auto.chosen is None:
        auto.run(None, jnp.zeros(10), 0, 10)
    assert auto.timings == {"scan": 2, "loop": 1} and auto.chosen.name == "loop"


def test_auto_runs_one_step_calls_on_the_batches_as_given_on_cpu(batches):
    expected = one_step_strategy()  # "step" on CPU; "scan" where the device is not the host
    with sinkax.data_sink(functools.partial(train_step), batches, 1) as sink:
        assert sink.stats.strategy == expected  # settled without measuring
        state, _ = sink(init_state())
        sink(state)
        stats = sink.stats
    assert stats.strategy == expected and stats.strategy_timings == {}
    assert stats.compiles == 1 and stats.dispatches == 2  # neither scan nor loop was built


class _RefillsOneBuffer:
    """A loader that refills one numpy buffer in place and yields it again for every batch."""

    def __len__(self):
        return 6

    def __iter__(self):
        buffer = {"i": np.zeros(1, np.int32)}
        for k in range(6):
            buffer["i"][0] = k
            yield buffer


@pytest.mark.parametrize(("sink_size", "strategy"), [(1, "auto"), (1, "scan"), (2, "loop")])
def test_a_dataset_may_refill_the_arrays_it_yielded(sink_size, strategy):
    # the producer reads ahead: it must own what it holds (one-step calls on CPU take "step")
    def count(total, batch):
        return total + 1, batch["i"][0]

    seen = []
    with sinkax.data_sink(count, _RefillsOneBuffer(), sink_size, strategy=strategy) as sink:
        total = np.int32(0)
        for _ in range(12 // sink_size):
            total, outs = sink(total)
            seen += outs.tolist()
    assert seen == [0, 1, 2, 3, 4, 5] * 2


def _counted(total, batch):  # a Python-number state becomes float32 in the first step
    return total + batch["x"].sum(), batch["x"].sum()


def _totals(batches, sink_size, **options):
    """Totals after each call, the state reset to the Python number 0 every third call."""
    totals = []
    with sinkax.data_sink(_counted, batches * 60, sink_size, **options) as sink:
        for _ in range(8):
            total, _ = sink(0)  # weakly typed int32: the step makes it float32
            for _ in range(2):
                total, _ = sink(total)
                assert total.dtype == jnp.float32
                totals.append(float(total))  # a copy: the next call donates `total`
    return np.array(totals)


@pytest.mark.parametrize(
    ("sink_size", "strategy"), [(1, "auto"), (3, "scan"), (3, "loop"), (4, "auto")]
)
def test_a_state_of_python_numbers_takes_the_dtypes_the_step_gives_it(
    batches, monkeypatch, sink_size, strategy
):
    # the rule of lax.scan's carry; resets fall mid-chunk, as an eval sum's would
    monkeypatch.setattr(sinkax.execution.auto, "TRIAL_S", 0.0)  # auto: scan and loop both run
    eager = _totals(batches, sink_size, jit=False)
    np.testing.assert_allclose(_totals(batches, sink_size, strategy=strategy), eager, atol=1e-4)


@pytest.mark.parametrize("strategy", ["scan", "loop"])
@pytest.mark.parametrize("start", [0, 0.0])
def test_a_state_of_python_numbers_compiles_once(batches, strategy, start):
    with sinkax.data_sink(functools.partial(_counted), batches, 3, strategy=strategy) as sink:
        total = start
        for _ in range(4):
            total, _ = sink(total)
        assert sink.stats.compiles == {"scan": 1, "loop": 2}[strategy]  # loop: its start too


@pytest.mark.parametrize("jit", [True, False], ids=["graph", "pynative"])
def test_a_step_that_changes_the_states_dtype_is_refused_by_name(batches, jit):
    def count(state, batch):
        return {"count": state["count"] + batch["x"].sum()}, 0

    unwrapped = sinkax.data_sink(lambda s, b: (s["count"], 0), batches, 2, jit=jit)
    with unwrapped, pytest.raises(TypeError, match=r"returns the state with structure"):
        unwrapped({"count": jnp.int32(0)})
    state = {"count": jnp.int32(0)}
    with sinkax.data_sink(count, batches, 2, jit=jit) as sink:
        with pytest.raises(TypeError, match=r"leaf \['count'\] as float32\[\], but was given int"):
            sink(state)
        assert sink.step == 0 and int(state["count"]) == 0  # nothing consumed, state intact
        sink({"count": jnp.float32(0)})
        assert sink.step == 2
    typed_as_jax_does = lambda s, b: ({"count": 0.5, "lr": np.float64(0.1)}, 0)  # noqa: E731
    with sinkax.data_sink(typed_as_jax_does, batches, 2, jit=jit) as sink:  # weak, canonical
        state, _ = sink({"count": jnp.float32(0), "lr": jnp.float32(0.1)})
        assert float(state["count"]) == 0.5
        assert all(isinstance(x, jax.Array) and x.dtype == jnp.float32 for x in state.values())


def test_a_step_function_runs_on_several_devices(tmp_path):
    # executables are compiled for their arguments' devices: one per device, not one for all
    script = tmp_path / "devices.py"
    script.write_text(
        "import numpy as np, jax, sinkax\n"
        "data = [{'x': np.float32(k)} for k in range(6)]\n"
        "def step(s, b):\n    return s + b['x'], s\n"
        "for device in jax.devices() * 2:\n"
        "    with sinkax.data_sink(step, data, 3, device=device) as sink:\n"
        "        state, _ = sink(np.float32(0))\n"
        "        assert state.devices() == {device} and float(state) == 3.0\n"
        "print(len(jax.devices()), 'devices')\n"
    )
    # two CPU devices, also on a machine whose default backend is a single GPU
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "2 devices" in result.stdout


def test_one_step_calls_get_copies_that_xla_takes_as_they_are():
    batches = [
        {"big": np.full((32, 1024), i, np.float32), "small": np.arange(4) + i} for i in range(4)
    ]
    ring = DeviceRing(
        as_source(batches),
        plan=lambda spec, position: itertools.repeat([(1, True)] * 4),
        prefetch=1,
        packer=Unstacked(),
    )
    try:
        handed = ring.get(timeout=10.0).data
    finally:
        ring.close(timeout=10.0)
    assert handed  # the first chunk goes out after its first batch
    for copy, original in zip(handed, batches, strict=False):
        for key in original:
            assert copy[key] is not original[key]
            np.testing.assert_array_equal(copy[key], original[key])
        big = copy["big"]  # 128 KB: aligned, so XLA:CPU aliases it rather than copy it again
        aliased = jax.device_put(big).unsafe_buffer_pointer() == big.ctypes.data
        assert aliased == default_backend().aliases_host_buffers  # a discrete device copies


class Computing:
    """What a compute on a chunk makes, ready once ``done`` is set: the device's time, held."""

    def __init__(self):
        self.done = threading.Event()

    def block_until_ready(self):
        assert self.done.wait(20.0)
        return self


def test_a_call_waiting_while_the_device_frees_no_slot_gets_a_whole_chunk(monkeypatch):
    # the device still computes on both slots: the producer waits for it, not for data, so the
    # waiting call is not ahead of the device and cutting the next chunk short would only
    # fragment the chunks (each cut one is moved and padded on its own)
    monkeypatch.setattr(sinkax.channel.ring, "CUT_AFTER_S", 0.1)
    data = [{"x": np.full(2, i, np.float32)} for i in range(40)]
    ring = DeviceRing(
        as_source(data),
        plan=lambda spec, position: itertools.repeat([(1, True)] * 4),
        prefetch=1,
        packer=Stacked(jax.sharding.SingleDeviceSharding(jax.devices()[0])),
    )
    busy = [Computing(), Computing()]
    try:
        first = ring.get(timeout=10.0)  # the first chunk goes out after its first piece
        ring.release(busy[0])
        second = ring.get(timeout=10.0)
        ring.release(busy[1])
        threading.Timer(1.0, lambda: [c.done.set() for c in busy]).start()
        third = ring.get(timeout=10.0)  # waits 1 s for the device, then for its data
    finally:
        for computing in busy:
            computing.done.set()
        ring.close(timeout=10.0)
    # (the second is the rest of the first layout)
    assert [len(chunk.pieces) for chunk in (first, second, third)] == [1, 3, 4]
    assert np.asarray(third.data["x"])[:, 0].tolist() == [4.0, 5.0, 6.0, 7.0]


def test_step_strategy_needs_one_step_calls(batches):
    with pytest.raises(ValueError, match=r"strategy='step' runs one step per call.*sink_size=1"):
        sinkax.data_sink(train_step, batches, 3, strategy="step")
    with pytest.raises(ValueError, match="runs 10 steps per call"):  # -1: the epoch's 10
        sinkax.data_sink(train_step, batches, -1, strategy="step")


def test_one_step_calls_fail_at_the_bad_batch_and_keep_failing(batches):
    ragged = [*batches[:5], {"x": batches[5]["x"][:3], "y": batches[5]["y"][:3]}]
    state = init_state()
    with sinkax.data_sink(train_step, ragged, 1) as sink:
        losses = []
        for _ in range(5):
            state, loss = sink(state)
            losses.append(np.asarray(loss))
        for _ in range(2):
            with pytest.raises(sinkax.BatchSpecError, match=r"epoch 0, step 5.*leaf \['x'\]"):
                sink(state)
        assert sink.data_state()["step"] == 5 and sink.stats.strategy == one_step_strategy()
    ref_state, ref_losses = reference_run(batches, 5)
    np.testing.assert_allclose(np.concatenate(losses), ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), state, ref_state)


def test_lowered_sink_is_one_loop_and_compile_time_does_not_depend_on_size(batches):
    with sinkax.data_sink(train_step, batches, 10_000, strategy="scan") as sink:
        text = sink.lower(init_state()).as_text()
    assert "stablehlo.while" in text
    assert text.count("dot_general") < 10  # the step is not unrolled 10,000 times


def test_save_graphs_writes_each_executable(batches, tmp_path):
    run_sink(batches, 3, 1, step=train_step, strategy="scan")  # compiled and cached before
    with sinkax.data_sink(train_step, batches, 3, strategy="scan", save_graphs=tmp_path) as sink:
        sink(init_state())
    files = sorted(os.listdir(tmp_path))
    assert files == ["train_step_scan_sink3.hlo.txt", "train_step_scan_sink3.stablehlo.mlir"]
    assert "while" in (tmp_path / "train_step_scan_sink3.hlo.txt").read_text()


def test_save_graphs_names_executables_of_one_kind_and_size_apart(tmp_path):
    joins = Compiler(train_step, save_graphs=tmp_path)
    for window in (1, 2):  # joins of 2 windows, of 1 and of 2 steps each
        parts = [jnp.zeros((window, 3)), jnp.ones((window, 3))]
        joined = joins.get("concat", 2, lambda: concat_program, parts, donate=False)(parts)
        assert joined.shape == (2 * window, 3)
    files = sorted(path.name for path in tmp_path.glob("*.hlo.txt"))
    assert files == ["train_step_concat_sink2.hlo.txt", "train_step_concat_sink2_2.hlo.txt"]
    assert "f32[4,3]" in (tmp_path / files[1]).read_text()


def test_a_sinks_executables_compile_with_its_compiler_options(batches):
    state = init_state()
    bogus = {"xla_gpu_enable_command_buffer": "BOGUS"}
    with sinkax.data_sink(train_step, batches, 2, compiler_options=bogus) as sink:
        with pytest.raises(Exception, match="BOGUS"):  # the option reached XLA
            sink(state)
        assert sink.step == 0  # nothing ran
    with sinkax.data_sink(train_step, batches, 2, compiler_options={}) as sink:
        _, losses = sink(state)  # the state passed to the failed call is intact
    np.testing.assert_allclose(losses, reference_run(batches, 2)[1], rtol=1e-6)


def test_compiler_options_default_to_the_devices_and_must_be_a_dict():
    cpu = jax.devices("cpu")[0]
    assert SinkConfig.of(1, device=cpu).compiler_options == backend_of(cpu).compiler_options == ()
    assert SinkConfig.of(1, compiler_options={"b": 1, "a": "x"}).compiler_options == (
        ("a", "x"),
        ("b", 1),
    )
    for bad in ("xla_gpu_enable_command_buffer=", {"xla_gpu_enable_command_buffer": ["WHILE"]}):
        with pytest.raises(TypeError, match="compiler_options must be a dict"):
            SinkConfig.of(1, compiler_options=bad)


def test_a_full_pass_of_a_plain_list_ends_the_epoch(batches):
    with sinkax.data_sink(train_step, batches, len(batches)) as sink:
        state, _ = sink(init_state())
        assert (sink.epoch, sink.step) == (1, 0)
        sink(state)
        assert (sink.epoch, sink.step) == (2, 0)


def test_ragged_last_takes_each_epochs_smaller_last_batch_and_only_that(batches):
    ragged = [*batches[:3], {k: v[:5] for k, v in batches[3].items()}]
    with sinkax.data_sink(train_step, ragged, 1, strategy="step", ragged_last=True) as sink:
        state, losses = init_state(), []
        for _ in range(8):  # two epochs
            state, loss = sink(state)
            losses.append(float(loss[0]))
        assert sink.epoch == 2 and sink.step == 0
    np.testing.assert_allclose(losses, reference_run(ragged, 8)[1], rtol=1e-5)
    with sinkax.data_sink(train_step, ragged, 1, strategy="step") as sink:  # not asked for
        for _ in range(3):
            sink(init_state())
        with pytest.raises(sinkax.BatchSpecError, match="drop_remainder=True"):
            sink(init_state())
    early = [batches[0], {k: v[:5] for k, v in batches[1].items()}, *batches[2:4]]
    with sinkax.data_sink(train_step, early, 1, strategy="step", ragged_last=True) as sink:
        sink(init_state())
        with pytest.raises(sinkax.BatchSpecError, match=r"epoch 0, step 1"):
            sink(init_state())
    with pytest.raises(ValueError, match=r"ragged_last=True .* would run 'scan'.*strategy='step'"):
        sinkax.data_sink(train_step, ragged, 1, strategy="scan", ragged_last=True)


def test_ragged_last_over_a_dataset_of_unknown_length_is_refused_at_once(batches):
    class Unsized:  # which batch is an epoch's last is not known
        def __iter__(self):
            return iter(batches)

    with pytest.raises(ValueError, match=r"ragged_last=True .* needs a dataset of known length"):
        sinkax.data_sink(train_step, Unsized(), 1, strategy="step", ragged_last=True)


def test_ragged_last_resumes_at_the_short_batch_and_goes_on_past_it(batches):
    # a new producer's first batch is then the short one: the next, full one sets the layout
    ragged = [*batches[:3], {k: v[:5] for k, v in batches[3].items()}]
    expected = reference_run(ragged, 8)[1][3:]  # the short batch, then a whole epoch
    options = {"strategy": "step", "ragged_last": True}

    with sinkax.data_sink(train_step, ragged, 1, **options) as sink:
        state = init_state()
        for _ in range(3):
            state, _ = sink(state)
        saved, at_short = sink.data_state(), sinkax.pytree.copy_tree(state)
        sink(sinkax.pytree.copy_tree(state))  # past it, then back (a rewind in the same sink)
        sink.restore_data_state(saved)
        rewound = run_calls(sink, sinkax.pytree.copy_tree(at_short), 5)
    resumed, positions = [], []
    with sinkax.data_sink(train_step, ragged, 1, data_state=saved, **options) as sink:
        state = at_short
        for _ in range(5):
            state, loss = sink(state)
            resumed.append(float(loss[0]))
            positions.append((sink.epoch, sink.step))
    assert positions == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]  # past the short batch only
    np.testing.assert_allclose(rewound, expected, rtol=1e-5)
    np.testing.assert_allclose(resumed, expected, rtol=1e-5)
    one_batch = ragged[3:]  # every batch ends its epoch
    with sinkax.data_sink(train_step, one_batch, 1, **options) as sink:
        state = init_state()
        for epoch in range(1, 4):
            state, _ = sink(state)
            assert (sink.epoch, sink.step) == (epoch, 0)


def test_ragged_last_resumed_at_the_short_batch_plans_chunks_by_a_full_batch(batches, monkeypatch):
    ragged = [*batches[:3], {k: v[:1] for k, v in batches[3].items()}]
    full = sinkax.spec.BatchSpec.of(batches[0]).nbytes
    steps = []  # of each chunk packed
    pack = sinkax.channel.packers.Unstacked.pack
    monkeypatch.setattr(
        sinkax.channel.packers.Unstacked,
        "pack",
        lambda self, build, spec, n: steps.append(n) or pack(self, build, spec, n),
    )
    options = {"strategy": "step", "ragged_last": True, "max_chunk_bytes": 2 * full}
    start = {"epoch": 0, "step": 3, "source": {"epoch": 0, "step": 3}}  # at the short batch
    with sinkax.data_sink(train_step, ragged, 1, data_state=start, **options) as sink:
        state = init_state()
        for _ in range(6):
            state, _ = sink(state)
        spec = sink._cursor.first_spec()  # widened by the full batch read after the short
    assert spec.nbytes == full and max(steps) <= 2  # not 8 short batches' worth a chunk


def test_ragged_last_resumed_at_the_short_batch_reads_nothing_past_its_calls(batches):
    read = []  # a pass may differ from the last (a loader reshuffling per pass): none begun

    class Logged:
        def __len__(self):
            return 4

        def __iter__(self):
            read.append("pass")
            for i, batch in enumerate([*batches[:3], {k: v[:5] for k, v in batches[3].items()}]):
                read.append(i)
                yield batch

    start = {"epoch": 0, "step": 3, "source": {"epoch": 0, "step": 3}}  # at the short batch
    options = {"strategy": "step", "ragged_last": True, "calls": 1}
    with sinkax.data_sink(train_step, Logged(), 1, data_state=start, **options) as sink:
        sink(init_state())
        assert sink.data_state()["epoch"] == 1
    assert read[-5:] == ["pass", 0, 1, 2, 3]  # the replay up to the short batch, nothing after


def run_calls(sink, state, calls):
    """The first loss of each of ``calls`` calls of ``sink`` from ``state``."""
    losses = []
    for _ in range(calls):
        state, loss = sink(state)
        losses.append(float(loss[0]))
    return losses
