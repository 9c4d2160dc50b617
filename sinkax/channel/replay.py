"""Whether a dataset read again gives the batches a saved run read: a resume that replays an
epoch's start, or positions a grain ``MapDataset`` within an epoch, compares a
:func:`fingerprint` of those batches with the one the saved state holds, and raises
:class:`ReplayDiffersError` where they differ (a reshuffle without a seed, another seed, other
data): resuming there would repeat some examples and skip others.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

# A grain MapDataset's state key: the fingerprint of its epoch's first batch, which tells only
# whether a position is this dataset's (positions it records itself need no check)
FIRST_BATCH = "first_batch"


def fingerprint(batch: Any) -> str:
    """A short hash of ``batch``: its leaves' shapes, dtypes and up to ~256 evenly spaced values
    each (enough to tell reshuffled batches apart, cheap for large ones).

    >>> fingerprint({"x": np.arange(4)}) == fingerprint({"x": np.arange(4)})
    True
    >>> fingerprint({"x": np.arange(4)}) == fingerprint({"x": np.arange(4)[::-1]})
    False
    """
    digest = hashlib.blake2b(digest_size=8)
    for leaf in jax.tree.leaves(batch):
        values = np.asarray(leaf)
        flat = values.reshape(-1)
        digest.update(f"{values.shape}{values.dtype.str}".encode())
        digest.update(np.ascontiguousarray(flat[:: max(1, flat.size // 256)]).tobytes())
    return digest.hexdigest()


class ReplayDiffersError(ValueError):
    """A resume replayed an epoch's first batches, and they differ from the saved run's."""
