"""The usual flax nnx loop through a sink: ``nnx.Optimizer``, ``nnx.MultiMetric`` and an
in-place ``train_step`` as the nnx MNIST tutorial writes them, unchanged.

nnx modules, optimizers and metrics are pytrees, so the three objects are the sink's state as
they are: the step calls ``train_step`` on them and returns them. No ``nnx.split`` or
``nnx.merge``: each call returns the updated objects -- rebind the names to them (the ones
passed in were donated) -- and ``metrics.compute()`` / ``metrics.reset()`` work on the returned
metrics in place, between calls. Runs in a few seconds on a CPU:

    python examples/nnx_loop.py
"""

import numpy as np
import optax
from flax import nnx

import sinkax

FEATURES, CLASSES, BATCH = 8, 3, 16


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(32, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, logits


@nnx.jit
def train_step(model, optimizer, metrics, batch):
    """The tutorial's step: updates the model, the optimizer and the metrics in place."""
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])
    optimizer.update(model, grads)


@nnx.jit
def eval_step(model, metrics, batch):
    loss, logits = loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])


def in_sink(step):
    """``step(*objects, batch)``, which works in place, as a sink's ``fn(state, batch)``."""

    def fn(objects, batch):
        step(*objects, batch)
        return objects, None

    return fn


def batches(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """``n`` batches of a learnable problem: labels from a fixed linear teacher."""
    teacher = np.random.default_rng(42).normal(size=(FEATURES, CLASSES))
    x = np.random.default_rng(seed).normal(size=(n, BATCH, FEATURES)).astype(np.float32)
    return [{"x": xb, "y": (xb @ teacher).argmax(1).astype(np.int32)} for xb in x]


def new_objects():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def main(epochs: int = 3, with_sink: bool = True) -> list[dict[str, float]]:
    """Train ``epochs`` epochs, evaluating after each; the history of both metrics.

    ``with_sink=False`` runs the tutorial's own loop, for comparison."""
    train, test = batches(20, seed=0), batches(5, seed=1)
    model, optimizer, metrics = new_objects()
    history = []
    with (
        sinkax.data_sink(in_sink(train_step), train, sink_size=-1) as train_sink,
        sinkax.data_sink(in_sink(eval_step), test, sink_size=-1) as test_sink,
    ):
        for _ in range(epochs):
            model.train()  # dropout on
            if with_sink:  # one call: one epoch on the device
                (model, optimizer, metrics), _ = train_sink((model, optimizer, metrics))
            else:
                for batch in train:
                    train_step(model, optimizer, metrics, batch)
            record = {f"train_{k}": float(v) for k, v in metrics.compute().items()}
            metrics.reset()  # in place, on the objects the sink returned
            model.eval()  # dropout off: a sink of its own, as the module's flags differ
            if with_sink:
                (model, metrics), _ = test_sink((model, metrics))
            else:
                for batch in test:
                    eval_step(model, metrics, batch)
            record |= {f"test_{k}": float(v) for k, v in metrics.compute().items()}
            metrics.reset()
            history.append(record)
    return history


if __name__ == "__main__":
    for epoch, record in enumerate(main()):
        print(epoch, {k: round(v, 4) for k, v in record.items()})
