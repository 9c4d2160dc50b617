"""Metric writers shared by data_sink loops and Model.train, read back from the event files;
jax.profiler traces of chosen calls."""

from __future__ import annotations

import glob
import os
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sinkax
from sinkax.train import (
    ConsoleWriter,
    History,
    HistoryWriter,
    MetricsLogger,
    Model,
    MultiWriter,
    Profile,
    TensorBoardWriter,
    TraceCalls,
    cross_entropy,
    write_steps,
)

tensorboardx = pytest.importorskip("tensorboardX")
from tensorboardX.crc32c import crc32c  # noqa: E402
from tensorboardX.proto import event_pb2  # noqa: E402


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TFRecord event files of ``logdir``, checksums verified."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        data = Path(path).read_bytes()
        offset = 0
        while offset < len(data):
            header = data[offset : offset + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[offset + 8 : offset + 12])[0] == masked_crc(header)
            record = data[offset + 12 : offset + 12 + length]
            (crc,) = struct.unpack("<I", data[offset + 12 + length : offset + 16 + length])
            assert crc == masked_crc(record)
            offset += 16 + length
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def count_step(state, batch):
    return state + 1, {"loss": batch["x"].sum(), "extra": {"twice": 2 * batch["x"].sum()}}


def test_a_data_sink_loop_writes_every_step_to_tensorboard_console_and_history(tmp_path, capsys):
    data = [{"x": np.full(2, i, np.float32)} for i in range(6)]
    history = HistoryWriter()
    with (
        MultiWriter([TensorBoardWriter(tmp_path), ConsoleWriter(every=4), history]) as writer,
        sinkax.data_sink(count_step, data, sink_size=4) as sink,
    ):
        state = jnp.int32(0)
        for _ in range(2):
            before = int(state)
            state, outs = sink(state)
            write_steps(writer, before, outs)
    expected_loss = [2.0 * (i % 6) for i in range(8)]
    scalars = read_scalars(str(tmp_path))
    assert scalars["loss"] == list(zip(range(1, 9), expected_loss, strict=True))
    assert [v for _, v in scalars["extra/twice"]] == [2 * v for v in expected_loss]
    assert history.scalars["loss"] == expected_loss and history.steps["loss"] == list(range(1, 9))
    assert capsys.readouterr().out.splitlines() == [
        "step: 4, extra/twice is 12, loss is 6",  # names in pytree order
        "step: 8, extra/twice is 4, loss is 2",
    ]


def test_model_train_logs_the_same_losses_as_history(tmp_path):
    x = np.random.default_rng(0).normal(size=(48, 3)).astype(np.float32)
    data = [{"image": x[i : i + 8], "label": (x[i : i + 8, 0] > 0).astype(np.int32)}
            for i in range(0, 48, 8)]  # fmt: skip
    model = Model(lambda p, x: x @ p, jnp.zeros((3, 2)), cross_entropy, optax.sgd(0.1))
    history = History()
    model.train(2, data, [MetricsLogger(TensorBoardWriter(tmp_path)), history], sink_size=4)
    scalars = read_scalars(str(tmp_path))
    assert [step for step, _ in scalars["loss"]] == list(range(1, 9))
    np.testing.assert_allclose([v for _, v in scalars["loss"]], history.losses, rtol=1e-6)
    assert [v for _, v in scalars["finite"]] == [1.0] * 8


def traced(logdir: str) -> list[str]:
    return glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))


def test_trace_calls_traces_only_the_chosen_calls(tmp_path):
    data = [{"x": np.ones(2, np.float32)}] * 4
    trace = TraceCalls(tmp_path / "trace", first=2, count=2)
    with sinkax.data_sink(count_step, data, sink_size=2) as sink:
        state = jnp.int32(0)
        for call in range(5):
            with trace:
                state, _ = sink(state)
            assert trace.active == (call in (2,)), call  # started at 2, stopped after 3
    assert len(traced(str(tmp_path / "trace"))) == 1
    with pytest.raises(ValueError, match="count >= 1"):
        TraceCalls(tmp_path, count=0)


def test_profile_callback_traces_a_model_run(tmp_path):
    data = [{"image": np.ones((4, 3), np.float32), "label": np.zeros(4, np.int32)}] * 3
    model = Model(lambda p, x: x @ p, jnp.zeros((3, 2)), cross_entropy, optax.sgd(0.1))
    profile = Profile(tmp_path, first=1, count=1)
    model.train(3, data, [profile])
    assert not profile.trace.active and len(traced(str(tmp_path))) == 1
