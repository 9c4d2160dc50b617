"""The processes of a sink: agreeing before each dispatch, and failing together.

The compiled steps contain collectives (the gradient's all-reduce), so every process of a
``jax.distributed`` job (see :mod:`sinkax.distributed`) must dispatch the same programs on the
same positions in the same order, whatever its data's speed, and a process that stops feeding
would leave the others blocked inside them. So:

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
  that not every process reaches in time (one killed, stopped, hung outside the sink) fails for
  all of them with :class:`PeerTimeoutError`, also for a process that arrives later, which
  therefore never runs alone into a collective. One write, one barrier and one read per
  dispatch (about 0.5 ms on localhost).

In time means: a process that waits raises within ``2 * timeout`` of its call's start (of a
later piece's, for a call fed as several; its own wait for its data not counted). The service
finds a barrier's deadline passed only at its next check, once a second, so the barrier is
given what is left of ``2 * timeout`` less :data:`VERDICT_S`, but at least ``timeout`` (see
:func:`barrier_ms`): a process that was busy for long before it came (a first transfer of a
large state) does not fail the others early, and raises up to 1 s past that bound, as does
any with a timeout under 1 s.

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
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from jax.sharding import Sharding

from sinkax import compat
from sinkax.errors import SinkTimeoutError

T = TypeVar("T")

# sinks are numbered alike in every process: each makes them in one order
_sink_numbers = itertools.count()
# the coordination service checks barrier deadlines once a second (xla's CheckStaleness); its
# verdict then takes a moment to reach each process: up to another second on a loaded machine
VERDICT_S = 2.0
_lost: list[float] = []  # the timeouts of this process's sinks whose round timed out


def barrier_ms(timeout: float, spent: float) -> int:
    """Milliseconds a process that spent ``spent`` seconds of a round's time gives the others
    at its barrier: ``2 * timeout - spent - VERDICT_S``, so that the service's verdict reaches
    it within ``2 * timeout``, but at least ``timeout``.

    >>> barrier_ms(10.0, spent=0.5), barrier_ms(10.0, spent=9.0)
    (17500, 10000)
    """
    return int(1000 * max(2 * timeout - spent - VERDICT_S, timeout))


def lost_timeout() -> float | None:
    """The largest ``timeout`` of this process's sinks that timed out waiting for another
    process (:class:`PeerTimeoutError`), or ``None`` if none did: whether a process may be
    gone, and how long this one waits for the others when it leaves the job
    (:func:`sinkax.distributed.shutdown`)."""
    return max(_lost, default=None)


class PeerError(RuntimeError):
    """Another process of the job failed; this one stops too instead of waiting for it."""


class PeerTimeoutError(PeerError, SinkTimeoutError):
    """Another process of the job did not report in time (or this one came too late)."""


class Alone:
    """One process: nothing to agree on."""

    waited_s = 0.0

    def begin(self) -> None:
        """Nothing: no one to wait for."""

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
    barrier for everyone at once: either all processes arrived in time (by the first one's
    deadline, see :func:`barrier_ms`) and all go on, or it timed out for all, also for one that
    arrives later (stopped, then continued), which therefore never runs on alone into a
    collective no one else joins.
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
        peers._exchange({"config": config}, "create this sink", since=time.monotonic())
        return peers

    def __init__(self, name: str, timeout: float):
        self._client = compat.coordination_client()
        self._name = name
        self._me = jax.process_index()
        self._timeout = timeout
        self._began: float | None = None  # when the call began, until its first round
        self._round = 0
        self._timed_out: str | None = None  # why a round timed out, once one has
        self.waited_s = 0.0  # at the barrier: for the other processes
        self._included: dict[str, Any] = {}
        self._raised: BaseException | None = None  # by the last round, which every process saw

    def begin(self) -> None:
        """A call starts: its first round's time counts from now (see the module docstring)."""
        self._began = time.monotonic()

    def include(self, values: Callable[[], dict[str, Any]]) -> None:
        """Compare ``values()`` too (layouts known once data arrived) in the next round."""
        self._included.update(values())

    def agree(self, fetch: Callable[[], T], describe: Callable[[T], dict[str, Any]]) -> T:
        """``fetch()`` (this process's next data), once every process has its own and
        ``describe`` of it (where in the data it is, what runs on it) is the same in every
        process; :class:`PeerError` if another process failed instead, ``ValueError`` if the
        descriptions differ. If ``fetch`` raises, the caller reports it with :meth:`fail`."""
        since, self._began = self._began or time.monotonic(), None
        fetching = time.monotonic()
        value = fetch()
        since += time.monotonic() - fetching  # its own wait for data does not count
        status, self._included = {**self._included, **describe(value)}, {}
        self._exchange({"run": status}, "get its data ready", since)
        return value

    def fail(self, error: BaseException) -> None:
        """Report ``error`` (raised in this process, not by a round) to the others, who raise
        :class:`PeerError` instead of waiting; waits up to ``2 * timeout`` for them to see it
        (less :data:`VERDICT_S`)."""
        if error is self._raised:  # the round that raised it was seen by every process
            return
        with contextlib.suppress(PeerError):  # they failed too, or are gone: nothing to add
            error_status = {"error": f"{type(error).__name__}: {error}"[:2000]}
            self._exchange(error_status, "fail too", since=time.monotonic())

    def _exchange(self, status: dict[str, Any], doing: str, since: float) -> None:
        """One round, whose time counts from ``since`` (``time.monotonic()``): write
        ``status``, meet at the barrier, compare every process's.

        Every round meets at the sink's one barrier, which the service counts instances of
        (it keeps nothing per round: a barrier per round cost its coordinator about 800 bytes
        each, for good). Once a round timed out, the processes' counts may differ: every later
        round fails at once, as the sink has failed.
        """
        if self._timed_out is not None:
            raise self._raise(PeerTimeoutError(self._timed_out))
        round_, self._round = self._round, self._round + 1
        # two alternating keys per process: no process writes round r + 2 before every process
        # has met at the barrier of round r + 1, after reading round r
        folder = f"{self._name}/{round_ % 2}/"
        mine = {"round": round_, **status}
        self._client.key_value_set(f"{folder}{self._me}", json.dumps(mine), allow_overwrite=True)
        t0 = time.perf_counter()
        try:
            wait_ms = barrier_ms(self._timeout, spent=time.monotonic() - since)
            self._client.wait_at_barrier(f"{self._name}/barrier", wait_ms)
        except Exception as error:  # the service's DEADLINE_EXCEEDED, for every process
            _lost.append(self._timeout)
            self._timed_out = self._late(self._statuses(folder, round_), doing, error)
            raise self._raise(PeerTimeoutError(self._timed_out)) from None
        finally:
            self.waited_s += time.perf_counter() - t0
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
        limit = f"{2 * self._timeout:.1f} s (2 x the sink's timeout)"
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
