"""Callbacks of :meth:`sinkax.train.Model.train`, MindSpore and Keras style.

A callback overrides some of the hooks of :class:`Callback`; each receives the
:class:`RunContext`. In sink mode ``on_step_end`` runs once per sink and ``run.losses`` holds
every step's loss of that sink; in non-sink mode it runs after every step with one loss.

>>> class CountSinks(Callback):
...     calls = 0
...     def on_step_end(self, run):
...         self.calls += 1
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from sinkax.errors import warn
from sinkax.train import checks

if TYPE_CHECKING:
    from sinkax.execution.guard import NonFinite
    from sinkax.sink import SinkStats
    from sinkax.train.helper import DatasetHelper
    from sinkax.train.model import Model
    from sinkax.train.steps import TrainState


# MindSpore's callback hooks (2.x, and the older names) -> sinkax's, or None: none runs there
_MINDSPORE_HOOKS = {
    "on_train_epoch_begin": "on_epoch_begin",
    "on_train_epoch_end": "on_epoch_end",
    "on_train_step_begin": None,
    "on_train_step_end": "on_step_end",
    "begin": "on_train_begin",
    "epoch_begin": "on_epoch_begin",
    "epoch_end": "on_epoch_end",
    "step_begin": None,
    "step_end": "on_step_end",
    "end": "on_train_end",
}


_HOOKS = ("on_train_begin", "on_epoch_begin", "on_step_end", "on_epoch_end", "on_train_end")


@dataclasses.dataclass
class RunContext:
    """What callbacks see of a training run; updated after every sink (or step).

    ``epoch`` counts from 1 as MindSpore prints it; ``step`` is the global number of steps done
    (it continues across resumed runs); ``step_in_epoch`` the steps done in this epoch, and
    ``epoch_steps`` those it holds in all (a run resumed within an epoch counts the steps run
    before it in both, ``epoch_from`` of them): the epoch has ended once they are equal.
    ``outputs`` holds the train step's per-step metrics of the last sink, still on the device.
    ``state`` is donated to the next sink: a callback that keeps it (the best params so far)
    keeps a copy, e.g. ``jax.device_get(run.state.params)``.
    """

    model: Model = dataclasses.field(repr=False)
    state: TrainState = dataclasses.field(repr=False)
    helper: DatasetHelper = dataclasses.field(repr=False)
    initial_epoch: int
    epochs: int
    epoch: int
    step: int
    step_in_epoch: int = 0
    epoch_steps: int = 0
    epoch_from: int = 0
    outputs: dict[str, jax.Array] = dataclasses.field(default_factory=dict, repr=False)
    stop_requested: bool = False
    nonfinite: NonFinite | None = None  # where the last sink stopped (stop_if_nonfinite)

    @property
    def losses(self) -> np.ndarray:
        """Every step's loss of the last sink (one per step in non-sink mode)."""
        return np.asarray(self.outputs["loss"])

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps of a whole epoch: ``sink_size`` if positive, else the dataset's length."""
        return self.helper.steps_per_epoch

    @property
    def epoch_done(self) -> bool:
        """Whether the epoch under way is done: its steps all ran, or, where an epoch is one
        call (sink mode, ``sink_size > 0``), that call ran, whether a stop at a non-finite step
        cut it short or not (the next epoch then starts at that batch)."""
        ran = self.step_in_epoch > self.epoch_from  # in this run
        return self.step_in_epoch >= self.epoch_steps or (self.helper.one_call_epochs and ran)

    @property
    def completed(self) -> tuple[int, int]:
        """``(epochs, steps)``: the epochs completed and the steps run of the next, where a run
        resumed from this point continues (before the first epoch begins: where this run
        resumed)."""
        if self.epoch == self.initial_epoch:  # on_train_begin: no epoch of this run under way
            return self.epoch, self.step_in_epoch
        return (self.epoch, 0) if self.epoch_done else (self.epoch - 1, self.step_in_epoch)

    @property
    def sink_stats(self) -> SinkStats | None:
        """The training sink's statistics (``None`` in non-sink mode)."""
        return self.helper.stats

    def data_state(self) -> dict[str, Any]:
        """Where the next step reads: saved by :class:`ModelCheckpoint` for an exact resume."""
        return self.helper.data_state()

    def request_stop(self) -> None:
        """Stop training after this sink (or step); ``on_train_end`` still runs."""
        self.stop_requested = True


