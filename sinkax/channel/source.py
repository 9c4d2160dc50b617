"""Batch sources: a dataset seen as an endless, checkpointable stream of batches.

A source knows where it is (epoch, step within the epoch) and can save and restore that place,
so a sink restored from a checkpoint continues with exactly the next batch.

* a grain ``MapDataset`` is read as ``dataset.repeat(None)`` (grain reshuffles every epoch) through
  grain's own checkpointable iterator: restoring is exact and costs nothing. Its ``len()`` is
  the batches per epoch, so one that filters elements out is refused at the first skip;
* any other re-iterable (grain ``IterDataset`` or ``DataLoader``, a list, a generator factory) is
  iterated once per epoch (with a ``len()``, a pass is its first ``len()`` batches, and one that
  ends sooner is an error); its iterator's ``get_state``/``set_state`` is used when it has one,
  otherwise a restore replays the epoch from its start up to the saved step.

>>> src = as_source([{"x": i} for i in range(3)])
>>> [next(src)["x"] for _ in range(3)], src.position
([0, 1, 2], Position(epoch=1, step=0))
"""

from __future__ import annotations

import base64
import dataclasses
import inspect
import numbers
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import grain
from grain.experimental import get_next_index

from sinkax.channel.closing import close
from sinkax.channel.replay import FIRST_BATCH, ReplayDiffersError, fingerprint
from sinkax.errors import warn


@dataclasses.dataclass(frozen=True, slots=True)  # one per batch read: slots make it cheap
class Position:
    """Where the next batch comes from: epoch number and step within that epoch (both from 0)."""

    epoch: int
    step: int

    def __str__(self) -> str:
        return f"epoch {self.epoch}, step {self.step}"


class Source(Protocol):
    """What the data channel needs of a dataset."""

    epoch_length: int | None
    position: Position
    keeps_batches: bool  # a batch it yielded stays as it is once it is read on (none refilled)
    rereadable: bool  # it can go back to a position it has read past (not a one-shot iterator)

    def __next__(self) -> Any: ...
    def get_state(self) -> dict[str, Any]: ...
    def check_state(self, state: Any) -> None:
        """``ValueError`` if ``state`` is not a state of this kind of source; touches nothing."""

    def set_state(self, state: dict[str, Any], own: bool = False) -> None:
        """Go to ``state``; ``own``: one this source recorded, not checked to be this
        dataset's (a grain ``MapDataset``'s ``"first_batch"``)."""

    def close(self) -> None: ...


def is_int(value: Any, least: int) -> bool:
    """Whether ``value`` is an int (numpy's too, not a bool) of at least ``least``."""
    if type(value) is int:  # the usual case, without the slower check of the abstract class
        return value >= least
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least


def known_length(dataset: Any) -> int | None:
    """``len(dataset)``, or ``None`` if it has none (or an endless one)."""
    try:
        n = len(dataset)
    except TypeError:
        return None
    return None if n >= sys.maxsize else n


def _empty_error(dataset: Any) -> ValueError:
    return ValueError(f"The dataset {type(dataset).__name__} yielded no batch: it is empty.")


def _empty_pass_error(dataset: Any, epoch: int) -> ValueError:
    return ValueError(
        f"The dataset {type(dataset).__name__} yielded no batch when iterated again (epoch "
        f"{epoch}): it is a one-shot iterator, such as a generator, or its pass was empty. Each "
        "epoch needs a new pass: give a re-iterable (a list, a grain MapDataset/IterDataset/"
        "DataLoader, or an object whose __iter__ starts a new pass)."
    )


