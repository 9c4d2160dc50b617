"""Execution strategies: how the steps of one device-resident chunk are run.

* ``"scan"``  -- one executable runs the whole window (a loop whose trip count, the window's
  steps, is compiled in: one executable per window length): one dispatch per window. The
  loop-sink proper. On a CPU device the step's convolutions are first put in XLA:CPU's
  canonical layout (:mod:`sinkax.execution.rewrite`), which XLA:CPU itself does only outside
  loop bodies; with that, a convolutional step is as fast in the loop as standalone.
* ``"loop"``  -- the compiled step is dispatched once per step over slices of the chunk, which
  stays on the device. No per-step host data work, but one dispatch per step: for steps that
  XLA compiles better outside a loop body than inside one.
* ``"step"``  -- one-step calls only: the compiled step runs on one batch as the producer copied
  it, unstacked, which XLA takes at dispatch, as a plain jitted step does. On a CPU device the
  device memory is host memory, so stacking batches into a ring of chunks and slicing them out
  again is more memory traffic, in a second thread that competes with XLA's compute threads for
  the cores.
* ``"eager"`` -- PyNative: the step function runs un-jitted, op by op, for prints and breakpoints.
* ``"auto"``  -- measures ``"scan"`` and ``"loop"`` on the windows the first calls run anyway
  and keeps the faster per step (:class:`~sinkax.execution.auto.Auto`): whole windows with one
  candidate at a time, each compiled before it runs, in trials in the order A, B, A
  (``"scan"``, ``"loop"``, ``"scan"``), a trial one or more windows spanning about
  :data:`~sinkax.execution.auto.TRIAL_S`. Each candidate is judged by its best trial: noise
  only ever slows a trial down, so one slow spell of a shared machine in a scan trial does not
  decide, and one in the loop trial keeps scan, the safe default. ``"scan"`` -- the loop sink
  proper -- is kept unless ``"loop"`` is faster by
  :data:`~sinkax.execution.auto.PREFER_MARGIN` and by more than scan's trials differ;
  measuring stops after A, B when ``"scan"`` is clearly faster (by
  :data:`~sinkax.execution.auto.CLEAR_MARGIN`). Its cost is what the slower candidate loses in
  its trial and the executables of the candidate not kept. The choice is kept per step
  function, state and batch layout and platform, and reused by every later sink of that step
  (``Sink.reselect()`` measures again); the environment variable :data:`ENV` or a data
  position that recorded a choice pins it (see :func:`pinned`). A sink of one-step calls is
  not measured (see :func:`resolve`), nor a one-step window (``sink_size="auto"``'s first
  calls), which ``"scan"`` runs. ``Sink.stats`` records the choice and the timings.

Every strategy computes the same steps in the same order; only speed differs. Each runs a
window of ``steps`` batches of a chunk, starting at ``offset``, and declares the feed it needs
from the ring (its ``feed``): batches stacked on the device, or for ``"step"``, a sequence of
unstacked batches. This module resolves a sink's strategy by name and makes it.

"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from sinkax.channel.position import RECORDED
from sinkax.execution.auto import Auto
from sinkax.execution.compiler import Compiler
from sinkax.execution.programs import StepFn
from sinkax.execution.single import Eager, Step
from sinkax.execution.windowed import Loop, Scan, Strategy

if TYPE_CHECKING:
    from sinkax.backend import Backend

NAMES = ("auto", "scan", "loop", "step")


ENV = "SINKAX_STRATEGY"  # pins what "auto" runs, e.g. SINKAX_STRATEGY=scan


def resolve(
    name: str,
    *,
    jit: bool,
    steps_per_call: int | None,
    backend: Backend,
    devices: int = 1,
    processes: int = 1,
) -> str:
    """The strategy a sink runs, by name: ``name`` itself, or what ``"auto"`` settles to
    without measuring.

    Without jit, ``"eager"``. ``"auto"`` for one-step calls measures nothing: XLA inlines a loop of
    one trip, so ``"scan"`` *is* the standalone step, and where host memory is device memory
    (CPU) ``"step"`` runs it without the ring's copy. ``"step"`` needs one-step calls on one
    device (it hands over host batches, unplaced). Where XLA:CPU does not compile the programs
    (GPU, Ascend) ``"auto"`` is ``"scan"``: ``"loop"`` exists for what XLA:CPU compiles better
    outside a loop body, and elsewhere a loop of known trip count is never slower than a host
    loop of launches. Over several devices ``"auto"`` is ``"scan"`` too: across processes each
    would time its own trials and might choose differently, while every process must run the
    same programs; and ``"loop"`` over several XLA:CPU devices waits for each step (with many
    steps in flight their collectives deadlocked here), where ``"scan"`` waits for each window
    (:func:`~sinkax.execution.windowed.one_in_flight`).

    >>> from sinkax.backend import Backend
    >>> cpu = Backend("cpu", True, True, True, True, 1, xla_cpu=True)
    >>> resolve("auto", jit=True, steps_per_call=1, backend=cpu)
    'step'
    >>> gpu = Backend("gpu", *[False] * 4, 1, xla_cpu=False)
    >>> resolve("auto", jit=True, steps_per_call=1, backend=gpu)
    'scan'
    >>> resolve("auto", jit=True, steps_per_call=100, backend=gpu)
    'scan'
    """
    if name not in NAMES:
        raise ValueError(f"strategy must be one of {NAMES}, got {name!r}.")
    if name == "step" and steps_per_call != 1:
        raise ValueError(
            f"strategy='step' runs one step per call, but this sink runs {steps_per_call} steps "
            "per call. Use sink_size=1, or strategy='scan' / 'loop' / 'auto' for longer sinks."
        )
    if name == "step" and devices > 1:
        raise ValueError(
            f"strategy='step' hands each host batch to the step unplaced, on one device; this "
            f"sink's sharding spans {devices} devices. Use strategy='scan' (or 'auto')."
        )
    if not jit:
        return "eager"
    if name == "auto" and steps_per_call == 1:
        return "step" if backend.host_is_device and devices == 1 else "scan"
    if name == "auto" and (processes > 1 or devices > 1 or not backend.xla_cpu):
        return "scan"
    return name


def pinned(name: str, recorded: str | None = None) -> str:
    """What a sink resolved to ``name`` (see :func:`resolve`) runs: ``"auto"`` -- which then
    measures -- becomes the strategy a saved data position ``recorded`` (see
    ``Sink.data_state``), else the environment variable :data:`ENV`; any other name stays.

    >>> pinned("auto", recorded="loop"), pinned("scan", recorded="loop")
    ('loop', 'scan')
    """
    if name != "auto":
        return name
    if recorded is not None:  # checked by the position that recorded it
        return recorded
    env = os.environ.get(ENV, "auto")
    if env not in ("auto", *RECORDED):
        raise ValueError(f"The environment variable {ENV}={env!r}: use one of {RECORDED} or auto.")
    return env


def kind(name: str) -> type[Strategy] | type[Auto]:
    """The class of the strategy called ``name``, as :func:`resolve` gave it; its ``feed`` says
    what the ring hands it.

    >>> kind("scan").feed, kind("step").feed
    ('stacked', 'unstacked')
    """
    return {"eager": Eager, "auto": Auto, "step": Step, "scan": Scan, "loop": Loop}[name]


def make(
    name: str, fn: StepFn, compiler: Compiler, batches_alike: bool = True, report: Any = None
) -> Strategy | Auto:
    """The strategy called ``name``, as :func:`resolve` gave it (``batches_alike``: see
    :class:`~sinkax.execution.single.Step`; ``report``: how ``"scan"`` reports progress, see
    :mod:`sinkax.execution.progress`)."""
    if name == "auto":
        return Auto([Scan(fn, compiler, report), Loop(fn, compiler)], compiler)
    if name == "eager":
        return Eager(fn)
    if name == "step":
        return Step(fn, compiler, batches_alike)
    if name == "scan":
        return Scan(fn, compiler, report)
    return kind(name)(fn, compiler)
