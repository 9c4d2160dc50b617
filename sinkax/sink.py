"""``data_sink``: many steps of a step function per host interaction.

A :class:`Sink` binds a step function to a dataset. Each call runs ``sink_size`` steps on the
device -- one compiled executable over a chunk of batches that a background producer has
already stacked and copied to the device (:mod:`sinkax.channel`) -- and returns the new state
and every step's output stacked on a leading axis. Consecutive calls continue through the data
exactly where the last one stopped; one call may cross epoch boundaries.

>>> import numpy as np, sinkax
>>> data = [{"x": np.float32(i)} for i in range(4)]
>>> with sinkax.data_sink(lambda s, b: (s + b["x"], s), data, sink_size=3) as sink:
...     total, seen = sink(np.float32(0))
...     print(float(total), seen.tolist(), sink.epoch, sink.step)
3.0 [0.0, 0.0, 1.0] 0 3
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import grain
import jax

from sinkax import context, distributed, interrupt, pjrt, placement
from sinkax import strategy as strategies
from sinkax.backend import TARGETS, backend_of, resolve_device
from sinkax.channel.ring import Chunk, DeviceRing
from sinkax.channel.source import Position, Source, as_source, snapshot
from sinkax.errors import SinkClosedError, SinkTimeoutError
from sinkax.executable import (
    Compiler,
    carry_dtypes,
    check_step_form,
    concat_trees,
    copy_tree,
    layout,
    scan_program,
    stateless,
    with_static,
)
from sinkax.pytree import Static, check_alive, partition
from sinkax.spec import BatchSpec

_NO_STATE: Any = object()


@dataclasses.dataclass(frozen=True)
class SinkStats:
    """What a sink has done so far.

    ``data_wait_s`` is time the caller waited for data (input-bound); ``slot_wait_s`` is time the
    producer waited for a free device slot (compute-bound). With the ``"step"`` strategy the
    chunks and bytes counted were handed over unstacked; XLA takes each batch at dispatch.
    ``interactions``: on a device of sinkax's PJRT plugin (:mod:`sinkax.pjrt`), the process's
    host–device interactions since the sink was created (other work in between counts too).
    """

    steps: int
    calls: int
    dispatches: int
    compiles: int
    chunks_transferred: int
    bytes_transferred: int
    max_chunks_on_device: int
    data_wait_s: float
    slot_wait_s: float
    strategy: str
    strategy_timings: dict[str, float]
    interactions: pjrt.Interactions | None = None

    @property
    def bound(self) -> str:
        """``"input"`` if the sink waited for data longer than the producer waited for room."""
        return "input" if self.data_wait_s > self.slot_wait_s else "compute"


MIN_CHUNK_STEPS = 64


def call_sizes(sink_size: int, epoch_length: int | None, start_step: int) -> Iterator[int]:
    """Steps of successive calls: ``sink_size``, or (for ``-1``) the rest of each epoch.

    >>> from itertools import islice
    >>> list(islice(call_sizes(-1, 10, start_step=3), 3))
    [7, 10, 10]
    """
    step = start_step
    while True:
        yield sink_size if sink_size > 0 else epoch_length - step  # type: ignore[operator]
        step = 0


def plan_chunks(
    calls: Iterator[int], max_steps: int, min_steps: int = MIN_CHUNK_STEPS
) -> Iterator[list[tuple[int, bool]]]:
    """Chunk layouts, each a list of ``(steps, ends_call)`` pieces, for a stream of calls.

    Whole calls share a chunk (one transfer) until it holds ``min_steps``, never more than
    ``max_steps``; a call longer than ``max_steps`` is split over several chunks.

    >>> from itertools import islice, repeat
    >>> list(islice(plan_chunks(repeat(5), max_steps=12, min_steps=8), 2))
    [[(5, True), (5, True)], [(5, True), (5, True)]]
    >>> list(islice(plan_chunks(repeat(5), max_steps=2), 3))
    [[(2, False)], [(2, False)], [(1, True)]]
    """
    chunk: list[tuple[int, bool]] = []
    filled = 0  # steps in `chunk`
    for steps in calls:
        if steps > max_steps:
            if chunk:
                yield chunk
                chunk, filled = [], 0
            while steps > max_steps:  # lazily: a call may span more chunks than fit in memory
                yield [(max_steps, False)]
                steps -= max_steps
            yield [(steps, True)]
            continue
        if filled + steps > max_steps:
            yield chunk
            chunk, filled = [], 0
        chunk.append((steps, True))
        filled += steps
        if filled >= min_steps:
            yield chunk
            chunk, filled = [], 0


def chunk_steps(max_chunk_bytes: int, spec: BatchSpec) -> int:
    """Batches of layout ``spec`` that fit in ``max_chunk_bytes`` (at least one)."""
    return max(1, max_chunk_bytes // max(1, spec.nbytes))


def plan(
    sink_size: int, epoch_length: int | None, max_chunk_bytes: int, spec: BatchSpec, start: Position
) -> Iterator[list[tuple[int, bool]]]:
    """The chunk layouts of a sink's calls from position ``start`` on (see :func:`plan_chunks`)."""
    calls = call_sizes(sink_size, epoch_length, start.step)
    return plan_chunks(calls, chunk_steps(max_chunk_bytes, spec))


