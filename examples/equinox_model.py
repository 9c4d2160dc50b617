"""An equinox MLP with BatchNorm and Dropout on the bundled MNIST sample, trained with
``data_sink`` and with ``Model.train`` (see ``_train_both.py``):

    python examples/equinox_model.py [steps] [tensorboard-logdir]

An ``eqx.Module`` holds non-array leaves (the dropout rate, activation functions, flags), which
a compiled step cannot take as inputs. As with plain ``jax.jit``, the example splits the model
once with ``eqx.partition(model, eqx.is_array)``: the arrays are the params that sinkax carries
and trains, the rest is closed over and put back with ``eqx.combine`` inside the step -- what
``eqx.filter_jit`` does for you. BatchNorm's statistics live in an ``eqx.nn.State``, the model
state; equinox modules take one example, so the step ``vmap``s them over the batch (BatchNorm
reduces over the ``"batch"`` axis) with a key per example for dropout.
"""

import equinox as eqx
import jax
from _train_both import command_line, train_both_ways

from sinkax.train import StatefulApply


class MLP(eqx.Module):
    dense: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key: jax.Array, hidden: int = 128):
        dense_key, out_key = jax.random.split(key)
        self.dense = eqx.nn.Linear(32 * 32, hidden, key=dense_key)
        self.norm = eqx.nn.BatchNorm(hidden, axis_name="batch", mode="ema")
        self.dropout = eqx.nn.Dropout(0.2)
        self.out = eqx.nn.Linear(hidden, 10, key=out_key)

    def __call__(self, x, state, *, key, inference):
        x, state = self.norm(self.dense(x.reshape(-1)), state, inference=inference)
        x = self.dropout(jax.nn.relu(x), key=key, inference=inference)
        return self.out(x), state


def equinox_apply(static) -> StatefulApply:
    """The network in sinkax's form: arrays in, ``eqx.combine`` with the rest inside."""

    def apply(params, model_state, x, *, train, rng):
        model = eqx.combine(params, static)

        def one(x, key):  # one example; BatchNorm reduces over the vmapped "batch" axis
            return model(x, model_state, key=key, inference=not train)

        keys = jax.random.split(rng, len(x)) if train else None
        out, new_state = jax.vmap(
            one, axis_name="batch", in_axes=(0, 0 if train else None), out_axes=(0, None)
        )(x, keys)
        return out, new_state if train else model_state

    return StatefulApply(apply)


def main(steps: int = 500, logdir: str | None = None) -> dict[str, float]:
    model, model_state = eqx.nn.make_with_state(MLP)(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    return train_both_ways(equinox_apply(static), params, model_state, jax.random.key(1), steps,
                           logdir)  # fmt: skip


if __name__ == "__main__":
    command_line(main)
