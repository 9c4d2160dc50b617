"""Pure train and eval steps for a network given as ``apply_fn(params, x)`` and a params pytree.

:func:`make_train_step` and :func:`make_eval_step` build the step functions
:class:`~sinkax.train.Model` sinks; use them with :func:`sinkax.data_sink` in your own loops. A
batch is a mapping (``batch[input_key]``, ``batch[label_key]``, by default ``"image"`` and
``"label"``) or an ``(x, y)`` pair.

A network with non-trainable state (BatchNorm's running statistics) or randomness (dropout) is
a :class:`StatefulApply`: ``fn(params, model_state, x, *, train, rng) -> (out, model_state)``.
The train step then keeps ``model_state`` in :attr:`TrainState.model_state`, out of the
optimizer's reach, and gives step ``k`` the key ``fold_in(state.rng, k)``.

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
"""``apply_fn(params, x) -> out``: a network without state or randomness."""
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


class StatefulApply(NamedTuple):
    """A network with non-trainable state or randomness, as the steps call it:
    ``fn(params, model_state, x, *, train, rng) -> (out, new_model_state)``.

    ``train`` is a Python bool (``True`` in the train step: batch statistics, dropout;
    ``False`` in eval: running statistics, no dropout); ``rng`` is the step's key (``None`` in
    eval, or when the state carries no key). The train step keeps ``new_model_state``; eval
    discards it. :func:`sinkax.train.from_linen` and :func:`~sinkax.train.from_nnx` build one for
    flax modules; wrapping a function makes the steps and :class:`~sinkax.train.Model` call it
    this way instead of as ``apply_fn(params, x)``.

    >>> def apply(params, count, x, *, train, rng):
    ...     return x * params, count + train
    >>> StatefulApply(apply)(2.0, 0, 3.0, train=True, rng=None)
    (6.0, 1)
    """

    fn: Callable[..., tuple[Any, Any]]

    def __call__(self, params: Any, model_state: Any, x: Any, *, train: bool, rng: Any) -> Any:
        return self.fn(params, model_state, x, train=train, rng=rng)


def as_stateful(apply_fn: ApplyFn | StatefulApply) -> StatefulApply:
    """``apply_fn`` in the :class:`StatefulApply` form: a plain ``apply_fn(params, x)`` passes
    the model state through untouched.

    >>> as_stateful(lambda p, x: p * x)(2, None, 3, train=True, rng=None)
    (6, None)
    """
    if isinstance(apply_fn, StatefulApply):
        return apply_fn
    return StatefulApply(lambda params, state, x, *, train, rng: (apply_fn(params, x), state))


class TrainState(NamedTuple):
    """What training changes: the step count, the params and the optimizer state (a pytree),
    and for a :class:`StatefulApply` network the non-trainable ``model_state`` (e.g. flax's
    ``batch_stats``: updated by the network, never by the optimizer) and the base key ``rng``
    (step ``k`` uses ``jax.random.fold_in(rng, k)``; a typed ``jax.random.key``)."""

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = None
    rng: Any = None

    @classmethod
    def create(
        cls,
        params: Any,
        optimizer: optax.GradientTransformation,
        opt_state: Any = None,
        *,
        model_state: Any = None,
        rng: Any = None,
    ) -> TrainState:
        """Step 0, ``params``, and ``opt_state`` (default ``optimizer.init(params)``); the
        optimizer sees only ``params``, never ``model_state``.

        >>> state = TrainState.create({"w": jnp.ones(2)}, optax.sgd(0.1, momentum=0.9))
        >>> int(state.step), type(state.opt_state[0]).__name__
        (0, 'TraceState')
        """
        if opt_state is None:
            opt_state = optimizer.init(params)
        else:
            check_opt_state(optimizer, params, opt_state)
        return cls(jnp.zeros((), jnp.int32), params, opt_state, model_state, rng)


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
    apply_fn: ApplyFn | StatefulApply,
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

    A :class:`StatefulApply` is called with ``train=True``, ``state.model_state`` and the key
    ``jax.random.fold_in(state.rng, state.step)`` (``None`` without ``state.rng``): a new
    dropout mask every step, the same ones for the same base key. The model state it returns
    replaces ``state.model_state``; gradients flow to ``params`` only.

    >>> step = make_train_step(lambda p, x: x * p, lambda out, y: ((out - y) ** 2).mean(),
    ...                        optax.apply_if_finite(optax.sgd(0.5), 3))
    >>> state = TrainState.create(jnp.float32(0), optax.apply_if_finite(optax.sgd(0.5), 3))
    >>> state, m = step(state, (1.0, jnp.nan))
    >>> float(state.params), bool(m["finite"])
    (0.0, False)
    """
    apply = as_stateful(apply_fn)

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        check_opt_state(optimizer, state.params, state.opt_state)
        x, y = split_batch(batch, input_key, label_key)
        rng = None if state.rng is None else jax.random.fold_in(state.rng, state.step)

        def objective(params: Any) -> tuple[jax.Array, Any]:
            out, model_state = apply(params, state.model_state, x, train=True, rng=rng)
            return _scalar_loss(loss_fn(out, y)), model_state

        (loss, model_state), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state._replace(
            step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state
        )
        return new_state, {"loss": loss, "finite": jnp.isfinite(loss)}

    return train_step


