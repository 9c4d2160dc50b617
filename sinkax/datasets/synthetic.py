"""Synthetic batch datasets: MNIST-shaped noise, and index-carrying records for delivery checks."""

from __future__ import annotations

import functools

import grain
import numpy as np

from sinkax.datasets.transforms import LENET_SIZE, index_batches


def _noise_batch(index: int, *, batch_size: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, index])
    return {
        "image": rng.standard_normal((batch_size, *LENET_SIZE, 1), dtype=np.float32),
        "label": rng.integers(0, 10, batch_size, dtype=np.int32),
    }


def synthetic_mnist(num_batches: int, batch_size: int = 32, seed: int = 0) -> grain.MapDataset:
    """``num_batches`` random batches laid out like :func:`lenet_mnist`'s output.

    ``{"image": float32 (B, 32, 32, 1) standard normal, "label": int32 (B,) in [0, 10)}``;
    batch ``i`` depends only on ``(seed, i)``, so the dataset is deterministic and
    random-access. Use it to time training without the data pipeline.

    >>> ds = synthetic_mnist(3, batch_size=4)
    >>> len(ds), ds[2]["image"].shape, ds[2]["label"].dtype
    (3, (4, 32, 32, 1), dtype('int32'))
    """
    make = functools.partial(_noise_batch, batch_size=batch_size, seed=seed)
    return grain.MapDataset.range(num_batches).map(make)


def _indexed_batch(indices: np.ndarray, *, feature_shape: tuple[int, ...]) -> dict:
    index = np.asarray(indices, np.int32)
    x = np.multiply.outer(index.astype(np.float32), np.ones(feature_shape, np.float32))
    return {"index": index, "x": x}


def indexed(
    num_samples: int,
    batch_size: int,
    feature_shape: tuple[int, ...] = (4,),
    seed: int | None = None,
) -> grain.MapDataset:
    """Batches of samples ``0 .. num_samples - 1`` that carry their own index.

    Each batch is ``{"index": int32 (B,), "x": float32 (B, *feature_shape)}`` with every
    entry of ``x[j]`` equal to ``index[j]`` (exact below 2**24), so a training step can
    e.g. sum the indices it saw. With ``seed`` the samples are shuffled (a fresh
    permutation per epoch under ``.repeat()``). Batches drop the remainder: ``len()`` is
    ``num_samples // batch_size`` and each epoch delivers that many distinct samples.

    >>> ds = indexed(6, batch_size=3)
    >>> ds[1]["index"].tolist(), ds[1]["x"][:, 0].tolist()
    ([3, 4, 5], [3.0, 4.0, 5.0])
    """
    batch = functools.partial(_indexed_batch, feature_shape=tuple(feature_shape))
    return index_batches(num_samples, batch_size, seed).map(batch)
