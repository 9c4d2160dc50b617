"""Pure train and eval steps for a network given as ``apply_fn(params, x)`` and a params pytree.

:func:`make_train_step` and :func:`make_eval_step` build the step functions
:class:`~sinkax.train.Model` sinks; use them with :func:`sinkax.data_sink` in your own loops. A
batch is a mapping (``batch[input_key]``, ``batch[label_key]``, by default ``"image"`` and
``"label"``) or an ``(x, y)`` pair.

>>> import jax.numpy as jnp, numpy as np, optax
>>> apply_fn = lambda p, x: x @ p["w"]
>>> params = {"w": jnp.zeros((3, 2))}
>>> step = make_train_step(apply_fn, cross_entropy, optax.sgd(0.1))
>>> batch = (np.ones((4, 3), np.float32), np.array([0, 1, 1, 1], np.int32))
>>> state, metrics = step(TrainState.create(params, optax.sgd(0.1)), batch)
>>> int(state.step), round(float(metrics["loss"]), 4), bool(metrics["finite"])
(1, 0.6931, True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

ApplyFn = Callable[[Any, Any], Any]
LossFn = Callable[[Any, Any], jax.Array]
Metric = Callable[[Any, Any], jax.Array]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of integer ``labels`` (MindSpore's
    ``SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")``).

    >>> float(cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 3])))  # log(4)
    1.3862943649291992
    """
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Fraction of rows whose arg-max matches the label (integer or one-hot).

    >>> float(accuracy(jnp.array([[0.0, 1.0], [1.0, 0.0]]), jnp.array([1, 1])))
    0.5
    """
    if labels.ndim == logits.ndim:
        labels = labels.argmax(-1)
    return (logits.argmax(-1) == labels).mean()


METRICS: dict[str, Metric] = {"accuracy": accuracy}


class TrainState(NamedTuple):
    """What training changes: the step count, the params and the optimizer state (a pytree)."""

    step: jax.Array
    params: Any
    opt_state: Any

    @classmethod
    def create(
        cls, params: Any, optimizer: optax.GradientTransformation, opt_state: Any = None
    ) -> TrainState:
        """Step 0, ``params``, and ``opt_state`` (default ``optimizer.init(params)``).

        >>> state = TrainState.create({"w": jnp.ones(2)}, optax.sgd(0.1, momentum=0.9))
        >>> int(state.step), type(state.opt_state[0]).__name__
        (0, 'TraceState')
        """
        if opt_state is None:
            opt_state = optimizer.init(params)
        else:
            check_opt_state(optimizer, params, opt_state)
        return cls(jnp.zeros((), jnp.int32), params, opt_state)


def split_batch(batch: Any, input_key: str = "image", label_key: str = "label") -> tuple[Any, Any]:
    """``(x, y)`` of a batch: ``batch[input_key], batch[label_key]`` or an ``(x, y)`` pair.

    >>> split_batch({"image": 1, "label": 2}), split_batch((1, 2))
    ((1, 2), (1, 2))
    """
    if isinstance(batch, Mapping):
        missing = [key for key in (input_key, label_key) if key not in batch]
        if missing:
            raise KeyError(
                f"The batch has keys {sorted(batch)} but no {missing}: name the input and label "
                "entries with input_key=... and label_key=..."
            )
        return batch[input_key], batch[label_key]
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"A batch must be a mapping with the input and label entries or an (x, y) pair, got "
        f"{type(batch).__name__}."
    )


def _scalar_loss(loss: Any) -> jax.Array:
    if jnp.shape(loss) != ():
        raise ValueError(
            f"loss_fn must return a scalar, got shape {jnp.shape(loss)}. Reduce the per-example "
            "losses inside loss_fn, e.g. `.mean()`."
        )
    return loss


def _describe(tree: Any, limit: int = 3) -> str:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0][:limit]
    shown = ", ".join(f"{jax.tree_util.keystr(p)}: {jnp.shape(x)}" for p, x in leaves)
    return f"{jax.tree.structure(tree).num_leaves} leaves ({shown}, ...)"


def check_opt_state(optimizer: optax.GradientTransformation, params: Any, opt_state: Any) -> None:
    """Raise ``ValueError`` unless ``opt_state`` has the layout ``optimizer.init(params)`` has.

    >>> opt = optax.sgd(0.1, momentum=0.9)
    >>> check_opt_state(opt, {"w": jnp.ones(3)}, opt.init({"w": jnp.ones(2)}))
    Traceback (most recent call last):
    ValueError: The optimizer state does not match the params: ...
    """
    expected = jax.eval_shape(optimizer.init, params)
    same_tree = jax.tree.structure(expected) == jax.tree.structure(opt_state)
    if same_tree and all(
        jnp.shape(a) == jnp.shape(b)
        for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(opt_state), strict=True)
    ):
        return
    raise ValueError(
        "The optimizer state does not match the params: it was built for a different params "
        f"tree or another optimizer. optimizer.init(params) gives {_describe(expected)}; the "
        f"state given has {_describe(opt_state)}. Build it from these params with "
        "optimizer.init(params) (TrainState.create(params, optimizer))."
    )


def make_train_step(
    apply_fn: ApplyFn,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    input_key: str = "image",
    label_key: str = "label",
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """``train_step(state, batch) -> (state, {"loss", "finite"})``: one optimizer step.

    ``loss_fn(apply_fn(params, x), y)`` must be a scalar; ``finite`` says whether it is finite
    (what :class:`~sinkax.train.TerminateOnNaN` reads). The step applies every update: to skip
    non-finite ones, so a NaN never reaches the params, wrap the optimizer in
    ``optax.apply_if_finite``. That check reads every gradient on every step (for a small MLP
    on CPU it cost ~40% of the step), so it is yours to choose, not built in.

    >>> step = make_train_step(lambda p, x: x * p, lambda out, y: ((out - y) ** 2).mean(),
    ...                        optax.apply_if_finite(optax.sgd(0.5), 3))
    >>> state = TrainState.create(jnp.float32(0), optax.apply_if_finite(optax.sgd(0.5), 3))
    >>> state, m = step(state, (1.0, jnp.nan))
    >>> float(state.params), bool(m["finite"])
    (0.0, False)
    """

    def objective(params: Any, x: Any, y: Any) -> jax.Array:
        return _scalar_loss(loss_fn(apply_fn(params, x), y))

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        check_opt_state(optimizer, state.params, state.opt_state)
        x, y = split_batch(batch, input_key, label_key)
        loss, grads = jax.value_and_grad(objective)(state.params, x, y)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), {
            "loss": loss,
            "finite": jnp.isfinite(loss),
        }

    return train_step


def resolve_metrics(metrics: Sequence[str] | Mapping[str, Metric]) -> dict[str, Metric]:
    """Metric functions by name: names from :data:`METRICS`, or a ``{name: fn}`` mapping.

    >>> list(resolve_metrics(("accuracy",)))
    ['accuracy']
    """
    if isinstance(metrics, Mapping):
        return dict(metrics)
    if isinstance(metrics, str):  # one name
        metrics = (metrics,)
    unknown = [name for name in metrics if name not in METRICS]
    if unknown:
        raise ValueError(
            f"Unknown metric(s) {unknown}; known: {sorted(METRICS)}. Pass a mapping "
            "{name: fn(logits, labels) -> scalar} for others."
        )
    return {name: METRICS[name] for name in metrics}


def make_eval_step(
    apply_fn: ApplyFn,
    loss_fn: LossFn = cross_entropy,
    *,
    metrics: Sequence[str] | Mapping[str, Metric] = ("accuracy",),
    input_key: str = "image",
    label_key: str = "label",
    carry_params: bool = False,
) -> Callable[[Any, Any], Any]:
    """``eval_step(params, batch) -> {"loss", *metrics}``, each the mean over the batch.

    With ``carry_params=True`` it returns ``(params, metrics)``: a step for a sink that carries
    the params through as its state, so that one executable serves every evaluation (params
    closed over, as in ``partial(eval_step, params)``, are compiled in as constants: each new
    partial compiles again). The sink donates the params it is given: pass a copy of params
    that are still needed.

    >>> eval_step = make_eval_step(lambda p, x: x @ p)
    >>> m = eval_step(jnp.eye(2), (jnp.array([[2.0, 0.0], [0.0, 1.0]]), jnp.array([0, 0])))
    >>> sorted(m), float(m["accuracy"])
    (['accuracy', 'loss'], 0.5)
    >>> import numpy as np, sinkax
    >>> test_set = [(np.eye(2, dtype=np.float32), np.array([0, 1]))] * 3
    >>> evaluate = make_eval_step(lambda p, x: x @ p, carry_params=True)  # once
    >>> with sinkax.data_sink(evaluate, test_set, sink_size=-1) as sink:
    ...     _, m = sink(jax.tree.map(jnp.copy, jnp.eye(2)))  # a copy: the sink donates it
    >>> m["accuracy"].tolist()
    [1.0, 1.0, 1.0]
    """
    fns = resolve_metrics(metrics)

    def eval_step(params: Any, batch: Any) -> dict[str, jax.Array]:
        x, y = split_batch(batch, input_key, label_key)
        logits = apply_fn(params, x)
        results = {"loss": _scalar_loss(loss_fn(logits, y))}
        results.update({name: fn(logits, y) for name, fn in fns.items()})
        return results

    if not carry_params:
        return eval_step

    def carrying_eval_step(params: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
        return params, eval_step(params, batch)

    return carrying_eval_step
