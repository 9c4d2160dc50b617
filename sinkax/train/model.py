"""``Model``: MindSpore's high-level ``train``/``eval``/``predict`` for a JAX network.

The network is plain functions and pytrees: ``apply_fn(params, x) -> logits`` with ``params``
any pytree (a flax ``module.apply`` with its ``variables`` when the module has no mutable
collections and no dropout; for equinox pass ``params, static = eqx.partition(model,
eqx.is_array)`` and ``apply_fn = lambda p, x: jax.vmap(eqx.combine(p, static))(x)``). A network
with BatchNorm statistics or dropout is a :class:`~sinkax.train.StatefulApply` with its
``model_state`` and a base ``rng`` (:func:`~sinkax.train.from_linen`,
:func:`~sinkax.train.from_nnx` build all three for flax). Training state is a
:class:`~sinkax.train.TrainState` pytree, available as ``model.state``.

>>> import jax.numpy as jnp, numpy as np, optax
>>> x = np.random.default_rng(0).normal(size=(64, 2)).astype(np.float32)
>>> data = [{"image": x[i:i + 8], "label": (x[i:i + 8, 0] > 0).astype(np.int32)}
...         for i in range(0, 64, 8)]
>>> model = Model(lambda p, x: x @ p["w"], {"w": jnp.zeros((2, 2))}, cross_entropy,
...               optax.sgd(0.5))
>>> run = model.train(3, data)
>>> run.epoch, run.step, model.eval(data)["accuracy"] > 0.9
(3, 24, True)
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from sinkax import backend, context, distributed
from sinkax.config import check_timed
from sinkax.errors import warn
from sinkax.pytree import committed, copy_tree
from sinkax.train.callbacks import Callback, RunContext
from sinkax.train.checkpoint import ModelCheckpoint
from sinkax.train.evaluation import Evaluator
from sinkax.train.helper import DatasetHelper, connect_network_with_dataset
from sinkax.train.steps import (
    ApplyFn,
    LossFn,
    Metric,
    StatefulApply,
    TrainState,
    as_stateful,
    batch_mask,
    cross_entropy,
    make_eval_step,
    make_train_step,
    split_batch,
)

# the DatasetHelper arguments Model.train and Model.eval pass themselves
_SET_BY_TRAIN = {"sink_size", "dataset_sink_mode", "epoch_num", "data_state"}
_NOT_FINITE_AGAIN = (
    "The step on the batch at data epoch {0.epoch}, step {0.step} was not finite, and again "
    "when training went on from that batch: training cannot go past it. model.state holds the "
    "params from before it. Add TerminateOnNaN() to the callbacks to stop there without an "
    "error, or fix that batch or the step (e.g. a lower learning rate, a loss that guards "
    "log(0))."
)


def _check_epochs(epoch: Any, initial_epoch: Any) -> None:
    for name, value, minimum in (("epoch", epoch, 1), ("initial_epoch", initial_epoch, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    if epoch <= initial_epoch:
        raise ValueError(
            f"epoch={epoch} is the number of the last epoch to train, so it must exceed "
            f"initial_epoch={initial_epoch} (the epochs already done, e.g. by the checkpoint "
            f"resumed from); nothing would run. Ask for more than {initial_epoch} epochs."
        )


def _notify(callbacks: Sequence[Callback], hook: str, run: RunContext) -> None:
    for callback in callbacks:
        getattr(callback, hook)(run)


class Model:
    """Train, evaluate and predict with ``apply_fn(params, x)``, sinking steps to the device.

    Args:
      apply_fn: ``apply_fn(params, x) -> logits``, or a
        :class:`~sinkax.train.StatefulApply` for a network with non-trainable state or dropout.
      params: the initial params (any pytree of arrays): what the optimizer trains.
      loss_fn: ``loss_fn(logits, labels) -> scalar``; default mean sparse softmax cross-entropy.
      optimizer: an optax ``GradientTransformation`` (``None`` for an eval-only model).
      metrics: metric names (``"accuracy"``) or ``{name: fn(logits, labels)}`` for :meth:`eval`.
      opt_state: an optimizer state to continue from (default ``optimizer.init(params)``).
      input_key, label_key: the batch entries holding inputs and labels (mapping batches);
        ``(x, y)`` pairs work as they are.
      model_state: a :class:`~sinkax.train.StatefulApply` network's non-trainable state (flax's
        ``batch_stats``): updated by the train step, used as it is by eval and predict.
      rng: the base key of a :class:`~sinkax.train.StatefulApply` network's randomness
        (``jax.random.key(seed)``): train step ``k`` gets ``fold_in(rng, k)``.
      sink_options: more :func:`sinkax.data_sink` options (``strategy``, ``prefetch``,
        ``timeout``, ``read_options``, ...) for every sink the model makes.
    """

    def __init__(
        self,
        apply_fn: ApplyFn,
        params: Any,
        loss_fn: LossFn = cross_entropy,
        optimizer: optax.GradientTransformation | None = None,
        *,
        metrics: Sequence[str] | Mapping[str, Metric] = ("accuracy",),
        opt_state: Any = None,
        input_key: str = "image",
        label_key: str = "label",
        sink_options: Mapping[str, Any] | None = None,
        model_state: Any = None,
        rng: Any = None,
    ):
        if optimizer is not None and not all(
            callable(getattr(optimizer, name, None)) for name in ("init", "update")
        ):  # an optax.GradientTransformation, or what has its init and update (MultiSteps)
            raise TypeError(
                f"optimizer must be an optax.GradientTransformation, got {optimizer!r:.80}: "
                "build one, e.g. optax.sgd(0.1) rather than optax.sgd."
            )
        self.apply_fn = apply_fn
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.sink_options = dict(sink_options or {})
        taken = sorted(self.sink_options.keys() & _SET_BY_TRAIN)
        if taken:
            raise ValueError(
                f"sink_options may not set {taken}: Model.train and Model.eval set them from "
                "their own arguments (sink_size=, dataset_sink_mode=, resume_from=)."
            )
        keys = {"input_key": input_key, "label_key": label_key}
        self._label_of: Callable[[Any], Any] = lambda batch: split_batch(batch, **keys)[1]
        if optimizer is None:
            self._train_step = None
            self.state = TrainState(jnp.zeros((), jnp.int32), params, None, model_state, rng)
        else:
            self._train_step = make_train_step(apply_fn, loss_fn, optimizer, **keys)
            self.state = TrainState.create(
                params, optimizer, opt_state, model_state=model_state, rng=rng
            )
        # committed to devices, as every state a run returns: copying one compiles once
        self.state = committed(self.state, backend.default_device())
        self._eval_step = make_eval_step(apply_fn, loss_fn, metrics=metrics, **keys)
        # one bound method for every eval: compiled executables are cached by step function
        self._eval_and_count = self._eval_and_count
        apply = as_stateful(apply_fn)
        self._predict = jax.jit(
            lambda params, state, x: apply(params, state, x, train=False, rng=None)[0]
        )

    def eval_variables(self, state: TrainState) -> Any:
        """What the eval step takes from a train state: the params, and for a
        :class:`~sinkax.train.StatefulApply` network ``(params, model_state)``."""
        if isinstance(self.apply_fn, StatefulApply):
            return state.params, state.model_state
        return state.params

    def _eval_and_count(self, variables: Any, batch: Any) -> tuple[Any, Any]:
        """The eval step carrying the variables through, with the examples it saw for
        weighting (the batch size, or the real rows of a padded batch)."""
        metrics = self._eval_step(variables, batch)
        mask = batch_mask(batch)
        if mask is None:
            return variables, (metrics, jnp.asarray(jnp.shape(self._label_of(batch))[0]))
        return variables, ({k: v for k, v in metrics.items() if k != "count"}, metrics["count"])

    @property
    def params(self) -> Any:
        """The current params."""
        return self.state.params

    def train(
        self,
        epoch: int,
        train_dataset: Any,
        callbacks: Callback | Sequence[Callback] | None = None,
        dataset_sink_mode: bool = True,
        sink_size: int | str = -1,
        initial_epoch: int = 0,
        resume_from: str | ModelCheckpoint | None = None,
        call_seconds: float | None = None,
    ) -> RunContext:
        """Train up to epoch number ``epoch``; returns the final :class:`RunContext`.

        * sink mode, ``sink_size=-1``: each epoch is one pass over the dataset, run as one sink;
        * sink mode, ``sink_size > 0``: each epoch is one sink of ``sink_size`` steps and the
          data is traversed endlessly, each epoch continuing where the last stopped (``epoch *
          sink_size`` steps in all);
        * sink mode, ``sink_size="auto"``: each epoch is one pass over the dataset (as for
          ``-1``), run as several sinks, each sized to last about ``call_seconds`` (default: the
          model's ``sink_options``, else 1 s; see :mod:`sinkax.channel.sizing`) and none
          crossing the epoch's end, so that ``on_step_end`` runs about once per
          ``call_seconds`` whatever a step costs; the sizes reached are saved with the data
          position, and a resumed run continues at them;
        * ``dataset_sink_mode=False``: one jitted step per host batch, callbacks after every
          step, each epoch a whole pass; ``sink_size`` is ignored.

        Epochs ``initial_epoch + 1 .. epoch`` run (numbered from 1, as printed).
        ``resume_from`` (a checkpoint directory or :class:`ModelCheckpoint`) restores the state,
        the epochs completed and the data position of its latest checkpoint, so training
        continues with exactly the next batch (in the epoch it was saved in, if that had not
        ended). One sink serves the whole call (its producer prefetches
        across epoch boundaries) and is closed at the end. With ``enable_profiling`` set in
        :func:`sinkax.set_context`, the run is traced.
        """
        if self._train_step is None:
            raise ValueError("This Model has no optimizer: pass optimizer= to train it.")
        _check_epochs(epoch, initial_epoch)
        state, data_state, resumed_in_epoch = self.state, None, 0
        if resume_from is not None:
            if initial_epoch:
                raise ValueError("Pass initial_epoch or resume_from, not both.")
            state, meta = self._load(resume_from)
            initial_epoch, data_state = meta["epoch"], meta["data_state"]
            resumed_in_epoch = meta.get("step_in_epoch", 0)  # saved before its epoch ended
            _check_epochs(epoch, initial_epoch)
        if not dataset_sink_mode and sink_size != -1:
            warn(
                "sink_size is ignored when dataset_sink_mode=False: every epoch is one pass "
                "over the dataset."
            )
        else:
            check_timed(sink_size, call_seconds)
        timed = {} if call_seconds is None else {"call_seconds": call_seconds}
        if isinstance(callbacks, Callback | str):  # (a str's characters are no callbacks)
            callbacks = [callbacks]
        callbacks = list(callbacks or [])
        for callback in callbacks:
            if not isinstance(callback, Callback):
                fix = "subclass sinkax.train.Callback, overriding the hooks you need"
                if isinstance(callback, type) and issubclass(callback, Callback):
                    fix = f"pass {callback.__name__}(), not the class"
                raise TypeError(
                    f"callbacks must be Callback instances, got {callback!r:.80}: {fix}."
                )
        wanted = {key: v for callback in callbacks for key, v in callback.sink_options().items()}
        helper = DatasetHelper(
            train_dataset,
            dataset_sink_mode,
            sink_size,
            epoch_num=epoch - initial_epoch,
            data_state=data_state,
            **{**wanted, **self.sink_options, **timed},
        )
        # The sinks donate the state: they get a copy, so that arrays taken from it before (the
        # params given to Model, model.params) stay valid.
        state = copy_tree(state)
        with helper, context.profiling(), contextlib.ExitStack() as entered:
            for callback in callbacks:
                entered.enter_context(callback)
            net = connect_network_with_dataset(self._train_step, helper)
            run = RunContext(
                model=self,
                state=state,
                helper=helper,
                initial_epoch=initial_epoch,
                epochs=epoch,
                epoch=initial_epoch,
                step=int(state.step),
                step_in_epoch=resumed_in_epoch,  # steps of the next epoch run before
            )
            _notify(callbacks, "on_train_begin", run)
            self.state = state  # every check has passed: the run starts
            stopped_at = None  # the data position of the last stop at a non-finite step
            for number in range(initial_epoch + 1, epoch + 1):
                run.epoch, run.step_in_epoch, resumed_in_epoch = number, resumed_in_epoch, 0
                run.epoch_from = run.step_in_epoch
                run.epoch_steps = run.step_in_epoch + helper.epoch_steps  # a stop runs fewer
                _notify(callbacks, "on_epoch_begin", run)
                stalled = 0  # passes of the helper in a row that ran no step
                while not (run.epoch_done or run.stop_requested) and stalled < 2:
                    before = run.step  # again after a stop at a non-finite step (training on)
                    for _ in helper:
                        self.state, run.outputs = net(self.state)
                        steps = len(run.outputs["loss"])
                        run.nonfinite = getattr(net, "nonfinite", None)  # a sink cut short
                        at = run.nonfinite and (run.nonfinite.epoch, run.nonfinite.step)
                        if at and not steps and at == stopped_at:  # its 2nd try failed too
                            raise FloatingPointError(_NOT_FINITE_AGAIN.format(run.nonfinite))
                        stopped_at = at
                        run.state, run.step = self.state, run.step + steps
                        run.step_in_epoch += steps
                        _notify(callbacks, "on_step_end", run)
                        if run.stop_requested:
                            break
                    stalled = 0 if run.step > before else stalled + 1
                if run.step_in_epoch == run.epoch_steps:
                    _notify(callbacks, "on_epoch_end", run)
                if run.stop_requested:
                    break
            _notify(callbacks, "on_train_end", run)
        return run

    def restore(self, checkpoint: str | ModelCheckpoint, step: int | None = None) -> dict[str, Any]:
        """Load checkpoint ``step`` (default: latest) into :attr:`state`; returns its metadata.

        The metadata has ``epoch`` (the epochs completed), ``step``, ``step_in_epoch`` (the
        steps of the next epoch run before it) and ``data_state`` (pass it to
        :class:`~sinkax.train.DatasetHelper` or :func:`sinkax.data_sink` to continue a custom
        loop). A checkpoint of a model with another layout raises ``ValueError`` untouched.
        """
        self.state, meta = self._load(checkpoint, step)
        return meta

    def _load(
        self, checkpoint: str | ModelCheckpoint, step: int | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """``(state, metadata)`` of a checkpoint, leaving :attr:`state` as it is."""
        if not isinstance(checkpoint, ModelCheckpoint):
            checkpoint = ModelCheckpoint(checkpoint)
        state, meta = checkpoint.restore(self.state, step)
        state = committed(state, backend.default_device(), like=self.state)
        meta["data_state"] = distributed.own_position(meta["data_state"])
        keys = ("epoch", "step", "step_in_epoch", "data_state")  # (older ones: no step_in_epoch)
        return state, {key: meta[key] for key in keys if key in meta}

    def eval(self, valid_dataset: Any, dataset_sink_mode: bool = True) -> dict[str, float]:
        """``{"loss", *metrics}`` over exactly one pass of ``valid_dataset``.

        In sink mode the pass is one sink (``sink_size=-1``) that carries a copy of the params
        through (as an argument, not baked into the executable as constants). Each metric is
        the mean over samples; batches padded by :class:`sinkax.datasets.PadBatch` count their
        real samples only, so a ragged last batch is evaluated too.
        """
        evaluate = self.evaluator(valid_dataset, dataset_sink_mode, passes=1)
        try:
            return evaluate(self.eval_variables(self.state))
        finally:
            evaluate.close()

    def evaluator(self, dataset: Any, dataset_sink_mode: bool = True, passes: int = 1) -> Evaluator:
        """An :class:`~sinkax.train.evaluation.Evaluator` of this model's eval step over
        ``passes`` passes of ``dataset`` (one sink for all of them: compiled once), as
        :meth:`eval` and :class:`~sinkax.train.EvalCallback` use it."""
        return Evaluator(
            self._eval_and_count, dataset, dataset_sink_mode, passes, self.sink_options
        )

    def predict(self, x: Any) -> jax.Array:
        """``apply_fn(params, x)``, jitted (a :class:`~sinkax.train.StatefulApply` with
        ``train=False``: running statistics, no dropout)."""
        return self._predict(self.state.params, self.state.model_state, x)
