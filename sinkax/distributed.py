"""Several processes feeding one sink: what they must agree on, and failing together.

In a ``jax.distributed`` job every process creates the same sinks in the same order, over a
sharding that spans the devices of all processes (e.g. ``NamedSharding(mesh, P("data"))`` on a
mesh of ``jax.devices()``). Each process's dataset yields only *its part* of every global batch
-- the rows its own devices hold -- and the ring assembles the global chunk with
``jax.make_array_from_process_local_data``. The rule for a dataset:

* grain: shard the source per process, ``grain.sharding.ShardByJaxProcess()`` (or
  ``ShardOptions(shard_index=jax.process_index(), shard_count=jax.process_count())``), and
  batch with the *per-process* batch size (global batch / process count);
* any iterable of global batches: ``map`` :func:`local_rows` over it, which keeps this process's
  contiguous block of rows (on a mesh of ``jax.devices()``, ordered by process, those are the
  rows this process's devices hold);
* in general, process ``i`` yields for the ``k``-th global batch the rows its devices hold;
  every process must yield the same number of batches of the same shape per epoch (checked
  when the sink is created: epoch lengths must agree).

The compiled steps contain collectives (the gradient's all-reduce), so a process that stops
feeding would leave the others blocked inside them. :class:`Peers` prevents that: before each
dispatch every process reports through the ``jax.distributed`` coordination service (its
key-value store, no device collective) that its data is ready, and waits for the others' reports;
a process whose dataset failed (or that timed out, or was interrupted) reports its error
instead, and every process then raises :class:`PeerError` naming it. One report and one read per
other process per dispatch (about 0.5 ms on localhost). A process that never reports (killed,
hung outside the sink) fails the others after ``2 * timeout`` with :class:`PeerTimeoutError`.

Each process keeps its own data position: ``Sink.data_state()`` is this process's.

In one process (or a sharding this process addresses alone) nothing is exchanged:

>>> import jax
>>> peers = Peers.of(jax.sharding.SingleDeviceSharding(jax.devices()[0]), 1.0, sink_size=1)
>>> peers.agree(lambda: "chunk")
'chunk'
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding

from sinkax import compat
from sinkax.errors import SinkTimeoutError

T = TypeVar("T")

# sinks and saved positions are numbered alike in every process: each makes them in one order
_sink_numbers = itertools.count()
_position_numbers = itertools.count()


def initialize() -> None:
    """Join the ``jax.distributed`` job this process belongs to.

    Started by :mod:`sinkax.launch`: with the coordinator, process count and id it set in the
    environment. Otherwise ``jax.distributed.initialize()`` with no arguments, which detects
    SLURM, Open MPI and Kubernetes (indexed Job) environments and fails elsewhere.
    """
    if "SINKAX_PROCESS_ID" in os.environ:
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["SINKAX_NUM_PROCESSES"]),
            process_id=int(os.environ["SINKAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()


def batch_sharding(axis: str = "data") -> NamedSharding:
    """``NamedSharding(mesh, P(axis))`` over every device of the job (all processes): the
    batch axis split over them, the data-parallel ``sharding=`` of a sink."""
    mesh = jax.make_mesh((jax.device_count(),), (axis,), axis_types=(AxisType.Auto,))
    return NamedSharding(mesh, PartitionSpec(axis))


def local_rows(batch: Any) -> Any:
    """This process's block of a global batch: rows ``i * B / n`` to ``(i + 1) * B / n`` of
    every leaf for process ``i`` of ``n`` -- the rows its devices hold under
    :func:`batch_sharding`. ``dataset.map(local_rows)`` turns a dataset of global batches into
    this process's part (each process reads the whole batch; sharding the records per process
    reads less, see the module docstring).

    >>> import numpy as np
    >>> local_rows({"x": np.arange(4)})["x"].tolist()  # one process: all of it
    [0, 1, 2, 3]
    """
    i, n = jax.process_index(), jax.process_count()

    def block(leaf: Any) -> Any:
        rows = len(leaf)
        if rows % n:
            raise ValueError(
                f"A global batch of {rows} rows cannot be split evenly over {n} processes: "
                "make the batch size a multiple of the number of processes (and devices)."
            )
        return leaf[i * rows // n : (i + 1) * rows // n]

    return jax.tree.map(block, batch)


def shared_position(data_state: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """What a checkpoint stores as the data position: ``data_state`` itself in one process;
    across processes every process's, ``{"processes": [...]}`` in process order (every process
    calls, in the same order). :func:`own_position` takes this process's back."""
    if jax.process_count() == 1:
        return data_state
    client, me = compat.coordination_client(), jax.process_index()
    key = f"sinkax/position{next(_position_numbers)}"
    client.key_value_set(f"{key}/{me}", json.dumps(data_state))
    positions = [
        data_state
        if p == me
        else json.loads(client.blocking_key_value_get(f"{key}/{p}", int(timeout * 1000)))
        for p in range(jax.process_count())
    ]
    return {"processes": positions}


