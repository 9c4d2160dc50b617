"""``set_cpu_affinity``: keep the data pipeline and the compute off each other's CPU cores.

On a GPU or NPU the device computes while the host prepares data. When XLA:CPU *is* the device,
its compute threads and the sink's producer share the host's cores, and they preempt each
other: XLA's worker threads spin on every core between tasks, so a producer thread waking up
from I/O waits for a core (``benchmarks/overlap.py`` on 2 cores: a 0.7 ms sleep took 0.81 ms
alone, 0.97 ms while a sink computed, 0.80 ms with the threads bound apart). MindSpore's answer
is thread-level core binding (``mindspore.runtime.set_cpu_affinity``); this is the same for
sinkax, on Linux:

* ``"main"``     -- the thread that calls ``set_cpu_affinity`` (the one that drives training);
* ``"runtime"``  -- every other thread already in the process (XLA's compute pools, JAX's
  threads); threads they start later inherit the binding;
* ``"minddata"`` -- every sink's producer thread, now and later; grain threads and copier
  threads (:mod:`sinkax.channel.packers`) a producer starts inherit its binding, but a later
  ``set_cpu_affinity`` call counts them as ``"runtime"``.

By default the last quarter of the CPUs (at least one) goes to ``"minddata"`` and the rest to
``"main"`` and ``"runtime"``. ``set_cpu_affinity(False)`` gives every thread the original CPUs.

>>> import os
>>> if len(os.sched_getaffinity(0)) >= 2:
...     plan = set_cpu_affinity(True)  # on 2 CPUs: main and runtime (0,), minddata (1,)
...     assert os.sched_getaffinity(0) == set(plan["main"])
...     unbound = set_cpu_affinity(False)
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence

from sinkax.config import int_in

MODULES = ("main", "runtime", "minddata")

_lock = threading.Lock()
_original: frozenset[int] | None = None  # the CPUs before the first binding
_plan: dict[str, tuple[int, ...]] = {}
_data_threads: set[int] = set()  # native ids of live producer threads


def parse_cpu_list(ranges: Sequence[str]) -> tuple[int, ...]:
    """CPU ids of ``["cpuidX-cpuidY", "cpuidZ", ...]``, sorted.

    >>> parse_cpu_list(["0-2", "6"])
    (0, 1, 2, 6)
    """
    cpus: set[int] = set()
    for item in [ranges] if isinstance(ranges, str) else ranges:  # "0-3" alone: one entry
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(item))
        if not match or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ValueError(
                f'affinity_cpu_list entries must look like "0-3" or "5", got {item!r}.'
            )
        first = int(match[1])
        cpus.update(range(first, int(match[2] or first) + 1))
    return tuple(sorted(cpus))


def default_plan(cpus: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The last quarter of ``cpus`` (at least one) for data, the rest for main and runtime.

    >>> default_plan([0, 1])
    {'main': (0,), 'runtime': (0,), 'minddata': (1,)}
    """
    if len(cpus) < 2:
        raise ValueError(
            f"Binding needs at least 2 CPUs to keep data and compute apart; this process may use "
            f"{len(cpus)} ({list(cpus)}). Run on more cores or leave affinity off."
        )
    data = max(1, len(cpus) // 4)
    compute = tuple(cpus[:-data])
    return {"main": compute, "runtime": compute, "minddata": tuple(cpus[-data:])}


def plan_from_dict(
    cpus: Sequence[int], module_to_cpu_dict: Mapping[str, Sequence[int]]
) -> dict[str, tuple[int, ...]]:
    """Each module's CPUs, given as indexes into ``cpus``; a module left out may use them all.

    >>> plan_from_dict([4, 5, 6], {"minddata": [2]})["minddata"]
    (6,)
    """
    unknown = sorted(set(module_to_cpu_dict) - set(MODULES))
    if unknown:
        raise ValueError(f"Unknown module(s) {unknown} in module_to_cpu_dict; known: {MODULES}.")
    plan = {name: tuple(cpus) for name in MODULES}
    for name, indexes in module_to_cpu_dict.items():
        bad = [i for i in indexes if not int_in(i, 0, len(cpus) - 1)]  # numpy's ints too
        if bad or not indexes:
            raise ValueError(
                f"module_to_cpu_dict[{name!r}] must list indexes into the {len(cpus)} CPUs "
                f"{list(cpus)} (0 to {len(cpus) - 1}), got {list(indexes)}."
            )
        plan[name] = tuple(sorted({cpus[i] for i in indexes}))
    return plan


def set_cpu_affinity(
    enable_affinity: bool,
    affinity_cpu_list: Sequence[str] | None = None,
    module_to_cpu_dict: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Bind the main, runtime and data threads to their CPUs; returns the binding used.

    Args:
      enable_affinity: ``True`` to bind, ``False`` to give every thread the original CPUs back.
      affinity_cpu_list: the CPUs to share out, as ``["0-3", "8-11"]``; default: the CPUs this
        thread may use now.
      module_to_cpu_dict: ``{"main" | "runtime" | "minddata": [indexes into those CPUs]}``;
        default: the last quarter for ``"minddata"``, the rest for the others.
    """
    if not hasattr(os, "sched_setaffinity"):
        raise NotImplementedError(
            "set_cpu_affinity needs os.sched_setaffinity, which this platform lacks (Linux has "
            "it); on other systems pin the process with the OS's own tools."
        )
    global _original
    with _lock:
        if not enable_affinity:
            if _original is not None:
                _apply(dict.fromkeys(MODULES, tuple(sorted(_original))))
            _plan.clear()
            return {}
        if _original is None:
            _original = frozenset(os.sched_getaffinity(0))
        available = _original
        cpus = parse_cpu_list(affinity_cpu_list) if affinity_cpu_list else tuple(sorted(available))
        missing = sorted(set(cpus) - available)
        if missing:
            raise ValueError(
                f"CPUs {missing} are not available to this process; it may use {sorted(available)}."
            )
        plan = (
            default_plan(cpus)
            if module_to_cpu_dict is None
            else plan_from_dict(cpus, module_to_cpu_dict)
        )
        _apply(plan)
        _plan.clear()
        _plan.update(plan)
        return dict(plan)


def _apply(plan: Mapping[str, tuple[int, ...]]) -> None:
    main = threading.get_native_id()
    for tid in _threads():
        module = "main" if tid == main else "minddata" if tid in _data_threads else "runtime"
        with contextlib.suppress(ProcessLookupError):  # the thread has just exited
            os.sched_setaffinity(tid, plan[module])


def _threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


@contextlib.contextmanager
def data_thread() -> Iterator[None]:
    """Marks the calling thread as a data thread while inside: bound to ``"minddata"``."""
    tid = threading.get_native_id()
    with _lock:
        _data_threads.add(tid)
        if _plan:
            os.sched_setaffinity(0, _plan["minddata"])
    try:
        yield
    finally:
        with _lock:
            _data_threads.discard(tid)
