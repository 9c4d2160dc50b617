"""What staying live costs: a sink with ``stop_if_nonfinite`` and with ``progress`` against the
same sink without, side by side (issue 24's targets: each at most 3 % slower, MLP, sink 1000,
one report per 100 steps).

Every mode runs the same step, sink size and strategy (``"scan"``: what a GPU runs, and the only
strategy that reports from the device), timed as ``benchmarks/sink_sizes.py`` times a sink (a new
sink per timed run after its warm calls; executables compiled before); the modes take turns
within each repeat, so that a change in the machine's load hits all of them. Every figure is a
median over repeats, every ratio compares figures of this one run.

    python benchmarks/live_costs.py                 # CPU
    python benchmarks/live_costs.py --device gpu
    python benchmarks/live_costs.py --steps 200 --repeats 1 --sink-size 100   # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
from _common import machine, save, table, workload
from sink_sizes import sinkax_run

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
TARGET = 0.97  # at most 3 % slower than plain


def measure(name: str, steps: int, sink_size: int, repeats: int) -> list[dict]:
    """Steps/s of each mode, its runs interleaved with the others'."""
    w = workload(name, max(sink_size, 250))
    runs = {mode: sinkax_run(w, steps, sink_size, "scan", **o)[0] for mode, o in MODES.items()}
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode, run in runs.items():
            done, seconds, _ = run()  # the timed steps, their seconds, all steps
            rates[mode].append(done / seconds)
    plain = statistics.median(rates["plain"])
    return [
        {"mode": m, "steps/s": statistics.median(r), "x plain": statistics.median(r) / plain}
        for m, r in rates.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or gpu (default: JAX's default)")
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--sink-size", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10000, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.device:
        jax.config.update("jax_platforms", args.device)
    rows = measure(args.workload, args.steps, args.sink_size, args.repeats)
    print(f"{args.workload}, sink {args.sink_size}  ({machine()['device']}, jax {jax.__version__})")
    print(table(rows, ["mode", "steps/s", "x plain"]))
    missed = [row for row in rows if row["x plain"] < TARGET]
    for row in rows[1:]:
        verdict = "MISS" if row in missed else "PASS"
        print(f"  {verdict}  {row['mode']}: {row['x plain']:.3f}x plain (target >= {TARGET}x)")
    suffix = "" if jax.default_backend() == "cpu" else f"_{jax.default_backend()}"
    save(f"live_costs{suffix}", {"workload": args.workload, "rows": rows, **vars(args)})
    return len(missed)


if __name__ == "__main__":
    sys.exit(main())
