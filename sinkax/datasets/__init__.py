"""grain data pipelines for sinkax: MNIST (IDX files or a bundled sample) and synthetic data.

Every builder returns a ``grain.MapDataset`` (random access, ``len()`` = batches per
epoch where batched); the sink turns it into an iterator with
``ds.repeat(None).to_iter_dataset(read_options)``.

>>> from sinkax.datasets import lenet_mnist
>>> batch = lenet_mnist(batch_size=8)[0]
>>> batch["image"].shape, batch["label"].shape
((8, 32, 32, 1), (8,))
"""

from sinkax.datasets.mnist import (
    ArraySource,
    bundled_csv_path,
    lenet_mnist,
    mnist,
    mnist_arrays,
    read_bundled_mnist,
    read_idx,
    read_mnist_idx,
    stratified_split,
)
from sinkax.datasets.synthetic import indexed, synthetic_mnist
from sinkax.datasets.transforms import (
    MNIST_MEAN,
    MNIST_STD,
    Gather,
    LeNetPreprocess,
    PadBatch,
    epoch_permutation,
    index_batches,
    normalize,
    pad_batch,
    rescale,
    resize_bilinear,
    resize_matrix,
)

__all__ = [
    "MNIST_MEAN",
    "MNIST_STD",
    "ArraySource",
    "Gather",
    "LeNetPreprocess",
    "PadBatch",
    "bundled_csv_path",
    "epoch_permutation",
    "index_batches",
    "indexed",
    "lenet_mnist",
    "mnist",
    "mnist_arrays",
    "normalize",
    "pad_batch",
    "read_bundled_mnist",
    "read_idx",
    "read_mnist_idx",
    "rescale",
    "resize_bilinear",
    "resize_matrix",
    "stratified_split",
    "synthetic_mnist",
]
