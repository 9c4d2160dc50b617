"""Metrics and traces for any loop: writers that a plain ``data_sink`` loop and
:meth:`Model.train <sinkax.train.Model.train>` (through :class:`MetricsLogger`) share, and a
``jax.profiler`` trace of chosen calls.

A sink returns every step's metrics stacked on axis 0; :func:`write_steps` reads them to the
host once per call and writes one row per step to a :class:`MetricWriter`:

>>> import numpy as np
>>> history = HistoryWriter()
>>> write_steps(history, 10, {"loss": np.array([0.5, 0.25])})  # 10 steps done before the call
>>> history.steps["loss"], history.scalars["loss"]
([11, 12], [0.5, 0.25])
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from sinkax.train import checks
from sinkax.train.callbacks import Callback, RunContext


class MetricWriter(abc.ABC):
    """Writes named scalars at a step; a context manager that closes itself.

    Subclasses override :meth:`write_scalars` (and :meth:`flush`, :meth:`close` if they hold
    a resource).
    """

    @abc.abstractmethod
    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record ``scalars`` (name -> number) as of global step ``step``."""

    def flush(self) -> None:  # noqa: B027 (optional: a writer that buffers nothing has none)
        """Make everything written so far visible (to files, to the console)."""

    def close(self) -> None:
        """Flush and release what the writer holds; idempotent."""
        self.flush()

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorBoardWriter(MetricWriter):
    """TensorBoard event files in ``logdir`` (``tensorboard --logdir ...``), via tensorboardX.

    >>> import tempfile
    >>> with TensorBoardWriter(tempfile.mkdtemp()) as writer:
    ...     writer.write_scalars(1, {"loss": 0.5})
    """

    def __init__(self, logdir: str | os.PathLike[str]):
        tensorboardx = checks.optional("tensorboardX", "TensorBoardWriter")
        self.logdir = os.fspath(logdir)
        self._writer = tensorboardx.SummaryWriter(self.logdir)

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, float(value), int(step))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class ConsoleWriter(MetricWriter):
    """Prints ``step: 100, loss is 0.0512, accuracy is 0.97`` for every ``every``-th step.

    >>> ConsoleWriter(every=2).write_scalars(4, {"loss": 0.5})
    step: 4, loss is 0.5
    """

    def __init__(self, every: int = 1):
        self.every = every

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if step % self.every == 0:
            shown = ", ".join(f"{name} is {float(value):.6g}" for name, value in scalars.items())
            print(f"step: {step}, {shown}", flush=True)


class HistoryWriter(MetricWriter):
    """Keeps everything in memory: ``scalars[name]`` the values, ``steps[name]`` their steps.

    >>> history = HistoryWriter()
    >>> history.write_scalars(3, {"loss": 1.0})
    >>> history.scalars, history.steps
    ({'loss': [1.0]}, {'loss': [3]})
    """

    def __init__(self) -> None:
        self.scalars: dict[str, list[float]] = {}
        self.steps: dict[str, list[int]] = {}

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.scalars.setdefault(name, []).append(float(value))
            self.steps.setdefault(name, []).append(int(step))


class MultiWriter(MetricWriter):
    """Writes to each of ``writers``.

    >>> a, b = HistoryWriter(), HistoryWriter()
    >>> MultiWriter([a, b]).write_scalars(1, {"loss": 2.0})
    >>> a.scalars == b.scalars == {"loss": [2.0]}
    True
    """

    def __init__(self, writers: Sequence[MetricWriter]):
        self.writers = list(writers)

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for writer in self.writers:
            writer.write_scalars(step, scalars)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def write_steps(writer: MetricWriter, steps_before: int, outputs: Any) -> None:
    """Write a sink call's per-step ``outputs`` (each leaf stacked on axis 0, one row per
    step): row ``i`` at step ``steps_before + i + 1``, the step count once it ran. Leaves
    of one number per step are written, named by their path (``"loss"``, ``"eval/accuracy"``);
    the outputs are read to the host in one transfer.
    """
    host = jax.device_get(outputs)
    columns = {
        "/".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(host)[0]
        if np.ndim(leaf) == 1
    }
    rows = min((len(leaf) for leaf in columns.values()), default=0)
    for i in range(rows):
        writer.write_scalars(steps_before + i + 1, {k: v[i] for k, v in columns.items()})


class MetricsLogger(Callback):
    """Writes every step's train metrics (the train step's outputs: ``loss``, ``finite``) to
    ``writer`` after each sink, and closes it when training ends.

    >>> MetricsLogger(HistoryWriter()).writer.scalars
    {}
    """

    def __init__(self, writer: MetricWriter):
        self.writer = writer

    def on_step_end(self, run: RunContext) -> None:
        write_steps(self.writer, run.step - len(run.losses), run.outputs)

    def __exit__(self, *exc: object) -> None:
        self.writer.close()


class TraceCalls:
    """A ``jax.profiler`` trace (TensorBoard/Perfetto) of calls ``first .. first + count - 1``
    (counted from 0) of a loop, into ``logdir``. Use it as a context manager around each call:

    .. code-block:: python

        trace = TraceCalls("trace", first=2, count=3)
        for _ in range(10):
            with trace:
                state, metrics = sink(state)

    The trace starts as call ``first`` begins and stops once call ``first + count - 1`` has
    returned and the computation in flight has finished, so it holds those calls' device work.
    Skipping the first calls keeps compilation and ``auto``'s measuring out of the trace.
    """

    def __init__(self, logdir: str | os.PathLike[str], first: int = 1, count: int = 1):
        if first < 0 or count < 1:
            raise ValueError(f"need first >= 0 and count >= 1, got first={first}, count={count}.")
        self.logdir = os.fspath(logdir)
        self.first, self.count = first, count
        self.calls = 0  # calls finished
        self.active = False

    def __enter__(self) -> TraceCalls:
        if self.calls == self.first and not self.active:
            os.makedirs(self.logdir, exist_ok=True)
            jax.profiler.start_trace(self.logdir)
            self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.calls += 1
        if self.active and (self.calls == self.first + self.count or exc[0] is not None):
            self.stop()

    def stop(self) -> None:
        """Stop the trace now (if running), after the computation in flight."""
        if self.active:
            jax.block_until_ready(jax.live_arrays())
            jax.profiler.stop_trace()
            self.active = False


class Profile(Callback):
    """:class:`TraceCalls` for :meth:`Model.train <sinkax.train.Model.train>`: a trace of sink
    calls ``first .. first + count - 1`` of the run (steps, in non-sink mode) into ``logdir``.

    >>> Profile("trace", first=2).trace.first
    2
    """

    def __init__(self, logdir: str | os.PathLike[str], first: int = 1, count: int = 1):
        self.trace = TraceCalls(logdir, first, count)

    def on_train_begin(self, run: RunContext) -> None:
        self.trace.__enter__()

    def on_step_end(self, run: RunContext) -> None:
        self.trace.__exit__(None, None, None)
        self.trace.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.trace.stop()
