"""The threads that feed a sink pause between batches while one of its calls runs on the host
(:mod:`sinkax.channel.quiet`): they wait for the call, for a bounded time, and not while it
waits for them. Whether that makes calls faster is a benchmark's question
(``benchmarks/quiet_feeders.py``)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import jax
import numpy as np
import pytest
from conftest import ctrl_c_at_check

import sinkax
from sinkax.channel import quiet as quiet_module
from sinkax.channel.quiet import Quiet
from sinkax.execution.executor import Executor

LONG = 30.0  # a limit no test reaches: a feeder that waits, waits for the call


def feeder(quiet: Quiet) -> threading.Thread:
    """A thread that pauses once, as a producer does before a batch."""
    thread = threading.Thread(target=quiet.pause)
    thread.start()
    return thread


def waiting_feeder(quiet: Quiet) -> threading.Thread:
    """A :func:`feeder` that is still waiting 0.2 s on (the limit is far: it waits for the
    call)."""
    thread = feeder(quiet)
    thread.join(0.2)
    assert thread.is_alive()
    return thread


def assert_goes_on(thread: threading.Thread) -> None:
    """``thread`` ends long before the limit: nothing holds it back."""
    thread.join(LONG / 2)
    assert not thread.is_alive()


@pytest.fixture
def long_limit(monkeypatch):
    monkeypatch.setattr(quiet_module, "LIMIT_S", LONG)


def test_a_feeder_waits_while_a_call_runs_and_goes_on_when_it_ends(long_limit):
    quiet = Quiet()
    with quiet:
        waiting = waiting_feeder(quiet)
    assert_goes_on(waiting)


def test_a_feeder_goes_on_while_the_call_waits_for_data_or_the_device(long_limit):
    quiet = Quiet()
    with quiet:
        with quiet.lifted():
            assert_goes_on(feeder(quiet))
        waiting = waiting_feeder(quiet)  # held again after the wait
    assert_goes_on(waiting)


def test_a_feeder_the_call_may_be_waiting_for_never_pauses(long_limit):
    chunks_ready = 0
    quiet = Quiet(ahead=lambda: chunks_ready)
    with quiet:
        assert_goes_on(feeder(quiet))  # no chunk ready: the call may need this one
        chunks_ready = 1
        ahead = waiting_feeder(quiet)
    assert_goes_on(ahead)


def test_a_feeder_waits_for_one_call_no_longer_than_the_limit(monkeypatch):
    monkeypatch.setattr(quiet_module, "LIMIT_S", 0.05)
    quiet = Quiet()
    with quiet:
        assert_goes_on(feeder(quiet))  # a call that never ends holds no feeder for good


def test_the_calling_thread_never_waits_for_its_own_call(long_limit):
    quiet = Quiet()
    with quiet:
        t0 = time.monotonic()
        quiet.pause()  # (a consumer that copies a cut chunk's rows itself does)
        assert time.monotonic() - t0 < LONG / 2


def test_a_call_that_fails_lets_its_feeders_go_on(long_limit):
    quiet = Quiet()
    with pytest.raises(KeyboardInterrupt), quiet:
        raise KeyboardInterrupt
    assert_goes_on(feeder(quiet))


def test_a_call_refused_as_another_runs_leaves_that_ones_hold(long_limit):
    quiet = Quiet()
    with quiet:

        def refused_call():
            with quiet:  # taken: this call goes without, and lets go of nothing
                pass

        refused = threading.Thread(target=refused_call)
        refused.start()
        refused.join(LONG / 2)
        waiting = waiting_feeder(quiet)  # held still
        with quiet.lifted():
            assert_goes_on(waiting)


@pytest.mark.parametrize("k", range(6))
def test_a_hold_a_ctrl_c_cut_short_is_taken_again_by_a_later_call(monkeypatch, long_limit, k):
    quiet = Quiet()
    with quiet:  # an earlier call, long ago
        pass
    monkeypatch.setattr(quiet_module, "STUCK_S", 0.0)
    with contextlib.suppress(KeyboardInterrupt), ctrl_c_at_check(k, Quiet.__enter__):
        quiet.__enter__()  # may leave the lock taken by no call
    quiet.__exit__()
    for _ in range(2):  # one call finds it so, a later one replaces it
        with quiet:
            pass
    with quiet:
        waiting = waiting_feeder(quiet)
    assert_goes_on(waiting)


def test_calls_racing_from_several_threads_never_release_a_lock_they_did_not_take(monkeypatch):
    """Misuse (a sink refuses a second thread's call), but it must leave the sink usable: with
    lock replacement allowed at once and thread switches as often as CPython makes them, each
    thread only ever releases the lock it took."""
    monkeypatch.setattr(quiet_module, "STUCK_S", 0.0)
    switch, errors = sys.getswitchinterval(), []
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(100):
            quiet, start = Quiet(), threading.Barrier(3)

            def calls(quiet=quiet, start=start):
                start.wait()
                try:
                    for _ in range(20):
                        with quiet, quiet.lifted():
                            pass
                except RuntimeError as error:
                    errors.append(error)

            threads = [threading.Thread(target=calls) for _ in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors


class Timed:
    """Numbered batches, the time each was read recorded."""

    def __init__(self, n: int):
        self.batches = [{"x": np.full((4,), i, np.float32)} for i in range(n)]
        self.read: list[float] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.read.append(time.monotonic())
            yield batch


def test_a_sinks_producer_reads_no_batch_while_a_call_runs_on_the_host(monkeypatch, long_limit):
    """A call of 4 steps over chunks of 2 batches frees the slot of the chunk before as it
    moves to its first; the producer, which could then refill the slot, waits for the call to
    end: a chunk stays ready ahead throughout (prefetch 3), whenever it gets there. Each
    window's dispatch is made 0.2 s slow, which the producer would otherwise use."""
    run, dispatched = Executor.run, []

    def slow_run(self, *args):
        result = run(self, *args)
        time.sleep(0.2)
        dispatched.append(time.monotonic())
        return result

    monkeypatch.setattr(Executor, "run", slow_run)
    data = Timed(40)
    chunk_bytes = 2 * data.batches[0]["x"].nbytes
    with sinkax.data_sink(
        lambda n, b: (n + b["x"][0], b["x"][0]),
        data,
        sink_size=4,
        max_chunk_bytes=chunk_bytes,
        prefetch=3,
        strategy="scan",
    ) as sink:
        t0 = time.monotonic()
        n, _ = sink(np.float32(0))  # compiles; the producer fills the ring meanwhile, and
        first_call_s = time.monotonic() - t0  # pauses once a chunk is ready, until the call
        jax.block_until_ready(n)  # waits for the next: it lets the producer go on then
        deadline = time.monotonic() + LONG
        while len(data.read) < 10 and time.monotonic() < deadline:  # 3 slots of 2 ahead
            time.sleep(0.01)
        time.sleep(0.2)  # the producer waits for a free slot
        before, dispatched[:] = len(data.read), []
        n, outs = sink(n)
        jax.block_until_ready(n)
        while len(data.read) == before and time.monotonic() < deadline:
            time.sleep(0.01)
    assert first_call_s < LONG / 2  # not a wait for the producer's pause to time out
    assert before == 10 and outs.tolist() == [4.0, 5.0, 6.0, 7.0] and len(dispatched) == 2
    assert len(data.read) > before  # it refilled the slot the call freed ...
    assert min(data.read[before:]) > dispatched[-1]  # ... once the call's windows had run
