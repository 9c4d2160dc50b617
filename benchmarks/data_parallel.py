"""Overhead of data-parallel sinks (``sharding=``) against today's sink and a plain sharded loop.

Two parts, each timed as interleaved repeats in one process (ratios compare figures of one run):

* one device: ``data_sink(step, batches, N)`` (placed by a device, as before) against the same
  sink given ``sharding=NamedSharding(mesh_of_1, P("data"))``; target >= 0.95x. (A one-device
  mesh is placed as its device: put as a NamedSharding, each chunk was copied where XLA:CPU
  aliases a single device's aligned buffer, 0.64x / 0.81x at sink_size 100 in a first run);
* 4 forced host CPU devices (a subprocess started with ``--xla_force_host_platform_device_count
  =4``): ``data_sink(..., 100, sharding=NamedSharding(mesh, P("data")))`` against the plain loop
  a user writes for data parallelism -- ``jax.jit(step)`` on ``jax.device_put(batch, sharding)``
  each step, the state replicated; target >= 1.0x. That loop waits for its step every
  ``--block-every`` steps (default 1): unbounded, its queued steps' all-reduces deadlocked
  XLA:CPU's forced devices here (the sink's ``"scan"`` has at most one call in flight).

The 4 "devices" share this machine's cores: nothing here shows scaling, only overhead (see
docs/guide/data_parallel.md for what to expect on a cluster).

    python benchmarks/data_parallel.py            # CPU, a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import jax
from _common import fresh, median_rate, save, table, workload
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sink_sizes import sinkax_run


def mesh_sharding(devices: int) -> NamedSharding:
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    return NamedSharding(mesh, P("data"))


def plain_sharded_run(w, steps, sharding, block_every):
    """The plain data-parallel loop: jitted step, each host batch put with the sharding."""
    step = jax.jit(w.step, donate_argnums=0)
    replicated = NamedSharding(sharding.mesh, P())
    state = jax.device_put(fresh(w.init()), replicated)
    state = jax.block_until_ready(step(state, jax.device_put(w.batches[0], sharding))[0])

    def run():
        nonlocal state
        for i in range(steps):
            batch = jax.device_put(w.batches[i % len(w.batches)], sharding)
            state, metrics = step(state, batch)
            if (i + 1) % block_every == 0:  # see the module docstring
                jax.block_until_ready(metrics)
        jax.block_until_ready(metrics)
        return steps

    return run


def interleaved(runs: dict, repeats: int) -> dict[str, float]:
    """Median steps/s of each run, the runs taking turns ``repeats`` times."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            rates[name].append(median_rate(run, 1))
    return {name: statistics.median(r) for name, r in rates.items()}


def one_device(repeats: int) -> list[dict]:
    rows = []
    device = jax.devices()[0]
    cases = (("mlp", 1, 300, "auto"), ("mlp", 100, 3, "scan"), ("lenet", 100, 2, "scan"))
    for name, sink_size, calls, strategy in cases:  # one strategy for both: auto may differ
        w = workload(name, 200)
        runs, chosen = {}, {}
        for label, options in (
            ("device", {"device": device, "strategy": strategy}),
            ("sharding", {"sharding": mesh_sharding(1), "strategy": strategy}),
        ):
            runs[label], chosen[label] = sinkax_run(w, sink_size * calls, sink_size, **options)
        rates = interleaved(runs, repeats)
        rows.append(
            {
                "part": "1 device",
                "workload": name,
                "sink_size": sink_size,
                "baseline": "sink, device=",
                "baseline steps/s": rates["device"],
                "sharded steps/s": rates["sharding"],
                "ratio": rates["sharding"] / rates["device"],
                "target": 0.95,
                "strategy": chosen["sharding"],
            }
        )
    return rows


def four_devices(repeats: int, block_every: int) -> list[dict]:
    assert jax.device_count() == 4, jax.devices()
    sharding = mesh_sharding(4)
    rows = []
    for name, calls in (("mlp", 3), ("lenet", 2)):
        w = workload(name, 200)
        sunk, chosen = sinkax_run(w, 100 * calls, 100, sharding=sharding)
        rates = interleaved(
            {"plain": plain_sharded_run(w, 100 * calls, sharding, block_every), "sink": sunk},
            repeats,
        )
        rows.append(
            {
                "part": "4 forced host devices",
                "workload": name,
                "sink_size": 100,
                "baseline": f"plain sharded jit loop, blocking every {block_every}",
                "baseline steps/s": rates["plain"],
                "sharded steps/s": rates["sink"],
                "ratio": rates["sink"] / rates["plain"],
                "target": 1.0,
                "strategy": chosen,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--part", choices=("all", "four"), default="all")
    parser.add_argument("--block-every", type=int, default=1, help="plain loop: wait every N steps")
    args = parser.parse_args()
    if args.part == "four":  # the subprocess with forced devices: rows as JSON on stdout
        print(json.dumps(four_devices(args.repeats, args.block_every)))
        return
    rows = one_device(args.repeats)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    child = subprocess.run(
        [
            sys.executable,
            __file__,
            "--part",
            "four",
            *("--repeats", str(args.repeats)),
            *("--block-every", str(args.block_every)),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if child.returncode:
        sys.exit(f"the 4-device part failed:\n{child.stderr[-3000:]}")
    rows += json.loads(child.stdout.strip().splitlines()[-1])
    columns = [
        "part", "workload", "sink_size", "baseline", "baseline steps/s", "sharded steps/s",
        "ratio", "target", "strategy",
    ]  # fmt: skip
    print(table(rows, columns))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()

    def draw(plt):
        figure, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r['part']}\n{r['workload']} sink {r['sink_size']}" for r in rows]
        ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="tab:blue")
        for i, r in enumerate(rows):
            ax.hlines(r["target"], i - 0.4, i + 0.4, colors="tab:red")
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("sharded sink / baseline (steps/s)")
        ax.set_title(f"data-parallel sink overhead (CPU, commit {commit}); red: target")
        return figure

    save(
        "data_parallel",
        {"commit": commit, "repeats": args.repeats, "rows": rows, "note": __doc__.split("\n\n")[1]},
        draw,
    )


if __name__ == "__main__":
    main()
