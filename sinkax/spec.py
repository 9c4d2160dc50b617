"""The fixed layout every batch of a sink must have: tree structure, shapes and dtypes.

A sink compiles one executable per batch layout, so every batch must match the first one.
:func:`check` names the leaf that differs and how to fix it.

>>> import numpy as np
>>> spec = BatchSpec.of({"x": np.zeros((32, 4), np.float32)})
>>> spec.nbytes
512
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sinkax.errors import BatchSpecError, warn
from sinkax.pytree import is_extended

_NOT_ON_DEVICE = "USOMm"  # numpy kinds: str, bytes, object, datetime, timedelta

_FIX = (
    "Every batch must match the first one. A smaller last batch usually means the dataset "
    "needs `batch(batch_size, drop_remainder=True)` (or padding, sinkax.datasets.PadBatch; "
    "or, for one-step calls on one device, ragged_last=True); a changed dtype needs an "
    "explicit cast in the pipeline."
)


def _record(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is a raw or structured (record) one, of numpy kind ``"V"`` as JAX's
    own extra number types (bfloat16, float8, int4) are, but none of them."""
    return dtype.kind == "V" and not jnp.issubdtype(dtype, jnp.number)


def _off_host(leaf: Any) -> bool:
    """Whether ``leaf`` is a jax array in some device's memory that is not the host's."""
    return isinstance(leaf, jax.Array) and any(
        device.platform != "cpu" for device in leaf.sharding.device_set
    )


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """Tree structure plus (path, shape, dtype) of each leaf of one batch."""

    treedef: Any
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]

    @classmethod
    def of(cls, batch: Any) -> BatchSpec:
        """The spec of ``batch`` (a pytree of array-likes)."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
        if not flat:
            raise BatchSpecError(
                f"The first batch holds no arrays ({batch!r:.100}): each step needs a batch of "
                "arrays to scan over. Check the pipeline's last map returns the batch."
            )
        paths = tuple(jax.tree_util.keystr(path) or "<root>" for path, _ in flat)
        for path, (_, leaf) in zip(paths, flat, strict=True):
            if is_extended(getattr(leaf, "dtype", None)):
                raise BatchSpecError(
                    f"Batch leaf {path} has dtype {leaf.dtype}, a JAX extended dtype (a typed "
                    "PRNG key) that the host-side data channel (numpy) cannot hold. Put "
                    "`jax.random.key_data(key)` in the batch and `jax.random.wrap_key_data` it "
                    "in the step, or keep the key in the state and split it there."
                )
        off_host = [path for path, (_, leaf) in zip(paths, flat, strict=True) if _off_host(leaf)]
        if off_host:
            warn(
                f"Batch leaf {off_host[0]} ({len(off_host)} of {len(paths)} leaves) is a jax "
                "array on a device: a data sink stacks batches on the host and moves them in "
                "chunks, so each such leaf is read back to the host first (a device-to-host "
                "transfer per leaf and batch). Yield numpy arrays from the pipeline (no "
                "jax.device_put or jnp in its maps); for data already on the device, run "
                "lax.scan over it yourself."
            )
        leaves = [np.asarray(leaf) for _, leaf in flat]
        if all(leaf.ndim and not leaf.shape[0] for leaf in leaves):
            raise BatchSpecError(
                f"The first batch has no rows (every leaf's leading axis is 0: "
                f"{[leaf.shape for leaf in leaves]}): a step over it computes on nothing, and a "
                "mean over it is NaN. Drop empty batches in the pipeline (e.g. a filter before "
                "the batching), or batch with drop_remainder=True."
            )
        for path, leaf in zip(paths, leaves, strict=True):
            if leaf.dtype.kind in _NOT_ON_DEVICE or _record(leaf.dtype):
                raise BatchSpecError(
                    f"Batch leaf {path} has dtype {leaf.dtype}, which a device array cannot hold "
                    "(numbers and booleans only). Drop it from the batch or encode it as numbers "
                    "in the pipeline (e.g. a map that removes file names, or turns them into ids)."
                )
        return cls(
            treedef=treedef,
            paths=paths,
            shapes=tuple(leaf.shape for leaf in leaves),
            dtypes=tuple(leaf.dtype for leaf in leaves),
        )

    @functools.cached_property
    def layout(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """``(shape, dtype)`` of each leaf, as :func:`check` compares a batch's."""
        return list(zip(self.shapes, self.dtypes, strict=True))

    @functools.cached_property
    def wide_ints(self) -> bool:
        """Whether a leaf is a 64-bit int, whose values :func:`check` bounds without x64."""
        return any(d.kind in "iu" and d.itemsize == 8 for d in self.dtypes)

    @property
    def nbytes(self) -> int:
        """Bytes of one batch."""
        return sum(
            int(np.prod(s, dtype=np.int64)) * d.itemsize
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def device_leaves(self) -> list[jax.ShapeDtypeStruct]:
        """Each leaf as it lives on the device (dtypes canonicalised: float64 -> float32
        unless ``jax_enable_x64``)."""
        return [
            jax.ShapeDtypeStruct(s, jax.dtypes.canonicalize_dtype(d))
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        ]

    @property
    def abstract(self) -> Any:
        """Abstract pytree (``jax.ShapeDtypeStruct``) of one batch, on the device."""
        return jax.tree_util.tree_unflatten(self.treedef, self.device_leaves)

    def stacked(self, steps: int) -> Any:
        """Abstract pytree (``jax.ShapeDtypeStruct``) of ``steps`` batches stacked, on device."""
        leaves = [jax.ShapeDtypeStruct((steps, *x.shape), x.dtype) for x in self.device_leaves]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _fewer_rows(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
    """Whether ``shape`` is ``full`` with fewer (but some) rows on its leading axis."""
    return len(shape) == len(full) >= 1 and shape[1:] == full[1:] and 0 < shape[0] < full[0]


def check(spec: BatchSpec, batch: Any, where: object, smaller: bool = False) -> list[np.ndarray]:
    """The leaves of ``batch`` as numpy arrays; raises :class:`BatchSpecError` on any drift.

    ``where`` says which batch this is (its ``str``, e.g. ``"epoch 0, step 57"``, is only
    built for the message); with ``smaller``, the batch may have fewer rows on the leading
    axis of every leaf (an epoch's last batch, where the sink takes one, see ``ragged_last``).

    >>> spec = BatchSpec.of({"x": np.zeros((4, 2))})
    >>> [leaf.shape for leaf in check(spec, {"x": np.zeros((3, 2))}, "the last", smaller=True)]
    [(3, 2)]
    """
    flat, treedef = jax.tree_util.tree_flatten(batch)
    if treedef != spec.treedef:
        raise BatchSpecError(
            f"Batch at {where} has tree structure {treedef}, but the first batch had "
            f"{spec.treedef}. {_FIX}"
        )
    leaves = [np.asarray(leaf) for leaf in flat]
    # per batch, in the producer: one comparison of the whole layout when nothing drifted
    if [(leaf.shape, leaf.dtype) for leaf in leaves] == spec.layout and not spec.wide_ints:
        return leaves
    for path, shape, dtype, leaf in zip(spec.paths, spec.shapes, spec.dtypes, leaves, strict=True):
        fits = leaf.shape == shape or (smaller and _fewer_rows(leaf.shape, shape))
        if not fits or leaf.dtype != dtype:
            raise BatchSpecError(
                f"Batch at {where}, leaf {path}: expected shape {shape} dtype {dtype}, got shape "
                f"{leaf.shape} dtype {leaf.dtype}. {_FIX}"
            )
        if dtype.kind in "iu" and dtype.itemsize == 8 and not jax.config.jax_enable_x64:
            _check_fits_32_bits(leaf, path, where)
    return leaves


def _check_fits_32_bits(leaf: np.ndarray, path: str, where: object) -> None:
    """Without ``jax_enable_x64`` a 64-bit int leaf goes to the device as 32 bits: refuse
    values that would wrap."""
    narrow = np.iinfo(np.int32 if leaf.dtype.kind == "i" else np.uint32)
    if leaf.size and (leaf.min() < narrow.min or leaf.max() > narrow.max):
        raise BatchSpecError(
            f"Batch at {where}, leaf {path}: {leaf.dtype} values from {leaf.min()} to "
            f"{leaf.max()} do not fit the {narrow.dtype} the device holds them in without "
            "jax_enable_x64, and would wrap. Enable it (jax.config.update('jax_enable_x64', "
            "True)) or map the values into 32 bits in the pipeline."
        )


def widened(short: BatchSpec, batch: Any, where: object) -> BatchSpec:
    """The spec of ``batch``, the first batch after one of ``short``, an epoch's last batch that
    may have had fewer rows (``ragged_last``): ``BatchSpecError`` unless ``short`` is ``batch``'s
    layout but, maybe, for fewer rows.

    >>> widened(BatchSpec.of({"x": np.zeros(2)}), {"x": np.zeros(3)}, "step 1").shapes
    ((3,),)
    """
    spec = BatchSpec.of(batch)
    if spec.treedef != short.treedef:
        check(short, batch, where)  # names the structures
    leaves = zip(short.paths, short.shapes, short.dtypes, spec.shapes, spec.dtypes, strict=True)
    for path, shape, dtype, full, full_dtype in leaves:
        if dtype != full_dtype or not (shape == full or _fewer_rows(shape, full)):
            rows = ", ".join(["n", *map(str, shape[1:])]) + ("," if len(shape) < 2 else "")
            expected = f"shape ({rows}) with n >= {shape[0]}" if shape else "shape ()"
            raise BatchSpecError(
                f"Batch at {where}, leaf {path}: expected {expected} and dtype {dtype} (the "
                f"epoch's last batch before it had shape {shape}), got shape {full} dtype "
                f"{full_dtype}. {_FIX}"
            )
    return spec
