"""``sinkax train`` end to end on the bundled MNIST sample."""

import os
import re
import subprocess
import sys

import pytest

from sinkax.backend import available
from sinkax.cli import main
from sinkax.train import ProgressBar

LOSS_LINE = re.compile(r"^epoch: \d+ step: \d+, loss is [-0-9.e]+$")
TIME_LINE = re.compile(r"^epoch time: \d+\.\d{3} ms, per step time: \d+\.\d{3} ms$")
pytestmark = pytest.mark.usefixtures("restore_context")  # main() sets the process's device


@pytest.mark.parametrize(
    "mode", [["--sink-size", "20", "--epochs", "2"], ["--no-sink", "--batch-size", "100"]]
)
def test_train_prints_losses_times_and_accuracy(capsys, mode):
    pytest.importorskip("mlxtend")
    assert main(["train", "--epochs", "1", *mode]) == 0
    out = capsys.readouterr().out.splitlines()
    losses = [line for line in out if LOSS_LINE.match(line)]
    times = [line for line in out if TIME_LINE.match(line)]
    if mode[0] == "--sink-size":  # one line per sink: epoch: 1 step: 20, epoch: 2 step: 20
        assert [line.split(",")[0] for line in losses] == ["epoch: 1 step: 20", "epoch: 2 step: 20"]
    else:  # one line per step
        assert len(losses) == 40 and losses[-1].startswith("epoch: 1 step: 40,")
    assert len(times) == (2 if mode[0] == "--sink-size" else 1)
    assert re.search(r"^test accuracy: 0\.\d{4} on 1000 images$", "\n".join(out), re.M)
    strategy = r"(scan|loop|auto \(measuring\))" if mode[0] == "--sink-size" else r"none"
    summary = rf"^sinkax train: accuracy 0\.\d{{4}}, wall time [\d.]+ s, sink strategy {strategy}"
    assert re.match(summary, out[-1]), out[-1]


def test_train_with_auto_sink_sizes_runs_each_epoch_in_several_calls(capsys):
    pytest.importorskip("mlxtend")
    command = ["train", "--epochs", "1", "--batch-size", "100", "--sink-size", "auto"]
    assert main([*command, "--call-seconds", "0.05"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "1 epochs of 40 steps, sink_size=auto (calls of about 0.05 s)" in out[0]
    losses = [line.split(",")[0] for line in out if LOSS_LINE.match(line)]
    assert len(losses) > 1 and losses[-1] == "epoch: 1 step: 40"  # a line a call, the first 1 step
    assert len([line for line in out if TIME_LINE.match(line)]) == 1  # an epoch is a pass


def test_train_shows_progress_from_inside_each_sink(capsys, monkeypatch):
    pytest.importorskip("mlxtend")
    advanced = []
    monkeypatch.setattr(ProgressBar, "_advance", lambda self, n, out: advanced.append(n))
    monkeypatch.setenv("SINKAX_STRATEGY", "scan")  # "loop" would report per sink
    assert main(["train", "--epochs", "1", "--sink-size", "25", "--progress", "10"]) == 0
    assert sorted(advanced) == [5, 10, 10]  # two blocks of 10, the 5 steps left


def test_python_dash_m_and_bad_options():
    help_text = subprocess.run(
        [sys.executable, "-m", "sinkax", "train", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for option in ("--epochs", "--batch-size", "--sink-size", "--no-sink", "--device", "--seed"):
        assert option in help_text
    assert "--lr" in help_text and "--momentum" in help_text and "--data-dir" in help_text
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    bads = (["--epochs", "0"], ["--sink-size", "many"], ["--call-seconds", "1"])
    numbers = (["--lr", "nan"], ["--lr", "-0.1"], ["--momentum", "1"], ["--call-seconds", "0"])
    seeds = (["--seed", "-1"], ["--seed", str(2**63)])  # jax.random.key takes an int64
    unsized = (["--no-sink", "--sink-size", "4"], ["--no-sink", "--sink-size", "auto"])
    sizes = (["--sink-size", "0"], ["--sink-size", "-2"])  # refused before anything is built
    for bad in (*bads, *numbers, *seeds, *unsized, *sizes, ["--batch-size", "0"]):
        with pytest.raises(SystemExit) as exit_info:  # before anything is built
            main(["train", *bad])
        assert exit_info.value.code == 2


def test_sinkax_pjrt_selects_the_emulated_device_for_the_cli_and_model():
    code = (
        "import sinkax, numpy as np, optax, jax.numpy as jnp\n"
        "from sinkax.train import Model\n"
        "print(repr(sinkax.backend.default_device()), repr(sinkax.backend.resolve_device()))\n"
        "loss = lambda y, b: jnp.mean(y)\n"
        "model = Model(lambda p, x: x @ p, jnp.ones((3, 2)), loss, optax.sgd(0.1))\n"
        "data = [(np.ones((4, 3), np.float32), np.zeros(4, np.int32))] * 2\n"
        "run = model.train(1, data, sink_size=-1)\n"
        "print(run.sink_stats.interactions.launches > 0)\n"
    )
    env = {**os.environ, "SINKAX_PJRT": "counting"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["EmuDevice(id=0)", "EmuDevice(id=0)", "True"]
    help_text = subprocess.run(
        [sys.executable, "-m", "sinkax", "train", "--help"], capture_output=True, text=True
    ).stdout
    assert "Emulated" in help_text and "SINKAX_PJRT" in help_text


def test_an_unavailable_device_is_a_clean_error(capsys):
    if "GPU" in available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--device", "GPU", "--epochs", "1"])
    assert exit_info.value.code == 2
    assert re.search(r"error: device_target='GPU' is not available.*CPU", capsys.readouterr().err)


@pytest.mark.slow
def test_the_default_run_reaches_95_percent(capsys):
    """The README's main job with its defaults (~20 s): the held-out accuracy target."""
    pytest.importorskip("mlxtend")
    assert main(["train"]) == 0
    accuracy = re.search(r"^test accuracy: (0\.\d{4})", capsys.readouterr().out, re.M)
    assert accuracy and float(accuracy.group(1)) >= 0.95


@pytest.mark.slow
def test_train_splits_batches_over_forced_devices():
    pytest.importorskip("mlxtend")
    command = ["train", "--devices", "2", "--epochs", "1", "--sink-size", "5"]
    result = subprocess.run(
        [sys.executable, "-m", "sinkax", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on 2 devices in 1 process(es), batch split" in result.stdout
    assert re.search(r"^epoch: 1 step: 5, loss is [0-9.]+$", result.stdout, re.M)


def test_help_gives_each_default_once():
    from sinkax.cli import build_parser

    (train,) = build_parser()._subparsers._group_actions[0].choices.values()
    text = " ".join(train.format_help().split())
    assert "(default: None)" not in text  # an option without one says what happens instead
    assert "(default: 15)" in text  # --epochs
    assert "should last (default 1) --no-sink" in text  # its own words, not twice
