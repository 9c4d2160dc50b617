"""What the flax linen, nnx and equinox examples share: given a network in sinkax's
:class:`~sinkax.train.StatefulApply` form, train it on the bundled MNIST sample twice from the
same start -- once in a hand-written ``data_sink`` loop that logs every step to a metric writer,
once with ``Model.train`` -- and evaluate both on all 1,000 test images (the last batch padded
and masked).
"""

from __future__ import annotations

import math
import sys

import jax
import numpy as np
import optax

import sinkax
from sinkax.datasets import lenet_mnist
from sinkax.train import (
    ConsoleWriter,
    MetricsLogger,
    Model,
    MultiWriter,
    StatefulApply,
    TensorBoardWriter,
    TrainState,
    cross_entropy,
    make_eval_step,
    make_train_step,
    write_steps,
)

SINK_SIZE = 50


def train_in_a_sink(apply: StatefulApply, params, model_state, rng, steps, writer):
    """``steps`` train steps, ``SINK_SIZE`` per call; returns the final TrainState."""
    optimizer = optax.adamw(1e-3)
    params, model_state, rng = jax.tree.map(lambda x: x.copy(), (params, model_state, rng))
    state = TrainState.create(params, optimizer, model_state=model_state, rng=rng)  # donated
    train_step = make_train_step(apply, cross_entropy, optimizer)
    sink_size = min(steps, SINK_SIZE)
    with sinkax.data_sink(train_step, lenet_mnist(32, "train"), sink_size) as sink:
        for _ in range(math.ceil(steps / sink_size)):
            done = int(state.step)
            state, metrics = sink(state)
            write_steps(writer, done, metrics)
    return state


def evaluate_in_a_sink(apply: StatefulApply, params, model_state) -> float:
    """Test accuracy over every test image: the sink carries (params, model_state)."""
    evaluate = make_eval_step(apply, carry_params=True)
    test = lenet_mnist(250, "test", pad_remainder=True)  # 4 batches: 1,000 images
    variables = jax.tree.map(lambda x: x.copy(), (params, model_state))  # the sink donates it
    with sinkax.data_sink(evaluate, test, sink_size=-1) as sink:
        _, metrics = sink(variables)
    counts = np.asarray(metrics["count"])
    assert counts.sum() == 1000, counts
    return float(np.average(metrics["accuracy"], weights=counts))


def train_both_ways(apply, params, model_state, rng, steps, logdir=None) -> dict[str, float]:
    """Test accuracy after ``steps`` steps, trained in a data_sink loop and with Model."""
    writers = [ConsoleWriter(every=SINK_SIZE)]
    if logdir is not None:  # TensorBoard event files: tensorboard --logdir <logdir>
        writers.append(TensorBoardWriter(logdir))
    print(f"data_sink loop, {steps} steps:")
    with MultiWriter(writers) as writer:
        state = train_in_a_sink(apply, params, model_state, rng, steps, writer)
    accuracy = {"data_sink": evaluate_in_a_sink(apply, state.params, state.model_state)}

    print(f"Model.train, {steps} steps:")
    model = Model(apply, params, cross_entropy, optax.adamw(1e-3),
                  model_state=model_state, rng=rng)  # fmt: skip
    model.train(1, lenet_mnist(32, "train"), [MetricsLogger(ConsoleWriter(every=steps))],
                sink_size=steps)  # fmt: skip
    accuracy["Model"] = model.eval(lenet_mnist(250, "test", pad_remainder=True))["accuracy"]
    print(", ".join(f"{way}: test accuracy {value:.4f}" for way, value in accuracy.items()))
    return accuracy


def command_line(main) -> None:
    """``python examples/<name>.py [steps] [tensorboard-logdir]``."""
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    main(steps, sys.argv[2] if len(sys.argv) > 2 else None)
