"""``data_sink``: many steps of a step function per host interaction.

A :class:`Sink` binds a step function to a dataset. Each call runs ``sink_size`` steps on the
device -- one compiled executable over a chunk of batches that a background producer has
already stacked and copied to the device (:mod:`sinkax.channel`) -- and returns the new state
and every step's output stacked on a leading axis. Consecutive calls continue through the data
exactly where the last one stopped; one call may cross epoch boundaries.

A sink is a facade over three parts: its checked :class:`~sinkax.config.SinkConfig`, a
:class:`~sinkax.channel.cursor.Cursor` (the data position and the ring that reads ahead) and an
:class:`~sinkax.execution.executor.Executor` (strategy, compiled programs, placement).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grain
import jax

from sinkax import context, interrupt, peers, pjrt, placement
from sinkax.channel.cursor import Cursor
from sinkax.channel.position import DataPosition
from sinkax.channel.source import as_source
from sinkax.config import SinkConfig, known_options
from sinkax.errors import SinkClosedError
from sinkax.execution import guard
from sinkax.execution.executor import NO_STATE, Executor
from sinkax.pytree import copy_tree
from sinkax.stats import SinkStats


def _shaping(config: SinkConfig) -> dict[str, Any]:
    """The options shaping a sink's programs and chunks, as processes compare them (Peers)."""
    shaping = ("sink_size", "jit", "strategy", "max_chunk_bytes", "calls", "ragged_last")
    mesh = placement.describe(config.sharding)
    return {**{name: getattr(config, name) for name in shaping}, "mesh": mesh}


_BUSY = (
    "This sink is already running a call, from another thread (or restoring its data state). "
    "It runs one at a time: give each thread its own sink, or a threading.Lock around the calls."
)


