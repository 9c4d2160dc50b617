"""Closing a dataset's iterator so that no thread it reads with outlives the sink.

grain's ``close()`` shuts its prefetch pool down without waiting, the pool may belong to an
iterator further up the chain (``to_iter_dataset(read_options).batch(...)``), and a grain
``DataLoader``'s iterator has no ``close()``, only the dataset iterator it wraps.

>>> close(iter([1, 2]))  # an iterator without threads: nothing to wait for
"""

from __future__ import annotations

from typing import Any

import grain


def close(iterator: Any) -> None:
    """Close ``iterator`` and wait for every thread it reads with (see the module docstring)."""
    if isinstance(iterator, grain.DataLoaderIterator):
        iterator = getattr(iterator, "_iterator", iterator)  # (grain 0.2: no public way)
    getattr(iterator, "close", lambda: None)()
    chain = [iterator]  # the pool may be a parent's: to_iter_dataset(read_options).batch(...)
    while chain:
        executor = getattr(chain[-1], "_executor", None)
        chain[-1:] = getattr(chain[-1], "_parents", ())  # (grain's DatasetIterator)
        if executor is not None:
            executor.shutdown(wait=True)
