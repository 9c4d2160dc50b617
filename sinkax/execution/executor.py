"""The executor: how a sink's steps run -- its strategy, compiled programs and placement.

It resolves the strategy when the sink is made (what ``"auto"`` would measure may be pinned, see
:func:`sinkax.execution.choice.pinned`), creates it at the first call, once the step's form is known
(``sink(state)`` or ``sink()``; an equinox-style state's non-array leaves compiled in), places
each new state on the sink's devices with the dtypes the step returns it with, and runs windows
of device-resident chunks.

>>> import jax.numpy as jnp
>>> from sinkax.config import SinkConfig
>>> from sinkax.spec import BatchSpec
>>> executor = Executor(lambda s, b: (s + b, s), SinkConfig.of(2, strategy="scan"))
>>> arrays, static = executor.select(jnp.float32(1))
>>> carry = executor.place(arrays, lambda: BatchSpec.of(jnp.float32(0)))
>>> state, outs = executor.run(carry, jnp.arange(4.0), offset=1, steps=2)
>>> float(state), outs.tolist(), executor.strategy_name
(4.0, [1.0, 2.0], 'scan')
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from sinkax import placement
from sinkax.backend import backend_of
from sinkax.channel.plan import chunk_steps
from sinkax.channel.quiet import Quiet
from sinkax.config import SinkConfig
from sinkax.execution import choice as strategies
from sinkax.execution.auto import Auto
from sinkax.execution.compiler import Compiler
from sinkax.execution.guard import Guarded, watcher
from sinkax.execution.programs import concat_program
from sinkax.execution.progress import Progress
from sinkax.execution.stepfn import carry_dtypes, check_step_form, stateless, with_static
from sinkax.execution.windowed import scan_window
from sinkax.pytree import Static, check_alive, layout, partition
from sinkax.spec import BatchSpec

NO_STATE: Any = object()  # what a stateless call (``sink()``) passes as its state


class Executor:
    """Runs ``fn`` -- ``fn(state, batch) -> (state, out)``, or stateless ``fn(batch) -> out`` --
    on windows of chunks as ``config`` says (strategy, jit, sharding, graph dumps; see
    :mod:`sinkax.execution.choice`); ``steps_per_call``: default ``config.sink_size``;
    ``recorded``: the strategy a restored data position recorded."""

    def __init__(
        self,
        fn: Callable[..., Any],
        config: SinkConfig,
        *,
        steps_per_call: int | None = None,
        recorded: str | None = None,
    ):
        self.fn, self.jit, self._sharding = fn, config.jit, config.sharding
        self._max_chunk_bytes = config.max_chunk_bytes
        resolved = strategies.resolve(
            config.strategy,
            jit=config.jit,
            steps_per_call=steps_per_call or config.sink_size,
            backend=backend_of(config.sharding),
            devices=placement.devices(config.sharding),
            processes=jax.process_count(),
        )
        self._measures = resolved == "auto"  # not given: a recorded position's comes first
        self.chosen = strategies.pinned(resolved, recorded)  # what "auto" would measure
        self.ragged_last = config.ragged_last
        if self.ragged_last and self.feed != "unstacked":
            raise ValueError(
                "ragged_last=True takes an epoch's smaller last batch as it comes, which only "
                "the 'step' strategy can: it runs each batch as its own executable, where the "
                f"others stack batches. This sink would run {self.chosen!r}: pass sink_size=1 "
                "and strategy='step' (one device, jit=True), or batch with drop_remainder=True."
            )
        # a build waits for the windows running first: "auto" sizes calls less their builds
        self.compiler = Compiler(
            fn,
            save_graphs=config.save_graphs,
            settle=self._settle,
            options=config.compiler_options,
        )
        self.dispatches = 0
        self._strategy: Any = None
        self._step: Any = None  # the step function the strategy runs
        self._reselect = False  # measure at the next call, see reselect()
        self._stateful: bool | None = None
        self._static: Static | None = None  # the state's non-array leaves, from the first call
        # the last returned state, its array part (the carry the next call may reuse as it is),
        # and its leaves as returned
        self._handed_back: Any = (None, None, [])
        self._watch = watcher(config.stop_if_nonfinite)  # None: the plain step
        self._carry: Any = None  # guarded: the last call's carry, its `ok` flag included
        self._stopped = False  # guarded: this call stopped at a non-finite step
        self.progress = config.progress and Progress(
            config.progress, config.progress_every, config.sharding
        )

    def _settle(self) -> None:
        """Wait for the last window dispatched, if any, to be computed."""
        done = getattr(self._strategy, "done", None)
        if done is not None:
            jax.block_until_ready(done)

    def wait(self) -> None:
        """Wait for the last window dispatched to be computed, then for every progress report."""
        self._settle()
        if self.progress:
            self.progress.flush()

    def close(self) -> None:
        """Tell every progress report and end the reporting thread (the sink is closing)."""
        if self.progress:
            self.progress.close()

    @property
    def feed(self) -> str:
        """What the strategy runs on, for the ring: ``"stacked"`` chunks or ``"unstacked"``
        batches."""
        return strategies.kind(self.chosen).feed

    @property
    def strategy_name(self) -> str:
        """The strategy running, or about to."""
        return self._strategy.name if self._strategy else self.chosen

    @property
    def recorded(self) -> str | None:
        """What a data position records of the strategy: the choice of ``"auto"``, once made."""
        name = getattr(self._strategy, "name", None)
        return name if name in strategies.RECORDED else None

    def counts(self) -> dict[str, Any]:
        """The compute side of ``Sink.stats``."""
        timings = getattr(self._strategy, "timings", {})
        return {
            "dispatches": self.dispatches,
            "compiles": self.compiler.compiles,
            "strategy": self.strategy_name,
            "strategy_timings": {k: v for k, v in timings.items() if math.isfinite(v)},
        }

    def _make(self) -> Any:
        """The strategy :attr:`chosen` names, over the step as the first call made it."""
        guarded = {"output": lambda out: out[0]} if self._watch is not None else {}
        report = self.progress.report(**guarded) if self.progress else None
        alike = not self.ragged_last  # else the step's executable is looked up per batch
        return strategies.make(
            self.chosen, self._program, self.compiler, batches_alike=alike, report=report
        )

    @property
    def atomic(self) -> bool:
        """Whether one window is one dispatch, compiled before it donates the state."""
        return self._strategy.atomic

    def reselect(self) -> None:
        """Let ``"auto"`` measure again at the next call (see ``Sink.reselect``)."""
        if self.chosen != "auto":
            raise ValueError(
                f"This sink's strategy is {self.chosen!r}, not chosen by measuring: "
                "reselect() applies to strategy='auto' (not pinned by strategy=, "
                f"{strategies.ENV} or a data_state's 'strategy')."
            )
        if self._strategy is None:
            self._reselect = True  # applied once the first call made the strategy
        else:
            self._strategy.reselect()

    def pin(self, recorded: str | None) -> None:
        """Run what a restored data position ``recorded``, where ``"auto"`` would choose."""
        if recorded is None or not self._measures:  # strategy= given: it stays
            return
        if isinstance(self._strategy, Auto):
            self._strategy.pin(recorded)
        elif recorded != self.chosen:  # (or SINKAX_STRATEGY's: a recorded one comes first)
            self.chosen = recorded
            if self._strategy is not None:
                self._strategy = self._make()

    @property
    def _returned(self) -> Any:
        """The array part of the state the last call returned, unchanged since."""
        return self._handed_back[1]

    # -- one call ------------------------------------------------------------------------
    def select(self, state: Any) -> tuple[Any, Static | None]:
        """Check a call's ``state`` (:data:`NO_STATE` for ``sink()``) against the step's form,
        making the strategy at the first call: its array part and its non-array leaves. Raises
        first what the progress hook raised in the last call."""
        if self.progress:  # what its hook raised in the last call
            self.progress.raise_error()
        if self.jit:  # compiled constants: refuse stale ones
            self.compiler.check_captures()
        stateful = state is not NO_STATE
        arrays, static = self._partition(state) if stateful else ((), None)
        if arrays is not self._returned:  # refused here, before any data is taken
            check_alive(arrays)
        if self._stateful is None:
            check_step_form(self.fn, stateful)
            self._static = static
            fn = self.fn if stateful else stateless(self.fn)
            if static is not None:  # an equinox module, say: compile around its functions
                fn = with_static(fn, static)
                self.compiler.specialise(static.key)
            self._step = fn
            if self._watch is not None:  # its executables are not the plain step's
                fn = Guarded(fn, self._watch)
                self.compiler.specialise(("stop_if_nonfinite", self._watch))
            self._program = fn
            self._strategy = self._make()
            if self._reselect:
                self._strategy.reselect()
            self._stateful = stateful  # last: a first call interrupted before makes it all again
        elif self._stateful != stateful:
            form = "sink(state)" if self._stateful else "sink()"
            raise TypeError(f"This sink was first called as {form}; call it the same way again.")
        elif not (static is self._static or (static and static.same(self._static))):
            raise TypeError(
                "The state's non-array leaves (functions, flags, other Python objects) differ "
                "from those of the first call; a sink compiles them in. Pass the state the last "
                "call returned, or create a new sink for another model."
            )
        return arrays, static

    def _partition(self, state: Any) -> tuple[Any, Static | None]:
        """:func:`~sinkax.pytree.partition` of ``state``; free for the state the last call
        returned, unless a leaf of it was replaced in place since (an optax
        ``inject_hyperparams`` learning rate set to a Python float, say): that one is placed
        and typed again, as a new state is."""
        handed_back, arrays, leaves = self._handed_back
        if state is handed_back:
            now = jax.tree.leaves(state)
            if len(now) == len(leaves) and all(map(operator.is_, now, leaves)):
                return arrays, self._static
            self._handed_back = (None, None, [])
        return partition(state)

    def place(self, state: Any, batch_spec: Callable[[], BatchSpec]) -> Any:
        """The carry of a call from ``state``: ``state`` on the sink's devices, its weakly typed
        leaves (Python numbers) given the dtypes the step returns them with (see
        :func:`~sinkax.execution.stepfn.carry_dtypes`; the batch layout from ``batch_spec()``);
        free for the state the last call returned. Guarded (``stop_if_nonfinite``), with the
        ``ok`` flag: the last call's, or else a new one."""
        placed = self._place(state, batch_spec)
        if self._watch is None:
            return placed
        if self._carry is not None and (placed is self._returned or not self._stateful):
            return self._carry
        ok = placement.put(np.True_, placement.replicated(self._sharding))
        return (placed, ok)

    def _place(self, state: Any, batch_spec: Callable[[], BatchSpec]) -> Any:
        if state is self._returned or not self._stateful:
            return state
        state = placement.place_state(state, self._sharding)
        if not self.jit:
            return state
        batch = batch_spec().abstract
        dtypes = self.compiler.memo(
            ("carry", layout((state, batch))), lambda: carry_dtypes(self._step, state, batch)
        )
        leaves, treedef = jax.tree.flatten(state)
        casts = [  # one carry type from the start: a Python number's weak one where kept
            x if (jax.typeof(x).dtype, jax.typeof(x).weak_type) == typed else x.astype(typed[0])
            for x, typed in zip(leaves, dtypes, strict=True)
        ]
        return jax.tree.unflatten(treedef, casts)

    def run(self, carry: Any, data: Any, offset: int, steps: int) -> tuple[Any, Any]:
        """``(carry, outs)`` after batches ``offset .. offset+steps`` of the chunk ``data``;
        ``carry`` is donated."""
        result = self._strategy.run(carry, data, offset, steps)
        self.dispatches += self._strategy.dispatches(steps)
        if self.progress:
            self.progress.ran(steps, getattr(self._strategy, "reported", lambda _: 0)(steps))
        return result

    def joined(self, parts: list[Any]) -> Any:
        """A call's outputs, the ``outs`` of its windows (a list) stacked as one: several are
        concatenated by an executable compiled once per their layout, and counted and timed
        as the windows' are (``"auto"`` sizes calls less it)."""
        if len(parts) == 1:
            return parts[0]
        concat = self.compiler.get(
            "concat", len(parts), lambda: concat_program, parts, donate=False
        )
        return concat(parts)

    @property
    def done(self) -> Any:
        """What the last window's compute makes: ready once it is done (see ``Strategy``)."""
        return self._strategy.done

    def checked(self, carry: Any, outs: Any, steps: int, quiet: Quiet) -> tuple[Any, int]:
        """A window's ``outs`` and the steps of its ``steps`` that ran: all, unless guarded
        (``stop_if_nonfinite``) and a step was not finite -- which this waits for the window to
        tell, reading its flag (``quiet`` lifted meanwhile: the producer goes on)."""
        if self._watch is None:
            return outs, steps
        outs, flags = outs
        with quiet.lifted():
            finite = bool(carry[1])
        if finite:
            return outs, steps
        self._stopped = True  # the next call starts with a new flag
        return outs, int(np.sum(flags))

    def returned(self, carry: Any, static: Static | None) -> Any:
        """The state a call hands back for its final ``carry`` (non-array leaves put back);
        frees the last call's state."""
        if self._watch is not None:
            self._carry, self._stopped = (None if self._stopped else carry), False
            carry = carry[0]
        returned = carry if static is None else static.combine(carry)
        self._handed_back = (returned, carry, jax.tree.leaves(returned))
        return returned

    def lower(self, state: Any, spec: BatchSpec, steps_per_call: int | None) -> jax.stages.Lowered:
        """The scan executable of a window of batches of layout ``spec``, lowered: a chunk's
        worth (:func:`~sinkax.channel.plan.chunk_steps`), or a call's if less; ``state``
        concrete or abstract, :data:`NO_STATE` for a stateless step."""
        most = chunk_steps(self._max_chunk_bytes, spec)
        steps = min(steps_per_call or most, most)
        if state is NO_STATE:
            fn, state = stateless(self.fn), ()
        else:
            state, static = partition(state)
            fn = self.fn if static is None else with_static(self.fn, static)
        program = scan_window(fn, backend_of(self._sharding), steps)
        return Compiler.lower(
            program, state, spec.stacked(steps), jax.ShapeDtypeStruct((), "int32")
        )
