"""A flax linen MLP with BatchNorm and Dropout on the bundled MNIST sample, trained with
``data_sink`` and with ``Model.train`` (see ``_train_both.py``):

    python examples/flax_linen.py [steps] [tensorboard-logdir]

``from_linen`` splits the variables into ``params`` (trained by the optimizer) and the other
collections (``batch_stats``: updated by the module, read by eval); each train step gets the key
``fold_in(rng, step)`` for dropout.
"""

import jax
from _train_both import command_line, train_both_ways
from flax import linen as nn

from sinkax.train import from_linen


class MLP(nn.Module):
    hidden: int = 128

    @nn.compact
    def __call__(self, x, train: bool):
        x = x.reshape(x.shape[0], -1)
        x = nn.Dense(self.hidden)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(10)(x)


def main(steps: int = 500, logdir: str | None = None) -> dict[str, float]:
    module = MLP()
    variables = module.init(jax.random.key(0), jax.numpy.zeros((1, 32, 32, 1)), train=False)
    apply, params, model_state = from_linen(module, variables)  # model_state: {"batch_stats"}
    return train_both_ways(apply, params, model_state, jax.random.key(1), steps, logdir)


if __name__ == "__main__":
    command_line(main)
