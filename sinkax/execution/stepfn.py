"""The user's step function: its form, what it returns, and how a sink calls it.

A step is ``fn(state, batch) -> (state, out)``, called as ``sink(state)``, or stateless
``fn(batch) -> out``, called as ``sink()`` (:func:`stateless` gives it the first form). The state
must come back with the structure, shapes and dtypes it went in with (:func:`carry_dtypes`).

>>> fn = stateless(lambda b: b * 2)
>>> fn((), 3)
((), 6)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

from sinkax.execution.programs import StepFn
from sinkax.pytree import Static, partition


def stateless(fn: Callable[[Any], Any]) -> StepFn:
    """``fn(batch) -> out`` as a step over an empty state: eval and predict steps."""
    return lambda state, batch: (state, fn(batch))


_BATCH_NAMES = {"batch", "inputs", "data", "x"}
_STATE_NAMES = {"state", "train_state", "params", "model", "carry", "variables"}


def check_step_form(fn: Callable[..., Any], stateful: bool) -> None:
    """``TypeError`` naming the fix if ``fn`` cannot be called as a step of the form the sink
    was called with: ``fn(state, batch)`` for ``sink(state)``, ``fn(batch)`` for ``sink()``.
    Diagnosed: the other form; more required parameters than the form passes (bind them); a
    stateful step whose parameter names say it takes the batch first. Functions without a
    signature pass.

    >>> check_step_form(lambda b: b, stateful=True)
    Traceback (most recent call last):
    ...
    TypeError: sink(state) runs a step fn(state, batch) -> (state, out), but <lambda>(b) takes ...
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins, some C callables: nothing to check
        return
    name = getattr(fn, "__name__", type(fn).__name__)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    params = [p for p in signature.parameters.values() if p.kind not in variadic]
    needed = [p.name for p in params if p.default is inspect.Parameter.empty]
    if len(needed) > 2:
        call = "sink(state) passes (state, batch)" if stateful else "sink() passes one, the batch"
        raise TypeError(
            f"{name}{signature} needs {len(needed)} arguments, but a step is called with at "
            f"most the state and the batch: {call}. Bind the others first, e.g. "
            f"`functools.partial({name}, {needed[2]}=...)`, or close over them; a value that "
            "changes between calls belongs in the state."
        )
    first, second = [*(p.name for p in params), None, None][:2]
    if stateful and first in _BATCH_NAMES and second in _STATE_NAMES:
        raise TypeError(
            f"sink(state) calls the step as fn(state, batch), but {name}{signature} takes the "
            f"batch first (by its parameter names). Put the state first: "
            f"def {name}({second}, {first}, ...)."
        )
    try:
        signature.bind(None, None) if stateful else signature.bind(None)
    except TypeError:
        if stateful:
            raise TypeError(
                f"sink(state) runs a step fn(state, batch) -> (state, out), but {name}"
                f"{signature} takes no state. Call sink() for a stateless step (eval, predict): "
                "it returns the outputs of every step."
            ) from None
        raise TypeError(
            f"sink() runs a stateless step fn(batch) -> out, but {name}{signature} takes a "
            "state. Call sink(state): it returns (state, outs), the state to pass next time."
        ) from None


def check_step_result(result: Any, state: Any) -> None:
    """``TypeError`` naming the fix if ``result`` (what a step returned, concrete or abstract)
    is not ``(state, out)`` for the ``state`` it was given."""
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return
    only_state = jax.tree.structure(result) == jax.tree.structure(state)
    raise TypeError(
        "A step function fn(state, batch) must return a pair (new_state, out), but it returned "
        + (
            "what looks like the new state alone. Return `state, None` if there is no output."
            if only_state
            else f"{type(result).__name__}. Return `state, out` (out may be None)."
        )
    )


def with_static(fn: StepFn, static: Static) -> StepFn:
    """``fn`` as a step over the array part of its state (:func:`sinkax.pytree.partition`),
    the ``static`` rest (functions, flags) put back around it: what ``eqx.filter_jit`` does."""

    def step(arrays: Any, batch: Any) -> tuple[Any, Any]:
        state = static.combine(arrays)
        result = fn(state, batch)
        check_step_result(result, state)
        arrays, rest = partition(result[0])
        if not static.same(rest):
            raise TypeError(
                "The step function changed the state's non-array leaves (functions, flags, "
                "other Python objects): a sink compiles them in, as constants. Return them as "
                "they came in; values that change must be arrays."
            )
        return arrays, result[1]

    return step


def carry_dtypes(fn: StepFn, state: Any, batch: Any) -> list[tuple[Any, bool]]:
    """The dtype of each leaf of ``state`` with which ``fn`` returns the state as it takes it,
    and whether weakly typed (a Python number's type, which ``jax.jit`` keeps: ``s + 1.0``).

    The rule of ``lax.scan``'s carry: a weakly typed leaf (from a Python number) takes the
    dtype ``fn`` gives it; any other change of structure, shape or dtype is an error naming the
    leaf, as a sink runs one compiled step on the state the last one returned.

    >>> import numpy as np
    >>> carry_dtypes(lambda s, b: (s + b, b), 0, np.float32(1))
    [(dtype('float32'), False)]
    """
    result = jax.eval_shape(fn, state, batch)
    check_step_result(result, state)
    weak = [getattr(leaf, "weak_type", False) for leaf in jax.tree.leaves(result[0])]
    return list(zip(returned_dtypes(state, result[0]), weak, strict=True))


def returned_dtypes(state: Any, out: Any) -> list[Any]:
    """The dtype of each leaf of ``out``, a step's returned state (arrays or their shapes), if it
    has the layout of ``state`` (see :func:`carry_dtypes`), else a ``TypeError`` naming the
    leaf."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    out_leaves, out_treedef = jax.tree.flatten(out)
    if out_treedef != treedef:
        raise TypeError(
            f"The step function returns the state with structure {out_treedef}, but was given "
            f"{treedef}. {_SAME_LAYOUT}"
        )
    dtypes = []
    for (path, leaf), returned in zip(flat, out_leaves, strict=True):
        given = jax.typeof(leaf)
        if given.shape != returned.shape or not (given.dtype == returned.dtype or given.weak_type):
            raise TypeError(
                f"The step function returns state leaf {jax.tree_util.keystr(path) or '<root>'} "
                f"as {returned.dtype}{list(returned.shape)}, but was given "
                f"{given.dtype}{list(given.shape)}. {_SAME_LAYOUT}"
            )
        dtypes.append(returned.dtype)
    return dtypes


_SAME_LAYOUT = (
    "A sink runs one compiled step on the state the last step returned: return the state with "
    "the structure, shapes and dtypes it came in with (cast in the step, or start from a state "
    "of the dtypes it returns)."
)
