"""``stop_if_nonfinite``: a sink stops at the first non-finite step, exactly there."""

import contextlib
import functools
import itertools

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ctrl_c_at_check,
    indexed_map_dataset,
    init_state,
    regression_batches,
    train_step,
)

import sinkax


def poisoned_at(bad_index):
    """A step summing the batches' first sample indices, not finite on the batch holding
    sample ``bad_index``; outputs ``{"loss", "index"}``."""

    def step(total, batch):
        bad = jnp.any(batch["index"] == bad_index)
        total = total + batch["index"][0].astype(jnp.float32)
        return total, {"loss": jnp.where(bad, jnp.nan, total), "index": batch["index"]}

    return step


def samples_of(dataset, steps):
    """The sample indices of the first ``steps`` batches the sinks read of ``dataset``."""
    with sinkax.data_sink(lambda b: b["index"], dataset, steps) as sink:
        return np.asarray(sink()).tolist()


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        ("scan", {}),
        ("loop", {}),
        ("scan", {"jit": False}),
        ("scan", {"max_chunk_bytes": 1}),
        ("scan", {"progress": lambda steps, out: None, "progress_every": 1}),  # 4 blocks a call
    ],
    ids=["scan", "loop", "eager", "one-batch-chunks", "progress-blocks"],
)
def test_a_call_stops_at_the_first_nonfinite_step_with_the_state_before_it(strategy, options):
    dataset = indexed_map_dataset(40, 2)  # 20 batches, reshuffled
    batches = samples_of(dataset, 20)
    bad = batches[6][0]  # the 7th batch: the second call's 3rd step
    step = poisoned_at(bad)
    with sinkax.data_sink(
        step, dataset, 4, strategy=strategy, stop_if_nonfinite="loss", **options
    ) as sink:
        total, _ = sink(jnp.float32(0))
        assert sink.nonfinite is None and sink.data_state()["step"] == 4
        total, second = sink(total)
        stop = sink.nonfinite
        assert (stop.epoch, stop.step, stop.step_in_call) == (0, 6, 2)
        assert (sink.epoch, sink.step) == (0, 6)  # the data position is *at* the bad batch
        assert second["index"].tolist() == batches[4:6]  # the kept steps' outputs only
        assert np.isnan(stop.out["loss"]) and stop.out["index"].tolist() == batches[6]
        assert float(total) == sum(b[0] for b in batches[:6])  # without the bad step
        assert sink.stats.steps == 6 and sink.stats.calls == 2
        total, third = sink(total)  # the next call starts at that batch: it stops at once
        assert len(third["index"]) == 0 and sink.nonfinite.step_in_call == 0
        assert float(total) == sum(b[0] for b in batches[:6])


def test_a_window_in_progress_blocks_branches_once_in_its_join_not_in_each_block(tmp_path):
    # XLA's GPU runtime decides a branch on the host, waiting for the device to get there: a
    # branch in each block would keep the host from dispatching the blocks ahead of the device
    with sinkax.data_sink(
        poisoned_at(-1),
        indexed_map_dataset(16, 2),
        8,
        strategy="scan",
        stop_if_nonfinite="loss",
        progress=lambda steps, out: None,
        progress_every=2,
        save_graphs=tmp_path,
    ) as sink:
        sink(jnp.float32(0))
        assert sink.stats.dispatches == 4 + 2  # the blocks, a copy of the first state, the join
    hlo = {path.name: path.read_text() for path in tmp_path.glob("*.hlo.txt")}
    blocks = [text for name, text in hlo.items() if "_scan_" in name]
    joins = [text for name, text in hlo.items() if "_guarded join_" in name]
    assert blocks and not any(" conditional(" in text for text in blocks)
    assert len(joins) == 1 and joins[0].count(" conditional(") == 1


def nan_at_step(k):
    """A step counting steps, not finite at step ``k`` (from 0); outputs the batch's samples."""

    def step(count, batch):
        return count + 1, jnp.where(count == k, jnp.nan, 1.0) * batch["index"]

    return step


@pytest.mark.parametrize("sink_size", [6, -1])
def test_exactly_once_across_a_stop_and_a_resume(sink_size):
    dataset = indexed_map_dataset(40, 2)  # 20 batches an epoch, reshuffled each epoch
    batches = samples_of(dataset, 80)
    seen, count = [], jnp.int32(0)
    with sinkax.data_sink(nan_at_step(27), dataset, sink_size, stop_if_nonfinite=True) as sink:
        while sink.nonfinite is None:
            count, outs = sink(count)
            seen += outs.tolist()
        data_state = sink.data_state()
    assert (data_state["epoch"], data_state["step"], int(count)) == (1, 7, 27)
    with sinkax.data_sink(nan_at_step(-1), dataset, sink_size, data_state=data_state) as sink:
        while len(seen) < 60:  # the resume
            count, outs = sink(count)
            seen += outs.tolist()
    assert seen == batches[: len(seen)]  # every batch once, in order, the bad one included


def regression_step(state, batch):
    state, loss = train_step(state, batch)
    return state, {"loss": loss}


PROGRESS = {"progress": lambda steps, out: None, "progress_every": 3}