class Sink:
    """A step function bound to a dataset; see :func:`data_sink` (whose options, other than
    the context's defaults, it takes)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        dataset: Any,
        sink_size: int | str = 1,
        *,
        read_options: grain.ReadOptions | None = None,
        data_state: DataPosition | dict[str, Any] | None = None,
        **options: Any,
    ):
        self.config = config = SinkConfig.of(sink_size, **known_options(options))
        self.fn, self.sink_size = fn, config.sink_size
        source = as_source(dataset, read_options)
        # before the producer starts: its first transfers are this sink's
        self._interactions_at_start = pjrt.counted(placement.platform(config.sharding))
        self._peers: peers.Alone | peers.Peers = peers.Alone()  # until the processes compare
        try:
            guard.check_rereadable(config.stop_if_nonfinite, source.rereadable)
            steps = config.check_length(source.epoch_length, dataset)
            start = None if data_state is None else DataPosition.from_dict(data_state)
            recorded = start.strategy if start else None
            self._executor = Executor(fn, config, steps_per_call=steps, recorded=recorded)
            self._peers = peers.Peers.of(
                config.sharding,
                config.timeout,
                **_shaping(config),
                epoch_length=source.epoch_length,
                recorded_strategy=recorded,
            )
            self._cursor = Cursor(source, config, feed=self._executor.feed, data_state=start)
        except Exception as error:  # bad options or data_state, or processes that disagree
            source.close()
            self._peers.fail(error)  # the others learn of it (PeerError), not wait
            raise
        self._running = self._closed = self._compared = False
        self.nonfinite: guard.NonFinite | None = None  # where the last call stopped, if it did

    def __call__(self, state: Any = NO_STATE) -> Any:
        """Run ``sink_size`` steps; ``sink(state)`` gives ``(state, outs)``, ``sink()`` ``outs``.

        ``outs`` stacks every step's output on a leading axis. The state is donated: use the
        returned one. If the call fails or is interrupted, the state passed in stays valid and
        the data position does not move -- except that an error the compiled steps raise while
        they run consumes the donated state, as in any donating ``jax.jit``. A Ctrl-C that
        comes once the state is donated is held until the next call (or ``close()``), which it
        stops before anything runs.
        """
        handoff = interrupt.Handoff.opened()  # passes Ctrl-C on until the call says otherwise
        with self._cursor.ring.quiet:  # its producer pauses meanwhile (see channel.quiet)
            result = self._call(handoff, state)  # freeing its arrays may let go of the lock
        interrupt.checkpoint()  # lock: a Ctrl-C meanwhile is handled here, not in the caller
        self._running = False
        handoff.state = None  # a store, no call: see interrupt.Handoff
        return result

    def _call(self, handoff: interrupt.Handoff, state: Any) -> Any:
        if self._running:  # a load and a store, no call between: no other thread runs in between
            raise RuntimeError(_BUSY)
        self._running = True
        cursor, executor, parts = self._cursor, self._executor, []
        compiled_s = executor.compiler.seconds  # "auto" times a call less its compiles
        stopped: Any = None  # stop_if_nonfinite: the output of the step not kept
        self.nonfinite = None
        try:
            self._peers.begin()  # the others' time to come counts from here
            self._check_open()
            interrupt.deliver_held()  # a Ctrl-C held back by the last call stops this one first
            arrays, static = executor.select(state)
            cursor.resync()  # an interrupted call took data it never delivered: rewind
            if not self._compared:  # with the next dispatch, across processes
                self._peers.include(
                    lambda: {
                        "batch": str(cursor.first_spec().abstract),
                        "state": placement.planned(arrays, self.config.sharding),
                        "strategy": executor.strategy_name,
                    }
                )
                self._compared = True
            cursor.begin()
            carry = None  # placed once every process has its data: placing may be a collective
            while True:
                data, piece, offset = cursor.next_piece(self._peers.agree)
                carry = executor.place(arrays, cursor.first_spec) if carry is None else carry
                if state is not NO_STATE and executor.jit and not parts:  # the caller's state
                    # must stay valid: donated only where one dispatch is the whole call
                    if cursor.ends_call(piece, ahead=True) and executor.atomic:
                        handoff.donating(carry)  # donates it; hold Ctrl-C until it returns
                    else:  # a failure between dispatches would lose it: work on a copy
                        carry = copy_tree(carry)
                carry, outs = executor.run(carry, data, offset, piece.steps)
                del data  # the next piece may free its slot: hold no reference past it
                outs, kept = executor.checked(carry, outs, piece.steps, cursor.ring.quiet)
                if kept < piece.steps:  # stop_if_nonfinite: a step was not finite
                    outs, stopped = guard.split(outs, kept)
                parts.append(outs)  # from here on, an interrupted call has consumed data
                cursor.ran(piece, executor.done, kept)
                compiling = executor.compiler.seconds - compiled_s
                if cursor.ends_call(piece, compiling) or stopped is not None:
                    break
            outs = executor.joined(parts)
            # Every step has run: from here to the return a Ctrl-C is held, whatever the path,
            # so that the results and the new data position reach the caller together (this
            # also drops the guarded state, so that its arrays are freed here, while held).
            handoff.dispatched()
            returned = executor.returned(carry, static)  # frees the last call's state
            if stopped is not None:  # the next call starts at the batch not kept
                kept = cursor.call_steps
                cursor.stop()
                self.nonfinite = guard.NonFinite(cursor.epoch, cursor.step, kept, stopped)
        except BaseException as error:
            # A plain store, no call: a second Ctrl-C is held, the cleanup runs whole
            handoff.state = interrupt.DISPATCHED
            self._peers.fail(error)  # the other processes raise too, none waits for this one
            if isinstance(error, peers.PeerTimeoutError):  # the last dispatch may wait
                cursor.abandon()  # for a process that is gone: close() must not wait for it
            cursor.failed(consumed=bool(parts))  # the next call rewinds what this one took
            self._running = False
            handoff.failed()  # (which passes that Ctrl-C on: the sink is left usable)
            raise
        if stopped is None:  # (a Ctrl-C from here on is held: the guard is DISPATCHED)
            cursor.commit(piece, compiling=executor.compiler.seconds - compiled_s)
        if executor.progress:  # the steps no block report covered: queued to be told
            executor.progress.call_ended(outs, stopped)
        return (returned, outs) if state is not NO_STATE else outs

    def data_state(self) -> dict[str, Any]:
        """Where the next call starts reading: ``{"epoch", "step", "source"}``, JSON-friendly,
        and, once known, the ``"strategy"`` that ran (``"scan"`` or ``"loop"``).

        Pass it to :meth:`restore_data_state` (or ``data_sink(..., data_state=...)``) to continue
        with exactly the next batch, none repeated and none skipped -- and, where ``"auto"`` would
        choose, with the same strategy, so that a resumed run computes what the uninterrupted one
        did, bit for bit. With a dataset of known length it also holds ``"epoch_length"``: a resume
        onto another length is refused. A ``sink_size="auto"`` sink records the steps per call it
        reached and its granule (``"call_steps"``, ``"call_granule"``), where a resumed one
        continues. It is :attr:`position`'s :meth:`~sinkax.channel.position.DataPosition.to_dict`.
        """
        return self.position.to_dict()

    @property
    def position(self) -> DataPosition:
        """Where the next call starts reading: :meth:`data_state` is its ``to_dict()``."""
        return self._cursor.position.recording(self._executor.recorded)

    def restore_data_state(self, state: DataPosition | dict[str, Any]) -> None:
        """Continue from a position saved by :meth:`data_state` (or a :attr:`position`); drops
        the prefetched chunks. ``ValueError`` naming the field if it is not one.

        Refused (``RuntimeError``) while a call runs, from another thread. If interrupted, the
        next call finishes the rewind, to :meth:`data_state` as it then reads.
        """
        if self._running:
            raise RuntimeError(_BUSY)
        self._running = True
        try:
            self._check_open()
            position = DataPosition.from_dict(state)
            self._cursor.rewind(position)
            self._executor.pin(position.strategy)  # what "auto" would measure, the saved run chose
        finally:
            self._running = False

    def reselect(self) -> None:
        """Let ``"auto"`` measure its candidates again at the next call (e.g. after the load
        changed) rather than reuse this step function's earlier choice, which the new replaces."""
        self._executor.reselect()

    def lower(self, state: Any = NO_STATE) -> jax.stages.Lowered:
        """A ``lax.scan`` over one chunk, lowered for ``state`` as given (concrete, abstract, or
        none if stateless): a view of the step in its loop (``.as_text()``), not necessarily the
        strategy a call runs (``save_graphs`` writes those). Waits for the first batch."""
        return self._executor.lower(state, self._cursor.first_spec(), self.steps_per_call)

    epoch = property(lambda self: self._cursor.epoch, doc="Epoch of the next batch (from 0).")
    step = property(lambda self: self._cursor.step, doc="Step within the epoch of the next batch.")
    epoch_length = property(lambda self: self._cursor.epoch_length, doc="Batches per epoch.")
    steps_per_call = property(
        lambda self: self.config.steps_per_call(self.epoch_length),
        doc="Steps a call runs: ``sink_size``, or for ``-1`` the epoch length (``None``: auto).",
    )

    @property
    def stats(self) -> SinkStats:
        """A snapshot of :class:`SinkStats`."""
        return SinkStats(
            **self._cursor.counts(),
            **self._executor.counts(),
            interactions=pjrt.since(self._interactions_at_start),
            **placement.memory(self.config.sharding),
            peer_wait_s=self._peers.waited_s,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise SinkClosedError("This sink is closed; create a new one with sinkax.data_sink.")

    def block_until_ready(self) -> None:
        """Wait until every call so far ran and every ``progress`` report of them was told."""
        self._executor.wait()

    def close(self) -> None:
        """Stop the producer, free the device chunks and tell every ``progress`` report
        (idempotent); then raise what the hook raised in the last call if no call has. A call
        waiting for data in another thread fails at once with ``SinkClosedError``."""
        self._shut()
        if self._executor.progress:
            self._executor.progress.raise_error()

    def _shut(self) -> None:  # close(), leaving a progress hook's error to the next close()
        try:
            if not self._closed:
                self._closed = True
                self._cursor.close(running=self._running)
        finally:  # then every progress report (a Ctrl-C in the hook leaves the sink closed)
            try:
                self._executor.close()
            finally:
                interrupt.release()

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, kind: Any, *exc: object) -> None:  # an error on its way: that one goes on
        self._shut() if kind else self.close()


