"""Stopping at the first non-finite step (``data_sink(..., stop_if_nonfinite=...)``).

The step function is *guarded* (:class:`Guarded`): its carry gains a device flag ``ok``, and
each step

* checks the leaves it watches of its output (every floating leaf, the entry a name picks, or
  what a function returns) for NaN and infinity;
* keeps the state from before the step once a step was not finite (a select per state leaf),
  for this step and every later step of the window, whose results are discarded;
* adds the flag to its output, so that the host learns how many steps ran.

A ``"scan"`` window does not pay the select per step (:meth:`Guarded.window`): it runs the
plain step over the window, checks the outputs of all its steps at once, and only if one was
not finite runs the window again from its start with the guarded step (one device branch per
window, on a copy of the window's first state). A window run in progress blocks does the same
across its executables (:meth:`Guarded.redo`): the blocks run the plain step and only lower the
flag, and the executable that joins their outputs holds the window's one branch -- a branch
that XLA's GPU runtime decides on the host, waiting for the device, so once per window rather
than once per block. The other programs run the guarded step.

A window's host reads the final flag (one scalar, so it waits for the window); only after a
stop does it count the steps that ran. Nothing of this runs unless asked for: an unguarded sink
compiles the plain step.

>>> import jax.numpy as jnp
>>> step = Guarded(lambda s, b: (s + b, s + b), watcher(True))
>>> (state, ok), (out, flag) = step((jnp.float32(1), jnp.bool_(True)), jnp.float32(jnp.nan))
>>> float(state), bool(ok), bool(flag)
(1.0, False, False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from sinkax.execution.programs import StepFn, concat_program

Watch = bool | str | Callable[[Any], Any] | None
Window = Callable[..., tuple[Any, Any, jax.Array]]  # (state, chunk, i) -> (state, outs, end)


def watcher(watch: Watch) -> Callable[[Any], Any] | None:
    """What a step's output is checked by, for ``stop_if_nonfinite=watch``: ``None`` (off),
    ``True`` (every floating leaf of the output), an entry's name (``"loss"``: ``out[name]``)
    or a function of the output; ``TypeError`` otherwise."""
    if watch is None or watch is False:
        return None
    if watch is True:
        return lambda out: out
    if isinstance(watch, str):
        return entry_of(watch)
    if callable(watch):
        return watch
    raise TypeError(
        "stop_if_nonfinite must be True (check every floating leaf of a step's output), the "
        "name of an entry of the output (e.g. 'loss'), a function of the output returning the "
        f"arrays to check, or False/None (off); got {type(watch).__name__}."
    )


def check_rereadable(watch: Watch, rereadable: bool) -> None:
    """``ValueError`` if a sink stops at non-finite steps (``watch``) but cannot read its
    dataset again from the batch where one was (it reads ahead): a one-shot iterator."""
    if watcher(watch) and not rereadable:
        raise ValueError(
            "stop_if_nonfinite needs a dataset the sink can read again from the batch where a "
            "step was not finite (it reads ahead); this one is a one-shot iterator (iter() of it "
            "gives itself, like a generator). Give a list, a grain dataset or DataLoader, or an "
            "object whose __iter__ starts a new pass."
        )


def entry_of(name: str) -> Callable[[Any], Any]:
    """``out -> out[name]``, with an error naming the entries when ``out`` has none such."""

    def entry(out: Any) -> Any:
        try:
            return out[name]
        except (KeyError, TypeError, IndexError):
            if isinstance(out, Mapping):
                has = f"which has none such (its entries: {sorted(map(str, out))})"
            else:
                leaf = jax.tree_util.treedef_is_leaf(jax.tree.structure(out))
                has = f"but the output is {'one array' if leaf else type(out).__name__}"
            raise KeyError(
                f"stop_if_nonfinite={name!r} names an entry of the step's output, {has}. Name "
                "an entry of a dict output, or pass True to check every floating leaf."
            ) from None

    return entry


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating leaf of ``tree`` is finite (``True`` if it has none)."""
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


