"""``sink_size="auto"``: calls that size themselves to about ``call_seconds``."""

import contextlib
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    collect_index,
    ctrl_c_at_check,
    indexed_map_dataset,
    init_state,
    reference_run,
    train_step,
)

import sinkax
from sinkax.channel import sizing
from sinkax.channel.position import DataPosition
from sinkax.channel.source import Position
from sinkax.execution import compiler

MID_EPOCH = Position(0, 5)


def on_clock(monkeypatch, now, caught_up=False):
    """Auto sinks timed by ``now``, their compiles too: how long a compile really takes (on a
    loaded machine) does not count, as the calls' sizes would follow it. Whether the device has
    done the last call when the next starts is ``caught_up`` too, not left to the machine: it
    sets how fast the sizes may grow."""
    monkeypatch.setattr(sizing, "now", now)
    monkeypatch.setattr(sizing, "finished", lambda work: caught_up)
    monkeypatch.setattr(compiler, "time", types.SimpleNamespace(perf_counter=now))


def test_the_target_follows_the_rate_of_the_last_calls_from_start_to_start():
    starts = iter([0.0, 0.1, 0.2, 1.0, 2.0, 5.0, 5.5])  # the clock when each call starts
    sizer = sizing.CallSizer(call_seconds=1.0, epoch_length=1000, clock=lambda: next(starts))
    targets = []

    def call(compiling=0.0, ends=True):
        sizer.started()
        targets.append(sizer.target)
        if ends:
            sizer.ended(sizer.target, compiling)

    call()  # nothing to measure yet: 1
    call()  # 1 step from 0.0 to 0.1: 10 steps/s, at most GROWTH x: 8
    call(compiling=0.5)  # the last two calls, 9 steps in 0.2 s: 45; this one compiles 0.5 s
    call()  # 45 + 8 steps from 0.1 to 1.0, less the compile: 53 in 0.4 s, 132
    call(ends=False)  # 132 + 45 steps from 0.2 to 2.0, less the compile: 136, within
    # KEPT_SIZE of 132: 132 kept; this one fails
    call()  # the last call failed: neither it nor those before count, 132 again
    call()  # 132 steps from 5.0 to 5.5 (the failed call does not count): 264
    assert targets == [1, 8, 45, 132, 132, 132, 264]
    assert list(sizer.sizes) == [1, 8, 45, 132, 132, 264]  # the failed call never ended


def test_growth_is_bounded_per_call_and_by_the_epoch():
    clock = itertools.count(step=1e-3)  # every call takes a millisecond
    sizer = sizing.CallSizer(call_seconds=10.0, epoch_length=3000, clock=lambda: next(clock))
    targets = []
    for _ in range(6):
        sizer.started()
        targets.append(sizer.target)
        sizer.ended(sizer.target, compiling=0.0)
    assert targets == [1, 8, 64, 512, 3000, 3000]
    assert sizer.granule() == 3000  # the whole epoch: each call is one window
    sizer.target = 2999
    assert sizer.granule() == 256  # else a power of two, at most an eighth of the target


def test_calls_timed_whole_grow_settled_growth_times_and_others_growth_times():
    done = jax.block_until_ready(jnp.zeros(3))
    deleted = jnp.zeros(3)
    deleted.delete()  # donated since: not known to be done

    def targets(last, compiling=0.0):
        clock = [0.0]
        sizer = sizing.CallSizer(call_seconds=10.0, epoch_length=None, clock=lambda: clock[0])
        seen = []
        for _ in range(4):
            sizer.started(last)
            seen.append(sizer.target)
            clock[0] += sizer.target / 10_000 + compiling  # 10,000 steps/s, and its compile
            sizer.ended(sizer.target, compiling)
        return seen

    assert targets(done) == [1, 64, 4096, 100_000]  # 10,000 steps/s for 10 s
    unknown = [targets(None), targets(deleted), targets({"no": "array"})]
    assert unknown == [[1, 8, 64, 512]] * 3  # not known to be done
    assert targets(done, compiling=1e-4) == [1, 8, 64, 512]  # its time, less a compile


