"""A new order every epoch, reproducible from a seed, with one sink call per epoch
(``sink_size=-1``). Two ways:

* grain: ``MapDataset.shuffle(seed=...)`` before ``batch``. A sink reads a ``MapDataset``
  endlessly (``repeat``), and grain draws each epoch's permutation from the seed and the epoch
  number -- so a sink resumed from a ``data_state`` sees the very same orders;
* plain numpy: a re-iterable whose ``__iter__`` (one pass, one epoch) draws the next
  permutation from one seeded ``np.random.Generator``. A sink iterates it once per epoch. It
  does not resume exactly: a resumed run's new generator starts over from the seed, so its
  next epoch repeats the first epoch's order, and a resume mid-epoch is refused (its replay
  draws another order). Give the pass a ``get_state``/``set_state``, or use grain, where
  resuming must be exact.

Each step returns the sample ids it saw, so the script prints each epoch's order:

    python examples/reshuffle.py
"""

import grain
import numpy as np

import sinkax

SAMPLES, BATCH = 12, 4


def grain_batches(seed: int) -> grain.MapDataset:
    ids = grain.MapDataset.range(SAMPLES).shuffle(seed=seed)
    return ids.batch(BATCH, drop_remainder=True).map(lambda b: {"id": b.astype(np.int32)})


class NumpyShuffled:
    """Batches of ``{"id": ...}`` in a new permutation every pass."""

    def __init__(self, ids: np.ndarray, batch_size: int, seed: int):
        self.ids, self.batch_size = ids, batch_size
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.ids) // self.batch_size

    def __iter__(self):
        order = self.rng.permutation(len(self.ids))
        for i in range(len(self)):
            yield {"id": self.ids[order[i * self.batch_size : (i + 1) * self.batch_size]]}


def count_and_show(seen, batch):
    return seen + 1, batch["id"]


def epoch_orders(dataset, epochs: int) -> list[list[int]]:
    """The sample ids of each epoch, in the order the steps saw them."""
    orders = []
    with sinkax.data_sink(count_and_show, dataset, sink_size=-1) as sink:
        steps = np.int32(0)
        for _ in range(epochs):
            steps, ids = sink(steps)  # one call, one epoch
            orders.append(np.asarray(ids).ravel().tolist())
    return orders


def main(epochs: int = 3, seed: int = 0) -> dict[str, list[list[int]]]:
    ids = np.arange(SAMPLES, dtype=np.int32)
    return {
        "grain": epoch_orders(grain_batches(seed), epochs),
        "numpy": epoch_orders(NumpyShuffled(ids, BATCH, seed), epochs),
    }


if __name__ == "__main__":
    for way, orders in main().items():
        for epoch, order in enumerate(orders):
            print(f"{way} epoch {epoch}: {order}")
