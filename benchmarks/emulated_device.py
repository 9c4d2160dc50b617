"""Sink sizes on sinkax's *emulated* discrete accelerator, with host–device interactions counted.

The emulated device (``sinkax.pjrt.use_emulated``) is XLA:CPU behind sinkax's PJRT plugin: its own
device buffers, a launch cost per execute and a latency + bandwidth per transfer, launches that
return before their compute ends (as on a device stream). It computes at this CPU's speed, so
every figure here is an *emulated* figure, not a GPU or Ascend one. For each workload (the MLP
and LeNet5, batch 32) and every preset of :mod:`sinkax.presets` plus

* ``balanced`` -- synthetic: host->device bandwidth set so that one batch's transfer costs what
  one step computes (measured below, without costs), the case the data sink exists for;

the modes of :func:`sink_sizes.measure` (plain, the two hand-written loops, sinkax at sink sizes
1, 10, 100, 1000 and one epoch -- each timed alone, a new sink per timed run after its warm
calls --, the device-only bounds), with the interactions per step the plugin counted in the
last timed run of each, and the process's page faults per step there. Targets: every sink size
>= 1.0x plain; from sink size 10 on >= 1.0x the better hand-written loop; sinkax 1000 >= 0.95x
the bound of the strategy it runs; on ``balanced``, sinkax 1000's time per step <= 1.1x
max(transfer, compute).

Then ``counting overhead``: in a subprocess, the same XLA:CPU plugin registered twice, once
directly and once through sinkax's plugin with costs off and host buffers left as they are, so
the only difference is the counting.

    python benchmarks/emulated_device.py        # ~35 minutes on 2 cores
    python benchmarks/emulated_device.py --affinity   # compute steadier on a small machine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys

from _common import add_affinity_option, bind_cpus, machine, median_rate, save, table, workload

import sinkax
from sinkax import pjrt
from sinkax.presets import PRESETS

pjrt.use_emulated("counting")  # before jax's backends start

import jax  # noqa: E402 (after the plugin registration, by design)
from sink_sizes import SIZES, device_scan, fixed_sizes, measure  # noqa: E402

sinkax.set_context(device_target="Emulated")  # every run below: sinks, jit, device_put
EMU = jax.devices(pjrt.EMULATED_PLATFORM)[0]
assert sinkax.backend.default_device() == EMU
PRESET_NAMES = ("pcie4-x16", "pcie5-x16", "ascend910-pcie4")


def page_faults():
    """The process's minor page faults so far: first touches of memory the kernel maps afresh."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def counted(counts):
    """``wrap`` for :func:`sink_sizes.measure`: each run records its interactions per step, and
    the process's page faults per step (host CPU time a copy into fresh memory costs)."""

    def wrap(mode, run):
        def counting_run():
            before, faults = pjrt.interactions(), page_faults()
            result = run()
            moved, faults = pjrt.interactions() - before, page_faults() - faults
            steps = result[-1] if isinstance(result, tuple) else result  # every step it ran
            counts[mode] = {
                f.name: getattr(moved, f.name) / steps for f in dataclasses.fields(moved)
            }
            counts[mode]["faults"] = faults / steps
            return result

        return counting_run

    return wrap


def balanced(w, compute_s):
    """A synthetic preset: one batch's host->device transfer costs one step's compute."""
    nbytes = sum(leaf.nbytes for leaf in w.batches[0].values())
    base = PRESETS["pcie4-x16"]
    return dataclasses.replace(
        base,
        name="balanced",
        h2d_bytes_per_s=nbytes / max(compute_s - base.h2d_latency_s, 1e-7),
        source="synthetic: a batch's transfer costs one step's compute on this CPU",
    )


def bench(w, steps, repeats, preset):
    """The rows of :func:`sink_sizes.measure` under ``preset``, with interactions per step."""
    pjrt.set_costs(preset)
    counts = {}
    rows = measure(w, steps, repeats, SIZES, wrap=counted(counts))
    for row in rows:
        per_step = counts[row["mode"]]
        row.update(
            {
                "launch/step": per_step["launches"],
                "h2d/step": per_step["h2d"],
                "h2d B/step": per_step["h2d_bytes"],
                "d2h/step": per_step["d2h"],
                "faults/step": per_step["faults"],
            }
        )
    return rows