def data_sink(
    fn: Callable[..., Any], dataset: Any, sink_size: int | str = 1, **options: Any
) -> Sink:
    """Bind ``fn`` to ``dataset`` so that each call runs ``sink_size`` steps on the device.

    Args:
      fn: ``fn(state, batch) -> (state, out)``, called as ``sink(state)``; or, stateless (eval,
        predict), ``fn(batch) -> out``, called as ``sink()``.
      dataset: a grain ``MapDataset``/``IterDataset``/``DataLoader`` or any re-iterable of
        pytrees of arrays; one pass is one epoch. Every batch has the first's tree, shapes, dtypes.
      sink_size: steps per call; ``-1`` is one epoch per call (needs a dataset of known length);
        ``"auto"`` sizes each call to last about ``call_seconds``, never past an epoch's end
        (see :mod:`sinkax.channel.sizing`). Else the data is traversed endlessly.
      jit: ``True`` compiles (GRAPH mode), ``False`` runs eagerly (PYNATIVE, for debugging);
        default from :func:`sinkax.set_context`.
      strategy: ``"auto"`` (measure in the first call, keep the faster), ``"scan"``, ``"loop"``,
        or for ``sink_size=1`` ``"step"`` (see :mod:`sinkax.execution.choice`). The environment
        variable ``SINKAX_STRATEGY`` (``scan`` / ``loop``) pins what ``"auto"`` runs, and so
        does a ``data_state`` that recorded one.
      prefetch: chunks prepared ahead (1 to 64), beside the one in use (:mod:`sinkax.channel.ring`).
      max_chunk_bytes: a call whose data exceeds this is fed as several consecutive chunks.
      timeout: seconds without a single new batch from the dataset before a waiting call
        raises :class:`~sinkax.SinkTimeoutError` (a slow but steady pipeline never times out;
        the device's time computing earlier chunks, which holds up the next, does not count).
      device: where data and compute go: a ``jax.Device`` or a target name (``"CPU"``, ``"GPU"``,
        ``"Ascend"``, ``"Emulated"``, or a platform such as ``"cpu"``); default from the context.
      sharding: instead of ``device``, a ``jax.sharding.Sharding`` of one batch, e.g.
        ``NamedSharding(mesh, P("data"))`` to split the batch axis over the mesh's devices (data
        parallelism; the state is replicated unless already placed on those devices, and then
        comes back sharded as it was). Across ``jax.distributed`` processes each process's
        dataset yields its own part of every global batch (see :mod:`sinkax.distributed`).
      save_graphs: a folder to write each executable's StableHLO and optimised HLO into.
      compiler_options: XLA options for every executable, as ``jax.jit``'s (``{}``: XLA's
        defaults); default: the device's, see :func:`sinkax.backend.compiler_options`.
      calls: the calls this sink will make, if known (``DatasetHelper`` and ``Model`` pass
        their epochs): its producer then reads and moves to the device nothing past them, and a
        call after them raises :class:`~sinkax.errors.SinkExhaustedError`; a call that
        ``stop_if_nonfinite`` ends before it kept a step is not counted. Default: no limit.
      total_steps: for ``sink_size="auto"`` or ``-1``, instead of ``calls``, the steps the sink
        will run, if known (``DatasetHelper`` and ``Model`` pass their epochs' steps): its last
        call ends there, and nothing past them is read or moved.
      ragged_last: each epoch's last batch may have fewer rows (a dataset batched without
        ``drop_remainder``; its length must be known); needs ``sink_size=1`` and
        ``strategy="step"`` -- each batch its own executable -- as non-sink mode runs.
      call_seconds: the seconds a call should last (default 1); only for ``sink_size="auto"``.
      stop_if_nonfinite: ``True``, an output entry's name (``"loss"``) or a function of the
        output: a call stops at the first step whose watched output is not finite, keeping the
        state from before it, returns the steps before it, and leaves the data position at
        that batch; :attr:`Sink.nonfinite` says where (see :mod:`sinkax.execution.guard`).
        Each call then waits for its compute to end (it reads one flag).
      progress: ``hook(steps, out)``, told of the steps done while a call runs: every
        ``progress_every`` steps (default 100) once the device computed them, from a thread of
        the sink's, the rest with a later block or as the call returns (see
        :mod:`sinkax.execution.progress`). An error it raises comes from a later call, before it
        runs, or from :meth:`Sink.close`.
      pin_memory: build chunks in the device's pinned (page-locked) host memory, which the
        device reads by DMA, not in numpy memory, which a GPU runtime first copies into pinned
        memory of its own (one device; ``prefetch + 1`` chunks never paged out; not for the
        ``"step"`` strategy, which hands batches over as they are). Default ``False``.
      read_options: ``grain.ReadOptions`` for a grain ``MapDataset`` (default: read in the
        producer thread; give ``num_threads`` for heavy per-record Python transforms).
      data_state: a :meth:`Sink.data_state` to start from.

    Returns:
      a :class:`Sink`; close it (or use ``with``) to stop its producer thread.

    >>> import numpy as np; data = [{"x": np.float32(i)} for i in range(3)]
    >>> with data_sink(lambda n, b: (n + 1, b["x"] * 2), data, sink_size=2) as sink:
    ...     n, outs = sink(0)
    ...     n, more = sink(n)  # continues at the 3rd batch, then the next epoch's 1st
    >>> int(n), outs.tolist(), more.tolist(), sink.data_state()["epoch"]
    (4, [0.0, 2.0], [4.0, 0.0], 1)
    """
    return Sink(fn, dataset, sink_size, **context.sink_options(options))
