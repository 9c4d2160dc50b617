"""The data position: one typed value, read back from the dicts ``Sink.data_state()`` gives."""

import json
import re

import grain
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import collect_index, indexed_map_dataset

import sinkax
from sinkax.channel.position import DataPosition

SIX = [{"index": np.array([i], np.int32)} for i in range(6)]


def seen(outs) -> list[int]:
    return np.asarray(outs).ravel().tolist()


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("step", -1, r"an int >= 0"),
        ("step", True, r"an int >= 0"),
        ("step", 6, r"below its epoch_length, 6"),
        ("epoch", "1", r"an int >= 0"),
        ("epoch", 1.0, r"an int >= 0"),
        ("epoch_length", 0, r"an int >= 1"),
        ("source", [0, 1], r"a dict"),
        ("source", None, r"a dict"),
        ("epoch", None, r"an int >= 0"),
        ("strategy", "fast", r"one of \('scan', 'loop'\)"),
        ("call_steps", 0, r"an int >= 1"),
        ("call_steps", 2.5, r"an int >= 1"),
        ("call_granule", 0, r"a power of two"),
        ("call_granule", 3, r"a power of two"),
    ],
)
def test_a_bad_field_is_refused_by_name_with_what_it_may_be(field, value, allowed):
    with sinkax.data_sink(collect_index, SIX, 2) as sink:
        sink(jnp.int32(0))
        saved = sink.data_state()
        bad = {**saved, field: value}
        match = rf"data_state\['{field}'\] must be {allowed}.*got {re.escape(repr(value))}\."
        with pytest.raises(ValueError, match=match):
            sinkax.data_sink(collect_index, SIX, 2, data_state=bad)
        with pytest.raises(ValueError, match=match):
            sink.restore_data_state(bad)
        assert sink.data_state() == saved  # refused before anything moved
        assert seen(sink(jnp.int32(0))[1]) == [2, 3]


@pytest.mark.parametrize("dataset", [SIX, indexed_map_dataset(12, 2, seed=None)])
def test_a_position_its_source_state_disagrees_with_is_refused_as_edited(dataset):
    with sinkax.data_sink(collect_index, dataset, 2) as reference:
        reference(jnp.int32(0))
        expected = seen(reference(jnp.int32(0))[1])  # the second call's batches
    with sinkax.data_sink(collect_index, dataset, 2) as sink:
        sink(jnp.int32(0))
        saved = sink.data_state()
        edited = {**saved, "step": 4}  # the source's own state still says step 2
        match = r"is at epoch 0, step 4, but its 'source' is at epoch 0, step 2: it was edited"
        with pytest.raises(ValueError, match=match):
            sink.restore_data_state(edited)
        mixed = {**saved, "epoch": 2, "step": 0}  # another epoch, the length it was saved at
        match = r"is at epoch 2, step 0, but its 'source' is at epoch 0, step 2: it was edited"
        with pytest.raises(ValueError, match=match):
            sink.restore_data_state(mixed)
        assert sink.data_state() == saved
        assert seen(sink(jnp.int32(0))[1]) == expected


def test_missing_and_unknown_keys_are_named():
    with pytest.raises(ValueError, match=r"a dict with 'epoch', 'step' and 'source'"):
        DataPosition.from_dict({"epoch": 0, "step": 0})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['epoch_lenght'\]"):
        DataPosition.from_dict({"epoch": 0, "step": 0, "source": {}, "epoch_lenght": 4})


def test_a_position_survives_json_and_older_dicts_still_load():
    with sinkax.data_sink(collect_index, indexed_map_dataset(24, 4, seed=None), 4) as sink:
        sink(jnp.int32(0))
        position = sink.position
        saved = json.loads(json.dumps(sink.data_state()))
    assert DataPosition.from_dict(saved) == position
    # "strategy" too if "auto" reused a choice made for collect_index by an earlier sink
    assert position.strategy == saved.pop("strategy", None)
    assert saved.pop("source").keys() == {"next_index", "first_batch"}  # within an epoch
    assert saved == {"epoch": 0, "step": 4, "epoch_length": 6}
    older = {"epoch": 0, "step": 4, "source": {"next_index": 4}}  # saved before both
    assert DataPosition.from_dict(older).epoch_length is None
    for start in (older, position):
        with sinkax.data_sink(collect_index, indexed_map_dataset(24, 4, seed=None), 2) as sink:
            sink.restore_data_state(start)
            assert seen(sink(jnp.int32(0))[1]) == list(range(16, 24))


def test_a_grain_dataset_resumed_within_an_epoch_with_another_seed_is_refused():
    with sinkax.data_sink(collect_index, indexed_map_dataset(24, 4, seed=1), 4) as sink:
        sink(jnp.int32(0))
        within = sink.data_state()  # epoch 0, step 4 of 6
        sink(jnp.int32(0))
        at_end = sink.data_state()  # epoch 1, step 2: its first batch read too
        expected = seen(sink(jnp.int32(0))[1])
    with sinkax.data_sink(collect_index, indexed_map_dataset(24, 4, seed=1), 4) as same:
        same.restore_data_state(at_end)
        assert seen(same(jnp.int32(0))[1]) == expected  # the same seed: exact
    match = r"This epoch \(0\) of the dataset begins with another batch than the saved run's"
    with pytest.raises(ValueError, match=match):
        sinkax.data_sink(collect_index, indexed_map_dataset(24, 4, seed=2), 4, data_state=within)
    edge = {**within, "step": 0, "source": {"next_index": 6}, "epoch": 1}  # an epoch's start
    with sinkax.data_sink(collect_index, indexed_map_dataset(24, 4, seed=2), 4, data_state=edge):
        pass  # a new epoch in another order repeats and skips nothing: allowed


def test_a_grain_dataset_that_draws_without_a_seed_resumes_within_an_epoch():
    noisy = grain.MapDataset.range(24).batch(4).map(lambda ids: {"x": ids + np.random.rand(4)})
    with sinkax.data_sink(lambda b: b["x"], noisy, 2) as sink:
        sink()
        within = sink.data_state()  # its first batch will not read alike again: not refused
    with sinkax.data_sink(lambda b: b["x"], noisy, 2, data_state=within) as resumed:
        assert np.floor(resumed()).tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]
        assert "first_batch" in resumed.data_state()["source"]


def test_a_grain_iterator_state_with_tuples_survives_json():
    # a packing iterator keeps tuples in its state, which JSON alone makes lists of
    from grain.experimental import ConcatThenSplitIterDataset

    def packed():
        rows = grain.MapDataset.range(40).map(lambda i: {"i": np.full((3,), i, np.int32)})
        return ConcatThenSplitIterDataset(rows.to_iter_dataset(), length_struct={"i": 4})

    step = lambda batch: batch["i"]  # noqa: E731
    for steps in (1, 2):  # the first packed batch ends inside an element: a remainder kept
        with sinkax.data_sink(step, packed(), steps) as sink:
            sink()
            saved = json.loads(json.dumps(sink.data_state()))
            expected = sink().tolist()
        with sinkax.data_sink(step, packed(), steps, data_state=saved) as resumed:
            assert resumed().tolist() == expected


def test_a_saved_dict_is_a_copy():
    with sinkax.data_sink(collect_index, SIX, 2) as sink:
        sink(jnp.int32(0))
        saved = sink.data_state()
        saved["source"]["step"] = 5
        assert sink.data_state()["source"]["step"] == 2
