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

import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_extended(dtype: Any) -> bool:
    """Whether ``dtype`` is a JAX extended dtype (a typed PRNG key's, for instance), which
    numpy cannot hold."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


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


def is_array(leaf: Any) -> bool:
    """Whether a sink carries ``leaf`` as data: an array (or its abstract value), or a Python
    number (weakly typed).

    A Python ``bool`` is a flag (``eqx.nn.Dropout.inference``, for instance), not data: it
    stays a Python value, with functions and every other object (see :func:`partition`), and
    so does a Python number that is a field of an equinox module (see :func:`module_numbers`).
    """
    data = jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic | int | float | complex
    return isinstance(leaf, data) and not isinstance(leaf, bool)


@dataclasses.dataclass(frozen=True)
class Static:
    """The leaves of a state that are not arrays (functions, flags...), and where they go."""

    treedef: Any
    where: tuple[int, ...]  # their positions among the leaves
    leaves: tuple[Any, ...]

    def combine(self, arrays: Any) -> Any:
        """The state: the array part ``arrays`` (``None`` in the holes) with these leaves."""
        leaves = jax.tree.leaves(arrays)
        for i, leaf in zip(self.where, self.leaves, strict=True):
            leaves.insert(i, leaf)
        return jax.tree.unflatten(self.treedef, leaves)

    def same(self, other: Static | None) -> bool:
        """Whether ``other`` holds the same leaves (by identity or equality) in the same places."""
        return (
            other is not None
            and (self.treedef, self.where) == (other.treedef, other.where)
            and all(a is b or _equal(a, b) for a, b in zip(self.leaves, other.leaves, strict=True))
        )

    @property
    def key(self) -> Any:
        """A hashable stand-in for these leaves (a new object if some are unhashable)."""
        try:
            hash(self.leaves)
        except TypeError:
            return object()
        return (self.treedef, self.where, self.leaves)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an __eq__ that fails or returns something ambiguous: not the same
        return False


def module_numbers(state: Any, leaves: list[Any]) -> set[int]:
    """The positions among ``leaves`` (those of ``state``) of the Python numbers that are fields
    of an equinox module, such as ``eqx.nn.MaxPool2d``'s ``init=-inf``: ``eqx.filter_jit``
    holds them static, and equinox layers rely on it (``reduce_window``'s derivative refuses a
    traced ``init``). Elsewhere -- a ``sink(0)`` counter, a flax ``TrainState``'s ``step=0`` --
    a Python number is data that the step changes.

    >>> import equinox as eqx
    >>> state = (eqx.nn.MaxPool2d(2), 0.5)
    >>> leaves = jax.tree.leaves(state)
    >>> [leaves[i] for i in sorted(module_numbers(state, leaves))]
    [-inf]
    """
    numbers = {i for i, leaf in enumerate(leaves) if type(leaf) in (int, float, complex)}
    eqx = sys.modules.get("equinox")
    if not numbers or eqx is None:  # (only a program that imported equinox holds its modules)
        return set()
    is_module = lambda x: isinstance(x, eqx.Module)  # noqa: E731
    inside, start = set(), 0
    for piece in jax.tree.leaves(state, is_leaf=is_module):
        count = len(jax.tree.leaves(piece)) if is_module(piece) else 1
        if is_module(piece):
            inside.update(range(start, start + count))
        start += count
    return numbers & inside


def partition(state: Any) -> tuple[Any, Static | None]:
    """``(arrays, static)``: the array leaves of ``state`` (``None`` in place of the others)
    and the others (:class:`Static`), as ``eqx.partition(state, eqx.is_array)`` gives them; or
    ``(state, None)`` when every leaf is an array (see :func:`is_array`,
    :func:`module_numbers`).

    >>> arrays, static = partition({"w": np.ones(2), "act": np.tanh})
    >>> arrays["act"] is None, static.combine(arrays)["act"] is np.tanh
    (True, True)
    """
    leaves, treedef = jax.tree.flatten(state)
    in_modules = module_numbers(state, leaves)
    where = tuple(i for i, leaf in enumerate(leaves) if not is_array(leaf) or i in in_modules)
    if not where:
        return state, None
    holes = [None if i in where else leaf for i, leaf in enumerate(leaves)]
    static = Static(treedef, where, tuple(leaves[i] for i in where))
    return jax.tree.unflatten(treedef, holes), static


def copy_tree(tree: Any) -> Any:
    """A fresh copy of every leaf, in one dispatch (one per leaf where the leaves lie on
    different devices, some over a mesh and some on one device, say): what a donating call may
    consume while the original stays valid.

    >>> x = jnp.ones(3); y = copy_tree(x)
    >>> y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    True
    """
    try:
        return _copy_together(tree)
    except ValueError:  # jit takes arguments on one set of devices only
        return jax.tree.map(jnp.copy, tree)


_copy_together = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def layout(tree: Any) -> tuple[Any, tuple[Any, ...]]:
    """Tree structure and abstract value of every leaf: what an executable is specialised to."""
    leaves, treedef = jax.tree.flatten(tree)
    # .aval and .sharding are cheap attribute reads; this runs on every call of a sink. An
    # executable is compiled for its arguments' devices, so they are part of the layout.
    return treedef, tuple(
        (x.aval, x.sharding) if isinstance(x, jax.Array) else jax.typeof(x) for x in leaves
    )


def committed(state: Any, default: jax.Device, like: Any = None) -> Any:
    """``state`` committed to devices: each leaf placed as in ``like`` (alike), or left where the
    caller placed it over several devices (sharded over a mesh, say), else on ``default``: a
    state never split over single devices."""

    def place(leaf: Any, model: Any = None) -> Any:
        if isinstance(model, jax.Array):
            return jax.device_put(leaf, model.sharding)
        if isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1:
            return leaf
        return jax.device_put(leaf, default)

    return jax.tree.map(place, state) if like is None else jax.tree.map(place, state, like)
