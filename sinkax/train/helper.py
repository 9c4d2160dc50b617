"""Custom training loops: :class:`DatasetHelper` and :func:`connect_network_with_dataset`.

The helper decides how data reaches a step function; the connected network runs it. Iterating
the helper once is one epoch:

* sink mode: one item per epoch, and each ``net(state)`` call runs one whole sink on the device
  (``sink_size`` steps, or the rest of the epoch for ``-1``) through :func:`sinkax.data_sink`;
* non-sink mode: one host batch per item, and each ``net(state)`` call runs one (jitted) step on
  the batch just yielded.

Either way ``net(state)`` returns ``(state, outs)`` with every step's output stacked on axis 0,
so the same loop body serves both modes:

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

from sinkax import backend, context, interrupt, placement
from sinkax.backend import backend_of
from sinkax.channel.position import DataPosition, move_to
from sinkax.channel.source import as_source
from sinkax.config import check_sink_size
from sinkax.errors import SinkClosedError
from sinkax.execution import choice as strategies
from sinkax.execution.compiler import Compiler
from sinkax.execution.executor import NO_STATE
from sinkax.execution.programs import with_leading_axis
from sinkax.execution.stepfn import stateless
from sinkax.sink import Sink, SinkStats, data_sink


class DatasetHelper:
    """How a dataset feeds a connected network: one sink or one host batch per iteration.

    Args:
      dataset: what :func:`sinkax.data_sink` accepts; non-sink mode needs a known ``len()``.
      dataset_sink_mode: sink (``True``) or feed host batches one step at a time (``False``).
      sink_size: steps per epoch in sink mode: ``-1`` is a whole pass over the dataset, ``> 0``
        is ``sink_size`` steps continuing where the last epoch stopped. Ignored in non-sink
        mode, where every epoch is a whole pass.
      epoch_num: how many epochs the helper is iterated; after the last one it closes itself
        (stops the data producer). Iterating it again raises :class:`~sinkax.SinkClosedError`.
      data_state: a :meth:`data_state` to continue from (e.g. read from a checkpoint).
      **sink_options: more :func:`sinkax.data_sink` options (``jit``, ``strategy``,
        ``prefetch``, ``device``, ...); non-sink mode uses ``jit``, ``device`` and
        ``read_options``.

    Items yielded: in sink mode the number of steps the next ``net(state)`` call runs; in
    non-sink mode the host batch it runs on.

    >>> import numpy as np
    >>> data = [(np.float32(i), np.float32(1)) for i in range(3)]
    >>> helper = DatasetHelper(data, dataset_sink_mode=False)
    >>> net = connect_network_with_dataset(lambda s, b: (s + b[0], b[0]), helper)
    >>> state = np.float32(0)
    >>> for x, _ in helper:
    ...     state, outs = net(state)
    >>> float(state), outs.shape, helper.data_state()["epoch"]
    (3.0, (1,), 1)
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
        self._options = sink_options
        self._epochs_done = 0
        self._sink: Sink | None = None
        self._host: _HostFeed | None = None
        self._net: _HostNet | None = None
        if self.dataset_sink_mode:
            self._data_state = data_state
        else:
            self._host = _HostFeed(dataset, data_state, sink_options.get("read_options"))

    # -- position ---------------------------------------------------------------------------
    def _channel(self) -> Sink | _HostFeed:
        channel = self._host or self._sink
        if channel is None:
            raise RuntimeError(
                "This sink-mode DatasetHelper has no network yet: connect one with "
                "connect_network_with_dataset(step_fn, helper) before iterating it."
            )
        return channel

    @property
    def epoch_length(self) -> int | None:
        """Batches in one pass over the dataset, when known."""
        return self._channel().epoch_length

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps one epoch of this helper runs: ``sink_size`` if positive, else a whole pass."""
        return self.sink_size if self.sink_size > 0 else self.epoch_length

    def data_state(self) -> dict[str, Any]:
        """Where the next step reads, as :meth:`sinkax.Sink.data_state`: save it to resume."""
        return self._channel().data_state()

    @property
    def stats(self) -> SinkStats | None:
        """The sink's :class:`~sinkax.SinkStats` (``None`` in non-sink mode)."""
        return self._sink.stats if self._sink else None

    # -- iteration --------------------------------------------------------------------------
    def __len__(self) -> int:
        """Items in the next epoch: ``1`` in sink mode, the batches left in non-sink mode."""
        if self.dataset_sink_mode:
            return 1
        return self._host.epoch_length - self._host.step  # type: ignore[union-attr]

    def __iter__(self) -> Iterator[Any]:
        channel = self._channel()
        if self._epochs_done >= self.epoch_num:
            raise SinkClosedError(
                f"This DatasetHelper was made for epoch_num={self.epoch_num} epoch(s) and has run "
                "them all; create it with a larger epoch_num (or a new one with "
                "data_state=helper.data_state() to continue)."
            )
        if self._sink is not None:
            yield self.sink_size if self.sink_size > 0 else self._sink.epoch_length - channel.step
        else:
            for _ in range(len(self)):
                yield self._host.pull()  # type: ignore[union-attr]
        self._epochs_done += 1
        if self._epochs_done == self.epoch_num:
            self.close()

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the data producer; idempotent. :meth:`data_state` stays readable."""
        if self._sink is not None:
            self._sink.close()
        if self._host is not None:
            self._host.close()

    def __enter__(self) -> DatasetHelper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _HostFeed:
    """Non-sink mode: the dataset read on the host, one batch handed out at a time.

    A batch counts as read once the network's step on it has finished (:class:`_HostNet` then
    sets ``committed`` and ``stepped``); a batch whose step was interrupted is handed out again,
    so no batch is skipped or repeated.
    """

    def __init__(self, dataset: Any, data_state: dict[str, Any] | None, read_options: Any):
        self._source = as_source(dataset, read_options)
        self.epoch_length = self._source.epoch_length
        if self.epoch_length is None:
            raise ValueError(
                f"dataset_sink_mode=False runs whole passes over the dataset, which needs a "
                f"dataset of known length; {type(dataset).__name__} has no len(). Use a sized "
                "dataset (a grain MapDataset, a list) or sink mode with sink_size > 0."
            )
        if data_state is not None:
            try:
                move_to(self._source, DataPosition.from_dict(data_state))
            except ValueError:
                self._source.close()
                raise
        self.committed = DataPosition.of(self._source)  # where the next batch to step on comes from
        self.pending: Any = None  # the batch handed out last
        self.pending_position = self.committed  # where the batch after it comes from
        self.stepped = True  # whether the network's step on `pending` has finished
        self._reading = False  # a pull is under way: the source may be past `committed`

    @property
    def step(self) -> int:
        return self.committed.step

    def data_state(self) -> dict[str, Any]:
        return self.committed.to_dict()

    def pull(self) -> Any:
        """The batch to step on next: a new one, or again the last if its step did not finish."""
        if self.stepped:
            if self._reading:  # a pull was interrupted after reading: read that batch again
                move_to(self._source, self.committed)
            self._reading = True
            batch = next(self._source)
            position = DataPosition.of(self._source)
            self.pending, self.pending_position, self.stepped = batch, position, False
            self._reading = False  # (no call since the stores: no Ctrl-C in between)
        return self.pending

    def take(self) -> Any:
        """The batch last pulled, for the network's one step on it."""
        if self.stepped:
            raise RuntimeError(
                "In non-sink mode the connected network runs on the batch the DatasetHelper "
                "just yielded: call net(state) once per item of `for _ in helper`."
            )
        return self.pending

    def close(self) -> None:
        self._source.close()
        interrupt.release()


