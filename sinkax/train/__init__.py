"""High-level training on top of :func:`sinkax.data_sink`: MindSpore's ``Model``, callbacks,
``DatasetHelper``/``connect_network_with_dataset`` for custom loops, and the pure train and
eval steps they run.

>>> from sinkax.train import LossMonitor, Model, make_train_step
"""

from sinkax.train.adapters import from_linen, from_nnx
from sinkax.train.callbacks import Callback, EvalCallback, RunContext, TerminateOnNaN
from sinkax.train.checkpoint import ModelCheckpoint
from sinkax.train.helper import DatasetHelper, connect_network_with_dataset
from sinkax.train.model import Model
from sinkax.train.monitors import History, LossMonitor, ProgressBar, TimeMonitor
from sinkax.train.steps import (
    StatefulApply,
    TrainState,
    accuracy,
    cross_entropy,
    make_eval_step,
    make_train_step,
)
from sinkax.train.writers import (
    ConsoleWriter,
    HistoryWriter,
    MetricsLogger,
    MetricWriter,
    MultiWriter,
    Profile,
    TensorBoardWriter,
    TraceCalls,
    write_steps,
)

__all__ = [
    "Callback",
    "ConsoleWriter",
    "DatasetHelper",
    "EvalCallback",
    "History",
    "HistoryWriter",
    "LossMonitor",
    "MetricWriter",
    "MetricsLogger",
    "Model",
    "ModelCheckpoint",
    "MultiWriter",
    "Profile",
    "ProgressBar",
    "RunContext",
    "StatefulApply",
    "TensorBoardWriter",
    "TerminateOnNaN",
    "TimeMonitor",
    "TraceCalls",
    "TrainState",
    "accuracy",
    "connect_network_with_dataset",
    "cross_entropy",
    "from_linen",
    "from_nnx",
    "make_eval_step",
    "make_train_step",
    "write_steps",
]
