"""Compile seconds of one sink executable against sink_size, from 10 to 100,000.

The sink is a ``lax.scan``: its program holds the step once whatever the sink length, so
compile time should stay flat (target: sink_size 10,000 within 1.5x of sink_size 10). Each size
is compiled from scratch (``jit(...).lower(...).compile()`` on abstract shapes; no data needed).

    python benchmarks/compile_time.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np
from _common import machine, save, table, workload

from sinkax.execution.compiler import Compiler
from sinkax.execution.programs import scan_program
from sinkax.spec import BatchSpec

SIZES = (10, 100, 1_000, 10_000, 100_000)


def compile_seconds(w, sink_size: int, repeats: int) -> float:
    chunk = BatchSpec.of(w.batches[0]).stacked(sink_size)
    state = jax.eval_shape(w.init)
    times = []
    for _ in range(repeats):
        jax.clear_caches()
        t0 = time.perf_counter()
        Compiler.lower(scan_program(w.step, sink_size), state, chunk, np.int32(0)).compile()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["mlp", "lenet"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows, results = [], {}
    for name in args.workloads:
        w = workload(name, num_batches=1)
        seconds = {size: compile_seconds(w, size, args.repeats) for size in SIZES}
        results[name] = seconds
        rows += [
            {"workload": name, "sink_size": size, "compile s": s, "x size 10": s / seconds[10]}
            for size, s in seconds.items()
        ]
    print(f"compile time of the sink executable ({machine()['device']}, jax {jax.__version__})")
    print(table(rows, ["workload", "sink_size", "compile s", "x size 10"]))
    failed = 0
    for name, seconds in results.items():
        ratio = seconds[10_000] / seconds[10]
        failed += ratio > 1.5
        print(
            f"{'PASS' if ratio <= 1.5 else 'MISS'}  {name}: size 10,000 / size 10 = "
            f"{ratio:.2f}x (target <= 1.5x)"
        )
    save("compile_time", {"seconds": results}, lambda plt: plot(results, plt))
    return failed


def plot(results, plt):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, seconds in results.items():
        ax.plot(list(seconds), list(seconds.values()), marker="o", label=name)
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("sink_size (steps per executable)")
    ax.set_ylabel("compile seconds")
    ax.legend()
    ax.set_title("sink compile time is flat in sink_size", fontsize=10)
    return fig


if __name__ == "__main__":
    sys.exit(main())
