"""``progress=``: a sink reports every k-th step from inside a call, where the device can."""

import functools
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import default_backend, needs_plugin

import sinkax

DATA = [{"x": np.float32(i)} for i in range(10)]


def running_sum(total, batch):
    total = total + batch["x"]
    return total, {"loss": total}


def reports_of(sink_size, calls, **options):
    """The ``(steps, loss)`` reports of ``calls`` calls of a running-sum sink."""
    reports = []
    with sinkax.data_sink(
        running_sum,
        DATA,
        sink_size,
        progress=lambda steps, out: reports.append((steps, float(out["loss"]))),
        **options,
    ) as sink:
        total = np.float32(0)
        for _ in range(calls):
            total, _ = sink(total)
        jax.effects_barrier()  # the device's reports have run
    return reports


def losses(steps):
    return np.cumsum([i % 10 for i in range(steps)]).tolist()


@pytest.mark.skipif(not default_backend().python_callbacks, reason="needs host callbacks")
def test_a_scan_reports_every_kth_step_from_the_device():
    reports = reports_of(25, 2, strategy="scan", progress_every=10)
    loss = losses(50)
    # steps 10 and 20 of each call from the device, the last 5 from the host at its end
    assert sorted(reports, key=lambda r: r[1]) == [
        (10, loss[9]),
        (10, loss[19]),
        (5, loss[24]),
        (10, loss[34]),
        (10, loss[44]),
        (5, loss[49]),
    ]


@pytest.mark.skipif(not default_backend().python_callbacks, reason="needs host callbacks")
def test_the_device_reports_while_the_call_runs():
    reported, release = threading.Event(), threading.Event()

    def hook(steps, out):
        reported.set()

    def waits_for_the_test(total, batch):  # step 3 waits until the test saw step 2's report
        total, out = running_sum(total, batch)
        jax.debug.callback(lambda t: release.wait(30) if t == 3 else None, total)
        return total, out

    with sinkax.data_sink(
        waits_for_the_test, DATA, 4, strategy="scan", progress=hook, progress_every=2
    ) as sink:
        done = threading.Thread(target=lambda: jax.block_until_ready(sink(np.float32(0))))
        done.start()
        assert reported.wait(30)  # the report of step 2, before step 3 ends
        release.set()
        done.join(30)


@pytest.mark.skipif(not default_backend().python_callbacks, reason="needs host callbacks")
def test_a_sink_that_stops_at_nan_reports_the_steps_outputs():
    data = [*DATA[:7], {"x": np.float32(np.nan)}, *DATA[8:]]
    reports = []
    with sinkax.data_sink(
        running_sum,
        data,
        10,
        strategy="scan",
        stop_if_nonfinite="loss",
        progress=lambda steps, out: reports.append((steps, float(out["loss"]))),
        progress_every=4,
    ) as sink:
        sink(np.float32(0))
        jax.effects_barrier()
    assert reports[0] == (4, 6.0)  # step 4's loss, from the device


@pytest.mark.parametrize("strategy", ["loop", "scan"])  # a report from the host, the device
def test_a_hook_that_raises_loses_nothing_and_the_next_call_raises_it(strategy):
    raised = []

    def hook(steps, out):
        if not raised:
            raised.append(steps)
            raise KeyError("accuracy")

    with sinkax.data_sink(
        running_sum, DATA, 5, strategy=strategy, progress=hook, progress_every=5
    ) as sink:
        with pytest.warns(RuntimeWarning, match="progress hook raised KeyError"):
            total, outs = sink(np.float32(0))
            jax.effects_barrier()
        assert float(total) == 10.0 and outs["loss"].tolist() == losses(5)  # the call completed
        with pytest.raises(RuntimeError, match="progress hook raised KeyError") as error:
            sink(total)
        assert isinstance(error.value.__cause__, KeyError)
        assert float(total) == 10.0 and sink.step == 5  # not donated, nothing read
        total, outs = sink(total)
    assert float(total) == 45.0 and outs["loss"].tolist() == losses(10)[5:]


