"""``progress=``: a sink reports every k-th step from inside a call, as its device computes it."""

import functools
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import default_backend, needs_plugin, producer_threads, producers_left

import sinkax
from sinkax.execution import progress as progress_module
from sinkax.execution import windowed

DATA = [{"x": np.float32(i)} for i in range(10)]


def running_sum(total, batch):
    total = total + batch["x"]
    return total, {"loss": total}


def scan_sink(hook, sink_size, progress_every=10):
    """A running-sum sink of ``sink_size`` steps a call, ``"scan"``, telling ``hook``."""
    return sinkax.data_sink(
        running_sum,
        DATA,
        sink_size,
        strategy="scan",
        progress=hook,
        progress_every=progress_every,
    )


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
    return reports  # (close() told every report)


def losses(steps):
    return np.cumsum([i % 10 for i in range(steps)]).tolist()


def test_a_scan_reports_every_kth_step_from_its_blocks():
    reports = reports_of(25, 2, strategy="scan", progress_every=10)
    loss = losses(50)
    # steps 10 and 20 of each call from its blocks, the last 5 from the host at its end
    assert sorted(reports, key=lambda r: r[1]) == [
        (10, loss[9]),
        (10, loss[19]),
        (5, loss[24]),
        (10, loss[34]),
        (10, loss[44]),
        (5, loss[49]),
    ]


def test_each_report_counts_every_step_up_to_the_output_it_tells():
    # chunks of 3 batches: a call of 7 steps runs windows of 3, 3 and 1, blocks of 2 in each
    reports = reports_of(7, 2, strategy="scan", progress_every=2, max_chunk_bytes=12)
    told = np.cumsum([steps for steps, _ in reports]).tolist()
    loss = losses(14)
    # a window's leftover step is told with the next block, whose output is of a later step
    assert [out for _, out in reports] == [loss[n - 1] for n in told] and told[-1] == 14


@pytest.mark.skipif(not default_backend().python_callbacks, reason="the step calls the host")
def test_a_block_is_reported_while_the_next_runs():
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
    # step 4's loss, then step 8's (not finite, not kept), then steps 9 and 10 as the call
    # returned, with the last kept output (step 7's)
    assert reports[0] == (4, 6.0) and reports[1][0] == 4 and np.isnan(reports[1][1])
    assert reports[2:] == [(2, 21.0)]


@pytest.mark.parametrize("strategy", ["loop", "scan"])  # a report from the host, a block
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
            sink.block_until_ready()  # (the next call would tell a computed block first)
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
        sink.block_until_ready()  # its report told
    try:
        raise FileNotFoundError  # an error handled before, unrelated
    except FileNotFoundError:
        with pytest.raises(RuntimeError, match="hook bug"):
            sink.close()
    assert float(total) == 10.0


