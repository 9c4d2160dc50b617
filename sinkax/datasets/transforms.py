"""Batch-level grain transformations: shuffled index batches, gathering, and MindSpore's
LeNet5/MNIST reference preprocessing, vectorised over a batch.

MindSpore's model-zoo pipeline maps every image through::

    Resize((32, 32), Inter.LINEAR) -> Rescale(1/255, 0) -> Rescale(1/0.3081, -0.1307/0.3081)
    -> HWC2CHW

and casts labels to int32. Here the same maths runs on whole batches (resize is two small
matrix products, ``Ry @ images @ Rx.T``) and the layout stays channels-last
(B, 32, 32, 1), the JAX/Flax convention, where MindSpore ends with ``HWC2CHW``.

One deliberate difference: OpenCV resizes uint8 images in fixed point and rounds the
result back to uint8; here the resized values stay float32 (within about half a grey
level of OpenCV's).

Shuffling happens on sample indices, one whole batch per lookup (:func:`index_batches`),
and records are then gathered with one fancy index per batch (:class:`Gather`). grain's
per-record route (``MapDataset.shuffle`` -> ``batch``) costs tens of microseconds of Python
per record (an ``index_shuffle`` call, stats bookkeeping, a dict per record, ``np.stack``):
about 1 ms per batch of 32, which held a LeNet5 pipeline to ~900 batches/s on this 2-core
machine, under the 1,350 needed (see ``benchmarks/pipeline.py``).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping
from typing import Any

import grain
import jax
import numpy as np

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
LENET_SIZE = (32, 32)


@functools.lru_cache(maxsize=8)
def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The (read-only, cached) int32 permutation of ``range(num_samples)`` for one epoch.

    Drawn with numpy's PCG64 seeded by ``[seed, epoch]``: fixed per seed, new each epoch.

    >>> sorted(epoch_permutation(5, seed=0, epoch=1).tolist())
    [0, 1, 2, 3, 4]
    """
    permutation = np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int32)
    permutation.flags.writeable = False
    return permutation


