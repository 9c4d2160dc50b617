"""The data position: where a sink's next call starts reading, as one checked, frozen value.

A :class:`DataPosition` is the epoch and step of the next batch, the source's own state (see
:class:`~sinkax.channel.source.Source`), the epoch length when known (a resume onto another is
refused), the strategy that ran, once ``"auto"`` chose one, and a ``sink_size="auto"`` sink's
steps per call and granule (see :mod:`sinkax.channel.sizing`). ``Sink.data_state()`` is its
:meth:`~DataPosition.to_dict`, JSON-friendly; :meth:`~DataPosition.from_dict` reads that back
(dicts saved before the epoch length or the strategy were kept still load), refusing a bad field
by name. :func:`move_to` sets a source to a position, after :func:`check_fits`.

>>> from sinkax.channel.source import as_source
>>> source = as_source([{"x": i} for i in range(4)])
>>> _ = next(source); saved = DataPosition.of(source); _ = next(source)
>>> saved.to_dict()
{'epoch': 0, 'step': 1, 'source': {'epoch': 0, 'step': 1}, 'epoch_length': 4}
>>> move_to(source, saved); next(source)["x"]
1
>>> DataPosition.from_dict({"epoch": -1, "step": 0, "source": {}})
Traceback (most recent call last):
ValueError: data_state['epoch'] must be an int >= 0 (the epoch of the next batch), got -1.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from sinkax.channel.replay import ReplayDiffersError
from sinkax.channel.source import Position, Source, is_int

RECORDED = ("scan", "loop")  # the choices of "auto", which a data position records

_REQUIRED = ("epoch", "step", "source")
_FIELDS = (*_REQUIRED, "epoch_length", "strategy", "call_steps", "call_granule")
_TUPLE = "__tuple__"  # a tuple in a source's state, as JSON keeps it


def _field_error(field: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f"data_state[{field!r}] must be {allowed}, got {value!r:.200}.")


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where the next batch comes from; every field checked when made (``ValueError`` naming
    the bad field and what it may be).

    ``epoch`` and ``step`` (from 0) locate the next batch; ``source`` is the source's own
    state; ``epoch_length``: batches per epoch, when known; ``strategy``: what ``"auto"`` chose
    (one of :data:`RECORDED`), once it has; ``call_steps`` and ``call_granule``: the steps per
    call a ``sink_size="auto"`` sink had reached and the granule it planned in, from which a
    resumed one continues.
    """

    epoch: int
    step: int
    source: Mapping[str, Any]
    epoch_length: int | None = None
    strategy: str | None = None
    call_steps: int | None = None
    call_granule: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.epoch, 0):
            raise _field_error("epoch", "an int >= 0 (the epoch of the next batch)", self.epoch)
        if not is_int(self.step, 0):
            allowed = "an int >= 0 (the step within the epoch of the next batch)"
            raise _field_error("step", allowed, self.step)
        if type(self.source) is not dict and not isinstance(self.source, Mapping):
            raise _field_error("source", "a dict (the dataset's own state)", self.source)
        if self.epoch_length is not None and not is_int(self.epoch_length, 1):
            allowed = "an int >= 1 (batches per epoch) or absent"
            raise _field_error("epoch_length", allowed, self.epoch_length)
        if self.epoch_length is not None and self.step >= self.epoch_length:
            allowed = f"below its epoch_length, {self.epoch_length}"
            raise _field_error("step", allowed, self.step)
        if self.strategy is not None and self.strategy not in RECORDED:
            allowed = f"one of {RECORDED} (what Sink.data_state() records) or absent"
            raise _field_error("strategy", allowed, self.strategy)
        if self.call_steps is not None and not is_int(self.call_steps, 1):
            allowed = "an int >= 1 (the steps per call a sink_size='auto' sink reached) or absent"
            raise _field_error("call_steps", allowed, self.call_steps)
        granule = self.call_granule
        if granule is not None and not (is_int(granule, 1) and granule & (granule - 1) == 0):
            allowed = "a power of two (the granule a sink_size='auto' sink planned in) or absent"
            raise _field_error("call_granule", allowed, granule)

    @classmethod
    def of(cls, source: Source) -> DataPosition:
        """Where ``source`` stands."""
        where = source.position
        return cls(where.epoch, where.step, source.get_state(), source.epoch_length)

    @classmethod
    def from_dict(cls, data: Any) -> DataPosition:
        """The position a :meth:`to_dict` gave (a :class:`DataPosition` is returned as is);
        ``ValueError`` naming what is missing, unknown or out of range."""
        if isinstance(data, DataPosition):
            return data
        if not (isinstance(data, Mapping) and set(_REQUIRED) <= data.keys()):
            raise ValueError(
                "data_state must be what Sink.data_state() returned, a dict with 'epoch', 'step' "
                f"and 'source'; got {data!r:.200}."
            )
        unknown = sorted(map(str, data.keys() - set(_FIELDS)))
        if unknown:
            raise ValueError(
                f"data_state has unknown key(s) {unknown}; a Sink.data_state() has {_FIELDS}."
            )
        values = {k: data[k] for k in _FIELDS if k in _REQUIRED or data.get(k) is not None}
        return cls(**{**values, "source": _decoded(values["source"])})

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: ``{"epoch", "step", "source"}``, and ``"epoch_length"``,
        ``"strategy"``, ``"call_steps"`` and ``"call_granule"`` when known. A copy: changing it
        changes no sink. Tuples in the source's state (a grain iterator's) are written as
        ``{"__tuple__": [...]}``, which JSON keeps and :meth:`from_dict` reads back as tuples."""
        data = {"epoch": int(self.epoch), "step": int(self.step), "source": _encoded(self.source)}
        if self.epoch_length is not None:
            data["epoch_length"] = int(self.epoch_length)
        if self.strategy is not None:
            data["strategy"] = self.strategy
        if self.call_steps is not None:
            data["call_steps"] = int(self.call_steps)
        if self.call_granule is not None:
            data["call_granule"] = int(self.call_granule)
        return copy.deepcopy(data)

    @property
    def position(self) -> Position:
        """The epoch and step of the next batch."""
        return Position(self.epoch, self.step)

    def recording(self, strategy: str | None) -> DataPosition:
        """This position with ``strategy`` recorded (``None`` keeps what it had)."""
        return self if strategy is None else dataclasses.replace(self, strategy=strategy)


def _encoded(value: Any) -> Any:
    """``value`` with each tuple as ``{"__tuple__": [...]}``: a JSON round trip keeps it."""
    if isinstance(value, tuple):
        return {_TUPLE: [_encoded(item) for item in value]}
    if isinstance(value, list):
        return [_encoded(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _encoded(item) for key, item in value.items()}
    return value


def _decoded(value: Any) -> Any:
    """The inverse of :func:`_encoded`."""
    if isinstance(value, Mapping):
        if value.keys() == {_TUPLE}:
            return tuple(_decoded(item) for item in value[_TUPLE])
        return {key: _decoded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decoded(item) for item in value]
    return value


def check_fits(source: Source, data: DataPosition) -> None:
    """``ValueError`` if ``data`` is not a position of ``source``'s kind and length, or one a
    one-shot iterator is not at; changes nothing."""
    try:
        source.check_state(data.source)
    except ValueError as error:
        raise ValueError(
            f"This data_state does not fit the dataset: {error} Give what Sink.data_state() "
            "returned for a sink over the same dataset."
        ) from None
    if data.epoch_length is not None and source.epoch_length is None:
        raise ValueError(
            f"This data_state was saved over a dataset of {data.epoch_length} batches per "
            "epoch, and this one has no len(): whether its epochs are as long cannot be "
            "checked, and resuming on other ones would run partial epochs. Give it its len() "
            "(a __len__, or the grain MapDataset before to_iter_dataset), or start without it."
        )
    if data.epoch_length is not None and data.epoch_length != source.epoch_length:
        raise _length_error(data, f"{data.epoch_length} batches per epoch", source.epoch_length)
    here = source.position
    if not source.rereadable and data.position != here:
        raise ValueError(
            f"The dataset is a one-shot iterator (iter() of it gives the iterator itself, as for "
            f"a generator): it is read to epoch {here.epoch}, step {here.step} and cannot go "
            f"back to epoch {data.epoch}, step {data.step}, as a rewind after an interrupted "
            "call, restore_data_state or a resume must. Give a re-iterable: a list, a grain "
            "MapDataset/IterDataset/DataLoader, or an object whose __iter__ starts a new pass."
        )


def _length_error(data: DataPosition, saved: str, length: int | None) -> ValueError:
    this = f"{length} batches per epoch" if length else f"fewer than {data.step + 1} an epoch"
    return ValueError(
        f"This data_state was saved over a dataset of another epoch length ({saved}) than this "
        f"one ({this}), at {data.position}: resuming would run partial epochs. Resume with the "
        "dataset and batch size it was saved with, or start without it."
    )


def move_to(source: Source, data: DataPosition, own: bool = False) -> None:
    """Set ``source`` to the position ``data``; ``ValueError`` if it does not fit, such as one
    saved over a dataset of another epoch length (the source is then left where the state put
    it: restore it). ``own``: a position ``source`` itself recorded, which needs no check that
    it is this dataset's (:data:`~sinkax.channel.replay.FIRST_BATCH`)."""
    check_fits(source, data)
    if not source.rereadable:  # a one-shot iterator at `data` already (see check_fits)
        return
    differs = None  # raised once the length is known to fit: that would be the cause first
    try:
        source.set_state(dict(data.source), own)
    except ReplayDiffersError as error:  # says what is wrong and what to do itself
        differs = error
    except Exception as error:
        raise ValueError(
            f"This data_state does not fit the dataset ({type(error).__name__}: {error}). Give "
            "what Sink.data_state() returned for a sink over the same dataset."
        ) from error
    length = source.epoch_length
    too_far = length is not None and data.step >= length
    if source.position != data.position or too_far:
        index = data.source.get("next_index")  # a grain state implies its length
        implied = (index - data.step) // data.epoch if data.epoch and index else None
        here = source.position  # elsewhere, of the length it saved (checked) or in its epoch
        if not too_far and (data.epoch_length or (not implied and here.epoch == data.epoch)):
            raise ValueError(
                f"This data_state is at {data.position}, but its 'source' is at {here}: it "
                "was edited, or mixed from two saves. Give what Sink.data_state() returned, "
                "unchanged."
            )
        raise _length_error(data, f"{implied or 'unknown'} batches per epoch", length)
    if differs is not None:
        raise differs
