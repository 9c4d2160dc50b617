"""A flax nnx MLP with BatchNorm and Dropout on the bundled MNIST sample, trained with
``data_sink`` and with ``Model.train`` (see ``_train_both.py``):

    python examples/flax_nnx.py [steps] [tensorboard-logdir]

``from_nnx`` is ``nnx.split(model, nnx.Param, ...)``: the ``nnx.Param`` variables are trained by
the optimizer, the rest (BatchNorm's statistics, the ``nnx.Rngs`` key and counter of the
dropout stream) is the model state, which the module updates as it runs; each call merges the
module from both inside the compiled step. nnx draws dropout from its own streams, so no
``rng`` is given. ``nnx.update(model, state.params, state.model_state)`` puts a trained state
back into the module.
"""

from _train_both import command_line, train_both_ways
from flax import nnx

from sinkax.train import from_nnx


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, hidden: int = 128):
        self.dense = nnx.Linear(32 * 32, hidden, rngs=rngs)
        self.norm = nnx.BatchNorm(hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        x = self.dropout(nnx.relu(self.norm(self.dense(x))))
        return self.out(x)


def main(steps: int = 500, logdir: str | None = None) -> dict[str, float]:
    apply, params, model_state = from_nnx(MLP(nnx.Rngs(0, dropout=1)))
    return train_both_ways(apply, params, model_state, None, steps, logdir)


if __name__ == "__main__":
    command_line(main)
