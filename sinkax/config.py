"""A sink's configuration: every option of :func:`sinkax.data_sink` checked once, up front.

Nothing here reads :func:`sinkax.set_context`: ``data_sink`` fills what the context decides
(:func:`sinkax.context.sink_options`) before the configuration is built.

>>> config = SinkConfig.of(100, prefetch=1, device="cpu")
>>> config.sink_size, config.jit, config.sharding.device_set == {jax.devices("cpu")[0]}
(100, True, True)
>>> SinkConfig.of(0)  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: sink_size must be a positive int (steps per call, ...), got 0.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import numbers
import os
import threading
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Sharding

from sinkax import placement
from sinkax.backend import TARGETS, backend_of, default_device, resolve_device
from sinkax.channel.sizing import check_call_seconds
from sinkax.channel.source import is_int
from sinkax.execution import progress as progress_hook
from sinkax.execution.guard import Watch, watcher

AUTO = "auto"  # sink_size="auto": see sinkax.channel.sizing
MAX_SINK_SIZE = 2**31 - 1  # scan counts its steps in int32 (without jax_enable_x64)
# The ring sets up prefetch + 1 device slots when it starts, each up to max_chunk_bytes on the
# device; a few chunks ahead keep the device fed, more only hold memory.
MAX_PREFETCH = 64


def check_sink_size(sink_size: Any) -> int | str:
    """``sink_size`` as an int: steps per call (1 to :data:`MAX_SINK_SIZE`), or -1; or
    :data:`AUTO`; else a ``ValueError``."""
    if isinstance(sink_size, str) and sink_size == AUTO:
        return AUTO
    if not (int_in(sink_size, 1, MAX_SINK_SIZE) or int_in(sink_size, -1, -1)):
        raise ValueError(
            f"sink_size must be a positive int (steps per call, at most {MAX_SINK_SIZE}: a "
            f"call stacks every step's output), -1 (one epoch per call) or 'auto' (calls of "
            f"about call_seconds), got {sink_size!r}."
        )
    return int(sink_size)


def check_timed(sink_size: Any, call_seconds: Any) -> None:
    """``ValueError`` if ``call_seconds`` (the target time of a call) is given without
    ``sink_size="auto"`` (calls that size themselves to it)."""
    if call_seconds is not None and sink_size != AUTO:
        raise ValueError(
            "call_seconds is the target time of a call of sink_size='auto'; got "
            f"sink_size={sink_size!r}. Pass sink_size='auto', or leave call_seconds out."
        )


def int_in(value: Any, least: int, most: float) -> bool:
    """Whether ``value`` is an int (numpy's too, not a bool) from ``least`` to ``most``."""
    return is_int(value, least) and value <= most


def _validate(sink_size: Any, prefetch: Any, timeout: Any, max_chunk_bytes: Any) -> None:
    check_sink_size(sink_size)
    if not int_in(prefetch, 1, MAX_PREFETCH):
        raise ValueError(
            f"prefetch must be an int from 1 to {MAX_PREFETCH} (chunks ready ahead: a sink sets "
            "up prefetch + 1 device slots when it starts, each holding up to max_chunk_bytes "
            f"there, and a few keep the device fed), got {prefetch!r}."
        )
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        or not 0 < timeout <= threading.TIMEOUT_MAX
    ):
        raise ValueError(
            f"timeout must be seconds > 0 (at most {threading.TIMEOUT_MAX:.3g}), got {timeout!r}."
        )
    if (
        isinstance(max_chunk_bytes, bool)
        or not isinstance(max_chunk_bytes, numbers.Real)
        or not 1 <= max_chunk_bytes < math.inf
    ):
        raise ValueError(
            f"max_chunk_bytes must be a number of bytes >= 1, got {max_chunk_bytes!r}."
        )


