"""A sink call's own host cost: main-thread CPU time per call, against a jitted step's.

A step that computes next to nothing (it adds its batch's sum to one state leaf), so that the
calling thread's CPU time is the cost of getting a call to the device: for ``jit`` the C++
dispatch of a jitted step over batches already on the device; for a sink everything a call
does besides (the Ctrl-C hand-off, the state's check, the data position, the chunk's window).
Two states: one scalar, and the benchmark MLP's parameters and momentum (12 leaves), which a
sink checks each call. CPU time of the calling thread (``time.thread_time``), so time waiting
for the producer or the device is not counted; beside it the CPU time of the process's other
threads per call (``time.process_time`` less the calling thread's): for a sink its producer
reading, checking and staging the call's batches, for both XLA's threads, which with this step
do next to nothing. Medians over repeats, each a run of many calls.

    python benchmarks/call_overhead.py          # ~10 seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np
from _common import bar_chart, fresh, machine, save, table, workload

import sinkax

MODES = ("jit", "sinkax 1 (scan)", "sinkax 1 (auto)", "sinkax 10 (scan)")


def states():
    """The two states: a scalar, and the MLP's train state (its parameters and momentum)."""
    return {"scalar": np.float32(0), "MLP state": fresh(workload("mlp", 1).init())}


def step(state, batch):
    """Adds the batch's sum to the state's first leaf: nearly no compute."""
    leaves, treedef = jax.tree.flatten(state)
    leaves[0] = leaves[0] + batch["x"].sum().astype(leaves[0].dtype)
    return treedef.unflatten(leaves), ()


def per_call_us(mode, state, batches, calls):
    """CPU microseconds per call of ``mode``, of the calling thread and of the others, after
    warm calls (on a copy of ``state``: the calls donate it)."""
    state = fresh(state)
    if mode == "jit":
        jitted = jax.jit(step, donate_argnums=0)
        on_device = [jax.device_put(b) for b in batches]

        def call(i, state):
            return jitted(state, on_device[i % len(on_device)])[0]

        close = None
    else:
        size = int(mode.split()[1])
        strategy = mode.split("(")[1].rstrip(")")
        # reading nothing past its calls: the other threads' time is theirs
        sink = sinkax.data_sink(step, batches, size, strategy=strategy, calls=100 + calls)

        def call(i, state):
            return sink(state)[0]

        close = sink.close
    for i in range(100):
        state = call(i, state)
    jax.block_until_ready(state)
    t0, p0 = time.thread_time(), time.process_time()
    for i in range(calls):
        state = call(i, state)
    jax.block_until_ready(state)
    seconds, process = time.thread_time() - t0, time.process_time() - p0
    if close:
        close()
    return seconds / calls * 1e6, (process - seconds) / calls * 1e6


def plot(rows, plt):
    labels = [f"{r['state']}: {r['mode']}" for r in rows]
    xlabel = "main-thread CPU microseconds per call"
    values = [r["host us/call"] for r in rows]
    return bar_chart(plt, labels, values, xlabel, "call overhead", 3.5, color="tab:blue")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    batches = [{"x": np.full((32, 4), i, np.float32)} for i in range(256)]
    rows = []
    for name, state in states().items():
        times = {mode: [] for mode in MODES}
        for _ in range(args.repeats):  # the modes take turns: a change of load hits them all
            for mode in MODES:
                times[mode].append(per_call_us(mode, state, batches, args.calls))
        base = statistics.median(main for main, _ in times["jit"])
        for mode in MODES:
            us = statistics.median(main for main, _ in times[mode])
            others = statistics.median(other for _, other in times[mode])
            row = {"state": name, "mode": mode, "host us/call": us, "x jit": us / base}
            rows.append({**row, "other threads us/call": others})
    print(f"call overhead ({machine()['device']}, jax {jax.__version__})")
    print(table(rows, ["state", "mode", "host us/call", "x jit", "other threads us/call"]))
    payload = {"rows": rows, "calls": args.calls, "repeats": args.repeats}
    save("call_overhead", payload, lambda plt: plot(rows, plt))


if __name__ == "__main__":
    sys.exit(main())
