"""Evaluation over whole passes of a dataset, on one sink: :class:`Evaluator`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np

from sinkax.channel.source import known_length
from sinkax.pytree import copy_tree
from sinkax.train.helper import DatasetHelper, connect_network_with_dataset

# Options of a model's sink_options that shape training, not a pass of evaluation: a stop at a
# non-finite step would end the pass early and average part of it.
TRAINING_ONLY = (
    "stop_if_nonfinite",
    "progress",
    "progress_every",
    "call_seconds",
    "calls",
    "total_steps",
)


class Evaluator:
    """Evaluates variables over one pass of a dataset per call, on one sink for all ``passes``
    calls (compiled once); :class:`~sinkax.train.EvalCallback` keeps one for a whole run.

    ``eval_step(variables, batch) -> (variables, (metrics, count))`` carries the variables
    through and weights each batch's metrics by ``count`` (its real examples).
    ``sink_options`` (a model's) configure its sink, but for those of :data:`TRAINING_ONLY`.

    >>> import numpy as np
    >>> step = lambda v, b: (v, ({"loss": (b - v) ** 2}, np.int32(1)))
    >>> evaluate = Evaluator(step, [np.float32(1), np.float32(3)], True, passes=1)
    >>> evaluate(np.float32(1)); evaluate.close()
    {'loss': 2.0}
    """

    def __init__(
        self,
        eval_step: Callable[[Any, Any], tuple[Any, Any]],
        dataset: Any,
        dataset_sink_mode: bool,
        passes: int,
        sink_options: Mapping[str, Any] | None = None,
    ):
        if known_length(dataset) is None:
            raise ValueError(
                f"Evaluation runs exactly one pass over the dataset, which needs a dataset of "
                f"known length; {type(dataset).__name__} has no len(). Give a sized dataset (a "
                "grain MapDataset, a list, an object with __len__)."
            )
        if dataset_sink_mode:
            check_last_batch(dataset)
        options = {k: v for k, v in (sink_options or {}).items() if k not in TRAINING_ONLY}
        self._helper = DatasetHelper(dataset, dataset_sink_mode, -1, passes, **options)
        self._net = connect_network_with_dataset(eval_step, self._helper)

    def __call__(self, variables: Any) -> dict[str, float]:
        """Metrics of ``variables`` (e.g. :meth:`Model.eval_variables`) over one pass."""
        variables, parts = copy_tree(variables), []  # a copy: the sink donates it
        for _ in self._helper:
            variables, outs = self._net(variables)
            parts.append(outs)
        metrics, counts = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
        if not np.sum(counts):
            raise ValueError(
                "The evaluation pass held no examples (every batch's real rows: 0), so no metric "
                "has a mean. Evaluate a dataset with examples (padded batches count real rows)."
            )
        names = sorted(metrics, key=lambda name: name != "loss")  # loss first
        return {name: float(np.average(metrics[name], weights=counts)) for name in names}

    def close(self) -> None:
        """Stop the data producer."""
        self._helper.close()


def check_last_batch(dataset: Any) -> None:
    """``ValueError`` if ``dataset`` (a sequence, or a grain ``MapDataset``) ends with a batch of
    fewer rows than its first: a sink's batches have one shape, so evaluating it in sink mode
    would fail at that batch, after the rest of the pass ran. Datasets without indexing pass.

    >>> check_last_batch([{"x": np.zeros(4)}, {"x": np.zeros(3)}])
    Traceback (most recent call last):
    ValueError: The evaluation dataset's last batch has 3 rows, its first 4: ...
    """
    if not isinstance(dataset, Sequence | grain.MapDataset) or len(dataset) < 2:
        return
    first, last = (jax.tree.leaves(dataset[i]) for i in (0, len(dataset) - 1))
    if not (first and last):  # (a filtered-out element: the sink says what to do)
        return
    rows = [np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in (first[0], last[0])]
    if None not in rows and rows[1] < rows[0]:
        raise ValueError(
            f"The evaluation dataset's last batch has {rows[1]} rows, its first {rows[0]}: in "
            "sink mode every batch has one shape. Pad it, so that every example counts: "
            f"`.map(sinkax.datasets.PadBatch({rows[0]}))` after the batching (its padding rows "
            "are not counted), or, on one device, evaluate with dataset_sink_mode=False."
        )
