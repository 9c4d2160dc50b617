"""Custom training loops: :class:`DatasetHelper` and :func:`connect_network_with_dataset`.

The helper decides how data reaches a step function; the connected network runs it. Iterating
the helper once is one epoch; each item is one ``net(state)`` call, which returns ``(state,
outs)`` with every step's output stacked on axis 0, so the same loop body serves both modes:

* sink mode: one item per epoch, and each ``net(state)`` call runs one whole sink on the device
  (``sink_size`` steps, or the rest of the epoch for ``-1``) through :func:`sinkax.data_sink`;
  for ``sink_size="auto"`` an epoch is the rest of a pass, one item per call, each call sized
  to last about ``call_seconds`` (see :mod:`sinkax.channel.sizing`) and none crossing the
  epoch's end;
* non-sink mode: one item per batch, and each ``net(state)`` call runs one compiled step on the
  next batch -- a sink of one step per call, with the ``"step"`` strategy, which takes a
  smaller last batch where the dataset has one (with jit; PYNATIVE mode refuses one).

>>> import numpy as np
>>> data = [{"x": np.float32(i)} for i in range(4)]
>>> with DatasetHelper(data, dataset_sink_mode=True, sink_size=-1, epoch_num=2) as helper:
...     net = connect_network_with_dataset(lambda s, b: (s + b["x"], b["x"]), helper)
...     state = np.float32(0)
...     for epoch in range(2):
...         for _ in helper:
...             state, outs = net(state)
...         print(epoch, float(state), outs.tolist())
0 6.0 [0.0, 1.0, 2.0, 3.0]
1 12.0 [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from typing import Any

from sinkax import context
from sinkax.channel.position import DataPosition
from sinkax.channel.source import known_length
from sinkax.config import AUTO, check_sink_size
from sinkax.errors import SinkClosedError
from sinkax.sink import Sink, SinkStats, data_sink


class DatasetHelper:
    """How a dataset feeds a connected network: one sink or one batch per iteration.

    Args:
      dataset: what :func:`sinkax.data_sink` accepts; non-sink mode needs a known ``len()``.
      dataset_sink_mode: sink (``True``) or one step per batch (``False``).
      sink_size: steps per epoch in sink mode: ``-1`` is a whole pass over the dataset, ``> 0``
        is ``sink_size`` steps continuing where the last epoch stopped, ``"auto"`` a whole pass
        in calls of about ``call_seconds`` (a :func:`sinkax.data_sink` option). Ignored in
        non-sink mode, where every epoch is a whole pass.
      epoch_num: how many epochs the helper is iterated; after the last one it closes itself
        (stops the data producer). Iterating it again raises :class:`~sinkax.SinkClosedError`.
      data_state: a :meth:`data_state` to continue from (e.g. read from a checkpoint).
      **sink_options: more :func:`sinkax.data_sink` options (``jit``, ``strategy``,
        ``prefetch``, ``device``, ...); non-sink mode chooses the strategy itself (``"step"``,
        or ``"scan"`` over several devices).

    Items yielded: the number of steps the next ``net(state)`` call runs (``1`` in non-sink
    mode; ``None`` for ``"auto"`` and ``-1``, whose call decides: the rest of the pass); call
    ``net`` once per item. Whatever the mode, the sink reads and moves nothing past the last
    epoch.

    >>> import numpy as np
    >>> data = [(np.float32(i), np.float32(1)) for i in range(3)]
    >>> helper = DatasetHelper(data, dataset_sink_mode=False)
    >>> net = connect_network_with_dataset(lambda s, b: (s + b[0], b[0]), helper)
    >>> state = np.float32(0)
    >>> for steps in helper:
    ...     state, outs = net(state)
    >>> float(state), steps, outs.shape, helper.data_state()["epoch"]
    (3.0, 1, (1,), 1)
    """

    def __init__(
        self,
        dataset: Any,
        dataset_sink_mode: bool = True,
        sink_size: int = -1,
        epoch_num: int = 1,
        *,
        data_state: dict[str, Any] | None = None,
        **sink_options: Any,
    ):
        valid = isinstance(epoch_num, numbers.Integral) and not isinstance(epoch_num, bool)
        if not valid or epoch_num <= 0:
            raise ValueError(f"epoch_num must be a positive int, got {epoch_num!r}.")
        self.dataset = dataset
        self.dataset_sink_mode = bool(dataset_sink_mode)
        self.sink_size = check_sink_size(sink_size) if self.dataset_sink_mode else -1
        self.epoch_num = int(epoch_num)
        passes = self.sink_size in (AUTO, -1) or not self.dataset_sink_mode  # each epoch a pass
        if passes and known_length(dataset) is None:
            mode = f"sink_size={self.sink_size!r}" if self.dataset_sink_mode else "non-sink mode"
            raise ValueError(
                f"{mode} runs whole passes over the dataset, which needs a dataset of known "
                f"length; {type(dataset).__name__} has no len(). Use a sized dataset (a grain "
                "MapDataset, a list) or sink mode with sink_size > 0."
            )
        # steps per epoch where an epoch is not the rest of a pass: sink_size > 0
        self._sink_steps = None if self.sink_size in (AUTO, -1) else self.sink_size
        self._options = sink_options
        self._data_state = data_state
        self._epochs_done = 0
        self._epoch_from: dict[str, Any] | None = None  # the position the epoch under way began
        self._sink: Sink | None = None

    # -- position ---------------------------------------------------------------------------
    def _connected(self) -> Sink:
        if self._sink is None:
            raise RuntimeError(
                "This DatasetHelper has no network yet: connect one with "
                "connect_network_with_dataset(step_fn, helper) before iterating it."
            )
        return self._sink

    @property
    def epoch_length(self) -> int | None:
        """Batches in one pass over the dataset, when known."""
        return self._connected().epoch_length

    timeout = property(lambda self: self._connected().config.timeout, doc="The sink's timeout.")

    @property
    def one_call_epochs(self) -> bool:
        """Whether an epoch is one call (sink mode, ``sink_size > 0``), done once that call ran,
        a stop at a non-finite step cutting it short or not; else an epoch is a pass."""
        return bool(self._sink_steps)

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps one epoch of this helper runs: ``sink_size`` if positive, else a whole pass."""
        return self._sink_steps or self.epoch_length

    @property
    def epoch_steps(self) -> int:
        """Steps the next epoch runs to its end: ``sink_size`` if positive, else the rest of the
        pass from the data position (a whole pass between epochs)."""
        sink = self._connected()
        return self._sink_steps or sink.epoch_length - sink.step  # type: ignore[operator]

    def data_state(self) -> dict[str, Any]:
        """Where the next step reads, as :meth:`sinkax.Sink.data_state`: save it to resume."""
        return self._connected().data_state()

    def block_until_ready(self) -> None:
        """Wait for every call so far and its ``progress`` reports (see
        :meth:`sinkax.Sink.block_until_ready`)."""
        if self._sink is not None:
            self._sink.block_until_ready()

    @property
    def stats(self) -> SinkStats | None:
        """The sink's :class:`~sinkax.SinkStats` (``None`` in non-sink mode)."""
        return self._sink.stats if self._sink and self.dataset_sink_mode else None

    # -- iteration --------------------------------------------------------------------------
    def __len__(self) -> int:
        """Items in the next epoch: ``1`` in sink mode (for ``-1``, one more after a call that
        ``stop_if_nonfinite`` ended early), the batches left in non-sink mode; a ``TypeError``
        for ``sink_size="auto"``, whose calls are sized as they run."""
        if self.sink_size == AUTO:
            raise TypeError(
                "A DatasetHelper of sink_size='auto' sizes its calls as they run: the items of "
                "an epoch are not known ahead (its steps are: epoch_steps)."
            )
        return 1 if self.dataset_sink_mode else self.epoch_steps

    def __iter__(self) -> Iterator[int | None]:
        sink = self._connected()
        self._count_epoch()  # one whose last step ran before a Ctrl-C stopped this generator
        if self._epochs_done >= self.epoch_num:
            self._shut()  # (done already, unless a Ctrl-C came between the count and the close)
            raise SinkClosedError(
                f"This DatasetHelper was made for epoch_num={self.epoch_num} epoch(s) and has run "
                "them all; create it with a larger epoch_num (or a new one with "
                "data_state=helper.data_state() to continue)."
            )
        if self._epoch_from is None:
            self._epoch_from = sink.data_state()
        if not self.dataset_sink_mode:
            for _ in range(len(self)):
                sink.item = (sink.epoch, sink.step)  # type: ignore[attr-defined]
                yield 1
        elif self._sink_steps:
            yield self.epoch_steps
        else:  # "auto" or -1: to the pass's end, also past a call a stop ended early
            yield from _calls_of_pass(sink)
        self._count_epoch()

    def _count_epoch(self) -> None:
        """Count the epoch under way if the data position shows it has run -- in sink mode one
        call (``sink_size > 0``) or the rest of a pass (``-1``), in non-sink mode the rest of a
        pass -- and close the helper after its last one. The data position, not the generator,
        decides: a Ctrl-C after an epoch's last step and before the generator resumed leaves the
        epoch run, and counted at the next iteration."""
        start = self._epoch_from
        if start is None:
            return
        now = self._connected().data_state()
        moved = (now["epoch"], now["step"]) != (start["epoch"], start["step"])
        if now["epoch"] > start["epoch"] or (self._sink_steps and moved):
            self._epochs_done, self._epoch_from = self._epochs_done + 1, None  # no call between
            if self._epochs_done == self.epoch_num:
                self._shut()

    def _bound(self) -> dict[str, int]:
        """The :func:`sinkax.data_sink` option that ends the sink with the last epoch: a call an
        epoch (``calls``), or for ``"auto"`` and ``-1`` the steps of the epochs (``total_steps``:
        the rest of the pass the data position is in, and ``epoch_num - 1`` more; a stop at a
        non-finite step makes a pass of more calls); in non-sink mode those steps as calls."""
        if self._sink_steps:  # in non-sink mode a call a step
            return {"calls": self.epoch_num * (1 if self.dataset_sink_mode else self._sink_steps)}
        start = DataPosition.from_dict(self._data_state).step if self._data_state else 0
        steps = max(1, self.epoch_num * known_length(self.dataset) - start)  # type: ignore[operator]
        # (a start past a pass: the sink names that)
        return {"total_steps": steps} if self.dataset_sink_mode else {"calls": steps}

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the data producer; idempotent. :meth:`data_state` stays readable."""
        if self._sink is not None:
            self._sink.close()

    def __enter__(self) -> DatasetHelper:
        return self

    def _shut(self) -> None:
        """:meth:`close`, leaving a ``progress`` hook's error to the next ``close()``."""
        if self._sink is not None:
            self._sink._shut()

    def __exit__(self, kind: Any, *exc: object) -> None:  # an error on its way: that one goes on
        self._shut() if kind else self.close()


