"""Steps/s of sinkax at several sink sizes against plain loops and device-only bounds.

For each workload (the reference LeNet5 in ``lax.conv``, the same LeNet5 in flax ``nn.Conv``, and a
dispatch-bound MLP; batch 32, SGD-momentum):

* ``plain``          -- jitted per-step loop on host (numpy) batches: what users write first;
* ``plain+prefetch`` -- the same with a thread putting the next batch on the device ahead;
* ``sinkax N``       -- ``data_sink(step, batches, N)`` for N in 1, 10, 100, 1000 and one epoch;
* ``device step``    -- per-step jitted loop over batches already on the device (bound);
* ``device scan``    -- ``lax.scan`` over batches already on the device (bound).

Then the "first calls" table: the seconds of a fresh sink's first 1, 3 and 10 calls (sink sizes 1,
100 and one epoch; ``strategy="auto"`` measuring again, as a new step function would, its
executables compiled before) against fresh sinks of each fixed strategy and against the plain
loop over the same steps -- compile excluded for all, the producer's start included for the sinks.

Every figure is a median over repeats, and every ratio compares figures of this one run.

    python benchmarks/sink_sizes.py            # CPU, < 5 minutes on 2 cores
    python benchmarks/sink_sizes.py --device gpu
    python benchmarks/sink_sizes.py --affinity     # with sinkax.set_cpu_affinity(True)
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time

import jax
from _common import fresh, machine, median_rate, save, table, workload

import sinkax

SIZES = (1, 10, 100, 1000, -1)


def plain(w, steps):
    step = jax.jit(w.step, donate_argnums=0)
    state = jax.block_until_ready(step(fresh(w.init()), w.batches[0])[0])

    def run():
        nonlocal state
        for i in range(steps):
            state, loss = step(state, w.batches[i % len(w.batches)])
        jax.block_until_ready(loss)
        return steps

    return run


def plain_prefetch(w, steps):
    step = jax.jit(w.step, donate_argnums=0)
    state = jax.block_until_ready(step(fresh(w.init()), w.batches[0])[0])

    def run():
        nonlocal state
        ready = queue.Queue(maxsize=1)
        thread = threading.Thread(
            target=lambda: [
                ready.put(jax.device_put(w.batches[i % len(w.batches)])) for i in range(steps)
            ],
            daemon=True,
        )
        thread.start()
        for _ in range(steps):
            state, loss = step(state, ready.get())
        jax.block_until_ready(loss)
        thread.join()
        return steps

    return run


def device_step(w, steps):
    step = jax.jit(w.step, donate_argnums=0)
    batches = jax.device_put(w.batches)
    state = jax.block_until_ready(step(fresh(w.init()), batches[0])[0])

    def run():
        nonlocal state
        for i in range(steps):
            state, loss = step(state, batches[i % len(batches)])
        jax.block_until_ready(loss)
        return steps

    return run


def device_scan(w, steps):
    stacked = jax.device_put(jax.tree.map(lambda *x: jax.numpy.stack(x), *w.batches))
    scan = jax.jit(lambda s, c: jax.lax.scan(w.step, s, c), donate_argnums=0)
    state = jax.block_until_ready(scan(fresh(w.init()), stacked)[0])
    calls = max(1, steps // len(w.batches))

    def run():
        nonlocal state
        for _ in range(calls):
            state, losses = scan(state, stacked)
        jax.block_until_ready(losses)
        return calls * len(w.batches)

    return run


def sinkax_run(w, steps, sink_size, strategy="auto", **options):
    sink = sinkax.data_sink(w.step, w.batches, sink_size, strategy=strategy, **options)
    per_call = len(w.batches) if sink_size == -1 else sink_size
    calls = max(1, steps // per_call)
    state = fresh(w.init())
    while sink.stats.calls < 2 or sink.stats.strategy.startswith("auto"):  # compile, measure
        state, _ = sink(state)
    jax.block_until_ready(state)

    def run():
        nonlocal state
        for _ in range(calls):
            state, metrics = sink(state)
        jax.block_until_ready(metrics)
        return calls * per_call

    return sink, run


def bench(name, steps, epoch, repeats, strategy):
    """Every mode compiled and warmed up first, then measured round-robin, ``repeats`` times,
    so that a slow spell of this shared machine hits all modes alike; medians reported."""
    w = workload(name, epoch)
    runs, sinks = {}, {}
    for label, make in [("plain", plain), ("plain+prefetch", plain_prefetch)]:
        runs[label] = make(w, steps)
    for size in SIZES:
        label = f"sinkax {'epoch (' + str(epoch) + ')' if size == -1 else size}"
        sinks[label], runs[label] = sinkax_run(w, steps, size, strategy)
    for label, make in [("device step", device_step), ("device scan", device_scan)]:
        runs[label] = make(w, steps)
    rates = {label: [] for label in runs}
    for _ in range(repeats):
        for label, run in runs.items():
            rates[label].append(median_rate(run, 1))
    rows = [{"mode": label, "steps/s": statistics.median(r)} for label, r in rates.items()]
    for row in rows:
        if row["mode"] in sinks:
            sink = sinks[row["mode"]]
            row.update(strategy=sink.stats.strategy, bound=sink.stats.bound)
            sink.close()
    base = rows[0]["steps/s"]
    best_device = max(r["steps/s"] for r in rows if r["mode"].startswith("device"))
    for row in rows:
        row["x plain"] = row["steps/s"] / base
        row["x device best"] = row["steps/s"] / best_device
    return rows


FIRST_SIZES = (1, 100, -1)
FIRST_CALLS = (1, 3, 10)


def fresh_sink_seconds(w, sink_size, calls, strategy):
    """Seconds from creating a sink to the end of its ``calls``-th call's compute."""
    state = jax.block_until_ready(fresh(w.init()))
    t0 = time.perf_counter()
    with sinkax.data_sink(w.step, w.batches, sink_size, strategy=strategy) as sink:
        if sink.stats.strategy == "auto":
            sink.reselect()  # measure, as a sink of a step function new to the process does
        for _ in range(calls):
            state, metrics = sink(state)
        jax.block_until_ready(metrics)
        return time.perf_counter() - t0, sink.stats.strategy


