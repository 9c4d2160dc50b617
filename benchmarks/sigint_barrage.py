"""A SIGINT barrage: random Ctrl-Cs into training loops; counts what they broke.

A sender thread delivers SIGINT to the main thread every 0-``--gap-ms`` ms (with ``--pairs``,
two SIGINTs 0-``--pair-gap-ms`` ms apart each time: a second Ctrl-C while a call unwinds from
the first) while the main thread trains with a sink (or in non-sink mode) over an indexed
dataset, catches each ``KeyboardInterrupt`` and carries on with the state it holds. The step
counts its steps and returns the numbers of the batches it ran on, so after every call the
script checks:

* ``lost``      -- the state the loop holds was donated to a call whose result never came back;
* ``skipped`` / ``repeated`` -- the batches delivered are not exactly the next ones;
* ``off_step``  -- the state's step count differs from the batches delivered, or
  ``data_state()`` from the next batch the loop expects;
* ``wedged``    -- a call timed out (``timeout=10`` s: the data is in memory), a call was refused
  as "already running" in this single-threaded loop, or a device slot was missing when the
  session ended;
* ``errors``    -- any other exception.

Sessions rotate over the strategies and chunk layouts (one dispatch, one step, a call split
over chunks, a dispatch per step), ``restore_data_state`` under fire, and non-sink mode, each
with ``prefetch=1`` (two slots: a leak shows at once).

``interrupts`` counts the ``KeyboardInterrupt``s raised inside the library's calls. A signal
that lands in the loop's own code -- including the few bytecodes after a call returns and
before its result is stored, which no library can cover (see :mod:`sinkax.interrupt`) -- is
not raised; the script's handler counts it as ``outside``.

    python benchmarks/sigint_barrage.py --seconds 120     # >= 10,000 interrupts on 2 cores
    python benchmarks/sigint_barrage.py --seconds 120 --pairs --pair-gap-ms 3
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import random
import signal
import threading
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
from _common import save, table

import sinkax
from sinkax.train import DatasetHelper, connect_network_with_dataset

BATCH = 2
COUNTS = ["interrupts", "outside", "calls", "lost", "skipped", "repeated", "off_step", "wedged"]
CONFIGS = {  # strategy, sink_size, max_chunk_bytes (a batch is 24 bytes)
    "scan, one dispatch": ("scan", 4, 64 << 10),
    "step, sink_size 1": ("step", 1, 64 << 10),
    "scan, split over chunks": ("scan", 9, 4 * 24),
    "loop, dispatch per step": ("loop", 3, 64 << 10),
    "restore under fire": ("scan", 4, 8 * 24),
    "non-sink mode": (None, 1, None),
}


def dataset() -> grain.MapDataset:
    ds = grain.MapDataset.range(BATCH * 100_000).batch(BATCH, drop_remainder=True)
    return ds.map(lambda idx: {"index": idx.astype(np.int32)})


def count_step(state, batch):
    return state + 1, batch["index"][0] // BATCH


class Barrage:
    """The SIGINT sender and the handler that raises only inside the library's calls."""

    def __init__(self, gap_s: float, seed: int, pair_gap_s: float | None = None):
        self.gap_s, self.pair_gap_s, self.random = gap_s, pair_gap_s, random.Random(seed)
        self.armed = False  # the main thread is inside a library call
        self.raised = self.outside = 0
        self._stop = threading.Event()
        self._main = threading.main_thread().ident

    def handler(self, signum, frame):
        if self.armed and (frame is None or frame.f_code.co_filename != __file__):
            self.raised += 1
            raise KeyboardInterrupt
        self.outside += 1

    @contextlib.contextmanager
    def firing(self):
        previous = signal.signal(signal.SIGINT, self.handler)
        self._stop.clear()
        sender = threading.Thread(target=self._send, daemon=True)
        sender.start()
        try:
            yield
        finally:
            self.armed = False
            self._stop.set()
            sender.join()
            signal.signal(signal.SIGINT, previous)

    def _send(self):
        while not self._stop.wait(self.random.uniform(0, self.gap_s)):
            signal.pthread_kill(self._main, signal.SIGINT)
            if self.pair_gap_s is not None:  # the second of a pair
                time.sleep(self.random.uniform(0, self.pair_gap_s))
                signal.pthread_kill(self._main, signal.SIGINT)


def lost(state) -> bool:
    return any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array))


def check_batches(numbers, expected: int, counts) -> int:
    """Count skips and repeats of ``numbers`` against the next expected batch; the next one."""
    for n in numbers:
        if n > expected:
            counts["skipped"] += n - expected
        elif n < expected:
            counts["repeated"] += expected - n
        expected = n + 1
    return expected