def check_data_state(source: Source, data_state: Any) -> None:
    """``ValueError`` if ``data_state`` is not a :meth:`Sink.data_state` of ``source``'s kind;
    changes nothing."""
    if not (isinstance(data_state, dict) and {"epoch", "step", "source"} <= data_state.keys()):
        raise ValueError(
            "data_state must be what Sink.data_state() returned, a dict with 'epoch', 'step' "
            f"and 'source'; got {data_state!r:.200}."
        )
    if "strategy" in data_state:
        strategies.check_recorded(data_state["strategy"])
    try:
        source.check_state(data_state["source"])
    except ValueError as error:
        raise ValueError(
            f"This data_state does not fit the dataset: {error} Give what Sink.data_state() "
            "returned for a sink over the same dataset."
        ) from None
    saved = data_state.get("epoch_length")
    if saved is not None and saved != source.epoch_length:
        raise _length_error(data_state, f"{saved} batches per epoch", source.epoch_length)


def _length_error(data_state: dict[str, Any], saved: str, length: int | None) -> ValueError:
    return ValueError(
        f"This data_state was saved over a dataset of another epoch length ({saved}) than this "
        f"one ({length} batches per epoch), at epoch {data_state['epoch']}, step "
        f"{data_state['step']}: resuming would run partial epochs. Resume with the dataset and "
        "batch size it was saved with, or start without it."
    )


def move_to(source: Source, data_state: Any) -> None:
    """Set ``source`` to a position saved by :meth:`Sink.data_state`; ``ValueError`` if it does
    not fit, such as one saved over a dataset of another epoch length (the source is then left
    where the state put it: restore it)."""
    check_data_state(source, data_state)
    try:
        source.set_state(data_state["source"])
    except Exception as error:
        raise ValueError(
            f"This data_state does not fit the dataset ({type(error).__name__}: {error}). Give "
            "what Sink.data_state() returned for a sink over the same dataset."
        ) from error
    saved = Position(data_state["epoch"], data_state["step"])
    length = source.epoch_length
    if source.position != saved or (length is not None and saved.step >= length):
        index = data_state["source"].get("next_index")  # a grain state implies its length
        implied = (index - saved.step) // saved.epoch if saved.epoch and index else None
        raise _length_error(data_state, f"{implied or 'unknown'} batches per epoch", length)


MAX_SINK_SIZE = 2**31 - 1  # scan counts its steps in int32 (without jax_enable_x64)


