"""Where a sink's host time goes, per thread, beside the rates that bound it (one workload).

For each sink size: steps/s of the sink, of a sink of the same data whose step does nothing (the
data path's own ceiling: read, stage, transfer), of the hand-written window loop over one chunk
already on the device (``lax.scan`` of ``size`` steps from a device position: what a sink call
computes, without its data path), of the sink timed once its producer had 2 s to prepare
``prefetch`` chunks ahead ("data prepared ahead": its calls' own cost, the data path out of the
way), and the sink's ``data_wait_s``/``slot_wait_s``. Then the
frames the main thread and the producer thread were in, sampled every millisecond while the
sink ran (the innermost frame inside sinkax, jax or numpy; ``other`` elsewhere).

    python benchmarks/host_profile.py mlp --sizes 10 1000     # any device; the default one
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import threading
import time

import jax
import numpy as np
from _common import fresh, machine, workload

import sinkax

KEEP = ("sinkax", "jax", "numpy", "grain", "threading", "queue")


def where(frame) -> str:
    """The innermost frame of ``frame``'s stack inside one of KEEP's packages."""
    while frame is not None:
        path = frame.f_code.co_filename
        for package in KEEP:
            if f"{os.sep}{package}{os.sep}" in path or path.endswith(f"{package}.py"):
                tail = path.split(f"{os.sep}{package}{os.sep}")[-1]
                return f"{package}/{tail}:{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "other"


class Sampler:
    """Samples every thread's innermost kept frame every ``interval`` seconds."""

    def __init__(self, interval: float = 0.001):
        self.interval, self.counts = interval, collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        me = threading.get_ident()
        names = {}
        while not self._stop.wait(self.interval):
            names.update({t.ident: t.name for t in threading.enumerate()})
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.counts[names.get(ident, str(ident))][where(frame)] += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def sink_rate(step, w, size, calls, sample=False, prefetch=2, prefilled=False):
    """Steps/s of a new sink over ``calls`` timed calls, its stats, and the sampler; with
    ``prefilled``, the timing starts 2 s after the warm calls: time for the producer to fill
    its free slots (``prefetch`` chunks) first."""
    state = fresh(w.init())
    with sinkax.data_sink(step, w.batches, size, strategy="scan", prefetch=prefetch) as sink:
        for _ in range(3):
            state, metrics = sink(state)
        jax.block_until_ready(metrics)
        if prefilled:
            time.sleep(2.0)
        sampler = Sampler() if sample else None
        t0 = time.perf_counter()
        with sampler or contextlib.nullcontext():
            for _ in range(calls):
                state, metrics = sink(state)
            jax.block_until_ready(metrics)
        seconds = time.perf_counter() - t0
        return calls * size / seconds, sink.stats, sampler


def window_rate(w, size, calls):
    """Steps/s of ``lax.scan`` windows of ``size`` steps over one chunk already on the device."""
    chunk_steps = max(size, 100)
    batches = [w.batches[i % len(w.batches)] for i in range(chunk_steps)]
    chunk = jax.device_put(jax.tree.map(lambda *x: np.stack(x), *batches))

    def window(state, chunk, i):
        part = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, size), chunk)
        state, outs = jax.lax.scan(w.step, state, part)
        return state, outs, (i + size) % chunk_steps

    run = jax.jit(window, donate_argnums=0)
    state, i = fresh(w.init()), jax.device_put(np.int32(0))
    state, outs, i = run(state, chunk, i)
    jax.block_until_ready(outs)
    t0 = time.perf_counter()
    for _ in range(calls):
        state, outs, i = run(state, chunk, i)
    jax.block_until_ready(outs)
    return calls * size / (time.perf_counter() - t0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", nargs="?", default="mlp")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    w = workload(args.workload, 1000)
    print(f"{args.workload} on {machine()['device']} (jax {jax.__version__})")

    def idle(state, batch):
        return state, ()

    for size in args.sizes:
        calls = max(3, args.steps // size)
        rate, stats, sampler = sink_rate(w.step, w, size, calls, sample=True)
        idle_rate, _, _ = sink_rate(idle, w, size, calls)
        bound = window_rate(w, size, calls)
        prefetch = min(16, max(2, 1024 // size))  # chunks of at least 64 steps
        ahead = max(2, prefetch * 64 // size)  # calls that the prepared chunks hold
        filled, _, _ = sink_rate(w.step, w, size, ahead, prefetch=prefetch, prefilled=True)
        print(
            f"\nsink {size}: {rate:.0f} steps/s; idle step {idle_rate:.0f}; device windows "
            f"{bound:.0f}; data prepared ahead {filled:.0f}; data_wait_s "
            f"{stats.data_wait_s:.3f} slot_wait_s {stats.slot_wait_s:.3f} chunks "
            f"{stats.chunks_transferred}"
        )
        for thread, counts in sampler.counts.items():
            total = sum(counts.values())
            print(f"  thread {thread}: {total} samples")
            for frame, n in counts.most_common(args.top):
                print(f"    {n / total:6.1%}  {frame}")


if __name__ == "__main__":
    sys.exit(main())
