"""Callbacks: what they print, what they receive, when they run."""

import io
import os
import re
import warnings

import numpy as np
import pytest
from conftest import threads_but_copiers
from test_model import (
    Recorder,
    _SaveAndStopAt,
    blobs,
    init_params,
    linear,
    new_model,
    shuffled_blobs,
)

from sinkax.train import (
    Callback,
    EvalCallback,
    History,
    LossMonitor,
    Model,
    ModelCheckpoint,
    ProgressBar,
    TimeMonitor,
    cross_entropy,
)

LOSS_LINE = re.compile(r"^epoch: \d+ step: \d+, loss is [-0-9.e]+$")
TIME_LINE = re.compile(r"^epoch time: \d+\.\d{3} ms, per step time: \d+\.\d{3} ms$")


def lines(capsys):
    return capsys.readouterr().out.splitlines()


def test_loss_monitor_prints_the_reference_format_once_per_sink(capsys):
    history = History()
    new_model().train(3, blobs(10), callbacks=[LossMonitor(), history], sink_size=4)
    out = lines(capsys)
    assert all(LOSS_LINE.match(line) for line in out), out
    assert [line.split(",")[0] for line in out] == [f"epoch: {e} step: 4" for e in (1, 2, 3)]
    last_losses = history.losses[3::4]
    assert [line.split("loss is ")[1] for line in out] == [repr(float(x)) for x in last_losses]


def test_loss_monitor_in_non_sink_mode_prints_every_per_print_times_steps(capsys):
    new_model().train(2, blobs(5), LossMonitor(per_print_times=2), dataset_sink_mode=False)
    out = lines(capsys)
    assert all(LOSS_LINE.match(line) for line in out), out
    steps = [line.split(",")[0] for line in out]  # global steps 2, 4, 6, 8, 10
    assert steps == [
        "epoch: 1 step: 2",
        "epoch: 1 step: 4",
        "epoch: 2 step: 1",
        "epoch: 2 step: 3",
        "epoch: 2 step: 5",
    ]


def test_loss_monitor_validates_its_argument():
    with pytest.raises(ValueError, match="per_print_times"):
        LossMonitor(-1)


def test_time_monitor_prints_epoch_and_step_times(capsys):
    monitor = TimeMonitor()
    new_model().train(2, blobs(5), callbacks=monitor)
    out = lines(capsys)
    assert len(out) == 2 and all(TIME_LINE.match(line) for line in out), out
    assert len(monitor.epoch_times) == 2 and min(monitor.epoch_times) > 0


@pytest.mark.parametrize(
    ("sink_mode", "sink_size", "expected"),
    [(True, -1, [10, 10]), (True, 7, [7, 7]), (True, 25, [25, 25]), (False, -1, [1] * 20)],
)
def test_callbacks_receive_every_step_loss_of_each_sink(sink_mode, sink_size, expected):
    recorder, history = Recorder(), History()
    run = new_model().train(
        2, blobs(10), [recorder, history], dataset_sink_mode=sink_mode, sink_size=sink_size
    )
    assert [e[3] for e in recorder.events if e[0] == "step_end"] == expected
    assert history.losses.shape == (sum(expected),) and run.step == sum(expected)
    assert np.all(np.isfinite(history.losses)) and history.losses[-1] < history.losses[0]


def test_a_stop_request_in_non_sink_mode_ends_the_epoch_early():
    class StopAtStep3(Callback):
        def on_step_end(self, run):
            if run.step == 3:
                run.request_stop()

    recorder = Recorder()
    run = new_model().train(2, blobs(5), [StopAtStep3(), recorder], dataset_sink_mode=False)
    assert run.step == 3 and recorder.count("epoch_end") == 0  # an unfinished epoch
    assert recorder.events[-1] == ("train_end", 1, 3)


