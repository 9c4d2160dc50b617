"""Why sinkax's LeNet5 writes its convolutions as im2col: ``lax.conv`` inside a loop on XLA:CPU.

The LeNet5 train step (batch 32, SGD-momentum) with ``lax.conv_general_dilated`` convolutions and
with ``sinkax.nets``' im2col ones, each run as a per-step jitted loop and as one ``lax.scan``
over 100 batches already on the device, and through ``data_sink(..., 100)`` with
``strategy="auto"``, which times scan against the per-step loop and keeps the faster. XLA:CPU
rewrites convolutions into its fast kernels' layout only in the entry computation, so the
weight-gradient convolutions of ``lax.conv`` stay generic inside a while body (see the README,
"Execution strategies"). Medians of interleaved repeats.

    python benchmarks/conv_in_scan.py      # ~40 s on 2 cores
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import jax
import jax.numpy as jnp
import optax
from _common import fresh, machine, median_rate, save, table, workload

import sinkax
from sinkax import nets
from sinkax.train import TrainState, cross_entropy, make_train_step

STEPS = 100


def lax_conv(x, w):
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def runs(step, init, batches):
    """``{mode: run() -> steps}`` for the per-step loop, the scan and a data_sink."""
    stacked = jax.device_put(jax.tree.map(lambda *x: jnp.stack(x), *batches))
    on_device = jax.device_put(batches)
    jitted = jax.jit(step, donate_argnums=0)
    scan = jax.jit(lambda s, c: jax.lax.scan(step, s, c), donate_argnums=0)
    states = {"device step": fresh(init()), "device scan": fresh(init()), "sinkax auto": init()}
    sink = sinkax.data_sink(step, batches, STEPS)
    while sink.stats.calls < 2 or sink.stats.strategy.startswith("auto"):  # compile, measure
        states["sinkax auto"], _ = sink(states["sinkax auto"])

    def device_step():
        state = states["device step"]
        for batch in on_device:
            state, _ = jitted(state, batch)
        states["device step"] = jax.block_until_ready(state)
        return len(on_device)

    def device_scan():
        states["device scan"], _ = jax.block_until_ready(scan(states["device scan"], stacked))
        return STEPS

    def sinkax_auto():
        states["sinkax auto"], _ = jax.block_until_ready(sink(states["sinkax auto"]))
        return STEPS

    for run in (device_step, device_scan):  # compile
        run()
    return {
        "device step": device_step,
        "device scan": device_scan,
        "sinkax auto": sinkax_auto,
    }, sink


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    w = workload("lenet", STEPS)
    optimizer = optax.sgd(0.01, momentum=0.9)
    init = functools.partial(TrainState.create, nets.lenet5_init(jax.random.key(0)), optimizer)
    convs = {"lax.conv": lax_conv, "im2col (sinkax.nets)": nets.conv2d_valid}
    timed, sinks = {}, {}
    for name, conv in convs.items():
        step = make_train_step(
            functools.partial(nets.lenet5_apply, conv=conv), cross_entropy, optimizer
        )
        modes, sinks[name] = runs(step, init, w.batches)
        timed.update({(name, mode): run for mode, run in modes.items()})
    rates = {key: [] for key in timed}
    for _ in range(args.repeats):
        for key, run in timed.items():
            rates[key].append(median_rate(run, 1))
    rows = []
    for name in convs:
        row = {"convolution": name}
        for mode in ("device step", "device scan", "sinkax auto"):
            row[mode] = statistics.median(rates[(name, mode)])
        row["scan / step"] = row["device scan"] / row["device step"]
        row["auto chose"] = sinks[name].stats.strategy
        sinks[name].close()
        rows.append(row)
    print(f"LeNet5 train step, batch 32, steps/s ({machine()['device']}, jax {jax.__version__})")
    print(
        table(
            rows,
            [
                "convolution",
                "device step",
                "device scan",
                "scan / step",
                "sinkax auto",
                "auto chose",
            ],
        )
    )
    save("conv_in_scan", {"rows": rows}, lambda plt: plot(rows, plt))
    return 0


def plot(rows, plt):
    fig, ax = plt.subplots(figsize=(7, 3))
    modes = ("device step", "device scan", "sinkax auto")
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