def test_a_caller_that_waits_for_each_call_lets_the_sizes_grow_faster(monkeypatch):
    clock = itertools.count(step=1e-3)  # every call "takes" a millisecond, and compiles nothing
    monkeypatch.setattr(sizing, "now", lambda: next(clock))
    monkeypatch.setattr(compiler, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))
    dataset = indexed_map_dataset(20_000, 2, seed=None).repeat(None)  # no epoch evens a call
    for wait in (True, False):

        def step(state, batch):  # compiles of its own (none count here): not the other tests'
            return collect_index(state, batch)

        with sinkax.data_sink(step, dataset, "auto", strategy="scan") as sink:
            for _ in range(3):
                _, indices = sink(jnp.int32(0))
                if wait:  # the last window is done when the next call starts
                    jax.block_until_ready(indices)
            sizes = sink.stats.call_sizes
        if wait:  # (a call holds whole granules up to its target: at least 4096)
            assert sizes[:2] == (1, 64) and 4096 <= sizes[2] < 2 * 4096
        else:  # the device may be still busy when the next call starts: x8, or x64 if not
            assert sizes[1] in (8, 64)


def test_one_step_windows_measure_no_strategy_and_the_first_larger_ones_do(monkeypatch):
    monkeypatch.setattr(sinkax.execution.auto, "TRIAL_S", 0.0)  # a trial is one window
    on_clock(monkeypatch, itertools.count(step=1e-3).__next__)  # the sizes grow 8 x a call

    def step(state, batch):  # compiles and a choice of its own: not the other tests'
        return collect_index(state, batch)

    dataset = indexed_map_dataset(2_000, 2, seed=None).repeat(None)  # no epoch evens a call
    with sinkax.data_sink(step, dataset, "auto") as sink:
        stats = []
        for _ in range(5):
            sink(jnp.int32(0))
            stats.append(sink.stats)
    # calls of 1, 8 and 64 steps in windows of one (the granules lag), then larger windows
    one_step = [s for s in stats if s.dispatches == s.steps]
    assert [s.call_sizes[-1] for s in one_step] == [1, 8, 64]
    for calls, s in enumerate(one_step, 1):  # the scan's window of one step (the step alone)
        assert s.strategy == "auto (scan: one-step windows)" and not s.strategy_timings  # none
        assert s.compiles == calls  # measured, no loop compiled: that window, a join per call
    assert set(stats[-1].strategy_timings) == {"scan", "loop"}  # measured on larger windows


def test_a_drifting_target_keeps_its_granule_and_a_far_one_changes_it():
    sizer = sizing.CallSizer(call_seconds=1.0, epoch_length=None, target=4096)
    assert sizer.granule() == 512
    granules = []
    for target in (4600, 3000, 2100, 8000, 16384, 2047, 16385):  # 512 x 4 to 512 x 32
        sizer.target = target
        granules.append(sizer.granule())
    # 2047 < 4 x 512: a new one (2047 / 8 -> 128); 16385 > 32 x 128: a new one again
    assert granules == [512, 512, 512, 512, 512, 128, 2048]
    # a resumed sizer plans in the granule of the position it resumes from
    resumed = sizing.CallSizer(call_seconds=1.0, epoch_length=None)
    resumed.restore(DataPosition(0, 0, {}, call_steps=3000, call_granule=256))
    assert (resumed.target, resumed.granule()) == (3000, 256)  # anew: 3000 / 8 -> 256 too
    resumed.restore(DataPosition(0, 0, {}, call_steps=4600, call_granule=256))
    assert resumed.granule() == 256  # anew it would be 512


def test_a_call_is_measured_less_the_seconds_it_spent_compiling(monkeypatch):
    clock = itertools.count(step=1.0)  # every call "takes" a second, compiles included
    monkeypatch.setattr(sizing, "now", lambda: next(clock))
    get = compiler.Compiler.get

    def slow_get(self, *args, **kwargs):  # and every compile "takes" at least 0.6 s of it
        compiles = self.compiles
        executable = get(self, *args, **kwargs)
        self.seconds += 0.6 * (self.compiles - compiles)
        return executable

    monkeypatch.setattr(compiler.Compiler, "get", slow_get)
    dataset = indexed_map_dataset(4000, 2, seed=None)
    options = {"call_seconds": 4.0, "strategy": "scan"}

    def step(state, batch):  # a step of its own: no other test compiled its windows
        return collect_index(state, batch)

    with sinkax.data_sink(step, dataset, "auto", **options) as sink:
        for _ in range(2):
            sink(jnp.int32(0))
        # the first call compiled: 1 step in at most 0.4 s of its second, 2.5 steps/s or more;
        # in 4 s 10 or more, 8 at most 8x (counted whole: 1 step/s, 4)
        assert sink.stats.call_sizes == (1, 8)


def test_a_build_first_waits_for_the_work_still_running_and_times_only_itself():
    events = []
    build = compiler.Compiler(lambda x: x, "settled", settle=lambda: events.append("settle"))
    for _ in range(2):  # built once, then from the cache: no wait
        build.get("scan", 1, lambda: lambda x: x + 1, jnp.zeros(3))
    assert events == ["settle"] and build.compiles == 1 and build.seconds > 0