def test_eval_callback_runs_every_n_epochs(capsys):
    evaluate = EvalCallback(blobs(4, seed=1), every_epochs=2)
    new_model().train(4, blobs(10), callbacks=evaluate)
    assert sorted(evaluate.results) == [2, 4]
    assert evaluate.results[4]["accuracy"] > 0.9
    out = lines(capsys)
    assert len(out) == 2 and re.match(
        r"^epoch: 2 eval: loss is [0-9.]+, accuracy is [0-9.]+$", out[0]
    )


def test_progress_bar_advances_by_the_steps_of_each_sink():
    stream = io.StringIO()
    bar = ProgressBar(file=stream)
    new_model().train(3, blobs(10), callbacks=bar, sink_size=4)
    assert bar.bar.total == 12 and bar.bar.n == 12
    assert "12/12" in stream.getvalue()


def test_progress_bar_without_a_sink_counts_each_step_once():
    bar = ProgressBar(file=io.StringIO())
    new_model().train(2, blobs(5), callbacks=bar, dataset_sink_mode=False)
    assert bar.bar.total == 10 and bar.bar.n == 10


def test_a_run_resumed_within_an_epoch_counts_only_its_own_steps(tmp_path, capsys):
    saved = ModelCheckpoint(tmp_path)
    new_model().train(3, shuffled_blobs(10), [saved, _SaveAndStopAt(saved, 5)], False)
    capsys.readouterr()
    bar, monitor = ProgressBar(file=io.StringIO()), TimeMonitor()
    run = new_model().train(3, shuffled_blobs(10), [bar, monitor], False, resume_from=tmp_path)
    assert run.step == 30 and bar.bar.total == bar.bar.n == 25  # 5 of epoch 1, then 2 whole
    first = lines(capsys)[0]  # epoch 1: its 5 steps of this run, not 10
    epoch_ms, step_ms = map(float, re.findall(r"(\d+\.\d+) ms", first))
    assert step_ms == pytest.approx(epoch_ms / 5, abs=1e-3), first


def test_mindspore_hook_names_warn_that_sinkax_never_calls_them():
    with pytest.warns(
        UserWarning, match=r"Ported.on_train_epoch_end is MindSpore's name .* on_epoch_end"
    ):

        class Ported(Callback):
            def on_train_epoch_end(self, run_context):
                pass

    with pytest.warns(UserWarning, match=r"Legacy.step_begin is MindSpore's hook before each step"):

        class Legacy(Callback):
            def step_begin(self, run_context):
                pass

    with pytest.warns(UserWarning, match=r"Loose.step_end is MindSpore's name .* on_step_end"):

        class Loose(Callback):
            def step_end(self, *args):
                pass

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # names of its own: a field, an alias, a helper

        class Window(Callback):
            begin, end = 0, 100

            def on_epoch_end(self, run):
                pass

            epoch_end = on_epoch_end

            def step_end(self):
                return self.end

        class Inherited(Window):
            end = Callback.on_train_end  # an alias of an inherited hook


def test_model_checkpoint_keeps_the_last_n_every_m_epochs(tmp_path):
    checkpoint = ModelCheckpoint(tmp_path, keep_last=2, save_every_epochs=2)
    new_model().train(6, shuffled_blobs(3), callbacks=checkpoint)  # saves at epochs 2, 4, 6
    assert sorted(int(name) for name in os.listdir(tmp_path) if name.isdigit()) == [12, 18]
    assert checkpoint.latest_step() == 18


def test_model_checkpoint_saves_the_last_epoch_at_the_end(tmp_path):
    checkpoint = ModelCheckpoint(tmp_path, save_every_epochs=2)
    new_model().train(5, shuffled_blobs(3), callbacks=checkpoint)  # saves at epochs 2, 4, 5
    assert sorted(int(name) for name in os.listdir(tmp_path) if name.isdigit()) == [6, 12, 15]
    resumed = new_model()
    assert resumed.restore(tmp_path)["epoch"] == 5