# The sink's producer thread already runs the pipeline off the training thread, so by default
# grain reads in that thread (grain's own default is 16 threads and a 500-element buffer, which
# only adds hand-off costs for batch-level pipelines). Pass ReadOptions(num_threads=N) for
# pipelines with heavy per-record Python work.
IN_PRODUCER_THREAD = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class MapDatasetSource:
    """A grain ``MapDataset`` read endlessly with per-epoch reshuffling."""

    keeps_batches = True  # grain makes every element anew
    rereadable = True

    def __init__(self, dataset: grain.MapDataset, read_options: grain.ReadOptions | None = None):
        self.epoch_length = known_length(dataset)
        if self.epoch_length == 0:
            raise _empty_error(dataset)
        self._dataset = dataset if self.epoch_length is None else dataset.repeat(None)
        self._iterable = self._dataset.to_iter_dataset(read_options or IN_PRODUCER_THREAD)
        self._iterator = iter(self._iterable)
        self._next_index = 0
        self._first: str | None = None  # fingerprint of this epoch's first batch, once known

    @property
    def position(self) -> Position:
        if self.epoch_length is None:
            return Position(0, self._next_index)
        return Position(*divmod(self._next_index, self.epoch_length))

    def __next__(self) -> Any:
        batch = next(self._iterator)
        skipped = get_next_index(self._iterator) - self._next_index - 1
        if skipped:
            raise ValueError(
                f"The grain MapDataset skipped {skipped} element(s) before its batch at "
                f"{self.position}: it filters (a `filter`, or a map that returned None), so its "
                "len() counts elements that never arrive, and sinkax can neither count batches "
                "per epoch nor resume exactly. Pass `dataset.to_iter_dataset()` instead: its "
                "epochs are its passes, counted as they go (use sink_size > 0)."
            )
        if self.epoch_length and not self._next_index % self.epoch_length:
            self._first = fingerprint(batch)
        self._next_index += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        """``{"next_index"}``, and within an epoch the fingerprint of its first batch (under
        :data:`~sinkax.channel.replay.FIRST_BATCH`): a resume checks it (another shuffle seed,
        other data: refused, see :meth:`set_state`)."""
        state: dict[str, Any] = {"next_index": self._next_index}
        if self._first and self.position.step:
            state[FIRST_BATCH] = self._first
        return state

    def check_state(self, state: Any) -> None:
        index = state.get("next_index") if isinstance(state, dict) else None
        if not is_int(index, 0):
            raise ValueError(
                f"a grain MapDataset's state is {{'next_index': int >= 0}}, got {state!r}."
            )

    def set_state(self, state: dict[str, Any], own: bool = False) -> None:
        self.check_state(state)
        index, saved = int(state["next_index"]), state.get(FIRST_BATCH)
        self.close()
        self._iterator = iter(self._iterable)
        self._iterator.set_state({"next_index": index})
        self._next_index = index
        step = self.position.step
        start, self._first = index - step, saved if step else None
        # The epoch's first batch, read again, must be the one the saved run read (unless a
        # second read differs too: a map that draws without a seed).
        if saved and step and not own:
            first = fingerprint(self._dataset[start])
            if first != saved and first == fingerprint(self._dataset[start]):
                raise ReplayDiffersError(
                    f"This epoch ({self.position.epoch}) of the dataset begins with another batch "
                    "than the saved run's did: its order or contents differ (another shuffle "
                    "seed, other data), so resuming within the epoch would repeat some examples "
                    "and skip others. Resume with the dataset the state was saved with (its seed "
                    f"too), or, to resume inexactly anyway, delete the {FIRST_BATCH!r} key from "
                    "the saved state's 'source'."
                )

    def close(self) -> None:
        close(self._iterator)


_ABC_MODULES = ("_collections_abc", "collections.abc", "typing")  # their __iter__: `return self`


def _one_shot(dataset: Any, iterator: Any) -> bool:
    """Whether ``dataset`` is an iterator that cannot start a new pass: ``iter()`` of it gives
    itself through an ``__iter__`` of Python's own (a generator, ``iter(a_list)``, a ``map``, a
    ``collections.abc.Iterator`` that defines only ``__next__``). A class whose own ``__iter__``
    returns itself may restart its pass there, and counts as none."""
    if iterator is not dataset:
        return False
    owner = next(k for k in type(dataset).__mro__ if "__iter__" in vars(k))
    return not inspect.isfunction(vars(owner)["__iter__"]) or owner.__module__ in _ABC_MODULES


def _prefix_fingerprint(first: str | None, last: Any) -> str:
    """What an epoch read so far is checked by: its first batch's fingerprint, its last batch."""
    return f"{first}:{fingerprint(last)}"