def _calls_of_pass(sink: Sink) -> Iterator[None]:
    """The items of a ``sink_size="auto"`` or ``-1`` epoch: one per call, until a call ends the
    pass -- or moves nothing (``net`` was not called, or stopped at once: see
    ``stop_if_nonfinite``), which leaves the epoch to the next iteration."""
    epoch = sink.epoch
    while sink.epoch == epoch:
        before = sink.step
        yield None
        if (sink.epoch, sink.step) == (epoch, before):
            return


def one_step_options(options: dict[str, Any]) -> dict[str, Any]:
    """The :func:`sinkax.data_sink` options of non-sink mode: the ``"step"`` strategy -- the
    compiled step on each batch as it comes, a smaller last one too (``ragged_last``) -- or,
    over several devices, ``"scan"``; without jit, ``"eager"``.

    >>> one_step_options({"jit": True})
    {'jit': True, 'strategy': 'step', 'ragged_last': True}
    """
    options = {k: v for k, v in options.items() if k != "call_seconds"}  # sizes no sink here
    sharding = options.get("sharding")
    if sharding is not None and len(sharding.device_set) > 1:
        return {**options, "strategy": "scan"}
    return {**options, "strategy": "step", "ragged_last": context.jit_enabled(options.get("jit"))}


def connect_network_with_dataset(
    fn: Callable[..., Any], dataset_helper: DatasetHelper
) -> Callable[..., Any]:
    """Bind a step function to a :class:`DatasetHelper`; returns ``net``.

    ``fn(state, batch) -> (state, out)`` gives ``net(state) -> (state, outs)``; a stateless
    ``fn(batch) -> out`` gives ``net() -> outs``. ``outs`` stacks each step's output on axis 0
    (one row per step of the sink; one row in non-sink mode). ``net`` runs a
    :class:`~sinkax.Sink` -- in sink mode it is that sink -- and the state passed in is
    donated: use the returned one. A helper feeds one network.

    >>> import numpy as np
    >>> helper = DatasetHelper([np.float32(2)] * 3, sink_size=2, epoch_num=1)
    >>> net = connect_network_with_dataset(lambda b: b * 10, helper)
    >>> [net().tolist() for _ in helper]
    [[20.0, 20.0]]
    """
    helper = dataset_helper
    if helper._sink is not None:
        raise RuntimeError("This DatasetHelper already feeds a network; create one per network.")
    if helper.dataset_sink_mode:  # nothing is read or moved past the last epoch
        size, options = helper.sink_size, {**helper._bound(), **helper._options}
    else:
        size, options = 1, {**helper._bound(), **one_step_options(helper._options)}
    make = data_sink if helper.dataset_sink_mode else _StepPerItem
    helper._sink = make(fn, helper.dataset, size, data_state=helper._data_state, **options)
    return helper._sink


class _StepPerItem(Sink):
    """Non-sink mode's network: a sink of one step per call, which runs once per item the
    helper yields (so that an epoch is the helper's pass over the batches left in it). Its
    calls are the sink's own, no Python frame around them: a Ctrl-C after one returns is
    held as the sink holds it."""

    item: tuple[int, int] | None = None  # where the batch of the item last yielded starts

    def _check_open(self) -> None:  # what a call checks first, inside its error path
        super()._check_open()
        if self.item != (self.epoch, self.step):
            raise RuntimeError(
                "In non-sink mode the connected network runs one step per item the "
                "DatasetHelper yields: call net(state) once per item of `for _ in helper`."
            )
