"""Errors a sink raises, each naming the problem and the usual fix."""


class SinkError(RuntimeError):
    """Base class of the errors raised by a :class:`~sinkax.Sink`."""


class BatchSpecError(SinkError, ValueError):
    """A batch differs from the first one in tree structure, shape or dtype."""


class SinkTimeoutError(SinkError, TimeoutError):
    """No data reached the sink within its ``timeout``."""


class SinkClosedError(SinkError):
    """The sink was used after :meth:`~sinkax.Sink.close`."""


class SinkExhaustedError(SinkError):
    """The sink has made the ``calls`` it was created for: its producer read no data past them."""