def connect_network_with_dataset(
    fn: Callable[..., Any], dataset_helper: DatasetHelper
) -> Callable[..., Any]:
    """Bind a step function to a :class:`DatasetHelper`; returns ``net``.

    ``fn(state, batch) -> (state, out)`` gives ``net(state) -> (state, outs)``; a stateless
    ``fn(batch) -> out`` gives ``net() -> outs``. ``outs`` stacks each step's output on axis 0
    (one row per step of the sink; one row in non-sink mode). In sink mode ``net`` is the
    :class:`~sinkax.Sink` itself, and the state passed in is donated: use the returned one.
    A helper feeds one network.

    >>> import numpy as np
    >>> helper = DatasetHelper([np.float32(2)] * 3, sink_size=2, epoch_num=1)
    >>> net = connect_network_with_dataset(lambda b: b * 10, helper)
    >>> [net().tolist() for _ in helper]
    [[20.0, 20.0]]
    """
    helper = dataset_helper
    if helper._sink is not None or helper._net is not None:
        raise RuntimeError("This DatasetHelper already feeds a network; create one per network.")
    if helper.dataset_sink_mode:
        helper._sink = data_sink(
            fn, helper.dataset, helper.sink_size, data_state=helper._data_state, **helper._options
        )
        return helper._sink
    helper._net = _HostNet(fn, helper._host, helper._options)  # type: ignore[arg-type]
    return helper._net