def first_calls(w, repeats):
    """Rows of the "first calls" table for workload ``w``."""
    epoch = len(w.batches)
    rows = []
    for size in FIRST_SIZES:
        per_call = epoch if size == -1 else size
        fixed = ("step",) if size == 1 else ("scan", "loop")
        for strategy in ("auto", *fixed):  # compile every executable this size needs
            fresh_sink_seconds(w, size, 2, strategy)
        for calls in FIRST_CALLS:
            steps = calls * per_call
            seconds = {mode: [] for mode in ("auto", *fixed, "plain")}
            chosen = []
            for _ in range(repeats):
                for strategy in ("auto", *fixed):
                    elapsed, name = fresh_sink_seconds(w, size, calls, strategy)
                    seconds[strategy].append(elapsed)
                    chosen += [name] if strategy == "auto" else []
                t0 = time.perf_counter()
                plain(w, steps)()
                seconds["plain"].append(time.perf_counter() - t0)
            med = {mode: statistics.median(v) for mode, v in seconds.items()}
            best = min(fixed, key=med.get)
            rows.append(
                {
                    "sink size": f"epoch ({epoch})" if size == -1 else size,
                    "calls": calls,
                    "steps": steps,
                    "auto s": med["auto"],
                    "best fixed s": med[best],
                    "best fixed": best,
                    "plain s": med["plain"],
                    "auto / best fixed": med["auto"] / med[best],
                    "auto x plain": med["plain"] / med["auto"],
                    "auto chose": "/".join(sorted(set(chosen))),
                }
            )
    return rows


def targets(results, first=None):
    """The issue's targets, each as (description, measured ratio, threshold)."""

    def rate(workload, mode):
        return next(r["steps/s"] for r in results[workload] if r["mode"] == mode)

    checks = []
    for name, rows in results.items():
        sinks = [r for r in rows if r["mode"].startswith("sinkax")]
        worst = min(sinks, key=lambda r: r["x plain"])
        checks.append(
            (f"{name}: every sink size vs plain (worst: {worst['mode']})", worst["x plain"], 1.0)
        )
    if "mlp" in results:
        checks.append(
            ("mlp: sinkax 1000 vs plain", rate("mlp", "sinkax 1000") / rate("mlp", "plain"), 2.5)
        )
        checks.append(
            (
                "mlp: sinkax 1000 vs device scan",
                rate("mlp", "sinkax 1000") / rate("mlp", "device scan"),
                0.95,
            )
        )
    if "mlp" in results:
        checks.append(
            ("mlp: sinkax 1 vs plain", rate("mlp", "sinkax 1") / rate("mlp", "plain"), 1.0)
        )
    for name in ("lenet", "flax"):
        if name in results:
            best = max(rate(name, "device step"), rate(name, "device scan"))
            best_sink = max(r["steps/s"] for r in results[name] if r["mode"].startswith("sinkax"))
            checks.append((f"{name}: best sinkax vs best device-only loop", best_sink / best, 1.0))
            for mode in ("sinkax 100", "sinkax 1000"):
                checks.append(
                    (f"{name}: {mode} vs plain", rate(name, mode) / rate(name, "plain"), 1.2)
                )
    for name, rows in (first or {}).items():
        for row in rows:
            if row["calls"] == 3:
                checks.append(
                    (
                        f"{name}: first 3 calls of sink {row['sink size']}, best fixed / auto time",
                        1 / row["auto / best fixed"],
                        round(1 / 1.1, 3),
                    )
                )
                if str(row["sink size"]).startswith("epoch"):
                    checks.append(
                        (f"{name}: first 3 epochs, auto vs plain", row["auto x plain"], 1.0)
                    )
    return checks


