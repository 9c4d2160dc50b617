"""Does the data sink hide the input pipeline? Wall time against max(pipeline, compute).

A pipeline whose every batch costs a set host time -- real CPU work (``work``) or waiting on
I/O (``sleep``) -- feeds a step of a known compute cost. Measured in one run, for N steps:
``pipeline`` (iterating the data alone), ``compute`` (a scan over the same batches already on
the device) and ``sinkax`` (the two together through ``data_sink``). Perfect overlap gives
sinkax = max(pipeline, compute); no overlap gives their sum. Target when the two are balanced:
sinkax <= 1.1 x max. Every row is measured twice: with the threads as they come, and with
``sinkax.set_cpu_affinity(True)`` (on Linux), which keeps XLA's compute threads and the
producer on different cores. Ratios are medians over repeats.

    python benchmarks/overlap.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import machine, save, table

import sinkax
from sinkax import affinity

FEATURES = 256


class CostlyPipeline:
    """``num_batches`` batches per epoch, each taking ``cost_ms`` of host time to make."""

    def __init__(self, num_batches: int, cost_ms: float, kind: str):
        self.num_batches, self.cost_s, self.kind = num_batches, cost_ms / 1e3, kind
        self._scratch = np.random.default_rng(0).random(4096)
        rng = np.random.default_rng(1)  # made ahead: the set cost is the only host cost
        self._pool = [{"x": rng.random((32, FEATURES), dtype=np.float32)} for _ in range(16)]

    def _spend(self) -> None:
        if self.kind == "sleep":
            time.sleep(self.cost_s)
            return
        deadline = time.perf_counter() + self.cost_s
        while time.perf_counter() < deadline:  # real CPU work, e.g. augmentation
            np.sin(self._scratch, out=self._scratch)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        for i in range(self.num_batches):
            self._spend()
            yield self._pool[i % len(self._pool)]


def make_step(matmuls: int):
    """A step whose compute cost grows with ``matmuls`` (a chain of 256x256 products)."""

    def step(w, batch):
        h = jax.lax.fori_loop(0, matmuls, lambda _, h: jnp.tanh(h @ w), batch["x"])
        return w - 1e-6 * (h.T @ batch["x"]), h.mean()

    return step


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compute_alone(step, num_steps):
    """Runs ``num_steps`` of ``step`` as one scan over batches already on the device."""
    stacked = jax.device_put({"x": np.stack([b["x"] for b in CostlyPipeline(num_steps, 0, "")])})
    scan = jax.jit(lambda w, c: jax.lax.scan(step, w, c))

    def run():
        jax.block_until_ready(scan(initial(), stacked))

    run()
    return run


def initial():
    return jnp.eye(FEATURES) * 0.5


def measure(cost_ms, kind, step, compute, num_steps, sink_size, repeats):
    """Medians over ``repeats`` of the three times and of the ratio to max(pipeline, compute)."""
    calls = num_steps // sink_size - 1  # after a first call that starts the pipeline

    def run(sink, w):
        for _ in range(calls):
            w, out = sink(w)
        jax.block_until_ready(out)

    runs = []
    for _ in range(repeats):
        pipeline = CostlyPipeline(num_steps, cost_ms, kind)
        pipeline_s = timed(lambda pipeline=pipeline: list(pipeline))
        compute_s = timed(compute)
        with sinkax.data_sink(step, pipeline, sink_size, strategy="scan") as sink:
            w = jax.block_until_ready(sink(initial())[0])  # compiled: the ring is not ahead
            sinkax_s = timed(lambda sink=sink, w=w: run(sink, w)) * num_steps / (calls * sink_size)
        runs.append((pipeline_s, compute_s, sinkax_s))
    pipeline_s, compute_s, sinkax_s = (statistics.median(x) for x in zip(*runs, strict=True))
    return {
        "host work": kind,
        "host ms/batch": cost_ms,
        "pipeline s": pipeline_s,
        "compute s": compute_s,
        "sinkax s": sinkax_s,
        "x max": statistics.median(s / max(p, c) for p, c, s in runs),
        "x sum": statistics.median(s / (p + c) for p, c, s in runs),
    }


def wakeups(compute, bind):
    """ms per ``time.sleep(0.7 ms)`` of a thread, alone and while the compute runs."""

    def probe(stop, count):
        with affinity.data_thread() if bind else contextlib.nullcontext():
            while not stop.is_set():
                time.sleep(0.0007)
                count[0] += 1

    def timed_probe(main):
        stop, count = threading.Event(), [0]
        thread = threading.Thread(target=probe, args=(stop, count))
        thread.start()
        seconds = timed(main)
        stop.set()
        thread.join()
        return 1e3 * seconds / count[0]

    alone = timed_probe(lambda: time.sleep(1.0))
    beside = timed_probe(lambda: [compute() for _ in range(2)])
    return alone, beside


@contextlib.contextmanager
def bound_apart():
    sinkax.set_cpu_affinity(True)
    try:
        yield
    finally:
        sinkax.set_cpu_affinity(False)


def sweep(step, compute, compute_ms, args):
    return [
        measure(
            round(compute_ms * f, 2), kind, step, compute, args.steps, args.sink_size, args.repeats
        )
        for kind in ("sleep", "work")
        for f in (0.5, 1.0, 2.0)
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--sink-size", type=int, default=25)
    parser.add_argument("--matmuls", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    step = make_step(args.matmuls)
    compute = compute_alone(step, args.steps)
    compute_ms = 1e3 * statistics.median(timed(compute) for _ in range(3)) / args.steps
    settings = {"threads as they come": False}
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
        settings[f"set_cpu_affinity {affinity.default_plan(sorted(os.sched_getaffinity(0)))}"] = (
            True
        )
    results, sleeps = {}, {}
    for setting, bind in settings.items():
        with bound_apart() if bind else contextlib.nullcontext():
            sleeps[setting] = wakeups(compute, bind)
            results[setting] = sweep(step, compute, compute_ms, args)
    print(
        f"overlap of pipeline and compute ({machine()['device']}, jax {jax.__version__}); "
        f"compute {compute_ms:.2f} ms/step, {args.steps} steps, sink_size {args.sink_size}, "
        f"medians of {args.repeats}"
    )
    failed = 0
    for setting, rows in results.items():
        alone, beside = sleeps[setting]
        print(
            f"\n{setting}: a 0.7 ms sleep takes {alone:.2f} ms alone, "
            f"{beside:.2f} ms beside the compute"
        )
        print(table(rows, list(rows[0])))
        for row in rows:
            if abs(row["host ms/batch"] - round(compute_ms, 2)) < 1e-9:  # balanced
                ok = row["x max"] <= 1.1
                failed += not ok
                print(
                    f"{'PASS' if ok else 'MISS'}  balanced, {row['host work']}: wall = "
                    f"{row['x max']:.2f} x max(pipeline, compute) (target <= 1.1)"
                )
    payload = {"compute_ms_per_step": compute_ms, "sleep_0.7ms_alone_beside": sleeps}
    save("overlap", {**payload, "results": results}, lambda plt: plot(results, plt))
    return failed


def plot(results, plt):
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 3.5), squeeze=False)
    for ax, (setting, rows) in zip(axes[0], results.items(), strict=True):
        labels = [f"{r['host work']} {r['host ms/batch']}ms" for r in rows]
        x = np.arange(len(rows))
        ax.bar(
            x - 0.2,
            [r["pipeline s"] + r["compute s"] for r in rows],
            0.4,
            label="sum (no overlap)",
            color="tab:gray",
        )
        ax.bar(x + 0.2, [r["sinkax s"] for r in rows], 0.4, label="sinkax", color="tab:blue")
        ax.plot(
            x,
            [max(r["pipeline s"], r["compute s"]) for r in rows],
            "k_",
            ms=30,
            label="max (perfect overlap)",
        )
        ax.set_xticks(x, labels, rotation=20, fontsize=8)
        ax.set_ylabel("seconds")
        ax.set_title(setting.split(" {")[0], fontsize=9)
        ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    sys.exit(main())