def resolve_metrics(metrics: Sequence[str] | Mapping[str, Metric]) -> dict[str, Metric]:
    """Metric functions by name: names from :data:`METRICS`, or a ``{name: fn}`` mapping.

    >>> list(resolve_metrics(("accuracy",)))
    ['accuracy']
    """
    if isinstance(metrics, Mapping):
        if metrics.keys() & {"loss", "count"}:
            raise ValueError(
                "No metric may be named 'loss' or 'count': those names are taken, the eval step "
                "reports the loss_fn's loss and weighs batches by their real examples' count."
            )
        return dict(metrics)
    if metrics is None:
        raise TypeError("metrics must be names or a {name: fn} mapping; () for none.")
    if isinstance(metrics, str):  # one name
        metrics = (metrics,)
    unknown = [name for name in metrics if name not in METRICS]
    if unknown:
        raise ValueError(
            f"Unknown metric(s) {unknown}; known: {sorted(METRICS)}. Pass a mapping "
            "{name: fn(logits, labels) -> scalar} for others."
        )
    return {name: METRICS[name] for name in metrics}


def batch_mask(batch: Any, mask_key: str = "mask") -> jax.Array | None:
    """The batch's mask leaf (``True`` for real examples, ``False`` for padding), or ``None``.

    >>> batch_mask({"mask": [True, False]}), batch_mask((1, 2))
    ([True, False], None)
    """
    return batch.get(mask_key) if isinstance(batch, Mapping) else None


def _masked_mean(fn: Callable[[Any, Any], jax.Array], out: Any, y: Any, mask: Any) -> jax.Array:
    """The mean of ``fn`` over the examples where ``mask`` holds, ``fn`` being a mean over a
    batch: it is evaluated on every example alone (a batch of one)."""
    one = lambda leaf: leaf[None]  # noqa: E731
    values = jax.vmap(lambda o, t: fn(jax.tree.map(one, o), jax.tree.map(one, t)))(out, y)
    weights = jnp.asarray(mask, values.dtype)
    return (values * weights).sum() / jnp.maximum(weights.sum(), 1)


def make_eval_step(
    apply_fn: ApplyFn | StatefulApply,
    loss_fn: LossFn = cross_entropy,
    *,
    metrics: Sequence[str] | Mapping[str, Metric] = ("accuracy",),
    input_key: str = "image",
    label_key: str = "label",
    mask_key: str = "mask",
    carry_params: bool = False,
) -> Callable[[Any, Any], Any]:
    """``eval_step(params, batch) -> {"loss", *metrics}``, each the mean over the batch.

    With ``carry_params=True`` it returns ``(params, metrics)``: a step for a sink that carries
    the params through as its state, so that one executable serves every evaluation (params
    closed over, as in ``partial(eval_step, params)``, are compiled in as constants: each new
    partial compiles again). The sink donates the params it is given: pass a copy of params
    that are still needed.

    For a :class:`StatefulApply` the params are ``(params, model_state)``, and the network
    runs with ``train=False`` and no key: running statistics, no dropout.

    A mapping batch with a ``mask_key`` entry (padded by :class:`sinkax.datasets.PadBatch`) is
    evaluated over its real examples only: each value is the mean over the rows whose mask is
    ``True`` (``loss_fn`` and the metrics, means over a batch, are taken per example), and the
    result has a ``"count"`` of those rows, to weight the batches' means by.

    >>> eval_step = make_eval_step(lambda p, x: x @ p)
    >>> m = eval_step(jnp.eye(2), (jnp.array([[2.0, 0.0], [0.0, 1.0]]), jnp.array([0, 0])))
    >>> sorted(m), float(m["accuracy"])
    (['accuracy', 'loss'], 0.5)
    >>> padded = {"image": jnp.array([[2.0, 0.0], [0.0, 1.0]]), "label": jnp.array([0, 0]),
    ...           "mask": jnp.array([True, False])}
    >>> m = eval_step(jnp.eye(2), padded)
    >>> float(m["accuracy"]), int(m["count"])
    (1.0, 1)
    >>> import numpy as np, sinkax
    >>> test_set = [(np.eye(2, dtype=np.float32), np.array([0, 1]))] * 3
    >>> evaluate = make_eval_step(lambda p, x: x @ p, carry_params=True)  # once
    >>> with sinkax.data_sink(evaluate, test_set, sink_size=-1) as sink:
    ...     _, m = sink(jax.tree.map(jnp.copy, jnp.eye(2)))  # a copy: the sink donates it
    >>> m["accuracy"].tolist()
    [1.0, 1.0, 1.0]
    """
    fns = {"loss": lambda out, y: _scalar_loss(loss_fn(out, y)), **resolve_metrics(metrics)}
    stateful = isinstance(apply_fn, StatefulApply)
    apply = as_stateful(apply_fn)

    def eval_step(params: Any, batch: Any) -> dict[str, jax.Array]:
        x, y = split_batch(batch, input_key, label_key)
        params, model_state = params if stateful else (params, None)
        out = apply(params, model_state, x, train=False, rng=None)[0]
        mask = batch_mask(batch, mask_key)
        if mask is None:
            return {name: fn(out, y) for name, fn in fns.items()}
        results = {name: _masked_mean(fn, out, y, mask) for name, fn in fns.items()}
        return {**results, "count": jnp.sum(jnp.asarray(mask, jnp.int32))}

    if not carry_params:
        return eval_step

    def carrying_eval_step(params: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
        return params, eval_step(params, batch)

    return carrying_eval_step
