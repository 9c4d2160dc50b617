"""Data positions: checking a saved one against a source, and moving the source to it.

A data position is what ``Sink.data_state()`` returns: ``{"epoch", "step", "source"}`` (the
source's own state), JSON-friendly, with ``"epoch_length"`` when known and the ``"strategy"``
that ran (checked by the executor, not here). See :func:`sinkax.channel.source.snapshot`.

>>> from sinkax.channel.source import as_source, snapshot
>>> source = as_source([{"x": i} for i in range(4)])
>>> _ = next(source); saved = snapshot(source); _ = next(source)
>>> move_to(source, saved); next(source)["x"]
1
"""

from __future__ import annotations

from typing import Any

from sinkax.channel.source import Position, Source


def check_data_state(source: Source, data_state: Any) -> None:
    """``ValueError`` if ``data_state`` is not a :meth:`Sink.data_state` of ``source``'s kind;
    changes nothing."""
    if not (isinstance(data_state, dict) and {"epoch", "step", "source"} <= data_state.keys()):
        raise ValueError(
            "data_state must be what Sink.data_state() returned, a dict with 'epoch', 'step' "
            f"and 'source'; got {data_state!r:.200}."
        )
    try:
        source.check_state(data_state["source"])
    except ValueError as error:
        raise ValueError(
            f"This data_state does not fit the dataset: {error} Give what Sink.data_state() "
            "returned for a sink over the same dataset."
        ) from None
    saved = data_state.get("epoch_length")
    if saved is not None and saved != source.epoch_length:
        raise _length_error(data_state, f"{saved} batches per epoch", source.epoch_length)


def _length_error(data_state: dict[str, Any], saved: str, length: int | None) -> ValueError:
    return ValueError(
        f"This data_state was saved over a dataset of another epoch length ({saved}) than this "
        f"one ({length} batches per epoch), at epoch {data_state['epoch']}, step "
        f"{data_state['step']}: resuming would run partial epochs. Resume with the dataset and "
        "batch size it was saved with, or start without it."
    )


def move_to(source: Source, data_state: Any) -> None:
    """Set ``source`` to a position saved by :meth:`Sink.data_state`; ``ValueError`` if it does
    not fit, such as one saved over a dataset of another epoch length (the source is then left
    where the state put it: restore it)."""
    check_data_state(source, data_state)
    try:
        source.set_state(data_state["source"])
    except Exception as error:
        raise ValueError(
            f"This data_state does not fit the dataset ({type(error).__name__}: {error}). Give "
            "what Sink.data_state() returned for a sink over the same dataset."
        ) from error
    saved = Position(data_state["epoch"], data_state["step"])
    length = source.epoch_length
    if source.position != saved or (length is not None and saved.step >= length):
        index = data_state["source"].get("next_index")  # a grain state implies its length
        implied = (index - saved.step) // saved.epoch if saved.epoch and index else None
        raise _length_error(data_state, f"{implied or 'unknown'} batches per epoch", length)
