"""flax networks as :class:`~sinkax.train.StatefulApply`: trainable params apart from the rest.

Each adapter returns ``(apply, params, model_state)`` for :class:`~sinkax.train.Model` or
:meth:`TrainState.create <sinkax.train.TrainState.create>`. ``params`` is what the optimizer
trains; ``model_state`` (BatchNorm's running statistics, nnx's RNG counters) is what the network
itself updates in training and reads in eval.

>>> import jax, jax.numpy as jnp
>>> from flax import linen as nn
>>> module = nn.Sequential([nn.Dense(3), nn.BatchNorm(use_running_average=False)])
>>> variables = module.init(jax.random.key(0), jnp.ones((2, 4)))
>>> apply, params, model_state = from_linen(module, variables, train_arg=None)
>>> sorted(params), sorted(model_state)
(['layers_0', 'layers_1'], ['batch_stats'])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from sinkax.train.steps import StatefulApply


def from_linen(
    module: Any,
    variables: Mapping[str, Any],
    *,
    train_arg: str | None = "train",
    rng_names: Sequence[str] = ("dropout",),
) -> tuple[StatefulApply, Any, dict[str, Any]]:
    """``(apply, variables["params"], the other collections)`` of a flax linen module.

    ``apply`` calls ``module.apply({"params": params, **model_state}, x, train=...)``: in
    training with every collection but ``params`` mutable (the updated ones become the new model
    state) and one key per name of ``rng_names`` derived from the step's key; in eval with
    nothing mutable and no key. ``train_arg`` names the module's ``__call__`` flag that switches
    BatchNorm (``use_running_average=not train``) and Dropout (``deterministic=not train``);
    ``None`` for a module without one.
    """
    if "params" not in variables:
        raise ValueError(
            f"The variables have collections {sorted(variables)} but no 'params': pass what "
            "module.init(key, x) returned."
        )
    params = variables["params"]
    model_state = {name: value for name, value in variables.items() if name != "params"}
    mutable = sorted(model_state)

    def apply(params: Any, model_state: Any, x: Any, *, train: bool, rng: Any) -> Any:
        kwargs = {} if train_arg is None else {train_arg: train}
        variables = {"params": params, **model_state}
        if not train:
            return module.apply(variables, x, **kwargs), model_state
        rngs = {} if rng is None else _named_keys(rng, rng_names)
        out, updates = module.apply(variables, x, rngs=rngs, mutable=mutable, **kwargs)
        return out, {**model_state, **updates}

    return StatefulApply(apply), params, model_state


def _named_keys(rng: jax.Array, names: Sequence[str]) -> dict[str, jax.Array]:
    """One independent key per name.

    >>> sorted(_named_keys(jax.random.key(0), ("dropout", "noise")))
    ['dropout', 'noise']
    """
    return {name: jax.random.fold_in(rng, i) for i, name in enumerate(names)}


def from_nnx(model: Any) -> tuple[StatefulApply, Any, Any]:
    """``(apply, params, model_state)`` of a flax nnx module: ``nnx.split(model, nnx.Param, ...)``.

    ``apply`` merges the graph with both states, calls the module and splits the result again:
    in training with ``deterministic=False, use_running_average=False`` set on every submodule
    that has them (``nnx.view``), in eval with both ``True``. nnx keeps its random streams in
    the module (``nnx.Rngs``, whose key and counter are leaves of ``model_state``), so dropout
    draws a new mask every step from the module's own seed; the step's key is not used. Put
    the trained state back with ``nnx.update(model, state.params, state.model_state)``.
    """
    from flax import nnx

    def graph(train: bool) -> Any:
        flags = {"deterministic": not train, "use_running_average": not train}
        return nnx.split(nnx.view(model, raise_if_not_found=False, **flags))[0]

    graphs = {True: graph(True), False: graph(False)}
    _, params, model_state = nnx.split(model, nnx.Param, ...)

    def apply(params: Any, model_state: Any, x: Any, *, train: bool, rng: Any) -> Any:
        module = nnx.merge(graphs[train], params, model_state, copy=True)
        out = module(x)
        return out, nnx.split(module, nnx.Param, ...)[2] if train else model_state

    return StatefulApply(apply), params, model_state