def test_a_hooks_error_unraised_by_a_call_comes_from_close_even_within_an_except_block():
    def hook(steps, out):
        raise ValueError("hook bug")

    sink = sinkax.data_sink(running_sum, DATA, 5, strategy="loop", progress=hook)
    with pytest.warns(RuntimeWarning):
        total, _ = sink(np.float32(0))
    try:
        raise FileNotFoundError  # an error handled before, unrelated
    except FileNotFoundError:
        with pytest.raises(RuntimeError, match="hook bug"):
            sink.close()
    assert float(total) == 10.0


def test_a_ctrl_c_in_the_hooks_end_of_call_report_is_held_with_the_results_returned():
    sink = sinkax.data_sink(
        running_sum,
        DATA,
        5,
        strategy="loop",
        progress=lambda *_: signal.raise_signal(signal.SIGINT),
    )
    total, outs = sink(np.float32(0))  # the call returns its results, the Ctrl-C held
    assert float(total) == 10.0 and outs["loss"].tolist() == losses(5) and sink.step == 5
    with pytest.raises(KeyboardInterrupt):
        sink.close()  # where the held Ctrl-C goes on


def test_a_call_that_stops_at_its_first_step_still_reports_its_steps():
    data = [*DATA[:5], {"x": np.float32(np.nan)}, *DATA[6:]]  # the second call's first batch
    reports = []
    with sinkax.data_sink(
        running_sum,
        data,
        5,
        strategy="loop",  # reported from the host as the call returns
        stop_if_nonfinite="loss",
        progress=lambda steps, out: reports.append((steps, float(out["loss"]))),
    ) as sink:
        total, _ = sink(np.float32(0))
        total, outs = sink(total)
    assert len(outs["loss"]) == 0 and sink.nonfinite.step_in_call == 0
    assert reports[0] == (5, 10.0) and reports[1][0] == 5 and np.isnan(reports[1][1])


@pytest.mark.parametrize(
    ("sink_size", "options"),
    [(25, {"strategy": "loop"}), (25, {"strategy": "auto"}), (1, {}), (25, {"jit": False})],
    ids=["loop", "auto", "one-step", "eager"],
)
def test_the_reports_add_up_to_every_step(sink_size, options):
    reports = reports_of(sink_size, 3, progress_every=10, **options)
    assert sum(steps for steps, _ in reports) == 3 * sink_size
    assert max(loss for _, loss in reports) == losses(3 * sink_size)[-1]


def test_a_step_that_outputs_nothing_is_reported_too():
    reports = []
    step = lambda total, batch: (total + batch["x"], None)  # noqa: E731
    with sinkax.data_sink(step, DATA, 3, progress=lambda *report: reports.append(report)) as sink:
        total, outs = sink(np.float32(0))
    assert float(total) == 3.0 and outs is None and reports == [(3, None)]


@needs_plugin
def test_without_host_callbacks_a_warning_and_a_report_per_call():
    with pytest.warns(RuntimeWarning, match="no Python host callbacks.*once per call"):
        reports = reports_of(25, 2, strategy="scan", progress_every=10, device="Emulated")
    loss = losses(50)
    assert reports == [(25, loss[24]), (25, loss[49])]


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"progress": 3}, TypeError, "progress must be a function hook"),
        ({"progress": print, "progress_every": 0}, ValueError, "progress_every must be an int"),
    ],
)
def test_bad_progress_options_are_named(options, error, match):
    with pytest.raises(error, match=match):
        sinkax.data_sink(running_sum, DATA, 2, **options)


def test_without_progress_a_scan_compiles_its_plain_program():
    step = functools.partial(running_sum)  # a new function: nothing cached for it yet
    with sinkax.data_sink(step, DATA, 4, strategy="scan") as sink:
        sink(jnp.float32(0))
        kinds = [key[0] for key in sink._executor.compiler._cache if isinstance(key, tuple)]
    assert sorted(kinds) == ["carry", "scan"]  # not ("scan", ("progress", ...), every)
