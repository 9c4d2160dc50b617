"""Where a sink's host time goes, per thread, beside the rates that bound it (one workload).

For each sink size: steps/s of the sink, of a sink of the same data whose step does nothing
(the data path's own ceiling: read, stage, transfer; also with ``pin_memory=True``), of the
hand-written window loop over one chunk already on the device (``lax.scan`` of ``size`` steps
from a device position: what a sink call computes, without its data path), of the sink timed
once its producer had 2 s to prepare ``prefetch`` chunks ahead ("data prepared ahead": its
calls' own cost, the data path out of the way), of the sink timed once its producer had read
every batch the timed calls need and was parked inside the dataset ("producer parked": no
producer or copier beside the calls at all), of the sink with the interpreter's switch interval
at 0.1 ms instead of 5 ms ("switch every 0.1 ms": if the calls wait for the interpreter lock
that the producer holds, they wait less), and the sink's ``data_wait_s``/``slot_wait_s``;
how long such a window's call takes to return made at once after its chunk's ``device_put`` and
once the chunk is there (whether a launch waits for a transfer in flight). Then the frames the
main thread and the producer thread were in, sampled every millisecond while the sink ran (the
innermost frame inside sinkax, jax or numpy; ``other`` elsewhere). First, once, how fast the
host copies batches into staging (:func:`copy_rates`).

    python benchmarks/host_profile.py mlp --sizes 10 1000     # any device; the default one
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import os
import statistics
import sys
import threading
import time

import jax
import numpy as np
from _common import fresh, machine, median_rate, workload

import sinkax
from sinkax.channel import packers

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


class Parked:
    """``batches`` over and over, one pass an epoch; the reader parked inside the dataset (no
    interpreter lock held) once it has read ``limit`` batches, until the timing is done."""

    def __init__(self, batches, limit):
        self.batches, self.limit, self.read = batches, limit, 0
        self.parked, self.done = threading.Event(), threading.Event()

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            if self.read == self.limit:
                self.parked.set()
                self.done.wait()
            self.read += 1
            yield batch


def sink_rate(step, w, size, calls, sample=False, prefetch=2, prefilled=False, **options):
    """Steps/s of a new sink (of ``data_sink`` ``options``) over ``calls`` timed calls, its
    stats, and the sampler; with ``prefilled``, the timing starts 2 s after the warm calls: time
    for the producer to fill its free slots (``prefetch`` chunks) first; with ``"parked"``, the
    timing starts once the producer has read every batch the calls need (and a few chunks
    more) and is parked in the dataset: the calls' own cost, no producer beside them."""
    state = fresh(w.init())
    data = w.batches
    if prefilled == "parked":  # 3 warm calls, the timed ones, 2 chunks' worth more
        data = Parked(w.batches, (3 + calls) * size + 2 * max(size, 64))
        prefetch = min(64, data.limit // max(size, 64) + 3)
    with sinkax.data_sink(step, data, size, strategy="scan", prefetch=prefetch, **options) as sink:
        for _ in range(3):
            state, metrics = sink(state)
        jax.block_until_ready(metrics)
        if prefilled == "parked":
            data.parked.wait(30.0)
        elif prefilled:
            time.sleep(2.0)
        sampler = Sampler() if sample else None
        t0 = time.perf_counter()
        with sampler or contextlib.nullcontext():
            for _ in range(calls):
                state, metrics = sink(state)
            jax.block_until_ready(metrics)
        seconds = time.perf_counter() - t0
        if prefilled == "parked":
            data.done.set()
        return calls * size / seconds, sink.stats, sampler


@contextlib.contextmanager
def switch_interval(seconds: float):
    """The interpreter's thread switch interval set to ``seconds`` meanwhile."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def host_chunk(w, size):
    """A chunk of ``max(size, 100)`` batches, stacked on the host."""
    batches = [w.batches[i % len(w.batches)] for i in range(max(size, 100))]
    return jax.tree.map(lambda *x: np.stack(x), *batches)


def window_program(w, size, chunk_steps):
    """Jitted ``(state, chunk, i) -> (state, outs, next i)``: ``lax.scan`` of ``size`` steps
    from position ``i`` of a chunk of ``chunk_steps`` batches; and its first carry."""

    def window(state, chunk, i):
        part = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, size), chunk)
        state, outs = jax.lax.scan(w.step, state, part)
        return state, outs, (i + size) % chunk_steps

    return jax.jit(window, donate_argnums=0), (fresh(w.init()), jax.device_put(np.int32(0)))


def window_rate(w, size, calls):
    """Steps/s of ``lax.scan`` windows of ``size`` steps over one chunk already on the device."""
    host = host_chunk(w, size)
    chunk = jax.device_put(host)
    run, (state, i) = window_program(w, size, len(jax.tree.leaves(host)[0]))
    state, outs, i = run(state, chunk, i)
    jax.block_until_ready(outs)
    t0 = time.perf_counter()
    for _ in range(calls):
        state, outs, i = run(state, chunk, i)
    jax.block_until_ready(outs)
    return calls * size / (time.perf_counter() - t0)


def call_after_put(w, size, calls=20):
    """Median seconds a window's call takes to return when made at once after its chunk's
    ``device_put``, and when made once that chunk is on the device: whether a launch waits for
    a transfer still in flight, as a sink's first call on a chunk just put may."""
    host = host_chunk(w, size)
    run, (state, i) = window_program(w, size, len(jax.tree.leaves(host)[0]))
    seconds = {False: [], True: []}
    for landed in (False, True, False, True):
        for _ in range(calls):
            chunk = jax.device_put(host)
            if landed:
                jax.block_until_ready(chunk)
            t0 = time.perf_counter()
            state, outs, i = run(state, chunk, i)
            seconds[landed].append(time.perf_counter() - t0)
            jax.block_until_ready(outs)
    return statistics.median(seconds[False][1:]), statistics.median(seconds[True])


def copy_rates(w, rows=1000, threads=4, repeats=3):
    """Steps/s at which this host stacks ``rows`` batches of ``w`` into reused staging, as a
    sink's copiers do (row by row, :func:`~sinkax.channel.packers.copy_rows`): in one thread,
    in ``threads`` threads (a share each, from a pool), and by one ``np.stack(..., out=)`` per
    leaf; medians of ``repeats``. Set against a sink's idle-step rate: whether the copy, or the
    handing over of its rows between threads, bounds the data path."""
    rows_of = [(i, jax.tree.leaves(w.batches[i % len(w.batches)])) for i in range(rows)]
    staging = [np.empty((rows, *np.shape(x)), np.asarray(x).dtype) for x in rows_of[0][1]]
    share = -(-rows // threads)

    def pooled(pool):
        parts = [rows_of[k : k + share] for k in range(0, rows, share)]
        for future in [pool.submit(packers.copy_rows, staging, part) for part in parts]:
            future.result()

    def stacked():
        for j, buffer in enumerate(staging):
            np.stack([leaves[j] for _, leaves in rows_of], out=buffer)

    def rate(copy):
        copy()  # pages touched, threads started
        return median_rate(lambda: copy() or rows, repeats)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return {
            "1 thread": rate(lambda: packers.copy_rows(staging, rows_of)),
            f"{threads} threads": rate(lambda: pooled(pool)),
            "np.stack": rate(stacked),
        }


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

    rates = copy_rates(w)
    print("host copy into staging, steps/s: " + "; ".join(f"{k} {v:.0f}" for k, v in rates.items()))

    for size in args.sizes:
        calls = max(3, args.steps // size)
        rate, stats, sampler = sink_rate(w.step, w, size, calls, sample=True)
        idle_rate, _, _ = sink_rate(idle, w, size, calls)
        idle_pinned, _, _ = sink_rate(idle, w, size, calls, pin_memory=True)
        bound = window_rate(w, size, calls)
        prefetch = min(16, max(2, 1024 // size))  # chunks of at least 64 steps
        ahead = max(2, prefetch * 64 // size)  # calls that the prepared chunks hold
        filled, _, _ = sink_rate(w.step, w, size, ahead, prefetch=prefetch, prefilled=True)
        parked, _, _ = sink_rate(w.step, w, size, max(2, 1000 // size), prefilled="parked")
        with switch_interval(1e-4):
            switching, _, _ = sink_rate(w.step, w, size, calls)
        in_flight, landed = call_after_put(w, size)
        print(
            f"\nsink {size}: {rate:.0f} steps/s; idle step {idle_rate:.0f} (staged in pinned "
            f"memory {idle_pinned:.0f}); device windows "
            f"{bound:.0f}; data prepared ahead {filled:.0f}; producer parked {parked:.0f}; "
            f"switch every 0.1 ms {switching:.0f}; "
            f"data_wait_s "
            f"{stats.data_wait_s:.3f} slot_wait_s {stats.slot_wait_s:.3f} chunks "
            f"{stats.chunks_transferred}\n  window call returns after {in_flight * 1e6:.0f} us "
            f"just after its chunk's device_put, {landed * 1e6:.0f} us once the chunk is there"
        )
        for thread, counts in sampler.counts.items():
            total = sum(counts.values())
            print(f"  thread {thread}: {total} samples")
            for frame, n in counts.most_common(args.top):
                print(f"    {n / total:6.1%}  {frame}")


if __name__ == "__main__":
    sys.exit(main())