def targets(w, rows, preset):
    """The issue's targets on this preset: (description, measured ratio, threshold, higher ok)."""
    by_mode = {r["mode"]: r for r in rows}
    sinks = fixed_sizes(rows)  # sink_size="auto" has its own targets
    worst = min(sinks, key=lambda r: r["x plain"])
    later = [r for r in sinks if r["mode"] != "sinkax 1"]
    slowest = min(later, key=lambda r: r["x hand best"])
    largest = by_mode["sinkax 1000"]
    key = f"{w.name}/{preset.name}"
    checks = [
        (
            f"{key}: every sink size vs plain ({worst['mode']}{rounds(worst, 'x plain')})",
            worst["x plain"],
            1.0,
            True,
        ),
        (
            f"{key}: from sink size 10 on vs the better hand-written loop "
            f"({slowest['mode']}{rounds(slowest, 'x hand best')})",
            slowest["x hand best"],
            1.0,
            True,
        ),
        (
            f"{key}: sinkax 1000 vs its strategy's device-only bound{rounds(largest, 'x bound')}",
            largest["x bound"],
            0.95,
            True,
        ),
    ]
    if preset.name == "balanced":
        nbytes = sum(leaf.nbytes for leaf in w.batches[0].values())
        transfer_s = preset.transfer_s("h2d", nbytes)
        bound = "device step" if largest["strategy"] == "loop" else "device scan"
        compute_s = 1 / by_mode[bound]["steps/s"]
        wall_s = 1 / largest["steps/s"]
        checks.append(
            (
                f"{key}: sinkax 1000 time / max(transfer, compute) per step",
                wall_s / max(transfer_s, compute_s),
                1.1,
                False,
            )
        )
        checks.append(
            (
                f"{key}: plain time / (transfer + compute) per step",
                (1 / by_mode["plain"]["steps/s"]) / (transfer_s + compute_s),
                1.0,
                None,  # reported, not targeted
            )
        )
    return checks


def rounds(row, ratio):
    """``"; rounds lo-hi"``: the range of ``row``'s ``ratio`` over the rounds (see
    :func:`sink_sizes.paired`), for a target's description."""
    each = row["rounds"][ratio]
    return f"; rounds {min(each):.2f}-{max(each):.2f}"


COUNTING_CHILD = """
import json, sys, time, statistics
sys.path.insert(0, {bench_dir!r})
import sinkax_pjrt
from sinkax import compat, pjrt
pjrt.use_plugin(sinkax_pjrt.cpu_plugin_path(), "counted", discrete=False)
compat.register_plugin("direct", library_path=sinkax_pjrt.cpu_plugin_path(), priority=-200)
import jax, sinkax
from _common import fresh, workload
w = workload("mlp", 100)
def runner(device, mode):
    state = jax.device_put(fresh(w.init()), device)
    if mode == "plain":
        step = jax.jit(w.step, donate_argnums=0)
        def run(state):
            for i in range(1000):
                state, loss = step(state, w.batches[i % 100])
            jax.block_until_ready(loss)
            return state
        return run, state
    sink = sinkax.data_sink(w.step, w.batches, 100, device=device, strategy="scan")
    def run(state):
        for _ in range(10):
            state, loss = sink(state)
        jax.block_until_ready(loss)
        return state
    return run, state
out = {{}}
for mode in ("plain", "sinkax 100"):
    runs = {{name: runner(jax.devices(name)[0], mode) for name in ("direct", "counted")}}
    states = {{name: r[1] for name, r in runs.items()}}
    for name, (run, _) in runs.items():
        states[name] = run(states[name])  # compile
    times = {{name: [] for name in runs}}
    for _ in range({repeats}):
        for name, (run, _) in runs.items():
            t0 = time.perf_counter(); states[name] = run(states[name])
            times[name].append(time.perf_counter() - t0)
    out[mode] = {{name: statistics.median(t) for name, t in times.items()}}
print(json.dumps(out))
"""