def _check_bounds(sink_size: int | str, calls: Any, total_steps: Any) -> None:
    """``calls`` bounds a sink of fixed sizes, ``total_steps`` an auto or ``-1`` one: else a
    ``ValueError``."""
    bounds = (
        ("calls", calls, "calls this sink will make"),
        ("total_steps", total_steps, "steps it will run"),
    )
    for name, value, what in bounds:
        if value is not None and not int_in(value, 1, math.inf):
            raise ValueError(
                f"{name} must be an int >= 1 (the {what}) or None (as many as you like), got "
                f"{value!r}."
            )
    if sink_size == AUTO and calls is not None:
        raise ValueError(
            "sink_size='auto' decides its calls' sizes as it runs, so calls= (a count of "
            "calls planned ahead) does not apply: give total_steps= (the steps it will run) to "
            "bound it, or a fixed sink_size."
        )
    if sink_size not in (AUTO, -1) and total_steps is not None:
        raise ValueError(
            "total_steps= bounds a sink_size='auto' or -1 sink (its calls' sizes vary; the "
            f"last ends there); a sink of a fixed size (here {sink_size}) is bounded by calls= "
            "(the calls it will make)."
        )


def _folder(name: str, folder: Any) -> str | None:
    """``folder`` as a path string (``None`` stays ``None``); ``TypeError`` naming ``name``."""
    if folder is None:
        return None
    if not isinstance(folder, str | os.PathLike):
        raise TypeError(f"{name} must be a folder (a path) or None, got {folder!r:.60}")
    return os.fspath(folder)


def _compiler_options(options: Any, sharding: Sharding) -> tuple[tuple[str, Any], ...]:
    """``options`` as sorted pairs; ``None``: the backend's (see
    :func:`sinkax.backend.compiler_options`)."""
    if options is None:
        return backend_of(sharding).compiler_options
    if not isinstance(options, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str | bool | int | float) for k, v in options.items()
    ):
        raise TypeError(
            "compiler_options must be a dict of XLA option names to str, bool, int or float "
            f'values, as jax.jit\'s (e.g. {{"xla_gpu_enable_command_buffer": ""}}; {{}}: XLA\'s '
            f"defaults), got {options!r}."
        )
    return tuple(sorted(options.items()))


def sink_device(device: jax.Device | str) -> jax.Device:
    """``device``; a target or platform name (``"CPU"``, ``"cpu"``, ``"gpu"``) is its first
    device.

    >>> sink_device("cpu").platform
    'cpu'
    """
    if isinstance(device, str):
        for target, platforms in TARGETS.items():
            if device.lower() in (target.lower(), *platforms):
                return resolve_device(target)
        raise ValueError(
            f"device must be a jax.Device or a target name ({', '.join(TARGETS)}), got {device!r}."
        )
    if not isinstance(device, jax.Device):
        raise TypeError(
            f"device must be a jax.Device (e.g. jax.devices()[0]) or a target name "
            f"({', '.join(TARGETS)}), got {type(device).__name__}."
        )
    return device


def staging(sharding: Sharding, pin_memory: bool) -> Sharding | None:
    """Where a sink placed by ``sharding`` builds its chunks on the host: with ``pin_memory``,
    in its device's pinned host memory, which the device reads by DMA; else (``None``) in numpy
    memory, which a GPU runtime first copies into pinned memory of its own.

    >>> staging(jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]), True).memory_kind
    'pinned_host'
    """
    if not isinstance(pin_memory, bool):
        raise TypeError(f"pin_memory must be True or False, got {pin_memory!r}.")
    if not pin_memory:
        return None
    pinned = placement.pinned_host(sharding)
    if pinned is None or placement.platform(sharding) in TARGETS["Emulated"]:
        raise ValueError(
            f"pin_memory=True builds chunks in the pinned host memory of the sink's one device, "
            f"but {sharding} has none (several devices, or a device without a 'pinned_host' "
            "memory; the emulated device models pageable transfers only): leave it False."
        )
    return pinned


