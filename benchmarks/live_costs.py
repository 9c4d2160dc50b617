"""What staying live costs: a sink with ``stop_if_nonfinite`` and with ``progress`` against the
same sink without, side by side (issue 24's targets: each at most 3 % slower, MLP, sink 1000,
one report per 100 steps); and, beside them, what reporting through JAX's own host callback
costs: a hand-written ``lax.scan`` over a chunk already on the device with a
``jax.debug.callback`` every 100 steps, against the same scan without. Reported too: both
options with conditionals in CUDA command buffers (``PROBES``; on other devices the same
sink as ``both``).

Every mode runs the same step, sink size and strategy (``"scan"``: what a GPU runs, and the
strategy whose windows report from blocks), timed as ``benchmarks/sink_sizes.py`` times a sink
(a new sink per timed run after its warm calls; executables compiled before); the modes take turns
within each repeat, so that a change in the machine's load hits all of them. Every figure is a
median over repeats, every ratio compares figures of this one run.

    python benchmarks/live_costs.py                 # CPU
    python benchmarks/live_costs.py --device gpu
    python benchmarks/live_costs.py --affinity      # compute steady on a small machine
    python benchmarks/live_costs.py --steps 200 --repeats 1 --sink-size 100 --out-dir /tmp  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
from _common import (
    RESULTS,
    add_affinity_option,
    bind_cpus,
    machine,
    median_rate,
    save,
    table,
    use_device,
    workload,
)
from sink_sizes import device_scan, sinkax_run

from sinkax.backend import CUDA_COMMAND_BUFFERS

MODES = {
    "plain": {},
    "stop_if_nonfinite": {"stop_if_nonfinite": "loss"},
    "progress every 100": {"progress": lambda steps, out: None, "progress_every": 100},
    "both": {
        "stop_if_nonfinite": "loss",
        "progress": lambda steps, out: None,
        "progress_every": 100,
    },
}
# reported, no target: both, with conditionals in CUDA graphs too. A guarded window has one
# `lax.cond` (sinkax.execution.guard; with `progress=`, in the join of its blocks), whose branch
# XLA's GPU runtime picks on the host, once what comes before it is computed. On CUDA in command
# buffers the device picks it; elsewhere the option changes nothing
PROBES = {
    "both, conditionals in command buffers": {
        **MODES["both"],
        "compiler_options": {
            "xla_gpu_enable_command_buffer": f"{CUDA_COMMAND_BUFFERS},CONDITIONAL"
        },
    }
}
EVERY = 100  # steps per report
HAND = {"hand scan": None, f"hand scan, jax.debug.callback every {EVERY}": EVERY}
TARGET = 0.97  # at most 3 % slower than plain


def reporting(w, every: int):
    """A window over a chunk in blocks of ``every`` steps, each ending with
    ``jax.debug.callback`` of its last output (as a reporting sink window does, without the
    sink)."""

    def block(state, part):
        state, outs = jax.lax.scan(w.step, state, part)
        jax.debug.callback(lambda out: None, jax.tree.map(lambda o: o[-1], outs))
        return state, outs

    def window(state, chunk):
        blocks = jax.tree.map(lambda x: x.reshape(-1, every, *x.shape[1:]), chunk)
        return jax.lax.scan(block, state, blocks)

    return window


def measure(name: str, steps: int, sink_size: int, repeats: int) -> list[dict]:
    """Steps/s of each mode, its runs interleaved with the others'; ``x base`` against the
    same sink without the option, or the same hand-written scan without the callback."""
    w = workload(name, max(sink_size, 3 * EVERY))  # the hand-written scans run an epoch a call
    runs = {
        mode: sinkax_run(w, steps, sink_size, "scan", **o)[0]
        for mode, o in {**MODES, **PROBES}.items()
    }
    for mode, every in HAND.items():
        runs[mode] = device_scan(w, steps, every and reporting(w, every))
    rates: dict[str, list[float]] = {mode: [] for mode in runs}
    for _ in range(repeats):
        for mode, run in runs.items():
            rates[mode].append(median_rate(run, 1))
    rows = []
    for mode, r in rates.items():
        base = "hand scan" if mode in HAND else "plain"
        rate, base_rate = statistics.median(r), statistics.median(rates[base])
        rows.append({"mode": mode, "steps/s": rate, "x base": rate / base_rate})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or gpu (default: JAX's default)")
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--sink-size", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10000, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", default=RESULTS, help="where the JSON goes (results/)")
    add_affinity_option(parser)
    args = parser.parse_args(argv)
    if args.sink_size % EVERY:
        parser.error(f"--sink-size must be a multiple of {EVERY}, the steps per report")
    use_device(args.device)
    binding = bind_cpus(args.affinity)
    rows = measure(args.workload, args.steps, args.sink_size, args.repeats)
    print(f"{args.workload}, sink {args.sink_size}  ({machine()['device']}, jax {jax.__version__})")
    print(table(rows, ["mode", "steps/s", "x base"]))
    sinks = [row for row in rows if row["mode"] in MODES]
    missed = [row for row in sinks if row["x base"] < TARGET]
    for row in sinks[1:]:
        verdict = "MISS" if row in missed else "PASS"
        print(f"  {verdict}  {row['mode']}: {row['x base']:.3f}x plain (target >= {TARGET}x)")
    alone = rows[-1]["x base"]
    print(f"  ----  JAX's host callback alone: {alone:.3f}x the scan without it (reported)")
    for row in rows:
        if row["mode"] in PROBES:
            print(f"  ----  {row['mode']}: {row['x base']:.3f}x plain (reported)")
    suffix = "" if jax.default_backend() == "cpu" else f"_{jax.default_backend()}"
    payload = {"workload": args.workload, "rows": rows, **vars(args)}
    save(f"live_costs{suffix}{binding}", payload, folder=args.out_dir)
    return 0  # the verdicts above are the report; a missed target is not a failure to run


if __name__ == "__main__":
    sys.exit(main())