def counting_overhead(repeats):
    """Median seconds per 1000 MLP steps, XLA:CPU plugin direct vs through sinkax's counter."""
    code = COUNTING_CHILD.format(bench_dir=os.path.dirname(__file__), repeats=repeats)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _color(mode):
    if mode.startswith("sinkax"):
        return "tab:blue"
    return "tab:green" if mode.startswith("device") else "tab:gray"


def plot(results, plt):
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 3.6 * len(results)), squeeze=False)
    for row_axes, (key, rows) in zip(axes, results.items(), strict=True):
        modes = [r["mode"] for r in rows]
        colors = [_color(m) for m in modes]
        row_axes[0].barh(modes, [r["x plain"] for r in rows], color=colors)
        row_axes[0].axvline(1.0, color="black", lw=0.8)
        row_axes[0].invert_yaxis()
        row_axes[0].set_xlabel("steps/s relative to the plain loop (emulated)")
        row_axes[0].set_title(key)
        row_axes[1].barh(modes, [max(r["h2d/step"], 1e-4) for r in rows], color=colors)
        row_axes[1].barh(
            modes, [max(r["launch/step"], 1e-4) for r in rows], color="none", edgecolor="black"
        )
        row_axes[1].set_xscale("log")
        row_axes[1].invert_yaxis()
        row_axes[1].set_xlabel("per step: host->device transfers (bars), launches (outlines)")
    info = machine()
    fig.suptitle(
        f"sinkax on the EMULATED device (XLA:CPU behind sinkax's PJRT plugin) -- "
        f"{info['cpu']}, jax {info['jax']}",
        fontsize=10,
    )
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["mlp", "lenet"])
    parser.add_argument("--presets", nargs="+", default=[*PRESET_NAMES, "balanced"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000, help="steps per timed run (MLP)")
    add_affinity_option(parser)
    args = parser.parse_args(argv)
    binding = bind_cpus(args.affinity)
    results, checks, presets = {}, [], {}
    for name in args.workloads:
        w = workload(name, 100)
        steps = args.steps if name == "mlp" else args.steps // 4
        pjrt.set_costs("counting")
        compute_s = 1 / median_rate(device_scan(w, steps), 3)
        for preset_name in args.presets:
            preset = balanced(w, compute_s) if preset_name == "balanced" else PRESETS[preset_name]
            key = f"{name} / {preset.name}"
            presets[key] = dataclasses.asdict(preset)
            results[key] = bench(w, steps, args.repeats, preset)
            checks += targets(w, results[key], preset)
    pjrt.set_costs("counting")
    columns = ["mode", "steps/s", "x plain", "x hand best", "x bound", "strategy"]
    columns += ["launch/step", "h2d/step", "h2d B/step", "d2h/step", "faults/step"]
    for key, rows in results.items():
        print(f"\n{key}  (EMULATED device, {machine()['cpu']}, jax {jax.__version__})")
        print(table(rows, columns))
    overhead = counting_overhead(args.repeats * 2)
    for mode, times in overhead.items():
        ratio = times["counted"] / times["direct"]
        checks.append((f"counting overhead, {mode} (counted / direct time)", ratio, 1.02, False))
    print("\ntargets")
    failed = 0
    for description, ratio, threshold, higher in checks:
        if higher is None:
            print(f"  ----  {description}: {ratio:.2f}x (reported)")
            continue
        ok = ratio >= threshold if higher else ratio <= threshold
        failed += not ok
        sign = ">=" if higher else "<="
        verdict = "PASS" if ok else "MISS"
        print(f"  {verdict}  {description}: {ratio:.3f}x (target {sign} {threshold}x)")
    payload = {
        "emulated": True,
        "presets": presets,
        "results": results,
        "counting_overhead_s": overhead,
        "targets": [list(c) for c in checks],
    }
    save(f"emulated_device{binding}", payload, lambda plt: plot(results, plt))
    return failed


if __name__ == "__main__":
    sys.exit(main())
