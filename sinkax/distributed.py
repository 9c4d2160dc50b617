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

The compiled steps contain collectives (the gradient's all-reduce), so every process must
dispatch the same programs on the same positions in the same order, whatever its data's speed,
and a process that stops feeding would leave the others blocked inside them. So:

* chunk boundaries are a function of the data position and the options alone: across
  processes a chunk holds one piece (one call, or a part of one), never cut where a waiting
  call happens to find the producer (:func:`sinkax.channel.plan.plan`);
* when a sink is created its processes compare the options that shape its programs and chunks
  (sink size, strategy, jit, max_chunk_bytes, calls, mesh, epoch length, a restored strategy),
  and with the first dispatch each one's batch layout, state layout and strategy; a difference
  is a ``ValueError`` on every process naming the option and each process's value;
* before each dispatch :class:`Peers` runs a round through the ``jax.distributed``
  coordination service (no device collective): each process writes what it is about to run
  (piece, offset, chunk shape; compared too) or its error, meets the others at a barrier, and
  reads theirs. A process whose dataset failed (or that timed out, or was interrupted) reports
  its error: it raises its own, every other process :class:`PeerError` naming it. A barrier
  that not every process reaches within ``2 * timeout`` (one killed, stopped, hung outside the
  sink) fails for all of them with :class:`PeerTimeoutError`, also for a process that arrives
  later, which therefore never runs alone into a collective. One write, one barrier and one
  read per dispatch (about 0.5 ms on localhost).

Each process keeps its own data position: ``Sink.data_state()`` is this process's.

In one process (or a sharding this process addresses alone) nothing is exchanged:

>>> import jax
>>> peers = Peers.of(jax.sharding.SingleDeviceSharding(jax.devices()[0]), 1.0, sink_size=1)
>>> peers.agree(lambda: "chunk", describe=lambda chunk: {})
'chunk'
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Callable, Mapping
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
    """Join the ``jax.distributed`` job this process belongs to:
    ``jax.distributed.initialize(**cluster_arguments(os.environ))``."""
    jax.distributed.initialize(**cluster_arguments(os.environ))


def cluster_arguments(environ: Mapping[str, str]) -> dict[str, Any]:
    """The arguments of ``jax.distributed.initialize`` for a process started with ``environ``:

    * by :mod:`sinkax.launch`: the coordinator, process count and id it set;
    * by a launcher that sets ``WORLD_SIZE``, ``RANK`` and ``MASTER_ADDR`` (``torchrun``, a
      Kubernetes PyTorchJob): that many processes, this one's rank, the coordinator at
      ``JAX_COORDINATOR_ADDRESS`` if set, else on ``MASTER_ADDR`` at ``JAX_COORDINATOR_PORT``
      or else ``MASTER_PORT`` (jax detects none of these variables itself; ``torchrun``'s own
      store holds ``MASTER_PORT``: give jax another with ``JAX_COORDINATOR_PORT``);
    * otherwise none: jax detects SLURM (``srun``), Open MPI and Kubernetes indexed Jobs
      itself, and fails elsewhere.

    >>> cluster_arguments({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "5"})
    {'coordinator_address': 'h:5', 'num_processes': 2, 'process_id': 1}
    >>> cluster_arguments({"SLURM_PROCID": "0"})
    {}
    """
    if "SINKAX_PROCESS_ID" in environ:
        count, rank = "SINKAX_NUM_PROCESSES", "SINKAX_PROCESS_ID"
    elif all(name in environ for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR")):
        count, rank = "WORLD_SIZE", "RANK"
    else:
        return {}
    port = environ.get("JAX_COORDINATOR_PORT", environ.get("MASTER_PORT"))
    return {
        "coordinator_address": environ.get(
            "JAX_COORDINATOR_ADDRESS", f"{environ.get('MASTER_ADDR')}:{port}"
        ),
        "num_processes": int(environ[count]),
        "process_id": int(environ[rank]),
    }


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
    """This process's data position in what :func:`shared_position` gave.

    Saved by a job of another number of processes, it is the position in the stream of global
    batches, which every process of the saving job shared: the same epoch and step, and the
    same source state once what is particular to a process is set aside (an iterable's
    fingerprint or iterator state: it is then replayed from the epoch's start). Each process
    of this job continues there, feeding its own part of the next global batch. A
    ``ValueError`` if the saved processes' positions differ beyond that (a grain
    ``DataLoader``'s iterator state, say): resume such a checkpoint with as many processes.

    >>> saved = {"epoch": 1, "step": 2, "source": {"next_index": 8}}
    >>> own_position({"processes": [saved, saved]}) == saved  # by 2 processes, into 1
    True
    """
    positions = saved.get("processes", [saved])
    if len(positions) == jax.process_count():
        return positions[jax.process_index()]
    shared = [_global_position(position) for position in positions]
    if any(position != shared[0] for position in shared):
        raise ValueError(
            f"This checkpoint holds the data positions of {len(positions)} process(es), which "
            f"differ ({shared[0]!r:.200} and {shared[-1]!r:.200}), and this job has "
            f"{jax.process_count()}: each position belongs to one process's dataset (a grain "
            f"DataLoader's iterator, say). Resume it with {len(positions)} process(es), each "
            "feeding the same part of the data as before."
        )
    return shared[0]


_PER_PROCESS = ("fingerprint", "iterator", "iterator_base64")  # of one process's own batches


def _global_position(position: dict[str, Any]) -> dict[str, Any]:
    """``position`` without what only its own process's dataset can restore."""
    source = {k: v for k, v in position["source"].items() if k not in _PER_PROCESS}
    return {**position, "source": source}


class PeerError(RuntimeError):
    """Another process of the job failed; this one stops too instead of waiting for it."""


class PeerTimeoutError(PeerError, SinkTimeoutError):
    """Another process of the job did not report in time (or this one came too late)."""


class Alone:
    """One process: nothing to agree on."""

    def agree(self, fetch: Callable[[], T], describe: Callable[[T], dict[str, Any]]) -> T:
        """``fetch()``."""
        return fetch()

    def include(self, values: Callable[[], dict[str, Any]]) -> None:
        """Nothing: no one to compare with."""

    def fail(self, error: BaseException) -> None:
        """Nothing: no one else is waiting."""


class Peers:
    """The processes of a sink over a sharding that spans them; see the module docstring.

    Each *round* (the sink's creation, then every dispatch) every process writes its status --
    what it is about to do, or its error -- into the key-value store, waits at a barrier of the
    coordination service for all the others, then reads every status. The service decides a
    barrier for everyone at once: either all processes arrived within ``2 * timeout`` and all
    go on, or it timed out for all, also for one that arrives later (stopped, then continued),
    which therefore never runs on alone into a collective no one else joins.
    """

    @staticmethod
    def of(sharding: Sharding, timeout: float, **config: Any) -> Alone | Peers:
        """:class:`Alone`, or when ``sharding`` spans other processes, :class:`Peers` that
        checked that ``config`` (options that shape the compiled programs, epoch length, ...)
        is the same in every process: a ``ValueError`` on every process naming each option
        that differs, with every process's value, otherwise."""
        if sharding.is_fully_addressable:
            return Alone()
        peers = Peers(f"sinkax/sink{next(_sink_numbers)}", timeout)
        peers._exchange({"config": config}, "create this sink")
        return peers

    def __init__(self, name: str, timeout: float):
        self._client = compat.coordination_client()
        self._name = name
        self._me = jax.process_index()
        self._timeout_ms = int(2 * timeout * 1000)
        self._round = 0
        self._included: dict[str, Any] = {}
        self._raised: BaseException | None = None  # by the last round, which every process saw

    def include(self, values: Callable[[], dict[str, Any]]) -> None:
        """Compare ``values()`` too (layouts known once data arrived) in the next round."""
        self._included.update(values())

    def agree(self, fetch: Callable[[], T], describe: Callable[[T], dict[str, Any]]) -> T:
        """``fetch()`` (this process's next data), once every process has its own and
        ``describe`` of it (where in the data it is, what runs on it) is the same in every
        process; :class:`PeerError` if another process failed instead, ``ValueError`` if the
        descriptions differ. If ``fetch`` raises, the caller reports it with :meth:`fail`."""
        value = fetch()
        status, self._included = {**self._included, **describe(value)}, {}
        self._exchange({"run": status}, "get its data ready")
        return value

    def fail(self, error: BaseException) -> None:
        """Report ``error`` (raised in this process, not by a round) to the others, who raise
        :class:`PeerError` instead of waiting; waits up to ``2 * timeout`` for them to see it."""
        if error is self._raised:  # the round that raised it was seen by every process
            return
        with contextlib.suppress(PeerError):  # they failed too, or are gone: nothing to add
            self._exchange({"error": f"{type(error).__name__}: {error}"[:2000]}, "fail too")

    def _exchange(self, status: dict[str, Any], doing: str) -> None:
        """One round: write ``status``, meet at the barrier, compare every process's."""
        round_, self._round = self._round, self._round + 1
        # two alternating keys per process: no process writes round r + 2 before every process
        # has met at the barrier of round r + 1, after reading round r
        folder = f"{self._name}/{round_ % 2}/"
        mine = {"round": round_, **status}
        self._client.key_value_set(f"{folder}{self._me}", json.dumps(mine), allow_overwrite=True)
        try:
            self._client.wait_at_barrier(f"{self._name}/round{round_}", self._timeout_ms)
        except Exception as error:  # the service's DEADLINE_EXCEEDED, for every process
            statuses = self._statuses(folder, round_)
            raise self._raise(PeerTimeoutError(self._late(statuses, doing, error))) from None
        statuses = self._statuses(folder, round_)
        for process, theirs in sorted(statuses.items()):
            if "error" in theirs and process != self._me:
                raise self._raise(
                    PeerError(
                        f"Process {process} failed, so this sink stops on every process: "
                        f"{theirs['error']}. Its own traceback is in that process's output."
                    )
                )
        for process, theirs in sorted(statuses.items()):
            if "error" not in mine and "error" not in theirs and theirs != mine:
                raise self._raise(ValueError(_differences(self._me, mine, process, theirs)))

    def _statuses(self, folder: str, round_: int) -> dict[int, dict[str, Any]]:
        """Every process's status of ``round_`` (a process that did not write one is missing)."""
        entries = self._client.key_value_dir_get(folder)
        statuses = {int(key.rsplit("/", 1)[1]): json.loads(value) for key, value in entries}
        return {p: status for p, status in statuses.items() if status["round"] == round_}

    def _late(self, statuses: dict[int, Any], doing: str, error: BaseException) -> str:
        limit = f"{self._timeout_ms / 1000:.1f} s (2 x the sink's timeout)"
        missing = [p for p in range(jax.process_count()) if p not in statuses]
        if not missing:  # they all wrote theirs, then gave up waiting for this one
            return (
                f"The other processes gave up waiting for this process: it came more than "
                f"{limit} after them (it was stopped, or far slower), so this sink stops on "
                "every process."
            )
        return (
            f"Process {', '.join(map(str, missing))} did not {doing} within {limit}: it is "
            f"stuck, gone, or running other code ({type(error).__name__}). Every process must "
            "make the same sink calls."
        )

    def _raise(self, error: BaseException) -> BaseException:
        self._raised = error
        return error


def _differences(me: int, mine: dict[str, Any], process: int, theirs: dict[str, Any]) -> str:
    """What differs between two processes' statuses, option by option, with both values."""
    mine, theirs = mine.get("config", mine.get("run")), theirs.get("config", theirs.get("run"))
    names = sorted(set(mine) | set(theirs))
    listed = "; ".join(
        f"{name}: process {me} has {mine.get(name)!r}, process {process} has {theirs.get(name)!r}"
        for name in names
        if mine.get(name) != theirs.get(name)
    )
    return (
        f"The processes disagree about this sink ({listed}). Every process must create its "
        "sinks in the same order with the same options, call them alike, and feed batches of "
        "the same layout and number per epoch (shard the data evenly over the processes)."
    )