def test_a_resumed_sink_plans_in_the_granule_its_position_records():
    dataset = indexed_map_dataset(4000, 2, seed=None).repeat(None)  # no epoch ends a call
    with sinkax.data_sink(collect_index, dataset, "auto", call_seconds=0.05) as sink:
        for _ in range(6):
            sink(jnp.int32(0))
        saved = sink.data_state()
        assert saved["call_granule"] == sink._cursor.sizer.kept_granule >= 1
    # a granule the target keeps (512 holds 16 of 32), where anew it would have 512 / 8 = 64
    saved["call_granule"], saved["call_steps"] = 32, 512
    # (calls long enough that a compile's share of them is not a step of the 512)
    options = {"data_state": saved, "call_seconds": 1e4}
    with sinkax.data_sink(collect_index, dataset, "auto", **options) as sink:
        sink(jnp.int32(0))
        assert sink._cursor.sizer.kept_granule == saved["call_granule"]
        assert sink.stats.call_sizes[0] == saved["call_steps"]


def test_a_call_ends_at_its_target_or_at_an_epochs_end():
    sizer = sizing.CallSizer(call_seconds=1.0, epoch_length=None, target=40)
    assert not sizer.enough(39, MID_EPOCH) and sizer.enough(40, MID_EPOCH)
    assert sizing.CallSizer(1.0, epoch_length=100, target=40).enough(3, Position(1, 0))


