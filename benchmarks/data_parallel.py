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
  XLA:CPU's forced devices here (a sink there dispatches each window after the last one's
  compute: ``sinkax.execution.windowed.one_in_flight``).

* the same 4 devices, the state FSDP-style (every leaf whose first axis divides by 4 split with
  ``P("data")``) against replicated: the sink's steps/s with each (no target: what sharding
  the state costs or saves here);
* 2 processes x 2 forced devices (``sinkax.launch``), process 1's data taking 0, 2 or 5 ms a
  batch, process 0's none: each process's steps/s and the fraction of its time spent waiting
  for the other to get its data ready (``SinkStats.peer_wait_s``) and for its own data
  (``data_wait_s``). A wait inside a collective, for a process that dispatched later, is not
  told apart from compute here.

The "devices" share this machine's cores: nothing here shows scaling, only overhead (see
docs/guide/data_parallel.md for what to expect on a cluster).

    python benchmarks/data_parallel.py            # CPU, a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
from _common import fresh, median_rate, save, table, workload
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sink_sizes import sinkax_run

import sinkax


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
    """Median steps/s of each run, the runs taking turns ``repeats`` times; a run returns its
    steps (timed whole) or ``(steps, seconds)`` (it timed the part that counts itself)."""
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


def fsdp(state, mesh):
    """``state`` with every leaf whose first axis divides by the mesh size split over it."""
    size = mesh.devices.size

    def place(x):
        split = x.ndim and x.shape[0] % size == 0
        return jax.device_put(x, NamedSharding(mesh, P("data") if split else P()))

    return jax.tree.map(place, state)


def sharded_state(repeats: int) -> list[dict]:
    sharding = mesh_sharding(4)
    w = workload("mlp", 200)
    split = dataclasses.replace(w, init=lambda: fsdp(w.init(), sharding.mesh))
    runs = {
        "replicated": sinkax_run(w, 300, 100, "scan", sharding=sharding)[0],
        "fsdp": sinkax_run(split, 300, 100, "scan", sharding=sharding)[0],
    }
    rates = interleaved(runs, repeats)
    return [
        {
            "part": "4 forced host devices, state",
            "workload": "mlp",
            "sink_size": 100,
            "baseline": "state replicated",
            "baseline steps/s": rates["replicated"],
            "sharded steps/s": rates["fsdp"],
            "ratio": rates["fsdp"] / rates["replicated"],
            "target": None,
            "strategy": "scan, state P('data')",
        }
    ]


class Delayed:
    """This process's rows of ``batches``, each after ``delay`` seconds."""

    def __init__(self, batches, delay):
        self.batches, self.delay = batches, delay

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            time.sleep(self.delay)
            yield sinkax.distributed.local_rows(batch)


def uneven(out: str, calls: int) -> None:
    """One process of the 2-process part: a row per delay of process 1, into ``out``."""
    sinkax.distributed.initialize()
    w, me, rows = workload("mlp", 200), jax.process_index(), []
    for delay in (0.0, 0.002, 0.005):
        data = Delayed(w.batches, delay if me == 1 else 0.0)
        state = fresh(w.init())
        options = {"sharding": sinkax.distributed.batch_sharding(), "strategy": "scan"}
        with sinkax.data_sink(w.step, data, 100, **options) as sink:
            state, metrics = sink(state)  # compiles
            jax.block_until_ready(metrics)
            before, t0 = sink.stats, time.perf_counter()
            for _ in range(calls):
                state, metrics = sink(state)
            jax.block_until_ready(metrics)
            seconds, after = time.perf_counter() - t0, sink.stats
        rows.append(
            {
                "process": me,
                "delay_ms": 1000 * (delay if me == 1 else 0.0),
                "process 1 delay_ms": 1000 * delay,
                "steps/s": calls * 100 / seconds,
                "peer wait": (after.peer_wait_s - before.peer_wait_s) / seconds,
                "data wait": (after.data_wait_s - before.data_wait_s) / seconds,
            }
        )
    with open(os.path.join(out, f"{me}.json"), "w") as f:
        json.dump(rows, f)
    jax.distributed.shutdown()


def two_processes(calls: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        script = [sys.executable, __file__, "--part", "uneven", "--out", out]
        launch = [sys.executable, "-m", "sinkax.launch", "-n", "2", "--devices", "2", "--"]
        child = subprocess.run(
            [*launch, *script, "--calls", str(calls)], capture_output=True, text=True, timeout=1800
        )
        if child.returncode:
            sys.exit(f"the 2-process part failed:\n{child.stderr[-3000:]}")
        rows = []
        for i in range(2):
            with open(os.path.join(out, f"{i}.json")) as f:
                rows += json.load(f)
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--part", choices=("all", "four", "uneven"), default="all")
    parser.add_argument("--block-every", type=int, default=1, help="plain loop: wait every N steps")
    parser.add_argument("--calls", type=int, default=10, help="timed calls of the 2-process part")
    parser.add_argument("--out", help="the 2-process part's folder for each process's rows")
    args = parser.parse_args()
    if args.part == "four":  # the subprocess with forced devices: rows as JSON on stdout
        rows = four_devices(args.repeats, args.block_every) + sharded_state(args.repeats)
        print(json.dumps(rows))
        return
    if args.part == "uneven":  # one process of the 2-process part (started by sinkax.launch)
        uneven(args.out, args.calls)
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
    waits = two_processes(args.calls)
    wait_columns = ["process 1 delay_ms", "process", "steps/s", "peer wait", "data wait"]
    print(table(waits, wait_columns))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()

    def draw(plt):
        figure, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r['part']}\n{r['workload']} sink {r['sink_size']}" for r in rows]
        ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="tab:blue")
        for i, r in enumerate(rows):
            if r["target"] is not None:
                ax.hlines(r["target"], i - 0.4, i + 0.4, colors="tab:red")
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("sharded sink / baseline (steps/s)")
        ax.set_title(f"data-parallel sink overhead (CPU, commit {commit}); red: target")
        return figure

    save(
        "data_parallel",
        {
            "commit": commit,
            "repeats": args.repeats,
            "rows": rows,
            "two_processes": waits,
            "note": __doc__.split("\n\n")[1],
        },
        draw,
    )


if __name__ == "__main__":
    main()
