"""``Model`` train/eval/predict, the train and eval steps, ``DatasetHelper``, resuming."""

import contextlib
import io
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ctrl_c_at_check, producer_threads, producers_left

import sinkax
from sinkax.datasets import pad_batch
from sinkax.train import (
    Callback,
    DatasetHelper,
    EvalCallback,
    History,
    Model,
    ModelCheckpoint,
    ProgressBar,
    TerminateOnNaN,
    TrainState,
    connect_network_with_dataset,
    cross_entropy,
    make_eval_step,
    make_train_step,
)

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZER = optax.sgd(0.1, momentum=0.9)


# -- a tiny learnable problem: two Gaussian blobs, a linear classifier --------------------------
def blobs(num_batches: int = 10, batch_size: int = 16, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, (num_batches, batch_size)).astype(np.int32)
    centers = np.array([[-2.0, -1.0], [2.0, 1.0]], np.float32)
    images = centers[labels] + rng.normal(size=(num_batches, batch_size, 2)).astype(np.float32)
    return [{"image": images[i], "label": labels[i]} for i in range(num_batches)]


def shuffled_blobs(num_batches: int = 10, seed: int = 0) -> grain.MapDataset:
    """The blobs as a grain dataset that reshuffles the batch order every epoch."""
    return grain.MapDataset.source(blobs(num_batches)).shuffle(seed=seed)


def linear(params, x):
    return x @ params["w"] + params["b"]


def init_params():
    return {"w": jnp.zeros((2, 2)), "b": jnp.zeros((2,))}


SCAN = {"sink_options": {"strategy": "scan"}}  # one strategy: runs comparable bit for bit


def new_model(**options) -> Model:
    """The linear classifier; its sinks use the "loop" strategy (the fastest to compile)."""
    options.setdefault("sink_options", {"strategy": "loop"})
    return Model(linear, init_params(), cross_entropy, OPTIMIZER, **options)


def reference(batches, steps: int):
    """``steps`` plain jitted steps over ``batches`` cycled: final state and losses."""
    step = jax.jit(make_train_step(linear, cross_entropy, OPTIMIZER))
    state, losses = TrainState.create(init_params(), OPTIMIZER), []
    for i in range(steps):
        state, metrics = step(state, batches[i % len(batches)])
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, run):
        self.events.append(("train_begin", run.epoch, run.step))

    def on_epoch_begin(self, run):
        self.events.append(("epoch_begin", run.epoch))

    def on_step_end(self, run):
        self.events.append(("step_end", run.epoch, run.step_in_epoch, len(run.losses)))

    def on_epoch_end(self, run):
        self.events.append(("epoch_end", run.epoch, run.step))

    def on_train_end(self, run):
        self.events.append(("train_end", run.epoch, run.step))

    def count(self, kind):
        return sum(event[0] == kind for event in self.events)


def assert_trees_close(a, b, **tolerance):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tolerance), a, b)


def assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


# -- step counts and callback calls ---------------------------------------------------------
def test_sink_size_minus_one_is_one_pass_per_epoch():
    recorder, model = Recorder(), new_model(sink_options={})  # the default "auto" strategy
    run = model.train(3, blobs(10), callbacks=[recorder])
    assert int(model.state.step) == run.step == 30
    assert recorder.events[0] == ("train_begin", 0, 0)
    assert [e for e in recorder.events if e[0] == "step_end"] == [
        ("step_end", epoch, 10, 10) for epoch in (1, 2, 3)
    ]
    assert recorder.count("epoch_end") == 3
    assert recorder.events[-1] == ("train_end", 3, 30)