def calls_of_an_epoch(steps, granule, target, **sizer):
    """The steps of the calls that a :class:`~sizing.CallSizer` of ``target`` (each call
    lasting its steps at that rate: a steady target) cuts ``steps`` into, from an epoch's
    start, in granules of ``granule`` steps (the last cut at the end, as the producer plans)."""
    clock = [0.0]
    sizer = sizing.CallSizer(1.0, target=target, clock=lambda: clock[0], **sizer)
    calls, start = [], 0
    while start < steps:
        sizer.started()
        taken = 0
        while True:
            taken += min(granule, steps - start - taken)
            end = start + taken
            if sizer.enough(taken, Position(end // steps, end % steps)):
                break
        sizer.ended(taken, compiling=0.0)
        clock[0] += taken / target
        calls.append(taken)
        start += taken
    assert sizer.target == target
    return calls


@pytest.mark.parametrize(
    ("epoch", "target", "granule", "calls"),
    [
        (500, 240, 16, [256, 244]),  # not 240, 240 and 20
        (100, 40, 4, [36, 32, 32]),  # not 40, 40 and 20
        (250, 100, 8, [88, 88, 74]),  # three calls 17 % short of 100, not two 25 % over
        (130, 100, 8, [130]),  # 30 % over, not 100 and 30
        (10_000, 64, 8, [64] * 150 + [72, 72] + [64] * 4),  # never over the target mid-epoch
    ],
)
def test_an_epoch_ends_in_calls_of_about_the_target_not_a_short_one(epoch, target, granule, calls):
    assert calls_of_an_epoch(epoch, granule, target, epoch_length=epoch) == calls
    # total_steps= ends a run alike
    assert calls_of_an_epoch(epoch, granule, target, epoch_length=None, total_steps=epoch) == calls


def test_a_call_that_compiles_holds_that_times_share_less_of_its_target():
    sizer = sizing.CallSizer(call_seconds=2.0, epoch_length=None, target=40)
    assert not sizer.enough(20, MID_EPOCH, compiling=0.0)
    # 1 s of its 2 compiling: 20 steps last the rest
    assert sizer.enough(20, MID_EPOCH, compiling=1.0)
    assert not sizer.enough(19, MID_EPOCH, compiling=1.0)
    assert sizer.enough(1, MID_EPOCH, compiling=3.0)  # compiling outlasted it: one granule


def test_a_call_holds_at_most_max_windows():
    sizer = sizing.CallSizer(call_seconds=1.0, epoch_length=None, target=10_000)
    assert not sizer.enough(255, MID_EPOCH, windows=sizing.MAX_WINDOWS - 1)
    assert sizer.enough(256, MID_EPOCH, windows=sizing.MAX_WINDOWS)


def test_a_growing_call_of_small_granules_ends_at_max_windows(monkeypatch):
    clock = itertools.count(step=1e-3)  # every call "takes" a millisecond: targets x8 a call
    on_clock(monkeypatch, lambda: next(clock))
    monkeypatch.setattr(sizing, "MAX_WINDOWS", 16)
    dataset = [{"x": np.int32(i)} for i in range(2000)]
    # prefetch: many chunks of one-step granules read ahead while the target grows past them
    with sinkax.data_sink(lambda s, b: (s + 1, b["x"]), dataset, "auto", prefetch=8) as sink:
        state = jnp.int32(0)
        for _ in range(4):
            dispatched = sink.stats.dispatches
            state, xs = sink(state)
            assert sink.stats.dispatches - dispatched <= 16
        assert sink.stats.call_sizes == (1, 8, 16, 16)  # targets 1, 8, 64, 512
        assert int(state) == 41 and np.asarray(xs).tolist() == list(range(25, 41))


def test_a_failed_call_of_several_windows_keeps_the_callers_state(monkeypatch):
    clock = itertools.count(step=1e-3)  # the second call's target: 8 one-step windows
    on_clock(monkeypatch, lambda: next(clock))

    def bad_record_5():
        for i in range(100):
            if i == 5:
                raise ValueError("bad record 5")
            yield {"x": np.int32(i)}

    failing_join = compiler.Compiler.get

    def get(self, kind, *args, **kwargs):
        if kind == "concat":
            raise RuntimeError("RESOURCE_EXHAUSTED (simulated)")
        return failing_join(self, kind, *args, **kwargs)

    step = lambda s, b: (s + 1, b["x"])  # noqa: E731
    dataset = type("Bad", (), {"__iter__": lambda self: bad_record_5()})()
    with sinkax.data_sink(step, dataset, "auto", strategy="scan") as sink:
        state, _ = sink(jnp.int32(0))
        with pytest.raises(ValueError, match="bad record 5"):  # in the call's 5th window
            sink(state)
        assert int(state) == 1 and sink.step == 1  # not donated to the windows before
    with sinkax.data_sink(step, [{"x": np.int32(i)} for i in range(100)], "auto") as sink:
        state, _ = sink(jnp.int32(0))
        monkeypatch.setattr(compiler.Compiler, "get", get)  # the windows run, their join fails
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
            sink(state)
        monkeypatch.setattr(compiler.Compiler, "get", failing_join)
        assert int(state) == 1 and sink.step == 1
        state, xs = sink(state)  # the failed call's batches come again
        assert int(state) == 9 and np.asarray(xs).tolist() == list(range(1, 9))


def test_a_steady_target_keeps_its_size_and_a_changed_rate_moves_it():
    sizer = sizing.CallSizer(call_seconds=1.0, epoch_length=None, target=1000)
    targets = []
    for seconds in (1.05, 0.95, 0.92, 1.3, 0.5):
        sizer.measured(steps=sizer.target, seconds=seconds)
        targets.append(sizer.target)
    # within KEPT_SIZE (10 %) of the target: kept (its calls join their windows' outputs in
    # an executable already compiled); 0.92 s: 1087 steps wanted, 8.7 % more: kept too
    assert targets == [1000, 1000, 1000, 769, 1538]
    # but for the whole epoch, within 10 % or not: each call is then one window
    near_an_epoch = sizing.CallSizer(call_seconds=1.0, epoch_length=1050, target=1000)
    near_an_epoch.measured(steps=1000, seconds=0.5)
    assert near_an_epoch.target == near_an_epoch.granule() == 1050


def test_a_steady_auto_sink_keeps_its_call_size_and_compiles_nothing_more(monkeypatch):
    # a step costs 1 ms, the calls' measured times jitter by up to +-4 % (a kept target is then
    # never 10 % off); unkept, targets around 192 would straddle a granule's edge (32 x 6)
    jitter = iter(np.random.default_rng(0).uniform(0.96, 1.04, 100))
    clock = [0.0]
    on_clock(monkeypatch, lambda: clock[0])
    dataset = indexed_map_dataset(4000, 2, seed=None).repeat(None)  # no epoch ends a call
    options = {"call_seconds": 0.192, "strategy": "scan"}
    with sinkax.data_sink(collect_index, dataset, "auto", **options) as sink:
        compiles = []
        for _ in range(24):
            sink(jnp.int32(0))
            clock[0] += sink.stats.call_sizes[-1] * 1e-3 * next(jitter)
            compiles.append(sink.stats.compiles)
        sizes = sink.stats.call_sizes
    # ~192 steps a call, in whole granules; each size joins its windows' outputs in an
    # executable of its own
    assert len(set(sizes[-12:])) == 1 and 180 <= sizes[-1] <= 250
    assert compiles[-12] == compiles[-1]


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"call_seconds": 0}, "call_seconds must be"),
        ({"call_seconds": 1.0, "sink_size": 4}, "call_seconds is the target time .*sink_size=4"),
        ({"calls": 3}, "calls= .* does not apply.*total_steps="),
        ({"total_steps": 0}, "total_steps must be an int >= 1"),
        (
            {"total_steps": 6, "sink_size": 3},
            "total_steps= bounds a sink_size='auto' or -1.*calls=",
        ),
        ({"data_state": {"call_steps": 0}}, r"call_steps'\] must be"),
    ],
)
def test_bad_auto_options_are_named(option, match):
    dataset = indexed_map_dataset(16, 2)
    if "data_state" in option:
        with sinkax.data_sink(collect_index, dataset, "auto") as sink:
            option = {"data_state": {**sink.data_state(), **option["data_state"]}}
    option = {"sink_size": "auto", **option}
    with pytest.raises(ValueError, match=match):
        sinkax.data_sink(collect_index, dataset, **option).close()


