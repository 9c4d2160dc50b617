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

The compiled steps contain collectives, so every process must dispatch the same programs on
the same positions in the same order, and fail together: :mod:`sinkax.peers` sees to it
(:class:`PeerError`, :class:`PeerTimeoutError`).

Each process keeps its own data position: ``Sink.data_state()`` is this process's.

A process leaves the job with :func:`shutdown` (:func:`initialize` runs it at exit), which does
not wait for a process that is gone.

>>> cluster_arguments({})  # no launcher's variables: jax detects the cluster, or fails
{}
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from sinkax import compat, peers
from sinkax.channel.replay import FIRST_BATCH
from sinkax.peers import PeerError, PeerTimeoutError

__all__ = [
    "PeerError",
    "PeerTimeoutError",
    "batch_sharding",
    "cluster_arguments",
    "initialize",
    "local_rows",
    "own_position",
    "shared_position",
    "shutdown",
]

# saved positions are numbered alike in every process: each saves them in one order
_position_numbers = itertools.count()
LEAVE_S = 300.0  # how long processes wait for each other to leave: jax's shutdown timeout


def initialize() -> None:
    """Join the ``jax.distributed`` job this process belongs to:
    ``jax.distributed.initialize(**cluster_arguments(os.environ))``; :func:`shutdown` leaves
    it at exit."""
    jax.distributed.initialize(**cluster_arguments(os.environ))
    atexit.register(shutdown)


def shutdown() -> None:
    """Leave the ``jax.distributed`` job, without waiting for a process that is gone.

    The processes meet at a barrier first. If all come, ``jax.distributed.shutdown()``
    follows, which passes at once. If not, one may be gone for good (killed), and jax's
    shutdown would wait for it until jax's heartbeat timeout (100 s by default), then abort
    this process: this process leaves without it, with its own exit status. The barrier waits
    as long as jax's shutdown would (:data:`LEAVE_S`) -- but after a sink of this process timed
    out waiting for another (:class:`PeerTimeoutError`), only as long as that sink's rounds
    (``2 * timeout``, see :func:`sinkax.peers.barrier_ms`). A process still stopped then is
    ended by jax when it continues, as is every process when process 0 is gone.

    :func:`initialize` runs it at exit; call it instead of ``jax.distributed.shutdown()``.
    Nothing once the job is left."""
    if not jax.distributed.is_initialized():
        return
    lost = peers.lost_timeout()
    wait_ms = int(LEAVE_S * 1000) if lost is None else peers.barrier_ms(lost, spent=0.0)
    client = compat.coordination_client()
    try:
        client.wait_at_barrier("sinkax/leave", wait_ms)
    except Exception:  # the service's DEADLINE_EXCEEDED: a process did not come
        compat.abandon_distributed()
        return
    jax.distributed.shutdown()


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
    every = range(jax.process_count())
    positions = [data_state if p == me else _position_of(client, key, p, timeout) for p in every]
    return {"processes": positions}


def _position_of(client: Any, key: str, process: int, timeout: float) -> dict[str, Any]:
    try:
        return json.loads(client.blocking_key_value_get(f"{key}/{process}", int(timeout * 1000)))
    except Exception as error:  # the coordination service's DEADLINE_EXCEEDED
        raise peers.PeerTimeoutError(
            f"Process {process} did not share its data position within {timeout:.1f} s, for a "
            "checkpoint every process saves: it is stuck, gone, or failed (its own error says "
            "why). Every process must run the same callbacks and save the same checkpoints."
        ) from error


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
    if any(key in p["source"] for p in positions for key in _BATCHED_BY_PROCESS):
        raise ValueError(
            f"This checkpoint holds the data position of {len(positions)} process(es) over a "
            "dataset that batches each process's records itself (a grain DataLoader or "
            f"IterDataset: it saved its iterator's state), and this job has "
            f"{jax.process_count()}: its global batches would be others, so no position in "
            f"them is exact. Resume it with {len(positions)} process(es)."
        )
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


_BATCHED_BY_PROCESS = ("iterator", "iterator_base64")  # a loader's: its batches, its own
_PER_PROCESS = ("fingerprint", FIRST_BATCH, *_BATCHED_BY_PROCESS)  # its own batches


def _global_position(position: dict[str, Any]) -> dict[str, Any]:
    """``position`` without what only its own process's dataset can restore."""
    source = {k: v for k, v in position["source"].items() if k not in _PER_PROCESS}
    return {**position, "source": source}