def check_sink_size(sink_size: Any) -> int:
    """``sink_size`` as an int: steps per call (1 to :data:`MAX_SINK_SIZE`), or -1; else a
    ``ValueError``."""
    if (
        isinstance(sink_size, bool)
        or not isinstance(sink_size, numbers.Integral)
        or not (0 < sink_size <= MAX_SINK_SIZE or sink_size == -1)
    ):
        raise ValueError(
            f"sink_size must be a positive int (steps per call, at most {MAX_SINK_SIZE}: a "
            f"call stacks every step's output) or -1 (one epoch per call), got {sink_size!r}."
        )
    return int(sink_size)


def _validate(sink_size: Any, prefetch: Any, timeout: Any, max_chunk_bytes: Any) -> None:
    check_sink_size(sink_size)
    if isinstance(prefetch, bool) or not isinstance(prefetch, numbers.Integral) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1 (chunks ready ahead), got {prefetch!r}.")
    if not isinstance(timeout, numbers.Real) or not 0 < timeout <= threading.TIMEOUT_MAX:
        raise ValueError(
            f"timeout must be seconds > 0 (at most {threading.TIMEOUT_MAX:.3g}), got {timeout!r}."
        )
    if (
        isinstance(max_chunk_bytes, bool)
        or not isinstance(max_chunk_bytes, numbers.Real)
        or not 1 <= max_chunk_bytes < math.inf
    ):
        raise ValueError(
            f"max_chunk_bytes must be a number of bytes >= 1, got {max_chunk_bytes!r}."
        )


def sink_device(device: jax.Device | str | None) -> jax.Device:
    """``device``; a target or platform name (``"CPU"``, ``"cpu"``, ``"gpu"``) is its first
    device; ``None`` the context's.

    >>> sink_device("cpu").platform
    'cpu'
    """
    if device is None:
        return context.default_device()
    if isinstance(device, str):
        for target, platforms in TARGETS.items():
            if device.lower() in (target.lower(), *platforms):
                return resolve_device(target)
        raise ValueError(
            f"device must be a jax.Device or a target name ({', '.join(TARGETS)}), got {device!r}."
        )
    if not isinstance(device, jax.Device):
        raise TypeError(
            f"device must be a jax.Device (e.g. jax.devices()[0]) or a target name "
            f"({', '.join(TARGETS)}), got {type(device).__name__}."
        )
    return device