def test_positive_sink_size_continues_across_epochs():
    batches, history, recorder = blobs(10), History(), Recorder()
    model = new_model()
    run = model.train(5, batches, callbacks=[history, recorder], sink_size=4)  # 5 x 4 steps
    assert run.step == 20 and recorder.count("step_end") == 5
    assert [e[2:] for e in recorder.events if e[0] == "step_end"] == [(4, 4)] * 5
    state, losses = reference(batches, 20)  # traversal continues: batches 0..9, 0..9
    np.testing.assert_allclose(history.losses, losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(model.state, state, rtol=1e-5, atol=1e-6)


def test_sink_size_larger_than_the_dataset_wraps_around():
    model = new_model()
    run = model.train(2, shuffled_blobs(4), sink_size=6)
    assert run.step == 12 and run.data_state()["epoch"] == 3  # 12 batches: 3 passes of 4


def test_non_sink_mode_steps_every_batch_and_ignores_sink_size():
    batches, recorder, history = blobs(10), Recorder(), History()
    model = new_model()
    with pytest.warns(UserWarning, match="sink_size is ignored"):
        run = model.train(2, batches, [recorder, history], dataset_sink_mode=False, sink_size=4)
    assert run.step == 20 and run.sink_stats is None
    steps = [e for e in recorder.events if e[0] == "step_end"]
    assert steps == [("step_end", epoch, i, 1) for epoch in (1, 2) for i in range(1, 11)]
    state, losses = reference(batches, 20)
    np.testing.assert_allclose(history.losses, losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(model.state, state, rtol=1e-5, atol=1e-6)


def test_auto_sink_size_runs_whole_passes_each_in_calls_of_its_own_size():
    batches, recorder, history = blobs(10), Recorder(), History()
    model = new_model(**SCAN)
    run = model.train(3, batches, [recorder, history], sink_size="auto", call_seconds=0.5)
    sizes = run.sink_stats.call_sizes
    calls = [e for e in recorder.events if e[0] == "step_end"]
    assert [e[3] for e in calls] == list(sizes) and len(sizes) > 3  # a step_end a call
    for epoch in (1, 2, 3):  # the epoch is a pass: its calls end at its end, none crosses it
        mine = [e[2] for e in calls if e[1] == epoch]
        assert mine[-1] == 10 and mine == sorted(mine)
    assert recorder.count("epoch_end") == 3 and run.step == 30 and run.steps_per_epoch == 10
    state, losses = reference(batches, 30)
    np.testing.assert_allclose(history.losses, losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(model.state, state, rtol=1e-5, atol=1e-6)


def test_initial_epoch_numbers_the_epochs_that_run():
    recorder = Recorder()
    run = new_model().train(4, blobs(3), callbacks=recorder, initial_epoch=2)
    assert [e[1] for e in recorder.events if e[0] == "epoch_begin"] == [3, 4]
    assert run.step == 6


def test_one_sink_serves_the_whole_train_call():
    run = new_model(**SCAN).train(3, blobs(5), sink_size=2)
    stats = run.sink_stats
    assert stats.calls == 3 and stats.steps == 6 and stats.strategy == "scan"


# -- eval, predict, batch formats -------------------------------------------------------------
def test_eval_and_predict_on_a_learnable_problem():
    model = new_model()
    before = model.eval(blobs(5, seed=1))
    model.train(3, blobs(10))
    after = model.eval(blobs(5, seed=1))
    assert set(after) == {"loss", "accuracy"}
    assert after["accuracy"] > 0.9 and after["loss"] < before["loss"]
    host = model.eval(blobs(5, seed=1), dataset_sink_mode=False)
    assert host == pytest.approx(after, rel=1e-5)
    logits = model.predict(blobs(1, seed=1)[0]["image"])
    assert logits.shape == (16, 2)


@pytest.mark.parametrize("stop", ["loss", True])
def test_eval_runs_the_whole_pass_whatever_the_models_training_options(stop):
    data = blobs(6, seed=1)
    data[3] = {**data[3], "image": np.where(np.arange(2) == 0, np.nan, data[3]["image"])}
    model = new_model(sink_options={"strategy": "loop", "stop_if_nonfinite": stop})
    for sink_mode in (True, False):  # a stop at batch 3 would average batches 0-2 only
        assert np.isnan(model.eval(data, dataset_sink_mode=sink_mode)["loss"])


def test_eval_over_padding_only_says_there_is_nothing_to_average():
    padding = [{**batch, "mask": np.zeros(16, bool)} for batch in blobs(2)]
    with pytest.raises(ValueError, match="evaluation pass held no examples"):
        new_model().eval(padding)


def test_eval_weighs_a_ragged_last_batch_by_its_size_in_non_sink_mode():
    data = blobs(3)
    ragged = [*data[:2], {"image": data[2]["image"][:4], "label": data[2]["label"][:4]}]
    assert set(new_model(metrics="accuracy").eval(blobs(2))) == {"loss", "accuracy"}  # one name
    model = new_model(metrics={"first_label": lambda logits, labels: labels[0].astype(float)})
    result = model.eval(ragged, dataset_sink_mode=False)
    per_batch = np.array([b["label"][0] for b in ragged], float)
    assert result["first_label"] == pytest.approx(np.average(per_batch, weights=[16, 16, 4]))


@pytest.mark.parametrize("kind", ["list", "grain"])
def test_a_ragged_last_eval_batch_is_named_with_the_padding_fix_before_training(kind):
    data = blobs(3)
    ragged = [*data[:2], {"image": data[2]["image"][:4], "label": data[2]["label"][:4]}]
    valid = ragged if kind == "list" else grain.MapDataset.source(ragged)
    fix = r"last batch has 4 rows, its first 16.*PadBatch\(16\).*dataset_sink_mode=False"
    model, epochs = new_model(), _Epochs()
    with pytest.raises(ValueError, match=fix):
        model.eval(valid)
    with pytest.raises(ValueError, match=fix):  # at the start, not after an epoch's training
        model.train(2, blobs(4), [epochs, EvalCallback(valid, verbose=False)])
    assert epochs.ended == [] and int(model.state.step) == 0
    padded = [pad_batch(batch, 16) for batch in ragged]
    assert model.eval(padded) == pytest.approx(model.eval(ragged, dataset_sink_mode=False))
    filtered = grain.MapDataset.source(data).filter(lambda batch: batch is not data[2])
    with pytest.raises(ValueError, match="it filters"):  # the sink's words, not an IndexError
        model.eval(filtered)


def test_non_sink_mode_trains_on_a_smaller_last_batch_as_a_plain_loop_does():
    data = blobs(3)
    ragged = [*data[:2], {"image": data[2]["image"][:5], "label": data[2]["label"][:5]}]
    step = make_train_step(linear, cross_entropy, OPTIMIZER)
    state = TrainState.create(init_params(), OPTIMIZER)
    expected, plain = state, jax.jit(step)
    for _ in range(2):
        for batch in ragged:
            expected, _ = plain(expected, batch)
    with DatasetHelper(ragged, dataset_sink_mode=False, epoch_num=2) as helper:
        net = connect_network_with_dataset(step, helper)
        for _ in range(2):
            for steps in helper:
                assert steps == 1
                state, _ = net(state)
        assert helper.data_state()["epoch"] == 2
        assert isinstance(helper._sink, sinkax.Sink)  # one path through the core
    assert_trees_close(state, expected, rtol=1e-6)


def test_tuple_batches_and_custom_keys():
    pairs = [(b["image"], b["label"]) for b in blobs(4)]
    renamed = [{"x": b["image"], "y": b["label"]} for b in blobs(4)]
    by_pairs, by_keys = new_model(), new_model(input_key="x", label_key="y")
    by_pairs.train(1, pairs)
    by_keys.train(1, renamed)
    assert_trees_close(by_pairs.state, by_keys.state, rtol=1e-6)
    with pytest.raises(KeyError, match=r"input_key=.*label_key="):
        new_model().train(1, renamed)


def test_flax_style_variables_and_an_eval_only_model():
    variables = {"params": init_params()}
    model = Model(lambda v, x: linear(v["params"], x), variables)
    assert model.eval(blobs(2))["accuracy"] == pytest.approx(0.5, abs=0.3)
    with pytest.raises(ValueError, match="no optimizer"):
        model.train(1, blobs(2))


def test_gradient_accumulation_with_multisteps_matches_bigger_batches():
    data = blobs(8)
    halves = [{k: v[i : i + 8] for k, v in b.items()} for b in data for i in (0, 8)]
    accumulate = Model(linear, init_params(), cross_entropy, optax.MultiSteps(OPTIMIZER, 2))
    accumulate.train(1, halves)
    whole = new_model()
    whole.train(1, data)
    assert_trees_close(accumulate.params, whole.params, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_example_runs():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gradient_accumulation.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "loss is" in result.stdout and "same params" in result.stdout


# -- custom loops ----------------------------------------------------------------------------
@pytest.mark.parametrize("sink_mode", [True, False])
def test_connected_network_gives_the_model_results(sink_mode):
    batches = blobs(6)
    step = make_train_step(linear, cross_entropy, OPTIMIZER)
    state = TrainState.create(init_params(), OPTIMIZER)
    losses = []
    with DatasetHelper(batches, sink_mode, sink_size=4, epoch_num=3, strategy="scan") as helper:
        net = connect_network_with_dataset(step, helper)
        for _ in range(3):
            for _ in helper:
                state, metrics = net(state)
                losses.append(np.asarray(metrics["loss"]))
    steps = 12 if sink_mode else 18
    ref_state, ref_losses = reference(batches, steps)
    np.testing.assert_allclose(np.concatenate(losses), ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(state, ref_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "mode", [{"dataset_sink_mode": False}, {"sink_size": "auto"}], ids=["non-sink", "auto"]
)
def test_ctrl_c_anywhere_in_a_call_of_an_epoch_keeps_the_state_and_every_batch(mode):
    step = make_train_step(linear, cross_entropy, OPTIMIZER)
    batches = blobs(4)
    for k in itertools.count():
        with DatasetHelper(batches, epoch_num=2, strategy="scan", **mode) as helper:
            net, trained = connect_network_with_dataset(step, helper), 0
            state = TrainState.create(init_params(), OPTIMIZER)
            for epoch in range(2):  # an interrupted call's batches come again, in this epoch
                for i, _ in enumerate(helper):  # (auto: the first call of an epoch is 1 step)
                    with (
                        contextlib.suppress(KeyboardInterrupt),  # a held one stops the next call
                        ctrl_c_at_check(
                            k if (epoch, i) == (0, 1) else -1, sinkax.Sink.__call__
                        ) as checks,
                    ):
                        state, metrics = net(state)
                        trained += len(metrics["loss"])
            position = helper.data_state()
        assert int(state.step) == trained == 4 * position["epoch"] + position["step"]
        assert_trees_close(state, reference(batches, trained)[0], rtol=1e-6)
        if next(checks) <= k:
            break


@pytest.fixture
def backend_compiles():
    """The XLA compilations that happen while the test runs."""
    compiles = []

    def count(event, *_, **__):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    yield compiles
    jax.monitoring.unregister_event_duration_listener(count)


@pytest.mark.parametrize("sink_mode", [True, False])
def test_a_second_run_of_the_same_step_compiles_nothing(backend_compiles, sink_mode):
    model = new_model(sink_options={"strategy": "scan"})
    model.train(1, blobs(4), dataset_sink_mode=sink_mode)
    model.eval(blobs(2, seed=1), dataset_sink_mode=sink_mode)
    backend_compiles.clear()
    model.train(2, blobs(4), dataset_sink_mode=sink_mode, initial_epoch=1)
    model.eval(blobs(2, seed=1), dataset_sink_mode=sink_mode)
    assert backend_compiles == []


class _NaNOnce:
    """12 batches a pass; the ``at``-th batch read (from 0) is not finite: a transient fault."""

    def __init__(self, at=5):
        self.data, self.at, self.read = blobs(12), at, 0

    def __len__(self):
        return 12

    def __iter__(self):
        for batch in self.data:
            self.read += 1
            bad = self.read - 1 == self.at
            yield {**batch, "image": batch["image"] * np.nan} if bad else batch


@pytest.mark.parametrize("at", [5, 12], ids=["mid-pass", "a-pass-start"])
@pytest.mark.parametrize(
    ("options", "steps", "ended"),
    [
        ({"sink_size": -1}, 36, [(1, 12), (2, 12), (3, 12)]),  # epochs run on past the stop
        ({"sink_size": "auto"}, 36, [(1, 12), (2, 12), (3, 12)]),
        ({"dataset_sink_mode": False}, 36, [(1, 12), (2, 12), (3, 12)]),
        ({"sink_size": 4}, 9, [(1, 4), (3, 4)]),  # an epoch is a call: one of 4-7 ends at 5
    ],
    ids=["-1", "auto", "non-sink", "4"],
)
def test_training_goes_on_past_a_stop_with_every_epoch_and_no_batch_lost(options, steps, ended, at):
    stop = {"sink_options": {"strategy": "scan", "stop_if_nonfinite": "loss"}}
    epochs, data = _Epochs(), _NaNOnce(at)  # no TerminateOnNaN: training goes on after the stop
    run = new_model(**stop).train(3, data, epochs, **options)
    if at == 12 and options.get("sink_size") == 4:  # the stop keeps nothing: that call again
        steps, ended = 12, [(1, 4), (2, 4), (3, 4)]
    assert run.step == steps and epochs.ended == ended  # the batch, read again, was finite


class _NaNAlways(_NaNOnce):
    """The 6th batch of every pass is not finite: training cannot go past it."""

    def __iter__(self):
        for i, batch in enumerate(self.data):
            yield {**batch, "image": batch["image"] * np.nan} if i == 5 else batch


@pytest.mark.parametrize(
    "options",
    [
        {"sink_size": -1},
        {"sink_size": "auto"},
        {"dataset_sink_mode": False},
        {"sink_size": 4},  # an epoch is a call: the retry is the next epoch's first call
    ],
    ids=["-1", "auto", "non-sink", "4"],
)
def test_a_batch_not_finite_on_its_retry_ends_training_naming_it(options):
    stop = {"sink_options": {"strategy": "scan", "stop_if_nonfinite": "loss"}}
    epochs, model = _Epochs(), new_model(**stop)
    with pytest.raises(FloatingPointError, match=r"data epoch 0, step 5 was not finite, and again"):
        model.train(3, _NaNAlways(), epochs, **options)
    assert int(model.state.step) == 5  # the 5 steps before it, the params from before it
    assert epochs.ended == ([(1, 4)] if options.get("sink_size") == 4 else [])


@pytest.mark.parametrize("sink_mode", [True, False])
def test_training_reads_nothing_past_its_last_epoch(sink_mode):
    reads = []

    class Counted:  # a loader that logs what it yields
        def __len__(self):
            return 4

        def __iter__(self):
            for i, batch in enumerate(blobs(4)):
                reads.append(i)
                yield batch

    new_model().train(2, Counted(), dataset_sink_mode=sink_mode)
    assert reads == [0, 1, 2, 3] * 2  # two epochs: not a batch more (non-sink read 128 more)


def test_a_checkpoint_after_a_stop_resumes_as_the_run_went_on(tmp_path):
    stop = {"sink_options": {"strategy": "scan", "stop_if_nonfinite": "loss"}}
    epochs = _Epochs()  # sink_size 4: epoch 2 (batches 4-7) ends at 5
    run = new_model(**stop).train(3, _NaNOnce(), epochs, sink_size=4)
    assert run.step == 9 and epochs.ended == [(1, 4), (3, 4)]
    saved = ModelCheckpoint(tmp_path)
    new_model(**stop).train(3, _NaNOnce(), [saved, _SaveAndStopAt(saved, 5)], sink_size=4)
    assert new_model().restore(tmp_path)["epoch"] == 2  # its one call ran: done
    epochs = _Epochs()
    run = new_model(**stop).train(3, _NaNOnce(at=None), epochs, sink_size=4, resume_from=tmp_path)
    assert run.step == 9 and epochs.ended == [(3, 4)]


@pytest.mark.parametrize("sink_size", [4, -1])
def test_a_helper_loop_that_retries_an_epoch_after_a_stop_runs_every_epoch(sink_size):
    class NaNOnceAt4:  # batch 4, the first of the second call of 4, is not finite once
        reads = 0

        def __len__(self):
            return 12

        def __iter__(self):
            for i in range(12):
                self.reads += i == 4
                yield np.float32(np.nan if i == 4 and self.reads == 1 else i)

    step = lambda total, x: (total + x, {"loss": x})  # noqa: E731
    with DatasetHelper(
        NaNOnceAt4(), sink_size=sink_size, epoch_num=3, stop_if_nonfinite="loss"
    ) as h:
        net, state, seen, epochs = connect_network_with_dataset(step, h), np.float32(0), [], 0
        while epochs < 3:
            for _ in h:
                state, outs = net(state)
                seen += np.asarray(outs["loss"]).astype(int).tolist()
            epochs += net.nonfinite is None  # a stop at once: the loop runs the epoch again
    per_epoch = 4 if sink_size == 4 else 12
    assert seen == [i % 12 for i in range(3 * per_epoch)]


def test_a_helper_epoch_a_stop_cut_short_reads_nothing_past_the_last_epoch():
    class NaNOnceAt5:  # 12 batches, batch 5 not finite the first time; every read recorded
        def __init__(self):
            self.read = []

        def __len__(self):
            return 12

        def __iter__(self):
            for i in range(12):
                self.read.append(i)
                yield np.float32(np.nan if i == 5 and self.read.count(5) == 1 else i)

    step = lambda total, x: (total + x, {"loss": x})  # noqa: E731
    data, seen = NaNOnceAt5(), []
    options = {"epoch_num": 3, "stop_if_nonfinite": "loss", "prefetch": 8}
    with DatasetHelper(data, sink_size=4, **options) as helper:
        net, state = connect_network_with_dataset(step, helper), np.float32(0)
        for _ in range(3):  # epochs go on past the stop: epoch 2 (batches 4-7) ends at 5
            for _ in helper:
                state, outs = net(state)
                seen.append(np.asarray(outs["loss"]).astype(int).tolist())
    assert seen == [[0, 1, 2, 3], [4], [5, 6, 7, 8]]
    assert data.read[data.read.index(5, 6) :] == [5, 6, 7, 8]  # the replay reads up to batch 8


@pytest.mark.parametrize("sink_size", ["auto", -1, 2])
def test_a_helper_resumed_onto_a_shorter_dataset_says_so(sink_size):
    with DatasetHelper(blobs(10), sink_size=sink_size, epoch_num=1) as helper:
        net = connect_network_with_dataset(lambda b: b["label"], helper)
        for _ in helper:
            net()
        saved = {**helper.data_state(), "step": 9, "source": {"epoch": 0, "step": 9}}
    with pytest.raises(ValueError, match="another epoch length"):
        helper = DatasetHelper(blobs(4), sink_size=sink_size, epoch_num=2, data_state=saved)
        connect_network_with_dataset(lambda b: b["label"], helper)


@pytest.mark.parametrize(
    "options", [{"sink_size": -1}, {"sink_size": "auto"}, {"dataset_sink_mode": False}]
)
def test_a_helper_of_whole_passes_needs_a_sized_dataset(options):
    class Unsized:
        def __iter__(self):
            yield from blobs(3)

    with pytest.raises(ValueError, match=r"runs whole passes.*known length.*Unsized has no len"):
        DatasetHelper(Unsized(), epoch_num=2, **options)


def test_helper_misuse_is_explained():
    step = make_train_step(linear, cross_entropy, OPTIMIZER)
    helper = DatasetHelper(blobs(2), epoch_num=1)
    with pytest.raises(RuntimeError, match="connect_network_with_dataset"):
        list(helper)
    net = connect_network_with_dataset(step, helper)
    with pytest.raises(RuntimeError, match="already feeds a network"):
        connect_network_with_dataset(step, helper)
    state = TrainState.create(init_params(), OPTIMIZER)
    for _ in helper:
        state, _ = net(state)
    with pytest.raises(sinkax.SinkClosedError, match="epoch_num=1"):
        list(helper)
    host = DatasetHelper(blobs(2), dataset_sink_mode=False)
    host_net = connect_network_with_dataset(step, host)
    with pytest.raises(RuntimeError, match="once per item"):
        host_net(state)


@pytest.mark.parametrize(
    "mode",
    [{}, {"dataset_sink_mode": False}, {"sink_size": "auto"}],
    ids=["sink", "non-sink", "auto"],
)
def test_a_ctrl_c_after_an_epochs_last_step_still_counts_the_epoch(mode):
    data = [{"i": np.int32(i)} for i in range(4)]
    with DatasetHelper(data, epoch_num=3, **mode) as helper:
        net = connect_network_with_dataset(lambda s, b: (s + 1, b["i"]), helper)
        state, seen, interrupted = jnp.int32(0), [], False
        while True:  # a loop that carries on after a Ctrl-C, until the helper has run out
            try:
                for _ in helper:
                    state, outs = net(state)
                    seen += np.asarray(outs).tolist()
                    if len(seen) == 8 and not interrupted:  # epoch 2's last step has run
                        interrupted = True
                        raise KeyboardInterrupt  # ... before the helper counted the epoch
            except KeyboardInterrupt:
                continue
            except sinkax.SinkClosedError:
                break
    assert seen == [0, 1, 2, 3] * 3  # 3 epochs, not 4
    assert int(state) == 12 and helper.data_state()["epoch"] == 3


def test_eval_step_in_a_stateless_sink():
    model = new_model()
    model.train(2, blobs(10))
    eval_step = make_eval_step(linear, cross_entropy)
    with sinkax.data_sink(lambda b: eval_step(model.params, b), blobs(5, seed=1), -1) as sink:
        metrics = sink()
    assert float(metrics["accuracy"].mean()) == pytest.approx(
        model.eval(blobs(5, seed=1))["accuracy"]
    )


# -- errors users meet -----------------------------------------------------------------------
def test_a_non_scalar_loss_is_explained():
    model = Model(linear, init_params(), optax.softmax_cross_entropy_with_integer_labels, OPTIMIZER)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar, got shape \(16,\).*mean"):
        model.train(1, blobs(2))


def test_an_optimizer_state_of_other_params_is_explained():
    other = OPTIMIZER.init({"w": jnp.zeros((3, 2)), "b": jnp.zeros((2,))})
    with pytest.raises(ValueError, match=r"does not match the params.*optimizer.init\(params\)"):
        new_model(opt_state=other)
    step = make_train_step(linear, cross_entropy, OPTIMIZER)
    with pytest.raises(ValueError, match="does not match the params"):
        step(TrainState(jnp.int32(0), init_params(), other), blobs(1)[0])


def test_a_ragged_last_batch_surfaces_the_sink_error_unchanged():
    data = blobs(3)
    ragged = [*data[:2], {"image": data[2]["image"][:5], "label": data[2]["label"][:5]}]
    model = new_model()
    with pytest.raises(sinkax.BatchSpecError, match=r"\(16, 2\).*\(5, 2\).*drop_remainder"):
        model.train(2, ragged)
    jax.block_until_ready(model.state)  # still valid
    assert int(model.state.step) == 0


@pytest.mark.parametrize(
    ("epoch", "initial_epoch", "match"),
    [(0, 0, "epoch must be an int >= 1"), (-1, 0, ">= 1"), (2.5, 0, ">= 1"), (2, 2, "exceed")],
)
def test_bad_epoch_counts(epoch, initial_epoch, match):
    with pytest.raises(ValueError, match=match):
        new_model().train(epoch, blobs(2), initial_epoch=initial_epoch)


# -- NaN -------------------------------------------------------------------------------------
def test_terminate_on_nan_stops_at_the_nonfinite_step_with_the_state_before_it():
    data = blobs(10)
    poisoned = [
        *data[:5],
        {"image": data[5]["image"] * np.nan, "label": data[5]["label"]},
        *data[6:],
    ]
    stop, recorder = TerminateOnNaN(), Recorder()
    model = Model(linear, init_params(), cross_entropy, OPTIMIZER, **SCAN)
    run = model.train(5, poisoned, callbacks=[stop, recorder], sink_size=4)
    assert stop.stopped_at == (2, 2) and run.stop_requested  # step 6 is the second sink's 2nd
    assert (stop.batch.epoch, stop.batch.step) == (0, 5)  # its data position: batch 5
    assert run.data_state()["step"] == 5  # a resume reads that batch next
    assert run.step == 5 and recorder.count("epoch_begin") == 2
    assert recorder.count("epoch_end") == 1  # the epoch cut short does not end
    assert recorder.events[-2:] == [("step_end", 2, 1, 1), ("train_end", 2, 5)]
    kept, _ = reference(data[:5], 5)  # the NaN step's update was not kept
    assert_trees_close(model.state.params, kept.params, rtol=1e-5, atol=1e-6)


def test_terminate_on_nan_names_the_first_nonfinite_step_and_only_this_runs():
    data = blobs(10)
    poisoned = [*data[:5], *({"image": b["image"] * np.nan, "label": b["label"]} for b in data[5:])]
    stop = TerminateOnNaN()
    unguarded = new_model(sink_options={"strategy": "scan", "stop_if_nonfinite": False})
    unguarded.train(3, poisoned, callbacks=stop, sink_size=4)  # steps 5-8 ran: 6 is the first
    assert stop.stopped_at == (2, 2) and stop.batch is None
    new_model(**SCAN).train(1, data, callbacks=stop)  # the same callback, a run without NaN
    assert stop.stopped_at is None and stop.batch is None


def test_the_progress_bar_counts_the_steps_kept_after_a_stop():
    data = blobs(10)
    poisoned = [*data[:5], {"image": data[5]["image"] * np.nan, "label": data[5]["label"]}]
    bar = ProgressBar(every=1, file=io.StringIO())  # the device reports every step it computes
    run = new_model(**SCAN).train(2, poisoned + data[6:], [TerminateOnNaN(), bar], sink_size=8)
    assert run.step == 5 and bar.bar.n == 5  # not 8: the stop discarded steps 6-8


def test_without_a_sink_too_the_nan_step_is_not_kept():
    data = blobs(10)
    poisoned = [*data[:1], {"image": data[1]["image"] * np.nan, "label": data[1]["label"]}]
    stop = TerminateOnNaN()
    model = new_model(**SCAN)
    run = model.train(3, [*poisoned, *data[2:]], callbacks=stop, dataset_sink_mode=False)
    assert stop.stopped_at == (1, 2) and (stop.batch.epoch, stop.batch.step) == (0, 1)
    assert run.data_state()["step"] == 1  # a resume reads that batch next
    kept, _ = reference(data[:1], 1)  # one step of one batch: the NaN step's update not kept
    assert_trees_close(model.state.params, kept.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("terminate", [True, False], ids=["terminate-on-nan", "train-on"])
def test_a_run_with_nan_keeps_its_last_good_checkpoint(tmp_path, terminate):
    data = blobs(4)
    poisoned = [{"image": b["image"] * np.nan, "label": b["label"]} for b in data]
    epochs = iter([data, data, *[poisoned] * 8])  # NaN from epoch 3 on, also when read again

    class ThirdEpochNaN:
        def __len__(self):
            return len(data)

        def __iter__(self):
            return iter(next(epochs))

    # TerminateOnNaN stops epoch 3 at its first step (no epoch end, nothing saved); training on,
    # the epochs' NaN ends must not be saved (nor delete 8)
    checkpoint = ModelCheckpoint(tmp_path, keep_last=1)
    callbacks = [TerminateOnNaN(), checkpoint] if terminate else [checkpoint]
    warns = pytest.warns(RuntimeWarning, match="not finite")
    with contextlib.nullcontext() if terminate else warns:
        run = new_model().train(6, ThirdEpochNaN(), callbacks)
    assert run.stop_requested == terminate and run.epoch == (3 if terminate else 6)
    assert sorted(os.listdir(tmp_path)) == ["8"]  # epoch 2's, not a NaN state
    restored = new_model()
    assert restored.restore(tmp_path)["epoch"] == 2
    assert np.all(np.isfinite(restored.params["w"]))


# -- checkpoints and resume ------------------------------------------------------------------
def test_resume_continues_with_exactly_the_next_batch(tmp_path):
    dataset = shuffled_blobs(10)  # reshuffled each epoch; sink_size 3 ends mid-epoch
    uninterrupted = new_model(**SCAN)
    uninterrupted.train(4, dataset, sink_size=3)
    first = new_model(**SCAN)
    first.train(2, dataset, callbacks=ModelCheckpoint(tmp_path, keep_last=2), sink_size=3)
    resumed, history = new_model(**SCAN), History()
    run = resumed.train(4, dataset, callbacks=history, sink_size=3, resume_from=tmp_path)
    assert run.initial_epoch == 2 and run.step == 12 and len(history.losses) == 6
    assert_trees_equal(resumed.state, uninterrupted.state)


class _SaveAndStopAt(Callback):
    """Saves with ``checkpoint`` (its "save now") once ``step`` steps ran, and stops there."""

    def __init__(self, checkpoint, step):
        self.checkpoint, self.step = checkpoint, step

    def on_step_end(self, run):
        if run.step >= self.step:
            self.checkpoint.save(run)
            run.request_stop()


class _Epochs(Callback):
    def __init__(self):
        self.ended = []

    def on_epoch_end(self, run):
        self.ended.append((run.epoch, run.step_in_epoch))


@pytest.mark.parametrize(
    ("options", "save_at", "completed"),
    [
        ({"sink_size": "auto", "call_seconds": 1e6}, 1, 0),  # calls of 1 and 9 steps, then 10
        ({"dataset_sink_mode": False}, 17, 1),  # a call a step
    ],
    ids=["auto", "non-sink"],
)
def test_a_checkpoint_saved_within_an_epoch_resumes_that_epoch(
    tmp_path, options, save_at, completed
):
    dataset = shuffled_blobs(10)
    uninterrupted = new_model(**SCAN)
    uninterrupted.train(3, dataset, **options)
    checkpoint = ModelCheckpoint(tmp_path)
    new_model(**SCAN).train(
        3, dataset, [checkpoint, _SaveAndStopAt(checkpoint, save_at)], **options
    )
    meta = new_model().restore(tmp_path)
    assert (meta["step"], meta["epoch"], meta["step_in_epoch"]) == (
        save_at,
        completed,
        save_at % 10,
    )
    resumed, epochs = new_model(**SCAN), _Epochs()
    run = resumed.train(3, dataset, epochs, resume_from=tmp_path, **options)
    assert run.initial_epoch == completed and run.step == 30
    assert epochs.ended == [(epoch, 10) for epoch in range(completed + 1, 4)]
    assert_trees_equal(resumed.state, uninterrupted.state)


def test_a_checkpoint_within_an_epoch_resumed_with_a_fixed_size_runs_that_epochs_call(tmp_path):
    checkpoint = ModelCheckpoint(tmp_path)  # within epoch 1 of a non-sink run, at step 3
    new_model().train(
        2, blobs(10), [checkpoint, _SaveAndStopAt(checkpoint, 3)], dataset_sink_mode=False
    )
    epochs = _Epochs()
    run = new_model().train(3, blobs(10), epochs, sink_size=4, resume_from=tmp_path)
    assert run.step == 3 + 3 * 4 and epochs.ended == [(1, 7), (2, 4), (3, 4)]


class _SaveAtBeginAndStop(Callback):
    def __init__(self, checkpoint):
        self.checkpoint = checkpoint

    def on_train_begin(self, run):
        self.checkpoint.save(run)
        run.request_stop()


def test_a_save_as_a_run_resumed_within_an_epoch_begins_records_where_it_resumed(tmp_path):
    uninterrupted = new_model()
    uninterrupted.train(3, blobs(10), dataset_sink_mode=False)
    first = ModelCheckpoint(tmp_path / "first")  # at step 13: epoch 1 and 3 steps of epoch 2
    new_model().train(3, blobs(10), [first, _SaveAndStopAt(first, 13)], dataset_sink_mode=False)
    again = ModelCheckpoint(tmp_path / "again")
    new_model().train(
        3, blobs(10), _SaveAtBeginAndStop(again), dataset_sink_mode=False, resume_from=first
    )
    meta = new_model().restore(tmp_path / "again")
    assert (meta["step"], meta["epoch"], meta["step_in_epoch"]) == (13, 1, 3)
    resumed = new_model()
    run = resumed.train(3, blobs(10), dataset_sink_mode=False, resume_from=tmp_path / "again")
    assert run.step == 30
    assert_trees_equal(resumed.state, uninterrupted.state)


def test_the_progress_hooks_error_in_the_last_call_comes_when_training_ends(tmp_path):
    told = []

    def hook(steps, out):  # fails in the run's last call (each call reports once, at its end)
        told.append(steps)
        if len(told) == 2:
            raise ValueError("hook bug")

    model, epochs = new_model(sink_options={"strategy": "loop", "progress": hook}), _Epochs()
    checkpoint = ModelCheckpoint(tmp_path)
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match=r"ValueError.*hook bug"):
        model.train(2, blobs(4), [epochs, checkpoint])  # no call after the last to raise it
    assert int(model.state.step) == 8 and epochs.ended == [(1, 4), (2, 4)]  # the run completed
    assert checkpoint.latest_step() == 8  # and saved its end before the error came


def test_a_save_at_an_epochs_end_is_not_saved_again(tmp_path):
    checkpoint = ModelCheckpoint(tmp_path)
    run = new_model().train(2, blobs(4), [checkpoint, _SaveAndStopAt(checkpoint, 4)], sink_size=2)
    assert run.step == 4 and checkpoint.latest_step() == 4  # then on_epoch_end at the same step
    resumed = new_model().train(3, blobs(4), checkpoint, sink_size=2, resume_from=tmp_path)
    assert resumed.step == 6 and checkpoint.latest_step() == 6


def test_resume_continues_with_the_strategy_auto_chose(tmp_path, monkeypatch):
    monkeypatch.setattr(sinkax.execution.auto, "TRIAL_S", 0.0)  # a window a trial: 3 at most
    checkpoint = ModelCheckpoint(tmp_path, keep_last=1)
    first = new_model(sink_options={}).train(3, blobs(4), callbacks=checkpoint, sink_size=3)
    chosen = first.sink_stats.strategy
    meta = new_model().restore(tmp_path)
    assert meta["data_state"]["strategy"] == chosen
    other = {"scan": "loop", "loop": "scan"}[chosen]
    monkeypatch.setenv("SINKAX_STRATEGY", other)  # the recorded choice wins over this
    resumed = new_model(sink_options={}).train(5, blobs(4), sink_size=3, resume_from=tmp_path)
    assert resumed.sink_stats.strategy == chosen and resumed.sink_stats.strategy_timings == {}


class _CtrlCInEpoch(Callback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_step_end(self, run):
        if run.epoch == self.epoch:
            raise KeyboardInterrupt


def test_auto_sizes_resume_at_the_saved_size_with_exactly_the_next_batch(tmp_path):
    dataset = shuffled_blobs(10)  # reshuffled each epoch
    auto = {"sink_size": "auto", "call_seconds": 1e6}  # a measured call's target: 8x, to 10
    uninterrupted = new_model(**SCAN)
    whole = uninterrupted.train(4, dataset, **auto).sink_stats.call_sizes
    with pytest.raises(KeyboardInterrupt):  # after epoch 3's first call: epoch 2 was saved last
        new_model(**SCAN).train(4, dataset, [ModelCheckpoint(tmp_path), _CtrlCInEpoch(3)], **auto)
    saved = new_model().restore(tmp_path)["data_state"]["call_steps"]
    resumed = new_model(**SCAN)
    run = resumed.train(4, dataset, resume_from=tmp_path, **auto)
    sizes = run.sink_stats.call_sizes
    assert saved > 1 and sizes[0] == saved  # not 1 again: the calls the uninterrupted run made
    assert sizes == whole[-len(sizes) :]
    assert run.initial_epoch == 2 and run.step == 40
    assert_trees_equal(resumed.state, uninterrupted.state)  # every call a window of 1 step


def test_resume_in_a_fresh_process(tmp_path):
    dataset = shuffled_blobs(10)
    uninterrupted = new_model(**SCAN)
    uninterrupted.train(5, dataset, sink_size=4)
    checkpoint = ModelCheckpoint(tmp_path / "ckpt", save_every_epochs=3)
    new_model(**SCAN).train(3, dataset, callbacks=checkpoint, sink_size=4)
    script = textwrap.dedent(
        f"""
        import numpy as np, jax
        from test_model import new_model, shuffled_blobs, SCAN
        model = new_model(**SCAN)
        resume = {str(tmp_path / "ckpt")!r}
        run = model.train(5, shuffled_blobs(10), sink_size=4, resume_from=resume)
        leaves = jax.tree.leaves(model.state)
        np.savez({str(tmp_path / "final.npz")!r}, *leaves)
        print(run.initial_epoch, run.step)
        """
    )
    path = [str(ROOT / "tests"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}  # keep where grain was put, say
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3", "20"]
    saved = np.load(tmp_path / "final.npz")
    for i, leaf in enumerate(jax.tree.leaves(uninterrupted.state)):
        np.testing.assert_array_equal(saved[f"arr_{i}"], leaf)


def test_a_save_by_a_checkpointer_outside_the_callbacks_is_written_before_the_process_exits(
    tmp_path,
):
    # a "keep the best" callback with its own ModelCheckpoint: no run's end waits for its saves
    script = textwrap.dedent(
        f"""
        from sinkax.train import Callback, ModelCheckpoint
        from test_model import blobs, new_model
        best = ModelCheckpoint({str(tmp_path / "best")!r}, keep_last=1)

        class SaveEveryEpoch(Callback):
            def on_epoch_end(self, run):
                best.save(run)

        new_model().train(3, blobs(4), SaveEveryEpoch())
        """
    )  # ... and the process exits at once after its last save
    path = [str(ROOT / "tests"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path / "best")) == ["12"]  # written whole, none half-done
    assert ModelCheckpoint(tmp_path / "best").latest_step() == 12


def test_resume_in_non_sink_mode_and_restore_metadata(tmp_path):
    dataset = shuffled_blobs(6)
    uninterrupted = new_model()
    uninterrupted.train(3, dataset, dataset_sink_mode=False)
    new_model().train(1, dataset, callbacks=ModelCheckpoint(tmp_path), dataset_sink_mode=False)
    resumed = new_model()
    meta = resumed.restore(tmp_path)
    assert meta["epoch"] == 1 and meta["step"] == 6
    assert json.loads(json.dumps(meta["data_state"])) == meta["data_state"]
    resumed.train(3, dataset, dataset_sink_mode=False, resume_from=tmp_path)
    assert_trees_equal(resumed.state, uninterrupted.state)


def test_resuming_a_different_model_is_refused_before_restoring(tmp_path):
    new_model().train(1, blobs(2), callbacks=ModelCheckpoint(tmp_path))
    bigger = Model(linear, {"w": jnp.zeros((2, 3)), "b": jnp.zeros((3,))}, cross_entropy, OPTIMIZER)
    before = jax.device_get(bigger.state)
    with pytest.raises(ValueError, match=r"different model.*\['w'\].*\(2, 2\).*\(2, 3\)"):
        bigger.train(2, blobs(2), resume_from=tmp_path)
    assert_trees_equal(bigger.state, before)
    adam = Model(linear, init_params(), cross_entropy, optax.adam(1e-3))
    with pytest.raises(ValueError, match="different model"):
        adam.restore(tmp_path)


def test_a_resume_that_fails_its_checks_leaves_the_model_as_it_was(tmp_path):
    new_model().train(4, shuffled_blobs(2), callbacks=ModelCheckpoint(tmp_path / "a"))
    new_model().train(6, blobs(2), callbacks=ModelCheckpoint(tmp_path / "b"))  # further on
    model = new_model()
    before = jax.device_get(model.state)
    with pytest.raises(ValueError, match="initial_epoch=4"):  # the epochs
        model.train(3, shuffled_blobs(2), resume_from=tmp_path / "a")
    with pytest.raises(ValueError, match="does not fit the dataset"):  # the data position
        model.train(6, blobs(2), resume_from=tmp_path / "a")
    with pytest.raises(ValueError, match="does not fit the dataset"):  # ... in non-sink mode
        model.train(6, blobs(2), dataset_sink_mode=False, resume_from=tmp_path / "a")
    with pytest.raises(ValueError, match="another run"):  # a callback's on_train_begin
        model.train(
            6, shuffled_blobs(2), [ModelCheckpoint(tmp_path / "b")], resume_from=tmp_path / "a"
        )
    assert_trees_equal(model.state, before)


@pytest.mark.parametrize("options", [{"sink_size": 1}, SCAN, {"dataset_sink_mode": False}])
def test_training_leaves_the_callers_arrays_alone(options):
    params = init_params()
    sink_options = options.get("sink_options", {"strategy": "loop"})
    model = Model(linear, params, cross_entropy, OPTIMIZER, sink_options=sink_options)
    before = model.params
    train_options = {k: v for k, v in options.items() if k != "sink_options"}
    model.train(2, blobs(3), **train_options)
    assert_trees_equal(params, init_params())  # neither deleted nor changed
    assert_trees_equal(before, init_params())
    assert not jnp.allclose(model.params["w"], 0.0)


class _FailsInEpoch:
    """``batches`` per epoch; raises OSError at the start of epoch ``fail``."""

    def __init__(self, batches, fail):
        self.batches, self.fail, self.epoch = batches, fail, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.epoch += 1
        if self.epoch == self.fail:
            raise OSError("disk gone")
        return iter(self.batches)


def test_a_failed_run_keeps_its_last_checkpoint_and_leaves_no_thread(tmp_path):
    checkpoint, before = ModelCheckpoint(tmp_path), producer_threads()
    evaluate = EvalCallback(blobs(2), verbose=False)
    with pytest.raises(OSError, match="disk gone"):
        new_model().train(5, _FailsInEpoch(blobs(3), fail=3), [checkpoint, evaluate])
    # at once: the write of epoch 2 has finished, and the sinks are closed -- their producers
    # have closed their sources (a thread may take a moment more to end; earlier tests' are
    # not this run's)
    assert sorted(os.listdir(tmp_path)) == ["3", "6"]
    assert producers_left(before) == []
    assert set(evaluate.results) == {1, 2}


def test_an_unsized_dataset_cannot_be_evaluated_and_says_what_can(tmp_path):
    for sink_mode in (True, False):
        with pytest.raises(ValueError, match=r"one pass.*no len\(\).*sized dataset"):
            new_model().eval(iter(blobs(2)), dataset_sink_mode=sink_mode)


def test_a_checkpoint_directory_that_cannot_be_made_fails_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    history = History()
    with pytest.raises(ValueError, match="cannot write to"):
        new_model().train(2, blobs(2), [history, ModelCheckpoint(tmp_path / "file" / "ckpt")])
    assert history.losses.size == 0


def test_auto_sink_size_needs_a_sized_dataset_and_call_seconds_needs_auto():
    with pytest.raises(ValueError, match=r"sink_size='auto'.*no len\(\).*sized dataset"):
        new_model().train(1, iter(blobs(2)), sink_size="auto")
    with pytest.raises(ValueError, match=r"call_seconds.*sink_size='auto'.*got sink_size=4"):
        new_model().train(1, blobs(2), sink_size=4, call_seconds=2.0)
    with pytest.raises(ValueError, match="call_seconds must be"):
        new_model().train(1, blobs(2), sink_size="auto", call_seconds=0)
    with pytest.raises(ValueError, match=r"sink_size must be .*'auto'"):
        new_model().train(1, blobs(2), sink_size="Auto")
    with pytest.warns(UserWarning, match="sink_size is ignored when dataset_sink_mode=False"):
        run = new_model().train(1, blobs(2), dataset_sink_mode=False, sink_size="auto",
                                call_seconds=2.0)  # fmt: skip
    assert run.step == len(blobs(2))  # one pass, a step a batch: nothing sized it


def test_resume_needs_a_checkpoint_and_no_initial_epoch(tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
        new_model().train(2, blobs(2), resume_from=tmp_path / "empty")
    with pytest.raises(ValueError, match="not both"):
        new_model().train(2, blobs(2), initial_epoch=1, resume_from=tmp_path)
    with pytest.raises(TypeError, match="checkpoint directory is a path"):
        new_model().train(2, blobs(2), resume_from=5)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Model(linear, init_params(), optimizer=optax.sgd), TypeError, r"optax.sgd\(0.1\)"),
        (lambda: new_model(sink_options={"sink_size": 2}), ValueError, "may not set.*sink_size"),
        (lambda: new_model().train(1, blobs(2), callbacks=[History]), TypeError, r"History\(\), n"),
        (lambda: new_model().train(1, blobs(2), callbacks=[print]), TypeError, "subclass sinkax"),
        (lambda: new_model().train(1, blobs(2), callbacks="abc"), TypeError, "got 'abc': sub"),
        (lambda: new_model(metrics={"loss": lambda o, y: o.mean()}), ValueError, "are taken"),
        (lambda: new_model(metrics=None), TypeError, "names or a"),
    ],
    ids=[
        "uncalled-optimizer",
        "sink-size-option",
        "callback-class",
        "callback-function",
        "callback-string",
        "metric-called-loss",
        "no-metrics",
    ],
)
def test_model_mistakes_are_named(make, error, match):
    with pytest.raises(error, match=match):
        make()