@pytest.mark.parametrize("options", [{}, PROGRESS], ids=["plain", "progress"])
def test_while_every_step_is_finite_a_guarded_sink_computes_what_a_plain_one_does(options):
    batches = regression_batches(12)
    results = []
    for watch in (None, "loss" if options else True):
        state, losses = init_state(), []
        with sinkax.data_sink(
            regression_step,
            batches,
            8,
            strategy="scan",
            stop_if_nonfinite=watch,
            **options,
        ) as sink:
            for _ in range(3):
                state, outs = sink(state)
                losses += np.asarray(outs["loss"]).tolist()
            assert sink.nonfinite is None and sink.step == 0 and sink.epoch == 2
        results.append((jax.tree.leaves(state), losses))
    (plain, plain_losses), (guarded, guarded_losses) = results
    assert guarded_losses == plain_losses
    for a, b in zip(plain, guarded, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("options", [{}, PROGRESS], ids=["plain", "progress"])
@pytest.mark.parametrize("out", [None, ()], ids=["None", "empty"])
def test_a_guarded_step_that_outputs_nothing_runs_in_every_strategy(options, out):
    batches = regression_batches(6)
    step = lambda state, batch: (regression_step(state, batch)[0], out)  # noqa: E731
    reference = init_state()
    for batch in batches:
        reference = regression_step(reference, batch)[0]
    for strategy in ("scan", "loop"):
        with sinkax.data_sink(
            step, batches, 6, strategy=strategy, stop_if_nonfinite=True, **options
        ) as sink:  # nothing to watch: every step is kept
            state, outs = sink(init_state())
        assert outs == out and sink.nonfinite is None and sink.step == 0
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_without_the_option_the_nonfinite_step_is_kept():
    dataset = indexed_map_dataset(16, 2)
    batches = samples_of(dataset, 8)
    with sinkax.data_sink(poisoned_at(batches[1][0]), dataset, 4) as sink:
        _, outs = sink(jnp.float32(0))
        assert sink.nonfinite is None and sink.step == 4
        assert np.isnan(outs["loss"][1:]).tolist() == [True, False, False]


def test_a_stateless_sink_stops_too():
    dataset = indexed_map_dataset(16, 2, seed=None)  # batch k holds samples 2k, 2k+1
    with sinkax.data_sink(
        lambda b: jnp.log(b["x"][0, 0] - 2.5), dataset, 5, stop_if_nonfinite=True
    ) as sink:
        outs = sink()  # x = 0.5 * index: log of a negative number until index 6
        assert len(outs) == 0 and sink.step == 0
    with sinkax.data_sink(
        lambda b: 1 / (b["x"][0, 0] - 3), dataset, 5, stop_if_nonfinite=True
    ) as sink:
        outs = sink()  # 1/0 at index 6, the 4th batch
        assert len(outs) == 3 and sink.step == 3 and jnp.isinf(sink.nonfinite.out)


@pytest.mark.parametrize(
    ("watch", "error", "match"),
    [
        (3, TypeError, "stop_if_nonfinite must be True"),
        ("lost", KeyError, "its entries: \\['index', 'loss'\\]"),
        ("loss", KeyError, "but the output is one array. Name an entry of a dict output"),
    ],
)
def test_a_bad_watch_names_the_forms_or_the_entries(watch, error, match):
    dataset = indexed_map_dataset(8, 2)
    step = functools.partial(poisoned_at(-1))
    if match.startswith("but"):  # a step whose output is one array, not a dict
        step = lambda state, batch: (state, batch["x"][0, 0])  # noqa: E731
    with (
        pytest.raises(error, match=match),
        sinkax.data_sink(step, dataset, 2, stop_if_nonfinite=watch) as sink,
    ):
        sink(jnp.float32(0))


def test_ctrl_c_anywhere_in_a_stopping_call_loses_and_repeats_no_batch():
    dataset = indexed_map_dataset(40, 2, seed=None)  # batch k holds samples 2k, 2k+1
    for k in itertools.count():
        with sinkax.data_sink(nan_at_step(6), dataset, 4, stop_if_nonfinite=True) as sink:
            count, outs = sink(jnp.int32(0))
            seen = outs.tolist()
            with (
                contextlib.suppress(KeyboardInterrupt),
                ctrl_c_at_check(k, sinkax.Sink.__call__) as checks,
            ):
                count, outs = sink(count)  # stops at step 6
                seen += outs.tolist()
            for _ in range(3):  # until it stops; a held Ctrl-C stops the first of these
                with contextlib.suppress(KeyboardInterrupt):
                    count, outs = sink(count)  # after the stop: stops again at once
                    seen += outs.tolist()
            assert sink.nonfinite.step_in_call == 0
            assert (int(count), sink.step) == (6, 6), f"Ctrl-C at check {k}"
        assert seen == [[2 * i, 2 * i + 1] for i in range(6)], f"Ctrl-C at check {k}"
        if next(checks) <= k:  # the call passed fewer checks: each one has had its Ctrl-C
            break


def test_a_stop_moves_a_grain_dataset_back_without_checking_it_is_the_same_dataset():
    # its batches read differently once read (as a map drawing without a seed may): a position
    # the sink recorded itself is this dataset's, and moving back to it reads nothing to check
    read = set()

    def changing(batch):
        first = int(batch[0]) not in read
        read.add(int(batch[0]))
        return {"x": batch.astype(np.float32) + (0 if first else 100)}

    dataset = grain.MapDataset.range(12).batch(4).map(changing)

    def step(total, batch):  # the batch of 8..11 is not finite the first time it is read
        bad = batch["x"][0] == 8
        return total + 1, {"loss": jnp.where(bad, jnp.nan, batch["x"][0])}

    with sinkax.data_sink(step, dataset, 2, stop_if_nonfinite="loss", strategy="scan") as sink:
        total, _ = sink(jnp.int32(0))  # batches 0, 1
        total, outs = sink(total)  # stops at batch 2: moved back to it
        assert sink.nonfinite is not None and (sink.epoch, sink.step) == (0, 2)
        assert "first_batch" in sink.data_state()["source"]  # a later resume is still checked
        total, outs = sink(total)  # batch 2 again (read anew: finite), then the next epoch's
    assert outs["loss"].tolist() == [108.0, 100.0]
