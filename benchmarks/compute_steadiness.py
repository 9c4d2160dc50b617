"""How steady XLA:CPU's own compute is on this machine: one compiled program, timed call by call.

Every CPU figure of the other benchmarks is a ratio of rates measured minutes apart, which holds
only if the same executable runs at the same speed throughout. This checks that: the benchmark
MLP's step in a ``lax.scan`` of 100 steps over batches already on the device (no sink, no data
pipeline, nothing else running in the process), called back to back for ``--seconds``, in a
fresh process

* with every CPU (JAX's default: XLA:CPU runs its work on a pool of one thread per CPU), and
* bound to one CPU (``os.sched_setaffinity`` before JAX starts: what ``sinkax.set_cpu_affinity``
  does to the compute threads, leaving the other CPUs to the data threads).

The table gives microseconds per step: the median, the 10th and 90th percentiles, and the share
of calls over 1.5x the fastest tenth; the plot each call over time.

    python benchmarks/compute_steadiness.py            # ~30 seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BINDINGS = {"every CPU": None, "one CPU": 1}  # how many CPUs the child keeps (None: all)
SLOW = 1.5  # a call over this many times the fastest tenth's median is a slow one


def child(cpus: int | None, seconds: float) -> list[tuple[float, float]]:
    """``(seconds since the first call, microseconds per step)`` of each call."""
    if cpus is not None:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cpus])
    import jax
    import numpy as np
    from _common import fresh, workload

    w = workload("mlp", 100)
    chunk = jax.device_put(jax.tree.map(lambda *x: np.stack(x), *w.batches))
    scan = jax.jit(lambda s, c: jax.lax.scan(w.step, s, c), donate_argnums=0)
    state = jax.block_until_ready(scan(fresh(w.init()), chunk)[0])
    calls, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        state, losses = scan(state, chunk)
        jax.block_until_ready(losses)
        us = (time.perf_counter() - t0) / len(w.batches) * 1e6
        calls.append((round(t0 - start, 3), round(us, 1)))
    return calls


def summary(binding: str, calls: list[tuple[float, float]]) -> dict:
    """The table's row of one binding."""
    per_step = sorted(us for _, us in calls)
    fast = statistics.median(per_step[: max(1, len(per_step) // 10)])
    return {
        "binding": binding,
        "calls": len(per_step),
        "median us/step": statistics.median(per_step),
        "p10": per_step[len(per_step) // 10],
        "p90": per_step[len(per_step) * 9 // 10],
        f"share > {SLOW}x fastest": sum(us > SLOW * fast for us in per_step) / len(per_step),
    }


def plot(runs: dict[str, list[tuple[float, float]]], plt):
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for binding, calls in runs.items():
        ax.plot([t for t, _ in calls], [us for _, us in calls], ".", ms=3, label=binding)
    ax.set_xlabel("seconds since the first call")
    ax.set_ylabel("us per step (one call)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("the same XLA:CPU executable (MLP, lax.scan of 100 steps), call by call")
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="per binding")
    parser.add_argument("--child", choices=BINDINGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # the timed process: its calls as JSON on stdout
        print(json.dumps(child(BINDINGS[args.child], args.seconds)))
        return 0
    from _common import machine, save, table

    runs = {}
    for binding in BINDINGS:
        command = [sys.executable, __file__, "--child", binding, "--seconds", str(args.seconds)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        runs[binding] = json.loads(out.splitlines()[-1])
    rows = [summary(binding, calls) for binding, calls in runs.items()]
    print(f"MLP step, lax.scan of 100 ({machine()['cpu']}, {os.cpu_count()} CPUs)")
    print(table(rows, list(rows[0])))
    save("compute_steadiness", {"rows": rows, "calls": runs}, lambda plt: plot(runs, plt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
