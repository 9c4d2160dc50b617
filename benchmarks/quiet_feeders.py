"""A sink call beside its producer: wall time per call with the feeders quiet while a call runs
on the host (sinkax's default, :mod:`sinkax.channel.quiet`) and not.

CPython runs one thread's Python at a time, so a producer that reads and copies batches beside
a call slows the call down, even on a core of its own. Three rows per setting, each of sink-10
calls of a step that does nothing (the MLP's 131 KB batches, so the call's host part is all
there is):

* ``idle``: every batch the timed calls take is on the device before they start, and the
  producer has read its whole plan: nothing runs beside the calls;
* ``refilling``: the same ready data, but the producer refills each slot the calls free;
* ``steady``: back to back with the default ``prefetch``, steps/s, where the producer's pace is
  the bound: what quiet feeders cost the data path.

The calls' wall times (``time.perf_counter`` around each call) over ``--calls`` calls per run,
pooled over ``--repeats`` interleaved runs (each setting first in every other round: the first
runs slower); quiet off is ``quiet.LIMIT_S = 0``.

    python benchmarks/quiet_feeders.py --affinity  # ~20 s: the producer on its own CPU
    python benchmarks/quiet_feeders.py --device gpu --repeats 5 --out-dir /tmp  # gpu_check's
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from _common import (
    RESULTS,
    add_affinity_option,
    bar_chart,
    bind_cpus,
    machine,
    save,
    table,
    use_device,
    workload,
)

import sinkax
from sinkax.channel import quiet

SIZE = 10
LIMITS = {"quiet": quiet.LIMIT_S, "not quiet": 0.0}


def step(state, batch):
    return state + 1, batch["image"][0, 0]


def timed_calls(batches, calls: int, refilling: bool) -> list[float]:
    """Seconds of each of ``calls`` sink-10 calls over data already on the device; the producer
    refilling the slots they free, or idle (its plan read)."""
    prefetch = -(-calls * SIZE // 64) + 1  # chunks of 64+ steps: the timed calls' and one more
    bounded = {} if refilling else {"calls": calls + 3}
    with sinkax.data_sink(step, batches, SIZE, prefetch=prefetch, **bounded) as sink:
        state = jnp.int32(0)
        for _ in range(3):
            state, _ = sink(state)
        jax.block_until_ready(state)
        time.sleep(0.5)  # the producer fills every slot
        seconds = []
        for _ in range(calls):
            t0 = time.perf_counter()
            state, _ = sink(state)
            seconds.append(time.perf_counter() - t0)
        jax.block_until_ready(state)
    return seconds


def steady_rate(batches, steps: int) -> float:
    """Steps/s of sink-10 calls back to back, default prefetch, after warm calls."""
    with sinkax.data_sink(step, batches, SIZE) as sink:
        state = jnp.int32(0)
        for _ in range(3):
            state, _ = sink(state)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(steps // SIZE):
            state, _ = sink(state)
        jax.block_until_ready(state)
        return steps / (time.perf_counter() - t0)


def plot(rows, plt):
    timed = [r for r in rows if r["mode"] != "steady"]
    labels = [f"{r['mode']}, {r['feeders']}" for r in timed]
    xlabel = "wall microseconds per sink-10 call (mean)"
    return bar_chart(plt, labels, [r["mean us"] for r in timed], xlabel, "quiet feeders")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--steady-steps", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default=None, help="cpu or gpu (default: JAX's default)")
    parser.add_argument("--out-dir", default=RESULTS, help="where the JSON goes (results/)")
    add_affinity_option(parser)
    args = parser.parse_args(argv)
    use_device(args.device)
    binding = bind_cpus(args.affinity)
    batches = workload("mlp", 250).batches
    seconds = {(mode, name): [] for mode in ("idle", "refilling", "steady") for name in LIMITS}
    for repeat in range(args.repeats):  # the settings take turns, first each in turn
        for name in list(LIMITS)[:: 1 if repeat % 2 else -1]:
            quiet.LIMIT_S = LIMITS[name]
            seconds["idle", name] += timed_calls(batches, args.calls, refilling=False)
            seconds["refilling", name] += timed_calls(batches, args.calls, refilling=True)
            seconds["steady", name].append(steady_rate(batches, args.steady_steps))
    quiet.LIMIT_S = LIMITS["quiet"]
    rows = []
    for (mode, name), values in seconds.items():
        row = {"mode": mode, "feeders": name}
        if mode == "steady":
            rows.append({**row, "steps/s": statistics.median(values)})
        else:
            us = sorted(s * 1e6 for s in values)
            rows.append({**row, "mean us": statistics.fmean(us), "median us": us[len(us) // 2]})
            rows[-1]["p90 us"] = us[9 * len(us) // 10]
    print(f"quiet feeders ({machine()['device']}, jax {jax.__version__}{binding})")
    print(table(rows, ["mode", "feeders", "mean us", "median us", "p90 us", "steps/s"]))
    payload = {"rows": rows, "settings": vars(args)}
    suffix = "" if jax.default_backend() == "cpu" else f"_{jax.default_backend()}"
    save(f"quiet_feeders{suffix}{binding}", payload, lambda plt: plot(rows, plt), args.out_dir)
    mean = {row["feeders"]: row["mean us"] for row in rows if row["mode"] == "refilling"}
    print(f"refilling: quiet {mean['quiet']:.0f} us, not quiet {mean['not quiet']:.0f} us a call")


if __name__ == "__main__":
    sys.exit(main())