class Callback:
    """Base class: every hook does nothing. Override the ones you need.

    As in MindSpore, a callback is also a context manager that ``Model.train`` enters for the
    whole run: ``__exit__`` runs however the run ends (an error, Ctrl-C), so that is where a
    callback releases what it holds (pending checkpoint writes, an eval sink's thread).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in sorted(filter(cls._ported, set(vars(cls)) & _MINDSPORE_HOOKS.keys())):
            ours, where = _MINDSPORE_HOOKS[name], f"{cls.__name__}.{name}"
            warn(
                f"{where} is MindSpore's name for the hook sinkax calls {ours}; sinkax never "
                f"calls {name}: rename it {ours} (the mapping: sinkax's docs, mindspore.md)."
                if ours
                else f"{where} is MindSpore's hook before each step, which sinkax has not (a "
                f"sink runs its steps on the device); sinkax never calls {name}: use "
                "on_step_end, after each sink."
            )

    @classmethod
    def _ported(cls, name: str) -> bool:
        """Whether ``cls.name`` reads as a hook ported from MindSpore: a method taking the run
        context, not an alias of a sinkax hook, a data field or a helper of its own."""
        method = vars(cls)[name]
        if not inspect.isfunction(method) or method in (getattr(cls, h) for h in _HOOKS):
            return False
        try:
            inspect.signature(method).bind(cls, RunContext)  # called as (self, run_context)
        except TypeError:
            return False
        return True

    def __enter__(self) -> Callback:
        return self

    def sink_options(self) -> dict[str, Any]:
        """:func:`sinkax.data_sink` options this callback needs of the training sink (a
        ``Model``'s own ``sink_options`` take precedence)."""
        return {}

    def __exit__(self, *exc: object) -> None:
        """After the run, also one that raised; after ``on_train_end`` if that ran."""

    def on_train_begin(self, run: RunContext) -> None:
        """Before the first epoch."""

    def on_epoch_begin(self, run: RunContext) -> None:
        """Before the epoch ``run.epoch``."""

    def on_step_end(self, run: RunContext) -> None:
        """After each sink (sink mode) or each step; ``run.losses`` has its losses."""

    def on_epoch_end(self, run: RunContext) -> None:
        """After a complete epoch (not after one cut short by a stop request)."""

    def on_train_end(self, run: RunContext) -> None:
        """After the last epoch, or once a stop was requested."""


class TerminateOnNaN(Callback):
    """Stops training at the first step whose loss is not finite, keeping the state from before it.

    The training sink -- in non-sink mode too, a sink of one step per call -- checks every step
    on the device (``stop_if_nonfinite="loss"``, see :mod:`sinkax.execution.guard`): it returns
    at the first non-finite step without its update, and the data position is *at* that batch,
    so a checkpoint holds finite params and a resume reads that batch next. The epoch it cuts
    short does not end (``on_epoch_end`` does not run). ``stopped_at`` is ``(epoch, step)`` of
    the non-finite step (both from 1, as printed) and ``batch`` its data position
    (:class:`~sinkax.execution.guard.NonFinite`). With ``stop_if_nonfinite`` turned off in the
    model's ``sink_options``, the step's ``finite`` flags are read after the sink ran: its
    updates are kept (``batch`` stays ``None``).

    >>> TerminateOnNaN().stopped_at is None
    True
    """

    def __init__(self) -> None:
        self.stopped_at: tuple[int, int] | None = None
        self.batch: NonFinite | None = None

    def sink_options(self) -> dict[str, Any]:
        return {"stop_if_nonfinite": "loss"}

    def on_train_begin(self, run: RunContext) -> None:
        self.stopped_at = self.batch = None  # of this run, not an earlier one

    def on_step_end(self, run: RunContext) -> None:
        if run.nonfinite is not None:
            self.stopped_at, self.batch = (run.epoch, run.step_in_epoch + 1), run.nonfinite
            where = f", batch at data epoch {self.batch.epoch}, step {self.batch.step}"
        else:
            finite = np.asarray(run.outputs["finite"])
            if finite.all():
                return
            first = len(finite) - int(np.argmin(finite))  # steps from the first non-finite one
            self.stopped_at, where = (run.epoch, run.step_in_epoch - first + 1), ""
        print(
            f"epoch: {self.stopped_at[0]} step: {self.stopped_at[1]}, non-finite loss{where}: "
            "terminating training.",
            flush=True,
        )
        run.request_stop()


class EvalCallback(Callback):
    """Inference while training: :meth:`Model.eval <sinkax.train.Model.eval>` every
    ``every_epochs`` epochs; results in :attr:`results` as ``{epoch: metrics}``.

    >>> EvalCallback([], every_epochs=2).results
    {}
    """

    def __init__(
        self,
        dataset: Any,
        every_epochs: int = 1,
        dataset_sink_mode: bool = True,
        verbose: bool = True,
    ):
        self.dataset = dataset
        self.every_epochs = checks.count("every_epochs", every_epochs)
        self.dataset_sink_mode = dataset_sink_mode
        self.verbose = verbose
        self.results: dict[int, dict[str, float]] = {}
        self._evaluate: Any = None

    def on_train_begin(self, run: RunContext) -> None:
        passes = run.epochs // self.every_epochs - run.initial_epoch // self.every_epochs
        if passes:  # one sink for all evaluations of the run: compiled once
            self._evaluate = run.model.evaluator(self.dataset, self.dataset_sink_mode, passes)

    def on_epoch_end(self, run: RunContext) -> None:
        if run.epoch % self.every_epochs:
            return
        metrics = self._evaluate(run.model.eval_variables(run.state))
        self.results[run.epoch] = metrics
        if self.verbose:
            shown = ", ".join(f"{name} is {value:.4f}" for name, value in metrics.items())
            print(f"epoch: {run.epoch} eval: {shown}", flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._evaluate is not None:
            self._evaluate.close()
            self._evaluate = None