def test_a_ctrl_c_while_close_tells_the_reports_leaves_the_sink_closed(monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt

    sink = sinkax.data_sink(running_sum, DATA, 5, strategy="scan", progress=lambda *_: None)
    before = producer_threads()
    total, _ = sink(np.float32(0))
    monkeypatch.setattr(progress_module.Progress, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sink.close()
    assert producers_left(before) == []
    with pytest.raises(sinkax.SinkClosedError):
        sink(total)


def test_the_reports_are_told_in_step_order_one_at_a_time():
    told, active, overlaps = [], [], []

    def hook(steps, out):
        active.append(steps)
        overlaps.append(len(active))
        time.sleep(0.01)  # long enough for a second thread to come in, if one did
        told.append((steps, float(out["loss"]), type(out["loss"])))
        active.pop()

    with scan_sink(hook, 25) as sink:
        total, _ = sink(np.float32(0))
        sink(total)
    loss = losses(50)
    assert [(steps, value) for steps, value, _ in told] == [
        (10, loss[9]),
        (10, loss[19]),
        (5, loss[24]),  # as the call returned, after its blocks
        (10, loss[34]),
        (10, loss[44]),
        (5, loss[49]),
    ]
    assert max(overlaps) == 1
    assert {kind for *_, kind in told} == {np.ndarray}  # the call's own report too


@pytest.mark.parametrize("wait", ["block_until_ready", "close"])
def test_a_hook_may_wait_for_the_sinks_reports_itself(wait):
    sinks = []
    told = []

    def hook(steps, out):
        told.append(steps)
        getattr(sinks[0], wait)()  # returns at once: the report it is in would wait for itself

    sink = scan_sink(hook, 20)
    sinks.append(sink)
    sink(np.float32(0))
    sink.close()
    assert told[0] == 10 and sum(told) == 20


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_reporting_thread_that_ended_is_replaced():
    told, last, ended = [], threading.Event(), []

    def hook(steps, out):
        told.append(steps)
        if len(told) == 1:
            ended.append(threading.current_thread())
            raise SystemExit  # ends the thread it runs in
        if len(told) == 4:
            last.set()

    with scan_sink(hook, 20) as sink:
        total, _ = sink(np.float32(0))
        sink(total)
        assert last.wait(30)  # the 4 reports told, by threads of their own (none waited here)
        ended[0].join(30)  # (its exit reported within this test)


def test_a_sink_left_open_at_exit_tells_its_reports_and_exits_cleanly():
    script = textwrap.dedent(
        """
        import atexit

        told = []
        atexit.register(lambda: print("told", sum(told)))  # runs after sinkax's own (LIFO)

        import jax.numpy as jnp
        import numpy as np

        import sinkax

        def slow(total, batch):  # a chain of matrix products: the reports are due at exit
            for _ in range(4):
                total = jnp.tanh(total @ batch)
            return total, total[0, 0]

        data = [np.eye(256, dtype=np.float32)] * 8
        sink = sinkax.data_sink(
            slow, data, 200, strategy="scan", progress=lambda n, out: told.append(n),
            progress_every=10,
        )
        sink(np.ones((256, 256), np.float32))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "told 200" in done.stdout


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
def test_a_device_without_host_callbacks_reports_from_the_blocks_too():
    reports = reports_of(25, 2, strategy="scan", progress_every=10, device="Emulated")
    loss = losses(50)
    assert sorted(reports, key=lambda r: r[1]) == [
        (10, loss[9]),
        (10, loss[19]),
        (5, loss[24]),
        (10, loss[34]),
        (10, loss[44]),
        (5, loss[49]),
    ]


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
    assert sorted(kinds) == ["carry", "scan"]  # one window, without its last output


def test_a_hook_that_waits_does_not_hold_up_the_device():
    told, release = threading.Event(), threading.Event()

    def hook(steps, out):  # the first block's report waits until the test saw the results
        told.set()
        release.wait(30)

    with scan_sink(hook, 30) as sink:
        total, outs = jax.block_until_ready(sink(np.float32(0)))  # its 3 blocks all ran
        assert outs["loss"].tolist() == losses(30)  # ready while the hook waits
        _, outs = jax.block_until_ready(sink(total))  # and the next call runs too
        assert outs["loss"].tolist() == losses(60)[30:]
        assert told.wait(30)
        release.set()


def test_block_until_ready_tells_every_report_of_the_calls_so_far():
    reports = []
    with sinkax.data_sink(
        running_sum,
        DATA,
        25,
        strategy="scan",
        progress=lambda steps, out: reports.append(steps),
        progress_every=10,
    ) as sink:
        total, _ = sink(np.float32(0))
        total, _ = sink(total)
        sink.block_until_ready()
        assert sorted(reports) == [5, 5, 10, 10, 10, 10]
        assert sink.stats.dispatches == 2 * 4  # a call: 2 blocks, the 5 steps left, the join


def test_a_window_holds_at_most_max_blocks_reported_blocks(monkeypatch):
    monkeypatch.setattr(windowed, "MAX_BLOCKS", 2)
    reports = reports_of(25, 1, strategy="scan", progress_every=5)
    loss = losses(25)
    # 5 blocks of 5 would be too many: one of 15, then the 10 steps left from the host
    assert sorted(reports) == [(10, loss[24]), (15, loss[14])]


def test_a_new_sink_of_the_step_reuses_its_blocks_executables():
    step = functools.partial(running_sum)  # a new function: nothing cached for it yet
    compiles = []
    for _ in range(2):
        with sinkax.data_sink(
            step, DATA, 25, strategy="scan", progress=lambda *_: None, progress_every=10
        ) as sink:
            sink(jnp.float32(0))
            compiles.append(sink.stats.compiles)
    assert compiles[0] >= 3 and compiles[1] == 0  # block, the 5 steps left, the join


def test_the_reporting_thread_ends_once_idle(monkeypatch):
    monkeypatch.setattr(progress_module, "IDLE_S", 0.01)
    told, both = [], threading.Event()

    def hook(steps, out):
        told.append(threading.current_thread())
        if len(told) == 2:
            both.set()

    with scan_sink(hook, 20) as sink:
        sink.block_until_ready()  # nothing ran yet: nothing to wait for
        total, _ = sink(np.float32(0))
        assert both.wait(30)  # both blocks told by the reporting thread (nothing else asked)
        reporter = told[0]
        assert reporter.name == "sinkax-progress" and told[1] is reporter
        reporter.join(30)
        assert not reporter.is_alive()
        total, _ = sink(total)  # a new one reports the next call's blocks
    assert len(told) == 4


def test_a_sink_over_several_cpu_devices_reports_its_blocks_as_without_progress():
    # each block all-reduces over 4 forced devices; XLA:CPU's devices deadlocked with many such
    # executables in flight, so there the blocks go one at a time
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np, sinkax
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        sharding = NamedSharding(mesh, P("data"))
        data = [{"x": np.full((8, 3), i, np.float32)} for i in range(50)]
        step = lambda s, b: (s + jnp.mean(b["x"]), s)
        results, told = [], []
        for progress in (None, lambda n, out: told.append(n)):
            with sinkax.data_sink(step, data, 200, strategy="scan", sharding=sharding,
                                  progress=progress, progress_every=2) as sink:
                state, outs = sink(jnp.float32(0))
                results.append((float(state), np.asarray(outs).tolist()))
        assert results[0] == results[1], results
        print("told", sum(told), len(told))
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "told 200 50" in done.stdout  # 100 blocks would be too many: 50 of 4 steps


def test_a_typed_key_in_the_outputs_is_reported_as_it_is():
    told = []

    def step(key, batch):
        key, sub = jax.random.split(key)
        return key, {"loss": batch["x"], "key": sub}

    with sinkax.data_sink(
        step,
        DATA,
        25,
        strategy="scan",
        progress=lambda steps, out: told.append((steps, type(out["key"]).__name__)),
        progress_every=10,
    ) as sink:
        sink(jax.random.key(0))
    assert [steps for steps, _ in told] == [10, 10, 5]
    assert {kind for _, kind in told} == {"PRNGKeyArray"}  # on the device: numpy holds no keys


def test_a_hook_slower_than_the_device_holds_a_bounded_queue(monkeypatch):
    monkeypatch.setattr(progress_module, "QUEUED", 2)
    release, told, longest = threading.Event(), [], []

    def hook(steps, out):
        release.wait(30)  # the first report waits while every block is handed over
        told.append(steps)

    with scan_sink(hook, 60, progress_every=1) as sink:
        progress = sink._executor.progress
        total, _ = sink(np.float32(0))
        jax.block_until_ready(total)
        longest.append(len(progress._pending))
        release.set()
    assert longest[0] <= 3  # the one being told, 2 queued, the newest merged into the last
    assert sum(told) == 60 and told[:1] == [1] and len(told) < 60


def test_block_until_ready_waits_for_the_reports_so_far_not_later_ones():
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    progress = progress_module.Progress(lambda *_: None, 1, cpu)
    submit = progress.report()[1]
    told = []

    def chain(steps, out):  # each report hands over the next, as calls made meanwhile would
        time.sleep(0.005)
        told.append(steps)
        if len(told) < 200:
            submit(1, jnp.float32(len(told)))

    progress.hook = chain
    submit(1, jnp.float32(0))
    progress.flush()  # returns once the first is told, not after the 200
    assert 1 <= len(told) < 200
    progress.close()
    assert len(told) == 200