@dataclasses.dataclass(frozen=True)
class Guarded:
    """``((state, ok), batch) -> ((state, ok), (out, ok))``: ``fn`` that, from the first step
    whose watched output (``watch(out)``) is not finite on, keeps its state and lowers ``ok``."""

    fn: StepFn
    watch: Callable[[Any], Any]

    def __call__(self, carry: tuple[Any, jax.Array], batch: Any) -> tuple[Any, Any]:
        state, ok = carry
        new, out = self.fn(state, batch)
        ok = ok & all_finite(self.watch(out))
        state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)
        return (state, ok), (out, ok)

    def window(self, program_of: Callable[[StepFn], Window]) -> Window:
        """The window program that ``program_of(step)`` makes for this guarded step, run as
        ``program_of(self.fn)`` -- the plain step -- unless a step of the window was not
        finite (or ``ok`` was down already): then as ``program_of(self)`` from the window's
        start. Same results as ``program_of(self)``, without a select per step.

        >>> from sinkax.execution.programs import scan_program
        >>> window = Guarded(lambda s, b: (s + b, s + b), watcher(True)).window(
        ...     lambda step: scan_program(step, 3))
        >>> chunk = jnp.array([1.0, jnp.inf, 1.0])
        >>> (state, ok), (outs, flags), end = window((jnp.float32(0), jnp.bool_(True)), chunk, 0)
        >>> float(state), flags.tolist(), int(end)
        (1.0, [True, False, False], 3)
        """
        flagged, checked = self.flagging(program_of), program_of(self)

        def run(carry: tuple[Any, jax.Array], chunk: Any, i: jax.Array) -> Any:
            new, outs, end = flagged(carry, chunk, i)
            return jax.lax.cond(new[1], lambda: (new, outs, end), lambda: checked(carry, chunk, i))

        return run

    def flagging(self, program_of: Callable[[StepFn], Window]) -> Window:
        """The window program ``program_of(step)`` makes of the plain step, each step's output
        flagged, with the guarded step's carry and outputs but neither a select per step nor a
        branch: ``ok`` falls at a step that is not finite, and the state goes on unguarded -- a
        window that holds one must be computed again from its start with the guarded step
        (:meth:`window`, :meth:`redo`)."""

        def flagged(state: Any, batch: Any) -> tuple[Any, Any]:
            new, out = self.fn(state, batch)
            return new, (out, all_finite(self.watch(out)))

        plain = program_of(flagged)

        def run(carry: tuple[Any, jax.Array], chunk: Any, i: jax.Array) -> Any:
            state, ok = carry
            new, (outs, flags), end = plain(state, chunk, i)
            return (new, ok & jnp.all(flags)), (outs, flags), end

        return run

    def redo(self, checked: Window, steps: int) -> Callable[..., Any]:
        """The end of a window of ``steps`` run in parts by :meth:`flagging` programs (progress
        blocks): ``(carry, start, parts, chunk, i) -> (carry, (outs, flags), end)``, the
        parts' outputs joined if every step was finite (``ok`` still up in the last part's
        ``carry``), else the window computed again from its first carry ``start``, at ``i``, by
        ``checked``, the guarded step's program -- one branch for the window, not one a part."""

        def run(carry: Any, start: Any, parts: list[Any], chunk: Any, i: jax.Array) -> Any:
            return jax.lax.cond(
                carry[1],
                lambda: (carry, concat_program(parts), i + steps),
                lambda: checked(start, chunk, i),
            )

        return run


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """Where a call stopped: the step at ``epoch``/``step`` (the data position the sink reports
    after the call: the batch is the next one it reads) was not finite; ``step_in_call`` steps
    of the call ran before it; ``out`` is that step's output (on the device), whose update was
    not kept."""

    epoch: int
    step: int
    step_in_call: int
    out: Any = dataclasses.field(repr=False)

    def __str__(self) -> str:
        return (
            f"a non-finite step at epoch {self.epoch}, step {self.step} (step {self.step_in_call}"
            " of the call): its update and the rest of the call were not kept"
        )


def split(outs: Any, ran: int) -> tuple[Any, Any]:
    """A window's stacked outputs cut after the ``ran`` steps that were kept, and the output of
    the step that was not."""
    kept = jax.tree.map(lambda x: x[:ran], outs)
    return kept, jax.tree.map(lambda x: x[ran], outs)