class _IndexBatches(grain.MapDataset):
    """Batch ``i`` of epoch ``i // len(self)``: int32 sample indices (batch_size,), the last
    one shorter when the remainder is kept."""

    def __init__(
        self, num_samples: int, batch_size: int, seed: int | None, drop_remainder: bool = True
    ) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("num_samples", num_samples)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        if batch_size > num_samples:
            raise ValueError(f"batch_size {batch_size} is larger than the {num_samples} samples.")
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0
        ):
            raise ValueError(f"seed must be an int >= 0 or None (no shuffling), got {seed!r}.")
        self._num_samples = num_samples
        self._batch_size = batch_size
        self._seed = seed
        self._drop_remainder = drop_remainder

    def __len__(self) -> int:
        if self._drop_remainder:
            return self._num_samples // self._batch_size
        return -(-self._num_samples // self._batch_size)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        epoch, position = divmod(index, len(self))
        start = position * self._batch_size
        if self._seed is None:
            stop = min(start + self._batch_size, self._num_samples)
            return np.arange(start, stop, dtype=np.int32)
        permutation = epoch_permutation(self._num_samples, self._seed, epoch)
        return permutation[start : start + self._batch_size].copy()

    def __str__(self) -> str:
        return (
            f"IndexBatches(num_samples={self._num_samples}, batch_size={self._batch_size}, "
            f"seed={self._seed}, drop_remainder={self._drop_remainder})"
        )


def index_batches(
    num_samples: int, batch_size: int, seed: int | None = None, *, drop_remainder: bool = True
) -> grain.MapDataset:
    """MapDataset of int32 sample-index batches (batch_size,), remainder dropped.

    ``len()`` is ``num_samples // batch_size``; with ``drop_remainder=False`` the last batch
    holds the remaining indices (fewer than ``batch_size``: pad it with :class:`PadBatch`) and
    ``len()`` rounds up. Without ``seed`` batches run in order;
    with it, each epoch is a fresh permutation (:func:`epoch_permutation`): index ``i``
    of ``ds.repeat(None)`` reads epoch ``i // len(ds)``. This is ``MapDataset.shuffle``
    followed by ``batch(drop_remainder=True)``, at one lookup per batch.

    >>> ds = index_batches(6, batch_size=2)
    >>> len(ds), ds[1].tolist(), ds[4].tolist()
    (3, [2, 3], [2, 3])
    >>> shuffled = index_batches(6, batch_size=3, seed=0).repeat(None)
    >>> sorted(shuffled[2].tolist() + shuffled[3].tolist())
    [0, 1, 2, 3, 4, 5]
    >>> ragged = index_batches(5, batch_size=2, drop_remainder=False)
    >>> len(ragged), ragged[2].tolist()
    (3, [4])
    """
    return _IndexBatches(num_samples, batch_size, seed, drop_remainder)


class Gather(grain.transforms.Map):
    """grain ``Map`` from an index batch to ``{name: array[indices]}`` for each array.

    >>> Gather({"label": np.array([5, 6, 7])}).map(np.array([2, 0]))
    {'label': array([7, 5])}
    """

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = dict(arrays)

    def map(self, element: np.ndarray) -> dict[str, np.ndarray]:
        return {name: array[element] for name, array in self.arrays.items()}

    def __repr__(self) -> str:
        return f"Gather({', '.join(f'{k}: {v.shape}' for k, v in self.arrays.items())})"


def pad_batch(batch: Mapping[str, Any], batch_size: int, mask_key: str = "mask") -> dict[str, Any]:
    """``batch`` with every leaf padded with zero rows to ``batch_size``, and a bool
    ``mask_key`` entry, ``True`` for the real rows: a ragged last batch in the shape of the
    others, so a sink evaluates it (the eval step weights its metrics by the mask).

    >>> out = pad_batch({"x": np.array([1.0, 2.0]), "y": np.array([[1], [2]])}, 3)
    >>> out["x"].tolist(), out["y"].tolist(), out["mask"].tolist()
    ([1.0, 2.0, 0.0], [[1], [2], [0]], [True, True, False])
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"pad_batch adds a {mask_key!r} entry, so a batch must be a mapping, got "
            f"{type(batch).__name__}: give the dataset dict batches, e.g. "
            '{"image": x, "label": y}.'
        )
    if mask_key in batch:
        raise ValueError(
            f"The batch already has a {mask_key!r} entry; name the padding mask another way "
            "with mask_key=... (and pass the same name to make_eval_step)."
        )
    rows = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(batch)}
    if len(rows) != 1 or None in rows or rows.pop() > batch_size:
        shapes = jax.tree.map(np.shape, dict(batch))
        raise ValueError(
            f"pad_batch pads batches of at most batch_size={batch_size} rows whose leaves all "
            f"have the same leading axis; got leaf shapes {shapes}. Batch first, then pad."
        )
    padded = jax.tree.map(lambda leaf: _pad_rows(np.asarray(leaf), batch_size), dict(batch))
    size = np.shape(jax.tree.leaves(batch)[0])[0]
    return {**padded, mask_key: np.arange(batch_size) < size}


def _pad_rows(leaf: np.ndarray, rows: int) -> np.ndarray:
    if len(leaf) == rows:
        return leaf
    return np.concatenate([leaf, np.zeros((rows - len(leaf), *leaf.shape[1:]), leaf.dtype)])


class PadBatch(grain.transforms.Map):
    """grain ``Map`` applying :func:`pad_batch`: put it after ``batch(..., drop_remainder=False)``
    so evaluation and prediction see every example in batches of one shape.

    >>> PadBatch(4).map({"x": np.ones(3)})["mask"].tolist()
    [True, True, True, False]
    """

    def __init__(self, batch_size: int, mask_key: str = "mask") -> None:
        self.batch_size = batch_size
        self.mask_key = mask_key

    def map(self, element: Mapping[str, Any]) -> dict[str, Any]:
        return pad_batch(element, self.batch_size, self.mask_key)

    def __repr__(self) -> str:
        return f"PadBatch({self.batch_size}, mask_key={self.mask_key!r})"


@functools.cache
def resize_matrix(src: int, dst: int) -> np.ndarray:
    """The (dst, src) float32 matrix of 1-D bilinear resampling with half-pixel centres.

    Output pixel ``i`` samples source coordinate ``(i + 0.5) * src / dst - 0.5``, clamped
    to the edge pixels, as OpenCV's ``INTER_LINEAR`` (MindSpore ``Inter.LINEAR``) does.
    Each row sums to 1. The returned array is cached and read-only.

    >>> resize_matrix(2, 4).tolist()
    [[1.0, 0.0], [0.75, 0.25], [0.25, 0.75], [0.0, 1.0]]
    """
    coord = (np.arange(dst) + 0.5) * (src / dst) - 0.5
    left = np.floor(coord).astype(np.int64)
    frac = coord - left
    frac[left < 0] = 0.0
    left[left < 0] = 0
    frac[left >= src - 1] = 0.0
    left[left >= src - 1] = src - 1
    matrix = np.zeros((dst, src), np.float64)
    rows = np.arange(dst)
    matrix[rows, left] += 1.0 - frac
    matrix[rows, np.minimum(left + 1, src - 1)] += frac
    matrix = matrix.astype(np.float32)
    matrix.flags.writeable = False
    return matrix


def resize_bilinear(images: np.ndarray, size: tuple[int, int] = LENET_SIZE) -> np.ndarray:
    """Bilinearly resize (..., H, W) images to (..., *size) float32, OpenCV ``INTER_LINEAR`` style.

    >>> resize_bilinear(np.full((28, 28), 7, np.uint8)).shape
    (32, 32)
    >>> resize_bilinear(np.array([[0, 4], [8, 12]], np.uint8), (4, 4))[1].tolist()
    [2.0, 3.0, 5.0, 6.0]
    """
    height, width = images.shape[-2:]
    rows = resize_matrix(height, size[0])
    cols = resize_matrix(width, size[1])
    return rows @ images.astype(np.float32) @ cols.T


def rescale(x: np.ndarray, scale: float, shift: float = 0.0) -> np.ndarray:
    """``x * scale + shift`` in float32, as MindSpore's ``Rescale(scale, shift)``.

    >>> rescale(np.array([0, 255], np.uint8), 1 / 255).tolist()
    [0.0, 1.0]
    """
    return np.asarray(x, np.float32) * np.float32(scale) + np.float32(shift)


def normalize(x: np.ndarray, mean: float = MNIST_MEAN, std: float = MNIST_STD) -> np.ndarray:
    """``(x - mean) / std`` in float32; defaults are MNIST's pixel statistics.

    >>> print(normalize(np.array([0.0, 1.0])).round(4))
    [-0.4242  2.8215]
    """
    return rescale(x, 1.0 / std, -mean / std)


class LeNetPreprocess(grain.transforms.Map):
    """grain ``Map`` from raw MNIST to LeNet5 input, for a batch or a single record.

    ``{"image": uint8 (..., 28, 28), "label": int (...)}`` becomes
    ``{"image": float32 (..., 32, 32, 1), "label": int32 (...)}``: bilinear resize,
    rescale by 1/255, normalise with MNIST's mean/std, add a trailing channel axis.
    Apply it after ``batch`` so the work is a few array operations per batch.

    >>> batch = {"image": np.zeros((2, 28, 28), np.uint8), "label": np.array([1, 2])}
    >>> out = LeNetPreprocess().map(batch)
    >>> out["image"].shape, out["image"].dtype, out["label"].dtype
    ((2, 32, 32, 1), dtype('float32'), dtype('int32'))
    """

    def __init__(
        self, size: tuple[int, int] = LENET_SIZE, mean: float = MNIST_MEAN, std: float = MNIST_STD
    ) -> None:
        self.size = size
        self.mean = mean
        self.std = std

    def map(self, element: dict[str, Any]) -> dict[str, np.ndarray]:
        pixels = rescale(resize_bilinear(element["image"], self.size), 1 / 255)
        image = normalize(pixels, self.mean, self.std)[..., np.newaxis]
        return {"image": image, "label": np.asarray(element["label"], np.int32)}

    def __repr__(self) -> str:
        return f"LeNetPreprocess(size={self.size}, mean={self.mean}, std={self.std})"
