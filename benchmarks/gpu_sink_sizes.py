"""Sink sizes on a GPU for one workload (``mlp``, ``lenet`` or ``transformer``): part of
benchmarks/gpu_check.py, which runs each workload in a process of its own and under a time limit.

The modes and the timing are :func:`sink_sizes.measure`'s (plain, the hand-written jit loop
with transfers issued 2 steps ahead and the hand-written ``lax.scan`` over chunks put ahead,
sinkax at sink sizes 1, 10, 100, 1000 and one epoch -- a new sink per timed run --, and the
device-only bounds), medians over repeats; then (but for the transformer), at sink sizes 10 and
1000, ``pinned``: the sink with ``pin_memory=True`` (chunks built in pinned host memory, moved
by DMA), ``no copiers``: the sink of the same batches as an iterable that is no list, which
the producer copies one by one before it reads the next, where a list's are copied by copier
threads (on a host of 8 cores or more; see sinkax.channel.packers), and ``1 copier``: the
list's batches copied by one such thread instead of up to 4, ``not quiet``: the producer and
its copiers never paused while a call runs on the host (sinkax.channel.quiet), and ``XLA
defaults``: the sink
compiled with ``compiler_options={}`` (on CUDA, its loops then out of command buffers: the
host launches each trip's kernels), timed in the same round-robin. Per sink size also ``first
call s``: a fresh sink's first call once its executables are compiled (the producer's start and
first chunk included), and ``cold first call s``: the first call of the first sink of the
step, compiles included (a sink of a step of its own pays the process's first-use costs
before them). The device's peak memory (``memory_stats()["peak_bytes_in_use"]``)
covers the whole process, all modes.

    python benchmarks/gpu_sink_sizes.py mlp --out mlp.json              # on a GPU
    python benchmarks/gpu_sink_sizes.py transformer --dry-run --out t.json  # tiny, any device
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import _transformer
import jax
import sink_sizes
from _common import fresh, machine, pay_first_use, table, workload

import sinkax
from sinkax.backend import backend_of
from sinkax.channel import packers, quiet

WORKLOADS = ("mlp", "lenet", "transformer")
SIZES, DRY_SIZES = (1, 10, 100, 1000, -1), (1, 2, -1)
VARIED, DRY_VARIED = (10, 1000), (2,)  # sink sizes also timed pinned and without copiers
FULL = {"mlp": (2000, 1000, 3), "lenet": (2000, 1000, 3), "transformer": (500, 500, 2)}
DRY = (20, 10, 1)  # (steps per repeat, batches per epoch, repeats)
COLUMNS = ["mode", "steps/s", "x plain", "x hand best", "x bound", "strategy"]
FIRST = ["cold first call s", "first call s"]


def first_call_seconds(w, size, strategy):
    """Seconds of a new sink's first call (its creation included)."""
    state = jax.block_until_ready(fresh(w.init()))
    t0 = time.perf_counter()
    with sinkax.data_sink(w.step, w.batches, size, strategy=strategy) as sink:
        jax.block_until_ready(sink(state))
        return time.perf_counter() - t0


class Iterated:
    """The batches as a re-iterable that is no list: a sink cannot tell that they stay put."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def varying(mode, run):
    """``run`` with its sinks' batches copied by one copier thread instead of
    :func:`~sinkax.channel.packers.spare_copiers`' (4 on a host of 16 cores), for the modes
    named ``1 copier N``: whether fewer threads beside the calls, each handed more batches at
    once, leave their launches freer; with the feeders never paused for a call
    (:mod:`sinkax.channel.quiet`), for those named ``not quiet N``."""
    module, name, value = {
        "1 copier": (packers, "spare_copiers", lambda: 1),
        "not quiet": (quiet, "LIMIT_S", 0.0),
    }.get(" ".join(mode.split()[:2]), (None, None, None))
    if module is None:
        return run

    def with_value():
        kept = getattr(module, name)
        setattr(module, name, value)
        try:
            return run()
        finally:
            setattr(module, name, kept)

    return with_value


def bench(w, steps, repeats, sizes, varied):
    """Rows of the table for workload ``w``, one per mode (see :func:`sink_sizes.measure`)."""
    cold = {}
    pay_first_use(w)
    for size in sizes:  # the first sink of the step: compiles included
        cold[sink_sizes.label(size, len(w.batches))] = first_call_seconds(w, size, "auto")
    iterated = dataclasses.replace(w, batches=Iterated(w.batches))
    variants = [(f"pinned {size}", size, w, {"pin_memory": True}) for size in varied]
    variants += [(f"no copiers {size}", size, iterated, {}) for size in varied]
    variants += [(f"1 copier {size}", size, w, {}) for size in varied]
    variants += [(f"not quiet {size}", size, w, {}) for size in varied]
    variants += [(f"XLA defaults {size}", size, w, {"compiler_options": {}}) for size in varied]
    rows = sink_sizes.measure(w, steps, repeats, sizes, variants=variants, wrap=varying)
    for row in rows:
        if row["mode"] in cold:
            size = -1 if "epoch" in row["mode"] else int(row["mode"].split()[1])
            row["cold first call s"] = cold[row["mode"]]
            row["first call s"] = first_call_seconds(w, size, row["strategy"])
    return rows


def targets(workload_name, rows):
    """The issue's targets for one workload, each ``(description, ratio, threshold)``."""
    sinks = sink_sizes.fixed_sizes(rows)  # sink_size="auto" has its own target
    worst = min(sinks, key=lambda r: r["x plain"])
    checks = [
        (f"{workload_name}: every sink size vs plain ({worst['mode']})", worst["x plain"], 1.0)
    ]
    later = sinks[1:]  # from the second sink size (10 on a GPU) on
    slowest = min(later, key=lambda r: r["x hand best"])
    checks.append(
        (
            f"{workload_name}: sizes >= {later[0]['mode']} vs the better hand-written loop "
            f"({slowest['mode']})",
            slowest["x hand best"],
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
    sizes, varied = (DRY_SIZES, DRY_VARIED) if args.dry_run else (SIZES, VARIED)
    if args.workload == "transformer" and not args.dry_run:
        varied = ()  # compute-bound: the data path's variants change nothing (and take minutes)
    w = workload(args.workload, epoch, lm_shape=shape)
    rows = bench(w, steps, repeats, sizes, varied)
    checks = targets(args.workload, rows)
    flags = os.environ.get("XLA_FLAGS") or None
    options = dict(backend_of(jax.devices()[0]).compiler_options)  # the sinks' own compiles
    print(f"{args.workload} ({machine()['device']}, jax {jax.__version__}, XLA_FLAGS {flags})")
    print(f"sinkax compiles its programs with {options or 'XLA defaults'}")
    print(table(rows, [*COLUMNS, *FIRST]))
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
        "xla_flags": flags,
        "sinkax_compiler_options": options,
        "rows": rows,
        "targets": [list(check) for check in checks],
    }
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
