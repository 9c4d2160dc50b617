"""sinkax: MindSpore's sinking mode for JAX -- many training steps per host interaction.

>>> import numpy as np, sinkax
>>> data = [{"x": np.ones(2, np.float32)}] * 4
>>> with sinkax.data_sink(lambda s, b: (s + b["x"].sum(), s), data, sink_size=4) as sink:
...     state, outs = sink(np.float32(0))
>>> float(state), outs.shape
(8.0, (4,))
"""

from sinkax.affinity import set_cpu_affinity
from sinkax.backend import resolve_device
from sinkax.channel.position import DataPosition
from sinkax.channel.source import Position
from sinkax.context import GRAPH_MODE, PYNATIVE_MODE, get_context, set_context
from sinkax.errors import (
    BatchSpecError,
    SinkClosedError,
    SinkError,
    SinkExhaustedError,
    SinkTimeoutError,
)
from sinkax.sink import Sink, SinkStats, data_sink
from sinkax.train import (
    Callback,
    DatasetHelper,
    EvalCallback,
    History,
    LossMonitor,
    Model,
    ModelCheckpoint,
    ProgressBar,
    RunContext,
    TerminateOnNaN,
    TimeMonitor,
    TrainState,
    connect_network_with_dataset,
    make_eval_step,
    make_train_step,
)

__version__ = "0.1.0"

__all__ = [
    "GRAPH_MODE",
    "PYNATIVE_MODE",
    "BatchSpecError",
    "Callback",
    "DataPosition",
    "DatasetHelper",
    "EvalCallback",
    "History",
    "LossMonitor",
    "Model",
    "ModelCheckpoint",
    "Position",
    "ProgressBar",
    "RunContext",
    "Sink",
    "SinkClosedError",
    "SinkError",
    "SinkExhaustedError",
    "SinkStats",
    "SinkTimeoutError",
    "TerminateOnNaN",
    "TimeMonitor",
    "TrainState",
    "connect_network_with_dataset",
    "data_sink",
    "get_context",
    "make_eval_step",
    "make_train_step",
    "resolve_device",
    "set_context",
    "set_cpu_affinity",
]