class Sink:
    """A step function bound to a dataset; see :func:`data_sink`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        dataset: Any,
        sink_size: int = 1,
        *,
        jit: bool | None = None,
        strategy: str = "auto",
        prefetch: int = 2,
        max_chunk_bytes: int = 256 << 20,
        timeout: float = 60.0,
        device: jax.Device | str | None = None,
        sharding: jax.sharding.Sharding | None = None,
        save_graphs: str | os.PathLike[str] | None = None,
        read_options: grain.ReadOptions | None = None,
        data_state: dict[str, Any] | None = None,
    ):
        _validate(sink_size, prefetch, timeout, max_chunk_bytes)
        self.fn = fn
        self.sink_size = int(sink_size)
        self.jit = context.jit_enabled(jit)
        self.timeout = float(timeout)
        self.prefetch = int(prefetch)
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.sharding = placement.resolve(
            None if device is None else sink_device(device), sharding, context.default_device
        )
        self._source = as_source(dataset, read_options)
        if self.sink_size == -1 and self._source.epoch_length is None:
            self._source.close()
            raise ValueError(
                f"sink_size=-1 runs one epoch per call, which needs a dataset of known length; "
                f"{type(dataset).__name__} has no len(). Pass sink_size > 0 (steps per call) or a "
                "sized dataset (a grain MapDataset, a list)."
            )
        recorded = data_state.get("strategy") if isinstance(data_state, dict) else None
        try:
            self._strategy_name = strategies.pinned(  # what "auto" would measure
                strategies.resolve(
                    strategy,
                    jit=self.jit,
                    steps_per_call=self.steps_per_call,
                    backend=backend_of(self.sharding),
                    devices=placement.devices(self.sharding),
                    processes=jax.process_count(),
                ),
                recorded,
            )
            self._peers = distributed.Peers.of(
                self.sharding,
                self.timeout,
                sink_size=self.sink_size,
                epoch_length=self.epoch_length,
            )
        except Exception:  # a bad strategy, or processes that disagree or never answer
            self._source.close()
            raise
        self._interactions_at_start = pjrt.counted(placement.platform(self.sharding))
        self._compiler = Compiler(fn, save_graphs=save_graphs or context.graphs_folder())
        self._strategy: Any = None
        self._step: Any = None  # the step function the strategy runs
        self._reselect = False  # measure at the next call, see reselect()
        self._stateful: bool | None = None
        self._in_flight: tuple[Any, Any] | None = None
        self._chunk: Chunk | None = None  # being consumed, piece by piece
        self._returned: Any = None  # the state the last call returned (its array part)
        self._handed_back: Any = (None, None)  # the last returned state, and its array part
        self._static: Static | None = None  # the state's non-array leaves, from the first call
        self._piece = self._offset = 0
        self._resync = False
        self._running = False  # whether a call is running
        self._closed = False
        self._steps = self._calls = self._dispatches = 0
        self._data_wait_s = self._busy_s = 0.0
        if data_state is not None:
            try:
                move_to(self._source, data_state)
            except ValueError:
                self._source.close()
                raise
        self._committed = snapshot(self._source)
        self._start_ring()

    # -- data channel --------------------------------------------------------------------
    def _start_ring(self) -> None:
        with interrupt.held():  # a producer started is a producer recorded (and closed)
            self._ring = DeviceRing(
                self._source,
                # the plan holds no reference to the sink: an unclosed sink can still be collected
                functools.partial(plan, self.sink_size, self.epoch_length, self.max_chunk_bytes),
                prefetch=self.prefetch,
                sharding=placement.stacked(self.sharding),
                stack=strategies.takes_stacked_chunks(self._strategy_name),
            )
            self._finalizer = weakref.finalize(self, self._ring.close, self.timeout)

    def _stop_ring(self) -> bool:
        """Stop the producer; whether it ended within ``timeout`` (see :meth:`DeviceRing.close`)."""
        self._finish_in_flight()
        self._chunk = None
        self._finalizer.detach()
        return self._ring.close(self.timeout)

    def _stuck_producer(self, doing: str) -> str:
        return (
            f"The producer thread is still inside the dataset's iterator {self.timeout:.1f} s "
            f"after {doing} asked it to stop: the dataset is slow or blocked. The thread is a "
            "daemon and ends as soon as the dataset returns; a dataset that can block "
            "indefinitely should time out by itself."
        )

    def data_state(self) -> dict[str, Any]:
        """Where the next call starts reading: ``{"epoch", "step", "source"}``, JSON-friendly,
        and, once known, the ``"strategy"`` that ran (``"scan"`` or ``"loop"``).

        Pass it to :meth:`restore_data_state` (or ``data_sink(..., data_state=...)``) to continue
        with exactly the next batch, none repeated and none skipped -- and, where ``"auto"``
        would choose, with the same strategy, so that a resumed run computes what the
        uninterrupted one did, bit for bit. With a dataset of known length it also holds
        ``"epoch_length"``: a resume onto another length is refused.
        """
        state = dict(self._committed)
        if self.epoch_length is not None:
            state["epoch_length"] = self.epoch_length
        name = getattr(self._strategy, "name", None)
        if name in strategies.RECORDED:
            state["strategy"] = name
        return state

    def reselect(self) -> None:
        """Let ``"auto"`` measure its candidates again at the next call (e.g. after the machine's
        load changed) instead of reusing the choice made for this step function before; the new
        choice replaces it."""
        if self._strategy_name != "auto":
            raise ValueError(
                f"This sink's strategy is {self._strategy_name!r}, not chosen by measuring: "
                "reselect() applies to strategy='auto' (not pinned by strategy=, "
                f"{strategies.ENV} or a data_state's 'strategy')."
            )
        if self._strategy is None:
            self._reselect = True  # applied once the first call made the strategy
        else:
            self._strategy.reselect()

    def restore_data_state(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by :meth:`data_state`; drops the prefetched chunks.

        Refused (``RuntimeError``) while a call runs, from another thread. If interrupted, the
        next call finishes the rewind, to :meth:`data_state` as it then reads.
        """
        if self._running:
            raise self._busy()
        self._running = True
        try:
            self._check_open()
            self._rewind(state)
        finally:
            self._running = False

    @staticmethod
    def _busy() -> RuntimeError:
        return RuntimeError(
            "This sink is already running a call, from another thread (or restoring its data "
            "state). A sink runs one at a time, as each moves its data position: give each "
            "thread its own sink, or let them take turns (a threading.Lock around the calls)."
        )

    def _rewind(self, state: dict[str, Any]) -> None:
        check_data_state(self._source, state)  # before the producer stops: a one-shot
        # iterator's producer cannot be restarted where it was
        self._resync = True  # until a producer runs from `_committed` again
        if not self._stop_ring():  # its source is in use: rewinding it now would corrupt it
            raise SinkTimeoutError(
                self._stuck_producer("rewinding the data")
                + " Call again once it has returned, or create a new sink."
            )
        try:
            move_to(self._source, state)
        except ValueError:  # the sink stays where it was, its producer running
            with contextlib.suppress(Exception):
                self._source.set_state(self._committed["source"])
            self._start_ring()
            self._resync = False
            raise
        self._committed = snapshot(self._source)
        if "strategy" in state:  # what "auto" would measure, the saved run chose
            if isinstance(self._strategy, strategies.Auto):
                self._strategy.pin(state["strategy"])
            elif self._strategy is None and self._strategy_name == "auto":
                self._strategy_name = state["strategy"]
        self._start_ring()
        self._resync = False

    @property
    def epoch(self) -> int:
        """Epoch of the next batch (from 0)."""
        return self._committed["epoch"]

    @property
    def step(self) -> int:
        """Step within :attr:`epoch` of the next batch (from 0)."""
        return self._committed["step"]

    @property
    def epoch_length(self) -> int | None:
        """Batches per epoch, when the dataset's length is known."""
        return self._source.epoch_length

    @property
    def steps_per_call(self) -> int | None:
        """Steps a call runs: ``sink_size``, or for ``-1`` the epoch length."""
        return self.sink_size if self.sink_size > 0 else self.epoch_length

    # -- execution -----------------------------------------------------------------------
    def _strategy_for(self, stateful: bool, static: Static | None) -> Any:
        if self._stateful is None:
            check_step_form(self.fn, stateful)
            self._stateful, self._static = stateful, static
            fn = self.fn if stateful else stateless(self.fn)
            if static is not None:  # an equinox module, say: compile around its functions
                fn = with_static(fn, static)
                self._compiler.specialise(static.key)
            self._step = fn
            self._strategy = strategies.make(self._strategy_name, fn, self._compiler)
            if self._reselect:
                self._strategy.reselect()
        elif self._stateful != stateful:
            form = "sink(state)" if self._stateful else "sink()"
            raise TypeError(f"This sink was first called as {form}; call it the same way again.")
        elif not (static is self._static or (static and static.same(self._static))):
            raise TypeError(
                "The state's non-array leaves (functions, flags, other Python objects) differ "
                "from those of the first call; a sink compiles them in. Pass the state the last "
                "call returned, or create a new sink for another model."
            )
        return self._strategy

    def _partition(self, state: Any) -> tuple[Any, Static | None]:
        """:func:`~sinkax.pytree.partition` of ``state``; free for the state the last call
        returned."""
        handed_back, arrays = self._handed_back
        if state is handed_back:
            return arrays, self._static
        return partition(state)

    def _finish_in_flight(self) -> None:
        """Wait for the last dispatched chunk's compute, then free its device slot.

        An unstacked ring's chunk owns no memory that the ring reuses (the batches were handed
        over one by one), so its slot is freed without waiting.
        """
        if self._in_flight is None:
            return
        if self._ring.stack:
            with contextlib.suppress(RuntimeError):  # outputs donated or deleted: it is over
                jax.block_until_ready(self._in_flight)
        self._in_flight = None
        self._ring.release()

    def _next_chunk(self) -> Chunk:
        t0 = time.perf_counter()
        try:
            return self._ring.get(self.timeout)
        except SinkTimeoutError:
            raise SinkTimeoutError(self._timeout_message()) from None
        finally:
            self._data_wait_s += time.perf_counter() - t0

    def _timeout_message(self) -> str:
        ring = self._ring.stats
        produced = f"{ring.batches / ring.busy_s:.1f} batches/s" if ring.busy_s else "n/a"
        consumed = f"{self._steps / self._busy_s:.1f} steps/s" if self._busy_s else "n/a"
        return (
            f"The input pipeline delivered no batch for {self.timeout:.1f} s while the sink "
            f"waited for data (epoch {self.epoch}, step {self.step}). So far it has delivered "
            f"{ring.batches} batches, at {produced}; the sink consumes {consumed}. The pipeline "
            "is stuck or very slow per batch: speed it up (grain ReadOptions(num_threads=...), "
            "batch before heavy transforms, vectorise them), raise `timeout=` if single batches "
            "can take that long, or iterate the dataset directly (or dataset_sink_mode=False) "
            "to find the slow sample."
        )

    def __call__(self, state: Any = _NO_STATE) -> Any:
        """Run ``sink_size`` steps; ``sink(state)`` gives ``(state, outs)``, ``sink()`` ``outs``.

        ``outs`` stacks every step's output on a leading axis. The state is donated: use the
        returned one. If the call fails or is interrupted, the state passed in stays valid and
        the data position does not move -- except that an error the compiled steps raise while
        they run consumes the donated state, as in any donating ``jax.jit``. A Ctrl-C that
        comes once the state is donated is held until the next call (or ``close()``), which it
        stops before anything runs.
        """
        if self._running:  # a load and a store, no call between: no other thread runs in between
            raise self._busy()
        self._running = True
        parts: list[Any] = []
        guarded = False  # whether this call holds Ctrl-C (main thread only): it clears it
        carry: Any = None
        try:
            self._check_open()
            interrupt.deliver_held()  # a Ctrl-C held back by the last call stops this one first
            if self.jit:  # compiled constants: refuse stale ones
                self._compiler.check_captures()
            stateful = state is not _NO_STATE
            arrays, static = self._partition(state) if stateful else ((), None)
            run = self._strategy_for(stateful, static)
            if self._resync:  # an interrupted call took data it never delivered: rewind
                self._rewind(self._committed)
            carry = () if not stateful else self._on_device(arrays)
            t_call, wait_before = time.perf_counter(), self._data_wait_s
            while True:
                chunk = self._peers.agree(self._current_chunk)
                piece = chunk.pieces[self._piece]
                if stateful and self.jit and not parts:  # the caller's state must stay valid:
                    if piece.ends_call and run.atomic:  # one dispatch donates it; after that,
                        guarded = interrupt.guard(carry)  # hold Ctrl-C until it is returned
                    else:  # a failure between dispatches would lose it: work on a copy
                        carry = copy_tree(carry)
                carry, outs = run.run(carry, chunk.data, self._offset, piece.steps)
                parts.append(outs)  # from here on, an interrupted call has consumed data
                self._in_flight = (carry, outs)
                self._piece += 1
                self._offset += piece.steps
                self._dispatches += run.dispatches(piece.steps)
                self._steps += piece.steps
                if piece.ends_call:
                    break
            outs = parts[0] if len(parts) == 1 else concat_trees(parts)
            busy_s = time.perf_counter() - t_call - (self._data_wait_s - wait_before)
            committed = {
                "epoch": piece.position.epoch,
                "step": piece.position.step,
                "source": piece.source_state,
            }
            # Every step has run: from here to the return a Ctrl-C is held, whatever the path,
            # so that the results and the new data position reach the caller together. (This
            # also drops the guarded state, so that its arrays are freed here, while held.)
            guarded = interrupt.guard(interrupt.DISPATCHED)
            self._returned = carry  # frees the last call's state, while a Ctrl-C is held
            returned = carry if static is None else static.combine(carry)  # static: put back
            self._handed_back = (returned, carry)
            interrupt.checkpoint()  # ... and a Ctrl-C that came meanwhile is handled here
        except BaseException as error:
            self._peers.fail(error)  # the other processes raise too, none waits for this one
            if guarded or interrupt.GUARD.state is carry:  # (a Ctrl-C as guard() returned)
                interrupt.GUARD.state = None
            if parts:  # data was consumed and not delivered: the next call rewinds
                self._resync = True
            if self._ring.failed:  # ... unless every call fails the same way
                self._resync = False
            self._running = False
            raise
        # From here on nothing is called and nothing slow is freed, so no Ctrl-C is handled
        # (Python does that at calls and backward jumps) until the caller's own check after
        # the return: the only window left, a few bytecodes long.
        self._committed = committed
        self._calls += 1
        self._busy_s += busy_s
        self._running = False
        if guarded:
            interrupt.GUARD.state = None
        return (returned, outs) if stateful else outs

    def _on_device(self, state: Any) -> Any:
        """``state`` on the sink's device, its weakly typed leaves (Python numbers) given the
        dtypes the step returns them with (see :func:`carry_dtypes`); free for the state the
        last call returned."""
        if state is self._returned:
            return state
        check_alive(state)
        state = placement.place_state(state, self.sharding)
        if not self.jit:
            return state
        batch = self._ring.first_spec(self.timeout).abstract
        dtypes = self._compiler.memo(
            ("carry", layout((state, batch))), lambda: carry_dtypes(self._step, state, batch)
        )
        leaves, treedef = jax.tree.flatten(state)
        casts = [  # a weakly typed leaf would come back strongly typed: one layout from the start
            x.astype(d) if jax.typeof(x).weak_type or x.dtype != d else x
            for x, d in zip(leaves, dtypes, strict=True)
        ]
        return jax.tree.unflatten(treedef, casts)

    def _current_chunk(self) -> Chunk:
        """The chunk holding the next piece, taking the next one when this is used up."""
        if self._chunk is None or self._piece == len(self._chunk.pieces):
            # Taking a chunk moves the ring: if anything interrupts this before the chunk is
            # recorded, the next call rewinds to the committed position (nothing is lost).
            self._resync = True
            self._finish_in_flight()  # frees the used-up chunk's slot
            try:
                chunk = self._next_chunk()
            except Exception:  # a timeout or the producer's error: nothing was taken
                self._resync = False
                raise
            self._chunk = chunk
            self._piece = self._offset = 0
            self._resync = False
        return self._chunk

    def lower(self, state: Any = _NO_STATE) -> jax.stages.Lowered:
        """The scan executable of one chunk of this sink, lowered (``.as_text()`` is StableHLO).

        ``state`` may be concrete or abstract (``jax.ShapeDtypeStruct``); omit it for a
        stateless sink. Waits for the first batch to learn the batch layout.
        """
        spec = self._ring.first_spec(self.timeout)
        steps = min(self.steps_per_call, chunk_steps(self.max_chunk_bytes, spec))  # type: ignore[type-var]
        if state is _NO_STATE:
            fn, state = stateless(self.fn), ()
        else:
            state, static = partition(state)
            fn = self.fn if static is None else with_static(self.fn, static)
        program = scan_program(strategies.loop_body(fn, placement.platform(self.sharding)), steps)
        return Compiler.lower(program, state, spec.stacked(steps), 0)

    @property
    def stats(self) -> SinkStats:
        """A snapshot of :class:`SinkStats`."""
        ring = self._ring.stats
        timings = getattr(self._strategy, "timings", {})
        return SinkStats(
            steps=self._steps,
            calls=self._calls,
            dispatches=self._dispatches,
            compiles=self._compiler.compiles,
            chunks_transferred=ring.chunks,
            bytes_transferred=ring.bytes,
            max_chunks_on_device=ring.max_chunks_on_device,
            data_wait_s=self._data_wait_s,
            slot_wait_s=ring.slot_wait_s,
            strategy=self._strategy.name if self._strategy else self._strategy_name,
            strategy_timings={k: v for k, v in timings.items() if math.isfinite(v)},
            interactions=pjrt.since(self._interactions_at_start),
        )

    # -- lifetime ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SinkClosedError("This sink is closed; create a new one with sinkax.data_sink.")

    def close(self) -> None:
        """Stop the producer thread and free the device chunks. Idempotent.

        From another thread while a call waits for data, that call fails at once with
        :class:`~sinkax.SinkClosedError` (its state stays valid).
        """
        if not self._closed:
            self._closed = True
            if self._running:  # a call in another thread owns the chunks: wake it, leave them
                self._finalizer.detach()
                self._ring.close(self.timeout)
            elif not self._stop_ring():
                warnings.warn(self._stuck_producer("close()"), RuntimeWarning, stacklevel=2)
        interrupt.release()

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def data_sink(fn: Callable[..., Any], dataset: Any, sink_size: int = 1, **options: Any) -> Sink:
    """Bind ``fn`` to ``dataset`` so that each call runs ``sink_size`` steps on the device.

    Args:
      fn: ``fn(state, batch) -> (state, out)``, called as ``sink(state)``; or, stateless (eval,
        predict), ``fn(batch) -> out``, called as ``sink()``.
      dataset: a grain ``MapDataset``/``IterDataset``/``DataLoader`` or any re-iterable of
        pytrees of arrays; one pass is one epoch. Every batch must match the first in
        structure, shape and dtype.
      sink_size: steps per call; ``-1`` is one epoch per call (needs a dataset of known length).
        With ``sink_size > 0`` the data is traversed endlessly.
      jit: ``True`` compiles (GRAPH mode), ``False`` runs eagerly (PYNATIVE, for debugging);
        default from :func:`sinkax.set_context`.
      strategy: ``"auto"`` (measure in the first call, keep the faster), ``"scan"``, ``"loop"``,
        or for ``sink_size=1`` ``"step"`` (see :mod:`sinkax.strategy`). The environment
        variable ``SINKAX_STRATEGY`` (``scan`` / ``loop``) pins what ``"auto"`` runs, and so
        does a ``data_state`` that recorded one.
      prefetch: chunks prepared ahead on the device; at most ``prefetch + 1`` are held there.
      max_chunk_bytes: a call whose data exceeds this is fed as several consecutive chunks.
      timeout: seconds without a single new batch from the dataset before a waiting call
        raises :class:`~sinkax.SinkTimeoutError` (a slow but steady pipeline never times out).
      device: where data and compute go: a ``jax.Device`` or a target name (``"CPU"``,
        ``"GPU"``, ``"Ascend"``, ``"Emulated"``, or a platform name such as ``"cpu"``); default
        from the context.
      sharding: instead of ``device``, a ``jax.sharding.Sharding`` of one batch, e.g.
        ``NamedSharding(mesh, P("data"))`` to split the batch axis over the mesh's devices
        (data parallelism; the state is replicated unless already placed on those devices).
        Across ``jax.distributed`` processes each process's dataset yields its own part of
        every global batch (see :mod:`sinkax.distributed`).
      save_graphs: a folder to write each executable's StableHLO and optimised HLO into.
      read_options: ``grain.ReadOptions`` for a grain ``MapDataset`` (default: read in the
        producer thread; give ``num_threads`` for heavy per-record Python transforms).
      data_state: a :meth:`Sink.data_state` to start from.

    Returns:
      a :class:`Sink`; close it (or use ``with``) to stop its producer thread.
    """
    return Sink(fn, dataset, sink_size, **options)
