"""``set_context``/``get_context``: process-wide defaults, as in MindSpore.

* ``mode``: ``GRAPH_MODE`` (sinks are compiled, ``jax.jit``) or ``PYNATIVE_MODE`` (steps run
  eagerly, for debugging); the default of every sink's ``jit``.
* ``device_target`` / ``device_id``: the JAX platform and device (``sinkax.backend``); also made
  JAX's default device.
* ``save_graphs``: ``False`` or a folder (``True``: :data:`GRAPHS`); every sink executable's
  StableHLO and optimised HLO is written there.
* ``enable_profiling`` / ``profiling_options``: ``Model.train`` records a ``jax.profiler`` trace
  (TensorBoard/Perfetto) into ``profiling_options["result_path"]``.

A folder is made when it is set, and refused then if it cannot be made or written.

>>> set_context(mode=PYNATIVE_MODE); get_context("mode") == PYNATIVE_MODE
True
>>> set_context(mode=GRAPH_MODE)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import jax

from sinkax.backend import resolve_device

GRAPHS = "graphs"  # the folder of save_graphs=True
GRAPH_MODE = 0
PYNATIVE_MODE = 1


@dataclasses.dataclass
class Context:
    """The settings :func:`set_context` changes."""

    mode: int = GRAPH_MODE
    device_target: str | None = None
    device_id: int = 0
    save_graphs: bool | str = False
    enable_profiling: bool = False
    profiling_options: dict[str, Any] = dataclasses.field(default_factory=dict)


_context = Context()
_SETTINGS = frozenset(f.name for f in dataclasses.fields(Context))


def set_context(**settings: Any) -> None:
    """Change the settings named (see the module docstring); unknown names are an error."""
    unknown = sorted(set(settings) - _SETTINGS)
    if unknown:
        raise ValueError(f"Unknown context setting(s) {unknown}; known: {sorted(_SETTINGS)}.")
    if not isinstance(settings.get("enable_profiling", False), bool):
        raise ValueError(
            f"enable_profiling must be True or False, got {settings['enable_profiling']!r}."
        )
    mode = settings.get("mode", GRAPH_MODE)
    if isinstance(mode, bool) or mode not in (GRAPH_MODE, PYNATIVE_MODE):
        raise ValueError(f"mode must be sinkax.GRAPH_MODE or sinkax.PYNATIVE_MODE, got {mode!r}.")
    options = settings.get("profiling_options", {})
    if isinstance(options, str):  # MindSpore passes a JSON string
        try:
            options = settings["profiling_options"] = json.loads(options)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"profiling_options is not valid JSON ({error}): {options!r:.80}."
            ) from None
    if not isinstance(options, dict):
        raise ValueError(
            'profiling_options must be a dict (or its JSON), e.g. {"result_path": "profiler"}; '
            f"got {options!r}."
        )
    graphs = settings.get("save_graphs")
    if graphs:
        check_folder("save_graphs", GRAPHS if graphs is True else graphs)
    if "result_path" in options:
        check_folder('profiling_options["result_path"]', options["result_path"])
    if "device_target" in settings or "device_id" in settings:
        target = settings.get("device_target", _context.device_target)
        device = resolve_device(target, settings.get("device_id", _context.device_id))
        jax.config.update("jax_default_device", device)
    for name, value in settings.items():
        setattr(_context, name, copy.deepcopy(value))  # not the caller's dict


def check_folder(name: str, folder: Any) -> None:
    """``folder`` made if it is not there; a ``ValueError`` naming ``name`` (a setting, or what
    writes there) if it is no path or cannot be made and written -- before any work, not at the
    first write."""
    if not isinstance(folder, str | os.PathLike):
        raise ValueError(f"{name} must be a folder (a path), got {folder!r:.60}.")
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()  # an existing one may be read-only
    except OSError as error:
        raise ValueError(
            f"{name} cannot write to {os.fspath(folder)} ({error.strerror}): give a folder that "
            "can be made and written."
        ) from None


def get_context(key: str | None = None) -> Any:
    """One setting by name, or a copy of all of them."""
    if key is not None and key not in _SETTINGS:
        raise ValueError(f"Unknown context setting {key!r}; known: {sorted(_SETTINGS)}.")
    return copy.deepcopy(_context if key is None else getattr(_context, key))


def sink_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` of :func:`sinkax.data_sink` with what the context decides filled in: ``jit``
    from the mode, ``save_graphs`` from the folder (the device: see :func:`set_context`, which
    makes it JAX's default device).

    >>> sink_options({"jit": None, "prefetch": 1})
    {'jit': True, 'prefetch': 1, 'save_graphs': None}
    """
    return {
        **options,
        "jit": jit_enabled(options.get("jit")),
        "save_graphs": options.get("save_graphs") or graphs_folder(),
    }


def jit_enabled(jit: bool | None) -> bool:
    """``jit`` if given, else whether the context is in ``GRAPH_MODE``."""
    return _context.mode == GRAPH_MODE if jit is None else jit


def graphs_folder() -> str | None:
    """Where ``save_graphs`` writes, or ``None``."""
    if _context.save_graphs is True:
        return GRAPHS
    return _context.save_graphs or None


@contextlib.contextmanager
def profiling() -> Iterator[None]:
    """A ``jax.profiler`` trace of the block when ``enable_profiling`` is set."""
    if not _context.enable_profiling:
        yield
        return
    path = _context.profiling_options.get("result_path", "profiler")
    os.makedirs(path, exist_ok=True)
    with jax.profiler.trace(path):
        yield
