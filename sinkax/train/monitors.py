"""Callbacks that report on a run: losses, epoch times, every loss, a progress bar.

>>> from sinkax.train import History, LossMonitor
>>> callbacks = [LossMonitor(per_print_times=100), History()]
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from sinkax.train import checks
from sinkax.train.callbacks import Callback, RunContext


class LossMonitor(Callback):
    """Prints ``epoch: 1 step: 125, loss is 0.0512...`` (the last step's loss).

    In sink mode it prints at the end of each sink that completes at least ``per_print_times``
    steps since the last print; in non-sink mode every ``per_print_times`` steps. ``0`` prints
    nothing.

    >>> LossMonitor(per_print_times=100).per_print_times
    100
    """

    def __init__(self, per_print_times: int = 1):
        self.per_print_times = checks.count("per_print_times", per_print_times, 0)
        self._last_print = 0

    def on_train_begin(self, run: RunContext) -> None:
        self._last_print = run.step

    def on_step_end(self, run: RunContext) -> None:
        if self.per_print_times and run.step - self._last_print >= self.per_print_times:
            self._last_print = run.step
            loss = float(run.losses[-1])
            print(f"epoch: {run.epoch} step: {run.step_in_epoch}, loss is {loss}", flush=True)


class TimeMonitor(Callback):
    """Prints ``epoch time: 812.345 ms, per step time: 6.499 ms`` after each epoch.

    It waits for the epoch's computation to finish, so the time is the true wall time.

    >>> TimeMonitor().epoch_times
    []
    """

    def __init__(self) -> None:
        self.epoch_times: list[float] = []
        self._start = 0.0

    def on_epoch_begin(self, run: RunContext) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, run: RunContext) -> None:
        jax.block_until_ready(run.outputs)
        seconds = time.perf_counter() - self._start
        self.epoch_times.append(seconds)
        per_step = 1e3 * seconds / max(1, run.step_in_epoch - run.epoch_from)  # run in it
        print(f"epoch time: {1e3 * seconds:.3f} ms, per step time: {per_step:.3f} ms", flush=True)


class History(Callback):
    """Collects every step's loss of the run.

    >>> History().losses
    array([], dtype=float32)
    """

    def __init__(self) -> None:
        self._losses: list[np.ndarray] = []

    def on_train_begin(self, run: RunContext) -> None:
        self._losses = []

    def on_step_end(self, run: RunContext) -> None:
        self._losses.append(run.losses)

    @property
    def losses(self) -> np.ndarray:
        """All losses in step order."""
        return np.concatenate(self._losses) if self._losses else np.zeros(0, np.float32)


class ProgressBar(Callback):
    """A ``tqdm`` bar over all steps of the run, advanced while each sink runs.

    The training sink reports every ``every``-th step as the device computes it
    (``progress=``, see :mod:`sinkax.execution.progress`), with that step's loss. In non-sink
    mode, a sink of one step per call, the bar advances after every step. A text bar, in a
    notebook too: a widget bar's saved output is its text when first shown (``0%``), where a
    text bar's reads as it ended.

    >>> ProgressBar().bar is None
    True
    """

    def __init__(self, every: int = 100, **tqdm_options: Any):
        self.every = checks.count("every", every)
        self.tqdm_options = tqdm_options
        self.bar: Any = None
        self._epoch = self._start = 0

    def sink_options(self) -> dict[str, Any]:
        return {"progress": self._advance, "progress_every": self.every}

    def on_train_begin(self, run: RunContext) -> None:
        tqdm = checks.optional("tqdm.std", "ProgressBar").tqdm
        epochs = (run.epochs - run.initial_epoch) * (run.steps_per_epoch or 0)
        total = epochs - run.step_in_epoch or None  # (resumed within an epoch: run before)
        self.bar = tqdm(total=total, unit="step", **self.tqdm_options)
        self._start = run.step

    def on_step_end(self, run: RunContext) -> None:
        if run.nonfinite is not None:  # the blocks reported the steps a stop discarded too
            run.helper.block_until_ready()
            self.bar.n = run.step - self._start
            self.bar.refresh()

    def on_epoch_begin(self, run: RunContext) -> None:
        self._epoch = run.epoch

    def _advance(self, steps: int, out: Any) -> None:
        """The sink's progress hook: ``steps`` more done, ``out`` the latest one's output."""
        self.bar.update(steps)
        self.bar.set_postfix(epoch=self._epoch, loss=f"{float(out['loss']):.4f}")

    def on_train_end(self, run: RunContext) -> None:
        run.helper.block_until_ready()  # the last reports reach the bar before it closes

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