def test_model_checkpoint_refuses_to_mix_runs(tmp_path):
    new_model().train(2, blobs(3), callbacks=ModelCheckpoint(tmp_path))
    with pytest.raises(ValueError, match=r"another run.*resume_from"):
        new_model().train(2, blobs(3), callbacks=ModelCheckpoint(tmp_path))


def test_model_checkpoint_sees_what_another_run_saved_since_it_last_looked(tmp_path):
    checkpoint = ModelCheckpoint(tmp_path)
    assert checkpoint.latest_step() is None
    new_model().train(2, blobs(3), callbacks=ModelCheckpoint(tmp_path))  # another run: 3, 6
    assert checkpoint.latest_step() == 6
    with pytest.raises(ValueError, match=r"up to step 6.*another run"):
        new_model().train(2, blobs(3, seed=1), callbacks=checkpoint)
    assert sorted(int(name) for name in os.listdir(tmp_path) if name.isdigit()) == [3, 6]


def test_looking_at_the_latest_step_during_a_run_sees_its_saves_and_keeps_keep_last(tmp_path):
    checkpoint, seen = ModelCheckpoint(tmp_path, keep_last=2), []

    class Looks(Callback):
        def on_epoch_end(self, run):  # after the checkpoint's own: its save may be in flight
            seen.append((run.step, checkpoint.latest_step()))

    new_model().train(4, blobs(3), callbacks=[checkpoint, Looks()])
    assert seen == [(3, 3), (6, 6), (9, 9), (12, 12)]
    assert sorted(int(name) for name in os.listdir(tmp_path) if name.isdigit()) == [9, 12]


def test_a_save_asked_for_by_a_callback_keeps_a_non_finite_state_out_too(tmp_path):
    checkpoint = ModelCheckpoint(tmp_path, keep_last=1)

    class SaveEveryStep(Callback):
        def on_step_end(self, run):
            checkpoint.save(run)

    data = blobs(4)
    data[2] = {"image": data[2]["image"] * np.nan, "label": data[2]["label"]}
    with pytest.warns(RuntimeWarning, match="did not save step 3 .* not finite"):
        new_model().train(1, data, [checkpoint, SaveEveryStep()], dataset_sink_mode=False)
    assert sorted(os.listdir(tmp_path)) == ["2"]  # the last finite state, kept


def test_a_directory_of_other_orbax_checkpoints_is_named_as_such(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(5, args=ocp.args.StandardSave({"w": np.zeros(2)}))
    with pytest.raises(ValueError, match=r"step 5\) holds no checkpoint of sinkax's ModelCheck"):
        new_model().restore(tmp_path)
    with pytest.raises(ValueError, match=r"step 5\) holds no checkpoint of sinkax's ModelCheck"):
        new_model().train(1, blobs(2), [ModelCheckpoint(tmp_path)])  # not: "resume from them"


def test_an_eval_only_model_restores_a_training_checkpoints_params(tmp_path):
    trained = new_model()
    trained.train(1, blobs(4), callbacks=ModelCheckpoint(tmp_path))
    evaluating = Model(linear, init_params(), cross_entropy)  # no optimizer
    assert evaluating.restore(tmp_path)["step"] == 4
    assert evaluating.state.opt_state is None and int(evaluating.state.step) == 4
    np.testing.assert_array_equal(evaluating.params["w"], trained.params["w"])
    assert evaluating.eval(blobs(4)) == trained.eval(blobs(4))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's read-only /proc")
def test_model_checkpoint_refuses_an_existing_unwritable_directory_before_training():
    # /proc/self exists and no one, root included, can create files in it
    started = []

    class Started(Recorder):
        def on_epoch_begin(self, run):
            started.append(run.epoch)

    before = threads_but_copiers()
    with pytest.raises(ValueError, match="ModelCheckpoint cannot write to /proc/self"):
        new_model().train(2, blobs(3), callbacks=[Started(), ModelCheckpoint("/proc/self")])
    assert started == []
    assert threads_but_copiers() <= before  # no producer or orbax thread left behind