def slots_accounted(sink, timeout: float = 10.0) -> bool:
    ring, deadline = sink._cursor.ring, time.monotonic() + timeout
    while ring._ready.qsize() + len(ring._handed_out) < sink.config.prefetch + 1:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def sink_session(name: str, seconds: float, barrage: Barrage, counts) -> None:
    strategy, sink_size, max_chunk_bytes = CONFIGS[name]
    options = {"strategy": strategy, "max_chunk_bytes": max_chunk_bytes, "prefetch": 1}
    with sinkax.data_sink(count_step, dataset(), sink_size, timeout=10.0, **options) as sink:
        state, outs = sink(jnp.int32(0))  # compiled before the barrage
        expected = check_batches(np.asarray(outs).tolist(), 0, counts)
        restore_to, restored = sink.data_state(), False
        deadline = time.monotonic() + seconds
        with barrage.firing():
            while time.monotonic() < deadline:
                try:
                    barrage.armed = True
                    if name == "restore under fire" and counts["calls"] % 3 == 0 and not restored:
                        sink.restore_data_state(restore_to)  # back by up to one call
                        barrage.armed, restored = False, True
                        expected = restore_to["step"]
                        state = jnp.int32(expected)
                        continue
                    state, outs = sink(state)
                    barrage.armed = False
                    counts["calls"] += 1
                except KeyboardInterrupt:
                    barrage.armed = False
                    if lost(state):
                        counts["lost"] += 1
                        state = jnp.int32(expected)  # carry on from where the data is
                    back = restore_to["step"]
                    if name == "restore under fire" and sink.data_state()["step"] == back:
                        expected, state = back, jnp.int32(back)  # the restore got through
                    continue
                except (sinkax.SinkTimeoutError, RuntimeError) as error:
                    barrage.armed = False
                    if isinstance(error, RuntimeError) and "already running" not in str(error):
                        raise
                    counts["wedged"] += 1
                    return
                numbers = np.asarray(outs).tolist()
                expected = check_batches(numbers, expected, counts)
                restored = False
                if counts["calls"] % 2:
                    restore_to = sink.data_state()
                if int(state) != expected or sink.data_state()["step"] != expected:
                    counts["off_step"] += 1
                    state = jnp.int32(expected)
        if not slots_accounted(sink):
            counts["wedged"] += 1


def non_sink_session(seconds: float, barrage: Barrage, counts) -> None:
    data = [{"index": np.array([BATCH * i, BATCH * i + 1], np.int32)} for i in range(50)]
    with DatasetHelper(data, dataset_sink_mode=False, epoch_num=10**9) as helper:
        net = connect_network_with_dataset(count_step, helper)
        state, expected = jnp.int32(0), 0  # the count of steps; batch numbers wrap at 50
        deadline = time.monotonic() + seconds
        with barrage.firing():
            while time.monotonic() < deadline:
                try:
                    barrage.armed = True
                    for _ in helper:
                        state, outs = net(state)
                        barrage.armed = False
                        counts["calls"] += 1
                        got = int(np.asarray(outs)[0])
                        if got != expected % 50:
                            counts["skipped" if got > expected % 50 else "repeated"] += 1
                            expected = got
                        expected += 1
                        if int(state) != expected:
                            counts["off_step"] += 1
                            state = jnp.int32(expected)
                        barrage.armed = True
                    barrage.armed = False
                except KeyboardInterrupt:
                    barrage.armed = False
                    if lost(state):
                        counts["lost"] += 1
                        state = jnp.int32(expected)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="total barrage time")
    parser.add_argument("--session", type=float, default=2.0, help="seconds per session")
    parser.add_argument("--gap-ms", type=float, default=4.0, help="max gap between SIGINTs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", action="store_true", help="send SIGINTs in pairs")
    parser.add_argument("--pair-gap-ms", type=float, default=3.0, help="max gap within a pair")
    args = parser.parse_args(argv)
    pair_gap_s = args.pair_gap_ms / 1e3 if args.pairs else None
    barrage = Barrage(args.gap_ms / 1e3, args.seed, pair_gap_s)
    per_config = {name: collections.Counter({c: 0 for c in COUNTS}) for name in CONFIGS}
    errors: list[str] = []
    t0, names = time.monotonic(), list(CONFIGS)
    for i in range(int(args.seconds / args.session)):
        name = names[i % len(names)]
        counts = per_config[name]
        raised, outside = barrage.raised, barrage.outside
        try:
            if name == "non-sink mode":
                non_sink_session(args.session, barrage, counts)
            else:
                sink_session(name, args.session, barrage, counts)
        except Exception as error:  # anything but the Ctrl-Cs is a failure
            errors.append(f"{name}: {type(error).__name__}: {error}"[:300])
        counts["interrupts"] += barrage.raised - raised
        counts["outside"] += barrage.outside - outside
    rows = [{"config": name, **per_config[name]} for name in CONFIGS]
    total = {"config": "total", **{c: sum(r[c] for r in rows) for c in COUNTS}}
    total["errors"] = len(errors)
    print(table([*rows, total], ["config", *COUNTS, "errors"]))
    print(f"{time.monotonic() - t0:.0f} s; errors: {errors or 'none'}")

    def draw(plt):
        figure, ax = plt.subplots(figsize=(8, 3.5))
        ax.barh([r["config"] for r in rows], [r["interrupts"] for r in rows])
        bad = [sum(r[c] for c in COUNTS[3:]) for r in rows]
        for y, (r, b) in enumerate(zip(rows, bad, strict=True)):
            ax.text(r["interrupts"], y, f" {b} broken", va="center")
        ax.set_xlabel("KeyboardInterrupts raised inside sinkax calls")
        kind = "SIGINT pairs" if args.pairs else "SIGINT barrage"
        ax.set_title(f"{kind}: {total['interrupts']} interrupts, failures annotated")
        return figure

    save(
        "sigint_barrage_pairs" if args.pairs else "sigint_barrage",
        {"args": vars(args), "rows": rows, "total": dict(total), "errors": errors},
        draw,
    )


if __name__ == "__main__":
    main()
