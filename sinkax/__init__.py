"""sinkax: MindSpore's sinking mode for JAX -- many training steps per host interaction.

>>> import numpy as np, sinkax
>>> data = [{"x": np.ones(2, np.float32)}] * 4
>>> with sinkax.data_sink(lambda s, b: (s + b["x"].sum(), s), data, sink_size=4) as sink:
...     state, outs = sink(np.float32(0))
>>> float(state), outs.shape
(8.0, (4,))
"""

from sinkax.backend import resolve_device
from sinkax.channel.source import Position
from sinkax.context import GRAPH_MODE, PYNATIVE_MODE, get_context, set_context
from sinkax.errors import BatchSpecError, SinkClosedError, SinkError, SinkTimeoutError
from sinkax.sink import Sink, SinkStats, data_sink

__version__ = "0.1.0"

__all__ = [
    "GRAPH_MODE",
    "PYNATIVE_MODE",
    "BatchSpecError",
    "Position",
    "Sink",
    "SinkClosedError",
    "SinkError",
    "SinkStats",
    "SinkTimeoutError",
    "data_sink",
    "get_context",
    "resolve_device",
    "set_context",
]