def test_sizes_grow_and_every_sample_is_seen_once_per_epoch(monkeypatch):
    clock = itertools.count(step=1e-3)  # every call "takes" a millisecond: targets x8 a call
    on_clock(monkeypatch, lambda: next(clock))
    dataset = indexed_map_dataset(400, 2)  # 200 batches an epoch, reshuffled each epoch
    seen = []
    options = {"call_seconds": 1.0, "strategy": "scan"}  # "auto" picks by real time: not here
    with sinkax.data_sink(collect_index, dataset, "auto", **options) as sink:
        while sum(map(len, seen)) < 3 * 400:
            _, indices = sink(jnp.int32(0))
            seen.append(np.asarray(indices).reshape(-1))
        sizes, saved = sink.stats.call_sizes, sink.data_state()
    assert sizes[0] == 1 and max(sizes) == 200  # bounded by the epoch
    assert all(b <= 8 * a or b == 200 for a, b in itertools.pairwise(sizes))
    samples = np.concatenate(seen)
    for epoch in range(3):  # calls end at epochs' ends: whole epochs, each sample once
        assert sorted(samples[400 * epoch : 400 * (epoch + 1)]) == list(range(400))
    assert saved["call_steps"] == 200
    with sinkax.data_sink(collect_index, dataset, "auto", data_state=saved, **options) as sink:
        for _ in range(2):  # the resumed sink starts at the size the saved one reached,
            sink(jnp.int32(0))  # the whole epoch: each call one window, as sink_size=-1
        assert sink.stats.call_sizes == (200, 200) and sink.stats.dispatches == 2


def test_total_steps_ends_the_last_call_there_and_reads_nothing_past_it(monkeypatch):
    clock = itertools.count(step=1e-3)  # every call "takes" a millisecond: targets x8 a call
    on_clock(monkeypatch, lambda: next(clock))
    read = []

    def counted():
        for i in range(100):
            read.append(i)
            yield {"index": np.full((2,), i, np.int32)}

    dataset = type("Counted", (), {"__iter__": lambda self: counted()})()
    with sinkax.data_sink(collect_index, dataset, "auto", total_steps=20, prefetch=4) as sink:
        while sink.step < 20:  # targets x8 a call: the last call ends at the bound, not its target
            sink(jnp.int32(0))
        sizes = sink.stats.call_sizes
        with pytest.raises(sinkax.SinkExhaustedError, match="total_steps="):
            sink(jnp.int32(0))
        assert sink.step == 20  # the failed call took nothing
    assert sum(sizes) == 20 and sizes[0] == 1
    assert read == list(range(20))  # prefetch 4 chunks ahead, but the run ends at 20 steps


def test_ctrl_c_anywhere_in_an_auto_call_keeps_the_state_and_every_batch(batches):
    _, ref_losses = reference_run(batches, 400)
    for k in itertools.count():
        with sinkax.data_sink(train_step, batches, "auto", strategy="scan") as sink:
            state, losses = sink(init_state())
            with (
                contextlib.suppress(KeyboardInterrupt),
                ctrl_c_at_check(k, sinkax.Sink.__call__) as checks,
            ):
                state, more = sink(state)
                losses = np.concatenate([losses, more])
            while len(losses) < 20:  # a held Ctrl-C stops the first of these
                with contextlib.suppress(KeyboardInterrupt):
                    state, more = sink(state)
                    losses = np.concatenate([losses, more])
        assert len(losses) <= len(ref_losses)
        np.testing.assert_allclose(
            losses, ref_losses[: len(losses)], rtol=1e-5, err_msg=f"Ctrl-C at check {k}"
        )
        if next(checks) <= k:  # the call passed fewer checks: each one has had its Ctrl-C
            break
