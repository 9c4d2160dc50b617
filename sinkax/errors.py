"""Errors a sink raises, each naming the problem and the usual fix; and :func:`warn`, which
points a warning at the user's line."""

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the innermost frame outside sinkax -- the user's line
    that led here, however many sinkax frames are in between (``data_sink``, ``Sink``,
    ``Model.train``, a callback)."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: warn's caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class SinkError(RuntimeError):
    """Base class of the errors raised by a :class:`~sinkax.Sink`."""


class BatchSpecError(SinkError, ValueError):
    """A batch differs from the first one in tree structure, shape or dtype."""


class SinkTimeoutError(SinkError, TimeoutError):
    """No data reached the sink within its ``timeout``."""


class SinkClosedError(SinkError):
    """The sink was used after :meth:`~sinkax.Sink.close`."""


class SinkExhaustedError(SinkError):
    """The sink has made the ``calls`` (or run the ``total_steps``) it was created for: its
    producer read no data past them."""

    def __init__(self) -> None:
        super().__init__(
            "This sink has made every call it was created for (its `calls=`, or its "
            "`total_steps=` for sink_size='auto' or -1), and its producer read no data past them. "
            "Create it with a larger bound, or without one to run on."
        )