class IterableSource:
    """Any re-iterable: one pass is one epoch, iterated again for the next."""

    def __init__(self, dataset: Iterable[Any]):
        self.epoch_length = known_length(dataset)
        if self.epoch_length == 0:
            raise _empty_error(dataset)
        self._dataset = dataset
        self._iterator: Iterator[Any] = iter(dataset)
        self.rereadable = not _one_shot(dataset, self._iterator)
        self._passes = 1  # iterators made: a one-shot iterator yields nothing after the first
        self._pass_done = False
        self.position = Position(0, 0)
        # a replay is checked against the saved run's batches, unless every pass is alike
        self._fingerprinted = not isinstance(dataset, Sequence)
        self.keeps_batches = isinstance(dataset, list | tuple)  # (a Sequence may make them)
        self._first: str | None = None  # fingerprint of this epoch's first batch
        self._last: Any = None  # the last batch read

    def __next__(self) -> Any:
        if self._pass_done:  # a sized pass ends after len() batches
            self._restart_epoch(self.position.epoch)
        try:
            batch = next(self._iterator)
        except StopIteration:
            if self.position.step == 0:
                raise self._no_batch_error() from None
            if self.epoch_length is not None:  # a sized pass ends at len(), not before
                raise ValueError(
                    f"The dataset {type(self._dataset).__name__} ended its pass after "
                    f"{self.position.step} batches, but its len() is {self.epoch_length}: epochs "
                    "and positions follow len(). Make __len__ return the batches a pass yields."
                ) from None
            self._restart_epoch(self.position.epoch + 1)
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise self._no_batch_error() from None
        self.position = Position(self.position.epoch, self.position.step + 1)
        if self._fingerprinted:
            self._last = batch
            if self.position.step == 1:
                self._first = fingerprint(batch)
        if self.position.step == self.epoch_length:  # the next batch starts the next epoch
            self.position = Position(self.position.epoch + 1, 0)
            self._pass_done = True
        return batch

    def _no_batch_error(self) -> ValueError:
        if self._passes == 1 and self.position.epoch == 0:
            return _empty_error(self._dataset)
        return _empty_pass_error(self._dataset, self.position.epoch)

    def _restart_epoch(self, epoch: int) -> None:
        self.close()
        self._pass_done = False
        self._iterator = iter(self._dataset)
        self._passes += 1
        self.position = Position(epoch, 0)

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.position.epoch, "step": self.position.step}
        if hasattr(self._iterator, "get_state") and not self._pass_done:
            saved = self._iterator.get_state()
            if isinstance(saved, bytes):  # a grain DataLoader's: kept JSON-friendly
                state["iterator_base64"] = base64.b64encode(saved).decode("ascii")
            else:
                state["iterator"] = saved
        elif self._fingerprinted and self.position.step > 0:  # a restore replays: check it
            state["fingerprint"] = _prefix_fingerprint(self._first, self._last)
        return state

    def check_state(self, state: Any) -> None:
        position = [state.get(key) for key in ("epoch", "step")] if isinstance(state, dict) else []
        if len(position) != 2 or not all(is_int(value, 0) for value in position):
            raise ValueError(
                "an iterable's state is {'epoch': int >= 0, 'step': int >= 0, ...}, got "
                f"{state!r}."
            )

    def set_state(self, state: dict[str, Any], own: bool = False) -> None:
        self.check_state(state)
        epoch, step = int(state["epoch"]), int(state["step"])
        self._restart_epoch(epoch)
        saved = state.get("iterator")
        if "iterator_base64" in state:
            saved = base64.b64decode(state["iterator_base64"])
        if saved is not None and hasattr(self._iterator, "set_state"):
            self._iterator.set_state(saved)
            self.position = Position(epoch, step)
        else:  # no checkpointable iterator: replay this epoch up to the saved step
            first = last = None  # (a list saves no fingerprint, but may replay one's run)
            for i in range(step):
                last = next(self)
                first = fingerprint(last) if i == 0 else first
            saved_fingerprint = state.get("fingerprint")
            if saved_fingerprint and saved_fingerprint != _prefix_fingerprint(first, last):
                raise ReplayDiffersError(
                    f"Resuming replayed the first {step} batches of epoch {epoch}, but they "
                    "differ from those the saved run read: the dataset reshuffles without a "
                    "seed (or changed), so the resumed run would repeat some examples and skip "
                    "others. Give a dataset whose order a seed fixes: a grain MapDataset "
                    "(`.shuffle(seed=...)`, restored exactly), or a loader seeded per epoch "
                    "(torch: a DataLoader whose generator is seeded with the epoch). To resume "
                    "inexactly anyway, delete the 'fingerprint' key from the saved state."
                )

    def close(self) -> None:
        close(self._iterator)


def as_source(dataset: Any, read_options: grain.ReadOptions | None = None) -> Source:
    """The :class:`Source` reading ``dataset``; raises ``TypeError`` for what is not iterable,
    or for ``read_options`` that are no ``grain.ReadOptions`` (they apply to a ``MapDataset``)."""
    if read_options is not None and not isinstance(read_options, grain.ReadOptions):
        raise TypeError(
            f"read_options must be a grain.ReadOptions, e.g. grain.ReadOptions(num_threads=4), "
            f"got {read_options!r:.80}."
        )
    if isinstance(dataset, grain.MapDataset):
        return MapDatasetSource(dataset, read_options)
    if read_options is not None:
        warn(
            f"read_options apply to a grain MapDataset (read as its to_iter_dataset(read_options))"
            f"; this {type(dataset).__name__} is read as it is, without them. Give its options "
            "where it is made: map_dataset.to_iter_dataset(read_options), or a DataLoader's "
            "worker_count."
        )
    if not isinstance(dataset, Iterable):
        raise TypeError(
            f"dataset must be a grain MapDataset/IterDataset/DataLoader or a re-iterable of "
            f"pytrees of arrays, got {type(dataset).__name__}."
        )
    if isinstance(dataset, Mapping | str | bytes):
        items = "keys" if isinstance(dataset, Mapping) else "characters"
        raise TypeError(
            f"dataset must yield batches, but a {type(dataset).__name__} yields its {items}. "
            "Give a sequence of batches (e.g. [{'x': x[i : i + 32]} for i in range(0, len(x), "
            "32)]) or a grain pipeline (e.g. grain.MapDataset.source(examples).batch(32, "
            "drop_remainder=True))."
        )
    return IterableSource(dataset)
