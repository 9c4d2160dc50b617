"""Leaves as JAX sees them, extended dtypes included: what a sink reads of a state's leaves.

A state may hold typed PRNG keys (``jax.random.key``: dtype ``key<fry>``), or any other
``jax.dtypes.extended`` dtype, beside ordinary arrays. numpy cannot hold those, and they have no
``weak_type`` attribute: this module reads a leaf's abstract value with ``jax.typeof`` and builds
buffers of extended dtypes on the device, so that the rest of sinkax needs no special case.

>>> import jax
>>> is_extended(jax.random.key(0).dtype), is_extended(np.dtype("float32"))
(True, False)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_extended(dtype: Any) -> bool:
    """Whether ``dtype`` is a JAX extended dtype (a typed PRNG key's, for instance), which
    numpy cannot hold."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def stacked_zeros(tree: Any, steps: int, device: jax.Device) -> Any:
    """Zero buffers for ``steps`` stacked leaves of the abstract ``tree``, to ``device_put`` to
    ``device`` in one transfer: numpy arrays, except for extended dtypes (typed keys), which
    numpy cannot hold and are built on ``device`` directly.

    >>> key = jax.eval_shape(jax.random.key, 0)
    >>> out = {"loss": jax.ShapeDtypeStruct((), np.float32), "key": key}
    >>> bufs = jax.device_put(stacked_zeros(out, 3, jax.devices()[0]))
    >>> bufs["loss"].shape, bufs["key"].shape, str(bufs["key"].dtype)
    ((3,), (3,), 'key<fry>')
    """

    def zeros(x: Any) -> Any:
        shape = (steps, *x.shape)
        if is_extended(x.dtype):
            return jnp.zeros(shape, x.dtype, device=device)
        return np.zeros(shape, x.dtype)

    return jax.tree.map(zeros, tree)


def deleted_leaf(tree: Any) -> str | None:
    """The path of the first leaf of ``tree`` whose buffer was deleted (donated to a call that
    consumed it), or ``None`` if every array is alive.

    >>> import jax.numpy as jnp
    >>> x = jnp.zeros(2); x.delete()
    >>> deleted_leaf({"w": jnp.ones(2), "b": x}), deleted_leaf({"w": jnp.ones(2)})
    ("['b']", None)
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            return jax.tree_util.keystr(path) or "<root>"
    return None


def check_alive(state: Any) -> None:
    """``ValueError`` naming the fix if a leaf of ``state`` was donated to an earlier call."""
    path = deleted_leaf(state)
    if path is not None:
        raise ValueError(
            f"This state was donated to an earlier call, which consumed it (leaf {path} is "
            "deleted); use the one it returned: `state, outs = sink(state)`, then pass that "
            "`state` to the next call. To run several calls from one starting state, pass each "
            "a copy: `sink(jax.tree.map(jnp.copy, state))`."
        )
