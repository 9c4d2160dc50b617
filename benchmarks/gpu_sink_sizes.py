"""Sink sizes on a GPU for one workload (``mlp``, ``lenet`` or ``transformer``): part of
benchmarks/gpu_check.py, which runs each workload in a process of its own and under a time limit.

Modes, each compiled and warmed up first, then measured round-robin (medians over repeats):

* ``plain``              -- jitted per-step loop on host (numpy) batches;
* ``prefetch 1 ahead``   -- the same, the next batch's ``device_put`` issued before each step:
  the best hand-written loop;
* ``device scan``        -- ``lax.scan`` over an epoch already on the device: the device-only
  bound (no host data at all);
* ``sinkax N``           -- ``data_sink(step, batches, N)``, N in 1, 10, 100, 1000 and one epoch.

Per mode: steps/s; ratios to plain, to the bound and to the prefetching loop; ``setup s``, the
seconds to compile and warm up (for a sink: create it, compile, measure its strategy, its first
calls); for sinks also ``first call s``, a fresh sink's first call once its executables are
compiled (the producer's start and first chunk included). The device's peak memory
(``memory_stats()["peak_bytes_in_use"]``) covers the whole process, all modes.

    python benchmarks/gpu_sink_sizes.py mlp --out mlp.json              # on a GPU
    python benchmarks/gpu_sink_sizes.py transformer --dry-run --out t.json  # tiny, any device
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import _transformer
import jax
import sink_sizes
from _common import fresh, machine, median_rate, table, workload

import sinkax

WORKLOADS = ("mlp", "lenet", "transformer")
SIZES, DRY_SIZES = (1, 10, 100, 1000, -1), (1, 2, -1)
FULL = {"mlp": (2000, 1000, 3), "lenet": (2000, 1000, 3), "transformer": (500, 500, 2)}
DRY = (20, 10, 1)  # (steps per repeat, batches per epoch, repeats)
COLUMNS = ["mode", "steps/s", "x plain", "x bound", "x prefetch", "strategy", "setup s"]


def prefetch_one_ahead(w, steps):
    """The jitted loop with the next batch's transfer issued before the current step."""
    step = jax.jit(w.step, donate_argnums=0)
    state = jax.block_until_ready(step(fresh(w.init()), w.batches[0])[0])

    def run():
        nonlocal state
        upcoming = jax.device_put(w.batches[0])
        for i in range(steps):
            batch, upcoming = upcoming, jax.device_put(w.batches[(i + 1) % len(w.batches)])
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        return steps

    return run


def fresh_first_call(w, size, strategy):
    """Seconds of a new sink's first call, its executables already compiled."""
    state = jax.block_until_ready(fresh(w.init()))
    t0 = time.perf_counter()
    with sinkax.data_sink(w.step, w.batches, size, strategy=strategy) as sink:
        jax.block_until_ready(sink(state))
        return time.perf_counter() - t0


def label(size, epoch):
    return f"sinkax epoch ({epoch})" if size == -1 else f"sinkax {size}"


def bench(w, steps, repeats, sizes):
    """Rows of the table for workload ``w``, one per mode."""
    runs, setup, sinks = {}, {}, {}
    plain_modes = [("plain", sink_sizes.plain), ("prefetch 1 ahead", prefetch_one_ahead)]
    for mode, make in [*plain_modes, ("device scan", sink_sizes.device_scan)]:
        t0 = time.perf_counter()
        runs[mode] = make(w, steps)
        setup[mode] = time.perf_counter() - t0
    for size in sizes:
        mode, t0 = label(size, len(w.batches)), time.perf_counter()
        sinks[mode], runs[mode] = sink_sizes.sinkax_run(w, steps, size)
        setup[mode] = time.perf_counter() - t0
    rates = {mode: [] for mode in runs}
    for _ in range(repeats):
        for mode, run in runs.items():
            rates[mode].append(median_rate(run, 1))
    rows = [
        {"mode": m, "steps/s": statistics.median(r), "setup s": setup[m]} for m, r in rates.items()
    ]
    by_mode = {row["mode"]: row["steps/s"] for row in rows}
    for row in rows:
        row["x plain"] = row["steps/s"] / by_mode["plain"]
        row["x bound"] = row["steps/s"] / by_mode["device scan"]
        row["x prefetch"] = row["steps/s"] / by_mode["prefetch 1 ahead"]
        if row["mode"] in sinks:
            sink = sinks[row["mode"]]
            row["strategy"] = sink.stats.strategy
            size = -1 if "epoch" in row["mode"] else int(row["mode"].split()[1])
            row["first call s"] = fresh_first_call(w, size, sink.stats.strategy)
            sink.close()
    return rows


def targets(workload_name, rows):
    """The issue's targets for one workload, each ``(description, ratio, threshold)``."""
    sinks = [r for r in rows if r["mode"].startswith("sinkax")]
    worst = min(sinks, key=lambda r: r["x plain"])
    checks = [
        (f"{workload_name}: every sink size vs plain ({worst['mode']})", worst["x plain"], 1.0)
    ]
    later = sinks[1:]  # from the second sink size (10 on a GPU) on
    slowest = min(later, key=lambda r: r["x prefetch"])
    checks.append(
        (
            f"{workload_name}: sizes >= {later[0]['mode']} vs prefetch ({slowest['mode']})",
            slowest["x prefetch"],
            1.0,
        )
    )
    if workload_name == "mlp":
        largest = sinks[-2]  # the largest fixed sink size
        checks += [
            (f"mlp: {largest['mode']} vs the device-only bound", largest["x bound"], 0.95),
            (f"mlp: {largest['mode']} vs plain", largest["x plain"], 2.0),
        ]
    return checks


def peak_bytes() -> int | None:
    """The default device's peak memory in use so far, where its backend reports it."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=WORKLOADS)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes: a check, no figures")
    args = parser.parse_args(argv)
    steps, epoch, repeats = DRY if args.dry_run else FULL[args.workload]
    shape = _transformer.TINY if args.dry_run else _transformer.LMShape()
    sizes = DRY_SIZES if args.dry_run else SIZES
    w = workload(args.workload, epoch, lm_shape=shape)
    rows = bench(w, steps, repeats, sizes)
    checks = targets(args.workload, rows)
    print(f"{args.workload} ({machine()['device']}, jax {jax.__version__})")
    print(table(rows, [*COLUMNS, "first call s"]))
    for description, ratio, threshold in checks:
        verdict = "PASS" if ratio >= threshold else "MISS"
        print(f"  {verdict}  {description}: {ratio:.2f}x (target >= {threshold}x)")
    payload = {
        "workload": args.workload,
        "dry_run": args.dry_run,
        "machine": machine(),
        "steps_per_repeat": steps,
        "epoch": epoch,
        "repeats": repeats,
        "transformer_shape": dataclasses.asdict(shape) if args.workload == "transformer" else None,
        "peak_bytes_in_use": peak_bytes(),
        "rows": rows,
        "targets": [list(check) for check in checks],
    }
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