def plot(results, plt, first=None):
    rows_of_axes = 2 if first else 1
    fig, axes = plt.subplots(
        rows_of_axes, len(results), figsize=(6 * len(results), 4 * rows_of_axes), squeeze=False
    )
    for ax, (name, rows) in zip(axes[1] if first else [], (first or {}).items(), strict=True):
        labels = [f"sink {r['sink size']}, {r['calls']} calls" for r in rows]
        ax.barh(labels, [r["auto / best fixed"] for r in rows], color="tab:blue")
        ax.axvline(1.1, color="tab:red", lw=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("fresh auto sink's time / best fixed strategy's (target <= 1.1)")
        ax.set_title(f"{name}: first calls", fontsize=10)
    for ax, (name, rows) in zip(axes[0], results.items(), strict=True):
        modes = [r["mode"] for r in rows]
        colors = [
            "tab:gray"
            if not m.startswith(("sinkax", "device"))
            else "tab:blue"
            if m.startswith("sinkax")
            else "tab:green"
            for m in modes
        ]
        ax.barh(modes, [r["x plain"] for r in rows], color=colors)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("steps/s relative to the plain jitted loop")
        ax.set_title(f"{name} (batch 32)")
    info = machine()
    fig.suptitle(f"sinkax sink sizes -- {info['device']}, jax {info['jax']}", fontsize=10)
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or gpu (default: JAX's default)")
    parser.add_argument("--workloads", nargs="+", default=["mlp", "lenet", "flax"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--first-repeats", type=int, default=3, help="0 skips the first calls")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument(
        "--affinity", action="store_true", help="sinkax.set_cpu_affinity(True) for the whole run"
    )
    args = parser.parse_args(argv)
    if args.device:
        jax.config.update("jax_platforms", args.device)
    if args.affinity:
        print("set_cpu_affinity:", sinkax.set_cpu_affinity(True))
    # (steps per repeat, batches per epoch)
    steps = {"mlp": (2000, 250), "lenet": (500, 250), "flax": (500, 250)}
    if jax.default_backend() != "cpu":
        steps = {name: (10000, 1000) for name in steps}
    results = {
        name: bench(name, *steps[name], args.repeats, args.strategy) for name in args.workloads
    }
    for name, rows in results.items():
        print(f"\n{name}  ({machine()['device']}, jax {jax.__version__})")
        print(table(rows, ["mode", "steps/s", "x plain", "x device best", "strategy", "bound"]))
    first = {}
    if args.first_repeats:
        for name in args.workloads:
            first[name] = first_calls(workload(name, steps[name][1]), args.first_repeats)
            print(f"\nfirst calls: {name} (seconds, compile excluded)")
            print(table(first[name], list(first[name][0])))
    print("\ntargets")
    failed = 0
    for description, ratio, threshold in targets(results, first):
        ok = ratio >= threshold
        failed += not ok
        print(f"  {'PASS' if ok else 'MISS'}  {description}: {ratio:.2f}x (target >= {threshold}x)")
    suffix = "" if jax.default_backend() == "cpu" else f"_{jax.default_backend()}"
    suffix += "_affinity" if args.affinity else ""
    payload = {
        "results": results,
        "first_calls": first,
        "targets": [list(t) for t in targets(results, first)],
    }
    save(f"sink_sizes{suffix}", payload, lambda plt: plot(results, plt, first))
    return failed


if __name__ == "__main__":
    sys.exit(main())
