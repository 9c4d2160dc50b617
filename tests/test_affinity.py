"""Thread-level CPU binding: what set_cpu_affinity asks is what the threads get."""

import os
import threading

import numpy as np
import pytest

import sinkax
from sinkax import affinity

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux")
CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="binding apart needs 2 CPUs")


@pytest.fixture
def unbind():
    yield
    sinkax.set_cpu_affinity(False)


def _affinity(tid):
    return tuple(sorted(os.sched_getaffinity(tid)))


def _producer(sink):
    (thread,) = [t for t in threading.enumerate() if t.name == "sinkax-producer"]
    assert sink._cursor.ring._thread is thread
    return thread.native_id


@pytest.mark.parametrize(
    "ranges, message",
    [(["a-b"], "look like"), (["3-1"], "look like"), (["0-"], "look like")],
)
def test_bad_cpu_list_is_named(ranges, message):
    with pytest.raises(ValueError, match=message):
        affinity.parse_cpu_list(ranges)


def test_a_cpu_list_given_as_one_string_is_one_entry():
    assert affinity.parse_cpu_list("0-2") == affinity.parse_cpu_list(["0-2"]) == (0, 1, 2)
    assert affinity.parse_cpu_list("12") == (12,)  # not CPUs 1 and 2


def test_bad_module_dict_names_the_problem():
    with pytest.raises(ValueError, match="Unknown module"):
        affinity.plan_from_dict([0, 1], {"compute": [0]})
    with pytest.raises(ValueError, match=r"indexes into the 2 CPUs \[0, 1\] \(0 to 1\), got \[2\]"):
        affinity.plan_from_dict([0, 1], {"minddata": [2]})
    with pytest.raises(ValueError, match=r"got \[True\]"):  # a bool is no index
        affinity.plan_from_dict([0, 1], {"minddata": [True]})
    assert affinity.plan_from_dict([4, 5], {"minddata": [np.int64(1)]})["minddata"] == (5,)


def test_one_cpu_cannot_be_split():
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        affinity.default_plan([3])


def test_default_plan_gives_data_a_quarter():
    plan = affinity.default_plan(list(range(8)))
    assert plan["minddata"] == (6, 7) and plan["main"] == plan["runtime"] == tuple(range(6))


@linux
def test_unavailable_cpu_is_refused(unbind):
    with pytest.raises(ValueError, match="not available"):
        sinkax.set_cpu_affinity(True, affinity_cpu_list=[f"{max(CPUS) + 1}"])
    assert _affinity(0) == tuple(CPUS)  # nothing was bound


@linux
@two_cpus
def test_threads_are_bound_and_unbound(unbind):
    data = [{"x": np.float32(i)} for i in range(8)]
    with sinkax.data_sink(lambda s, b: (s + b["x"], s), data, 2) as before:
        before(np.float32(0))
        plan = sinkax.set_cpu_affinity(True)
        assert set(plan["main"]).isdisjoint(plan["minddata"])
        assert _affinity(0) == plan["main"]
        assert _affinity(_producer(before)) == plan["minddata"]  # running before: rebound
        others = [
            int(t)
            for t in os.listdir("/proc/self/task")
            if int(t) not in (threading.get_native_id(), _producer(before))
        ]
        assert others and all(_affinity(t) == plan["runtime"] for t in others)
    with sinkax.data_sink(lambda s, b: (s + b["x"], s), data, 2) as after:
        after(np.float32(0))
        assert _affinity(_producer(after)) == plan["minddata"]  # started after: bound
        sinkax.set_cpu_affinity(False)
        assert _affinity(0) == tuple(CPUS)
        assert _affinity(_producer(after)) == tuple(CPUS)


@linux
@two_cpus
def test_module_dict_binds_what_it_names(unbind):
    plan = sinkax.set_cpu_affinity(
        True, affinity_cpu_list=[f"{CPUS[0]}", f"{CPUS[1]}"], module_to_cpu_dict={"main": [1]}
    )
    assert plan == {
        "main": (CPUS[1],),
        "runtime": (CPUS[0], CPUS[1]),
        "minddata": (CPUS[0], CPUS[1]),
    }
    assert _affinity(0) == (CPUS[1],)