def own_position(saved: dict[str, Any]) -> dict[str, Any]:
    """This process's data position in what :func:`shared_position` gave; ``ValueError`` if
    it was saved by a job of another number of processes."""
    count = len(saved["processes"]) if "processes" in saved else 1
    if count != jax.process_count():
        raise ValueError(
            f"This checkpoint holds the data positions of {count} process(es), but this job has "
            f"{jax.process_count()}: resume it with {count} process(es), each feeding the same "
            "part of the data as before."
        )
    return saved["processes"][jax.process_index()] if "processes" in saved else saved


class PeerError(RuntimeError):
    """Another process of the job failed; this one stops too instead of waiting for it."""


class PeerTimeoutError(PeerError, SinkTimeoutError):
    """Another process of the job did not report in time."""


class Alone:
    """One process: nothing to agree on."""

    def agree(self, fetch: Callable[[], T]) -> T:
        """``fetch()``."""
        return fetch()

    def fail(self, error: BaseException) -> None:
        """Nothing: no one else is waiting."""


class Peers:
    """The processes of a sink over a sharding that spans them; see the module docstring."""

    @staticmethod
    def of(sharding: Sharding, timeout: float, **config: Any) -> Alone | Peers:
        """:class:`Alone`, or when ``sharding`` spans other processes, :class:`Peers` that
        checked that ``config`` (sink size, epoch length, ...) is the same in every process
        (``ValueError`` naming the differences otherwise)."""
        if sharding.is_fully_addressable:
            return Alone()
        return Peers(f"sinkax/sink{next(_sink_numbers)}", timeout, config)

    def __init__(self, name: str, timeout: float, config: dict[str, Any]):
        self._client = compat.coordination_client()
        self._name = name
        self._me = jax.process_index()
        self._others = [p for p in range(jax.process_count()) if p != self._me]
        self._timeout_ms = int(2 * timeout * 1000)
        self._round = 0
        mine = json.dumps(config, sort_keys=True)
        self._client.key_value_set(f"{name}/config/{self._me}", mine)
        for process in self._others:
            theirs = self._read(f"{name}/config/{process}", "create this sink")
            if theirs != mine:
                raise ValueError(
                    f"The processes disagree about this sink: process {self._me} has {mine}, "
                    f"process {process} has {theirs}. Every process must create its sinks in "
                    "the same order with the same sink_size, and its dataset must give the same "
                    "number of batches per epoch (shard the data evenly over the processes)."
                )

    def _key(self, round_: int, process: int) -> str:
        return f"{self._name}/{round_}/{process}"

    def _read(self, key: str, doing: str) -> str:
        try:
            return self._client.blocking_key_value_get(key, self._timeout_ms)
        except Exception as error:  # the coordination service's DEADLINE_EXCEEDED
            process = key.rsplit("/", 1)[1]
            raise PeerTimeoutError(
                f"Process {process} did not {doing} within {self._timeout_ms / 1000:.1f} s "
                f"(2 x the sink's timeout): it is stuck, gone, or running other code "
                f"({type(error).__name__}). Every process must make the same sink calls."
            ) from None

    def agree(self, fetch: Callable[[], T]) -> T:
        """``fetch()`` (this process's next data), once every process has its own; raises
        :class:`PeerError` if another process failed instead. If ``fetch`` raises, the caller
        reports it with :meth:`fail`."""
        value = fetch()
        self._client.key_value_set(self._key(self._round, self._me), "ok")
        try:
            for process in self._others:
                status = self._read(self._key(self._round, process), "get its data ready")
                if status != "ok":
                    raise PeerError(
                        f"Process {process} failed, so this sink stops on every process: "
                        f"{status}. Its own traceback is in that process's output."
                    )
        finally:
            if self._round:  # every process has read it: each has reported on this round
                self._client.key_value_delete(self._key(self._round - 1, self._me))
            self._round += 1
        return value

    def fail(self, error: BaseException) -> None:
        """Report ``error`` (raised in this process before its data was agreed) to the others,
        who raise :class:`PeerError` instead of waiting."""
        if isinstance(error, PeerError):  # another process's failure, reported by it
            return
        self._client.key_value_set(
            self._key(self._round, self._me), f"{type(error).__name__}: {error}"[:2000]
        )
        self._round += 1
