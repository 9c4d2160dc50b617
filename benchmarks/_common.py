"""What the benchmark scripts share: workloads, timing, machine facts, tables and plots."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

RESULTS = os.path.join(os.path.dirname(__file__), "results")


@dataclasses.dataclass(frozen=True)
class Workload:
    """A train step, its initial state and a list of host batches (one epoch)."""

    name: str
    step: Callable[[Any, Any], tuple[Any, Any]]  # (state, batch) -> (state, metrics)
    init: Callable[[], Any]
    batches: list[dict[str, np.ndarray]]


def flax_lenet5() -> tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]:
    """``(init(key) -> params, apply(params, x) -> logits)`` of LeNet5 written with flax linen
    (``nn.Conv``, ``nn.max_pool``, ``nn.Dense``), as a flax user writes it."""
    import flax.linen as nn

    class LeNet5(nn.Module):
        @nn.compact
        def __call__(self, x):
            for features in (6, 16):
                x = nn.Conv(features, (5, 5), padding="VALID", use_bias=False)(x)
                x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
            x = x.reshape(x.shape[0], -1)
            x = nn.relu(nn.Dense(120)(x))
            x = nn.relu(nn.Dense(84)(x))
            return nn.Dense(10)(x)

    net = LeNet5()
    return (
        lambda key: net.init(key, jnp.zeros((1, 32, 32, 1)))["params"],
        lambda params, x: net.apply({"params": params}, x),
    )


def workload(
    name: str, num_batches: int, batch_size: int = 32, seed: int = 0, lm_shape: Any = None
) -> Workload:
    """``"lenet"`` (the reference LeNet5, ``lax.conv``), ``"flax"`` (LeNet5 in flax ``nn.Conv``)
    or ``"mlp"`` (1024-128-10), SGD-momentum; or ``"transformer"``, a small language model
    (:mod:`_transformer`, of ``lm_shape``, whose batch size it has), AdamW. Each step built with
    :func:`sinkax.train.make_train_step` (what ``Model.train`` runs)."""
    from sinkax import nets
    from sinkax.train import TrainState, cross_entropy, make_train_step

    if name == "transformer":
        import _transformer as lm

        shape = lm_shape or lm.LMShape()
        adamw = optax.adamw(3e-4)
        step = make_train_step(
            lambda params, tokens: lm.apply(params, tokens, shape.heads),
            cross_entropy,
            adamw,
            input_key="tokens",
            label_key="targets",
        )
        return Workload(
            name,
            step,
            lambda: TrainState.create(lm.init(jax.random.key(seed), shape), adamw),
            lm.batches(shape, num_batches, seed),
        )
    rng = np.random.default_rng(seed)
    shape, init_fn, apply_fn = {
        "lenet": lambda: ((32, 32, 1), nets.lenet5_init, nets.lenet5_apply),
        "flax": lambda: ((32, 32, 1), *flax_lenet5()),
        "mlp": lambda: ((1024,), nets.mlp_init, nets.mlp_apply),
    }[name]()
    batches = [
        {
            "image": rng.normal(size=(batch_size, *shape)).astype(np.float32),
            "label": rng.integers(0, 10, batch_size).astype(np.int32),
        }
        for _ in range(num_batches)
    ]
    optimizer = optax.sgd(0.01, momentum=0.9)
    step = make_train_step(apply_fn, cross_entropy, optimizer)
    return Workload(
        name, step, lambda: TrainState.create(init_fn(jax.random.key(seed)), optimizer), batches
    )


def fresh(state: Any) -> Any:
    """A copy of ``state`` that a donating call may consume."""
    return jax.tree.map(jnp.copy, state)


def pay_first_use(w: Workload) -> None:
    """Run a one-step sink of ``w`` on a step function of its own: what a process pays once,
    whatever sink comes first (the device's libraries set up, the first compile's own costs,
    sinkax's threads), so that no timed sink pays it. The executables of ``w.step`` are not
    compiled by it: a sink timed cold after it still compiles everything."""
    import sinkax

    with sinkax.data_sink(lambda state, batch: w.step(state, batch), w.batches, 1) as sink:
        jax.block_until_ready(sink(fresh(w.init())))


def median_rate(run: Callable[[], int | tuple[int, float, int]], repeats: int) -> float:
    """Median over ``repeats`` of (steps run) / (seconds), ``run`` returning its step count (it
    is timed whole) or ``(steps, seconds, all steps)`` (it timed the part that counts itself, of
    all the steps it ran)."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = run()
        steps, seconds = result[:2] if isinstance(result, tuple) else (result, None)
        rates.append(steps / (seconds or time.perf_counter() - t0))
    return statistics.median(rates)


def use_device(name: str | None) -> None:
    """Make the first device of platform ``name`` (``"cpu"``, ``"gpu"``) JAX's default, if
    given (``jax_platforms="gpu"`` would also ask for ROCm on a CUDA machine, and fail)."""
    if name:
        jax.config.update("jax_default_device", jax.devices(name)[0])


def add_affinity_option(parser: Any) -> None:
    """``--affinity``: the run under ``sinkax.set_cpu_affinity(True)`` (see :func:`bind_cpus`)."""
    parser.add_argument(
        "--affinity",
        action="store_true",
        help="sinkax.set_cpu_affinity(True) for the whole run: XLA's compute on its own CPUs, "
        "steady on a small machine (benchmarks/compute_steadiness.py); results *_affinity.json",
    )


def bind_cpus(enabled: bool) -> str:
    """``sinkax.set_cpu_affinity(True)`` if ``enabled`` (its plan printed), and the suffix of
    the results' names that says so (``"_affinity"`` or ``""``)."""
    if not enabled:
        return ""
    import sinkax

    print("set_cpu_affinity:", sinkax.set_cpu_affinity(True))
    return "_affinity"


def machine() -> dict[str, str]:
    """JAX version, backend, device and CPU model: where the figures were taken."""
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = f"{names[0]} x{len(names)}" if names else cpu
    device = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "cpu": cpu,
    }


def bar_chart(
    plt: Any,
    labels: list[str],
    values: list[float],
    xlabel: str,
    name: str,
    height: float = 3,
    **bars: Any,
) -> Any:
    """A horizontal bar chart of ``values`` (first label on top), titled ``name`` and stamped
    with :func:`machine`: the figure a benchmark's ``draw`` returns to :func:`save`."""
    figure, ax = plt.subplots(figsize=(8, height))
    ax.barh(labels, values, **bars)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    info = machine()
    ax.set_title(f"{name} -- {info['device']}, {info['cpu']}, jax {info['jax']}", fontsize=9)
    return figure


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain-text table of ``rows`` (dicts) in ``columns`` order."""
    cells = [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def save(
    name: str,
    payload: dict[str, Any],
    draw: Callable[[Any], Any] | None = None,
    folder: str = RESULTS,
) -> None:
    """Write ``<folder>/<name>.json`` (default ``results/``) and, with ``draw(pyplot) ->
    figure``, ``<name>.png``."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine(), **payload}, f, indent=2)
    if draw is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure = draw(plt)
        figure.tight_layout()
        figure.savefig(path.replace(".json", ".png"), dpi=80)
    print(f"wrote {path}" + (" and the .png beside it" if draw else ""))
