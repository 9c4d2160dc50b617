"""What the train layer's constructors check before a run: counts, and optional dependencies.

>>> count("keep_last", 3)
3
>>> count("keep_last", 0)
Traceback (most recent call last):
ValueError: keep_last must be an int >= 1, got 0.
"""

from __future__ import annotations

import importlib
from typing import Any


def count(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` if it is an int of at least ``minimum`` (not a bool), else a ``ValueError``
    naming the option ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return value


def optional(module: str, user: str) -> Any:
    """Import ``module``, an optional dependency of ``user`` (a class name), or raise an
    ``ImportError`` saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{user} needs {module.split('.')[0]}: pip install 'sinkax[train]'."
        ) from error