@dataclasses.dataclass(frozen=True)
class SinkConfig:
    """The checked options of a sink (see :func:`sinkax.data_sink` for each); build it with
    :meth:`of`."""

    sink_size: int | str  # or AUTO
    jit: bool
    strategy: str
    prefetch: int
    max_chunk_bytes: int
    timeout: float
    sharding: Sharding  # of one batch
    save_graphs: str | None
    compiler_options: tuple[tuple[str, Any], ...]  # what every executable compiles with
    ragged_last: bool
    calls: int | None = None  # the calls the sink will make, when known
    total_steps: int | None = None  # the steps a sink_size="auto" or -1 sink runs, when known
    stop_if_nonfinite: Watch = None  # what is checked, see sinkax.execution.guard.watcher
    progress: progress_hook.Hook | None = None  # see sinkax.execution.progress
    progress_every: int = 100
    call_seconds: float = 1.0  # the target of sink_size="auto"
    staging: Sharding | None = None  # pinned host memory chunks are built in (None: numpy's)

    @classmethod
    def of(
        cls,
        sink_size: int | str = 1,
        *,
        jit: bool = True,
        strategy: str = "auto",
        prefetch: int = 2,
        max_chunk_bytes: int = 256 << 20,
        timeout: float = 60.0,
        device: jax.Device | str | None = None,
        sharding: Sharding | None = None,
        save_graphs: str | os.PathLike[str] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
        calls: int | None = None,
        total_steps: int | None = None,
        ragged_last: bool = False,
        stop_if_nonfinite: Watch = None,
        progress: progress_hook.Hook | None = None,
        progress_every: int | None = None,
        call_seconds: float | None = None,
        pin_memory: bool = False,
    ) -> SinkConfig:
        """The configuration, or a ``ValueError``/``TypeError`` naming the bad option."""
        _validate(sink_size, prefetch, timeout, max_chunk_bytes)
        _check_bounds(sink_size, calls, total_steps)
        watcher(stop_if_nonfinite)  # a TypeError naming the forms it takes
        progress_hook.check(progress, progress_every)
        check_timed(sink_size, call_seconds)
        if sink_size == AUTO and jax.process_count() > 1:
            raise ValueError(
                "sink_size='auto' sizes calls from this process's own timings, but every "
                "process must run the same calls: give a fixed sink_size across processes."
            )
        placed = placement.resolve(
            None if device is None else sink_device(device), sharding, default_device
        )
        return cls(
            sink_size=sink_size if sink_size == AUTO else int(sink_size),
            jit=bool(jit),
            strategy=strategy,
            prefetch=int(prefetch),
            max_chunk_bytes=int(max_chunk_bytes),
            timeout=float(timeout),
            sharding=placed,
            save_graphs=_folder("save_graphs", save_graphs),
            compiler_options=_compiler_options(compiler_options, placed),
            calls=None if calls is None else int(calls),
            total_steps=None if total_steps is None else int(total_steps),
            ragged_last=bool(ragged_last),
            stop_if_nonfinite=stop_if_nonfinite or None,
            progress=progress,
            progress_every=int(cls.progress_every if progress_every is None else progress_every),
            call_seconds=check_call_seconds(
                cls.call_seconds if call_seconds is None else call_seconds
            ),
            staging=staging(placed, pin_memory),
        )

    def check_length(self, epoch_length: int | None, dataset: Any) -> int | None:
        """The steps per call over ``dataset`` of ``epoch_length`` batches, or a ``ValueError``
        if ``sink_size=-1`` (one epoch per call) or ``ragged_last`` and its length is unknown."""
        if self.ragged_last and epoch_length is None:
            raise ValueError(
                "ragged_last=True lets each epoch's last batch have fewer rows, which needs a "
                f"dataset of known length to tell which batch is last; {type(dataset).__name__} "
                "has no len(). Give a sized dataset, or batch with drop_remainder=True."
            )
        if self.sink_size == -1 and epoch_length is None:
            raise ValueError(
                "sink_size=-1 runs one epoch per call, which needs a dataset of known length; "
                f"{type(dataset).__name__} has no len(). Pass sink_size > 0 (steps per call) or "
                "a sized dataset (a grain MapDataset, a list)."
            )
        return self.steps_per_call(epoch_length)

    def steps_per_call(self, epoch_length: int | None) -> int | None:
        """Steps a call runs: ``sink_size``, or for ``-1`` the epoch length; ``None`` for
        ``"auto"`` (it varies)."""
        if self.sink_size == AUTO:
            return None
        return self.sink_size if self.sink_size > 0 else epoch_length  # type: ignore[operator]


def known_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` of :func:`sinkax.data_sink`, once each is known to be one (``TypeError``
    naming the first that is not, and the closest that is).

    >>> known_options({"prefech": 2})
    Traceback (most recent call last):
    TypeError: data_sink has no option 'prefech' (did you mean 'prefetch'?). Its options: ...
    """
    names = {*inspect.signature(SinkConfig.of).parameters, "read_options", "data_state"}
    names.discard("sink_size")
    unknown = sorted(map(str, options.keys() - names))
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(
            f"data_sink has no option {unknown[0]!r}{hint}. Its options: "
            f"{', '.join(sorted(names))}."
        )
    return options
