"""``lax.conv`` inside a loop on XLA:CPU, with and without sinkax's canonical-layout rewrite.

The LeNet5 train step (batch 32, SGD-momentum) written with ``lax.conv_general_dilated``
(``sinkax.nets``) and with flax ``nn.Conv``, each run as a per-step jitted loop, as one
``lax.scan`` over 100 batches already on the device, as the same scan of the step with its
convolutions put in XLA:CPU's canonical layout
(``sinkax.execution.rewrite.canonical_convs``, what the
``"scan"`` strategy runs on CPU), and through ``data_sink(..., 100)`` with ``strategy="auto"``.
XLA:CPU rewrites convolutions into its fast kernels' layout only in the entry computation, so
the weight-gradient convolutions stay generic inside a while body unless the step's jaxpr is
rewritten first. Medians of interleaved repeats.

    python benchmarks/conv_in_scan.py      # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import jax
import jax.numpy as jnp
from _common import fresh, machine, median_rate, save, table, workload

import sinkax
from sinkax.execution.rewrite import canonical_convs

STEPS = 100
MODES = ("device step", "device scan", "device scan, canonical convs", "sinkax auto")


def runs(step, init, batches):
    """``{mode: run() -> steps}`` for the per-step loop, the scans and a data_sink."""
    stacked = jax.device_put(jax.tree.map(lambda *x: jnp.stack(x), *batches))
    on_device = jax.device_put(batches)
    jitted = jax.jit(step, donate_argnums=0)
    scans = {
        mode: jax.jit(lambda s, c, fn=fn: jax.lax.scan(fn, s, c), donate_argnums=0)
        for mode, fn in (
            ("device scan", step),
            ("device scan, canonical convs", canonical_convs(step)),
        )
    }
    states = {mode: fresh(init()) for mode in MODES}
    sink = sinkax.data_sink(step, batches, STEPS)
    while sink.stats.calls < 2 or sink.stats.strategy.startswith("auto"):  # compile, measure
        states["sinkax auto"], _ = sink(states["sinkax auto"])

    def device_step():
        state = states["device step"]
        for batch in on_device:
            state, _ = jitted(state, batch)
        states["device step"] = jax.block_until_ready(state)
        return len(on_device)

    def device_scan(mode):
        states[mode], _ = jax.block_until_ready(scans[mode](states[mode], stacked))
        return STEPS

    def sinkax_auto():
        states["sinkax auto"], _ = jax.block_until_ready(sink(states["sinkax auto"]))
        return STEPS

    modes = {"device step": device_step, "sinkax auto": sinkax_auto}
    modes.update({mode: functools.partial(device_scan, mode) for mode in scans})
    for mode in scans:  # compile
        device_scan(mode)
    device_step()
    return modes, sink


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    convs = {"lax.conv (sinkax.nets)": "lenet", "flax nn.Conv": "flax"}
    timed, sinks = {}, {}
    for name, kind in convs.items():
        w = workload(kind, STEPS)
        modes, sinks[name] = runs(w.step, w.init, w.batches)
        timed.update({(name, mode): run for mode, run in modes.items()})
    rates = {key: [] for key in timed}
    for _ in range(args.repeats):
        for key, run in timed.items():
            rates[key].append(median_rate(run, 1))
    rows = []
    for name in convs:
        row = {"convolution": name}
        for mode in MODES:
            row[mode] = statistics.median(rates[(name, mode)])
        row["scan / step"] = row["device scan"] / row["device step"]
        row["canonical scan / step"] = row["device scan, canonical convs"] / row["device step"]
        row["auto chose"] = sinks[name].stats.strategy
        sinks[name].close()
        rows.append(row)
    print(f"LeNet5 train step, batch 32, steps/s ({machine()['device']}, jax {jax.__version__})")
    print(
        table(
            rows,
            ["convolution", *MODES, "scan / step", "canonical scan / step", "auto chose"],
        )
    )
    save("conv_in_scan", {"rows": rows}, lambda plt: plot(rows, plt))
    return 0


def plot(rows, plt):
    fig, ax = plt.subplots(figsize=(7, 3))
    modes = MODES
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        ax.bar(
            [j + i * width for j in range(len(rows))], [r[mode] for r in rows], width, label=mode
        )
    ax.set_xticks([j + width for j in range(len(rows))], [r["convolution"] for r in rows])
    ax.set_ylabel("steps/s")
    ax.legend(fontsize=8)
    ax.set_title(f"LeNet5 convolutions in a loop body -- {machine()['cpu']}", fontsize=10)
    return fig


if __name__ == "__main__":
    sys.exit(main())