class _HostNet:
    """Non-sink mode: one step on the batch the helper yielded, its output stacked as a window of
    one -- the ``"step"`` strategy (``"eager"`` without jit), whose executables every sink and
    helper of the same step function share."""

    def __init__(self, fn: Callable[..., Any], feed: _HostFeed, options: dict[str, Any]):
        self._feed = feed
        options = context.sink_options(options)  # what data_sink fills in, the same way
        self._sharding = placement.resolve(
            options.get("device"), options.get("sharding"), backend.default_device
        )
        devices = placement.devices(self._sharding)
        name = strategies.resolve(  # "step" on one device, "eager" without jit
            "step" if devices == 1 else "scan",
            jit=options["jit"],
            steps_per_call=1,
            backend=backend_of(self._sharding),
            devices=devices,
        )
        self._stacked = strategies.kind(name).feed == "stacked"
        compiler = Compiler(fn, save_graphs=options["save_graphs"])
        # the host batches are unchecked: an eval pass may end on a smaller one
        self._stateful = strategies.make(name, fn, compiler, batches_alike=False)
        self._stateless = strategies.make(name, stateless(fn), compiler, batches_alike=False)
        self._returned: Any = None  # the state the last step returned: on the device already

    def __call__(self, state: Any = NO_STATE) -> Any:
        interrupt.deliver_held()
        feed = self._feed
        batch = feed.take()
        if self._stacked:  # a window of one batch, stacked on the device
            window = with_leading_axis(placement.put(batch, self._sharding))
        else:  # "step": XLA takes the host batch at dispatch, as a plain jitted step does
            window = (batch,)
        handoff = interrupt.Handoff()  # as in Sink.__call__
        try:
            if state is NO_STATE:
                out = self._stateless.run((), window, 0, 1)[1]
            else:
                if state is not self._returned:  # (device_put walks the tree: ~80 µs a state)
                    state = placement.place_state(state, self._sharding)
                handoff.donating(state)  # the step donates it: hold a later Ctrl-C
                out = self._stateful.run(state, window, 0, 1)
                self._returned = out[0]
            handoff.dispatched()  # hold Ctrl-C to the return
            del state, batch, window  # freed (µs) while a Ctrl-C is held, not after the guard
            interrupt.checkpoint()  # a Ctrl-C that came meanwhile is handled here, and held
        except BaseException:
            handoff.failed()
            raise
        # A Ctrl-C from here on is held (see Sink.__call__): the step's output and the data
        # position reach the caller together.
        feed.committed, feed.stepped = feed.pending_position, True
        handoff.state = None  # a store, no call: see interrupt.Handoff
        return out
