"""What a Ctrl-C costs: how often it loses the training state, or puts it out of step with the data.

Each trial trains the dispatch-bound MLP (batch 32) in a loop until another process sends
SIGINT at a random moment (as a terminal's Ctrl-C would), then checks the state the loop holds:

* ``lost``     -- its arrays were donated to a step whose result never reached the loop;
* ``agree``    -- it has taken exactly as many steps as the data position has moved on
  (``TrainState.step`` against ``data_state()``), so resuming skips and repeats nothing;
* ``again``    -- the first Ctrl-C was swallowed and a second one, 2 s later, was needed (Python
  drops a KeyboardInterrupt raised in a weakref callback its garbage collector runs).

Modes: a plain donating ``jax.jit`` loop; ``data_sink`` at a few sink sizes; non-sink mode
(``DatasetHelper(dataset_sink_mode=False)``). Linux/macOS (the signal comes from ``kill``).

    python benchmarks/ctrl_c.py            # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import time

import jax
from _common import bar_chart, fresh, save, table, workload

import sinkax
from sinkax.train import DatasetHelper, connect_network_with_dataset

AGAIN_S = 2.0


@contextlib.contextmanager
def ctrl_c_after(seconds: float):
    """Another process sends this one SIGINT after ``seconds``, and again ``AGAIN_S`` later if
    the block is still running (Python drops a KeyboardInterrupt raised inside a weakref callback
    or ``__del__``, which its garbage collector may be running at that moment); yields a dict
    whose ``"presses"`` says how many it took."""
    pid, counted = os.getpid(), {"presses": 1}
    script = f"sleep {seconds:.3f}; kill -INT {pid}; sleep {AGAIN_S}; kill -INT {pid}"
    sender = subprocess.Popen(["sh", "-c", script])
    t0 = time.perf_counter()
    try:
        yield counted
    finally:
        sender.kill()
        sender.wait()
        counted["presses"] = 2 if time.perf_counter() - t0 > seconds + AGAIN_S else 1


def interrupted(step_once, delay: float | None) -> int:
    """Run ``step_once`` until a Ctrl-C sent after ``delay`` s stops it; the presses it took.

    ``delay=None`` runs it three times, uninterrupted: to compile before the trials, since a
    Ctrl-C during JAX's compilation is not what this measures.
    """
    if delay is None:
        for _ in range(3):
            step_once()
        return 0
    with ctrl_c_after(delay) as ctrl_c, contextlib.suppress(KeyboardInterrupt):
        while True:
            step_once()
    return ctrl_c["presses"]


def outcome(state, steps_read: int, presses: int) -> dict:
    """Whether the state was lost, and whether it took exactly the steps the data has moved."""
    gone = any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    return {"lost": gone, "agree": not gone and int(state.step) == steps_read, "again": presses > 1}


def position(data_state, epoch_length: int) -> int:
    return data_state["epoch"] * epoch_length + data_state["step"]


def plain_trial(w, delay):
    step = jax.jit(w.step, donate_argnums=0)
    state, steps = fresh(w.init()), 0

    def step_once():
        nonlocal state, steps
        state, _ = step(state, w.batches[steps % len(w.batches)])
        steps += 1

    presses = interrupted(step_once, delay)
    return outcome(state, steps, presses)


def sink_trial(w, delay, sink_size):
    state = fresh(w.init())
    with sinkax.data_sink(w.step, w.batches, sink_size) as sink:

        def step_once():
            nonlocal state
            state, _ = sink(state)

        presses = interrupted(step_once, delay)
        return outcome(state, position(sink.data_state(), len(w.batches)), presses)


def non_sink_trial(w, delay):
    state = fresh(w.init())
    with DatasetHelper(w.batches, dataset_sink_mode=False, epoch_num=10**6) as helper:
        net = connect_network_with_dataset(w.step, helper)

        def epoch():
            nonlocal state
            for _ in helper:
                state, _ = net(state)

        presses = interrupted(epoch, delay)
        return outcome(state, position(helper.data_state(), len(w.batches)), presses)


MODES = {
    "plain jit loop (donating)": plain_trial,
    "sinkax, sink_size 1": lambda w, d: sink_trial(w, d, 1),
    "sinkax, sink_size 10": lambda w, d: sink_trial(w, d, 10),
    "sinkax, sink_size 100": lambda w, d: sink_trial(w, d, 100),
    "non-sink mode": non_sink_trial,
}


COLUMNS = ["mode", "trials", "lost", "agree", "again"]


def plot(rows, plt):
    xlabel = "trials in which Ctrl-C lost the training state (%)"
    name = "Ctrl-C at a random moment (MLP, batch 32)"
    values = [r["lost %"] for r in rows]
    return bar_chart(plt, [r["mode"] for r in rows], values, xlabel, name, color="tab:red")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # Python's own Ctrl-C handling, also where this runs as a background job (which the shell
    # starts with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    w = workload("mlp", 250)
    rng = random.Random(args.seed)
    rows = []
    for mode, trial in MODES.items():
        trial(w, None)  # compile, uninterrupted and outside the count
        outcomes = [trial(w, rng.uniform(0.05, 0.3)) for _ in range(args.trials)]
        row = {"mode": mode, "trials": args.trials}
        row.update({key: sum(o[key] for o in outcomes) for key in ("lost", "agree", "again")})
        row["lost %"] = 100 * row["lost"] / args.trials
        rows.append(row)
        print(table(rows[-1:], COLUMNS), flush=True)
    print()
    print(table(rows, COLUMNS))
    save(
        "ctrl_c",
        {"trials": args.trials, "seed": args.seed, "rows": rows},
        lambda plt: plot(rows, plt),
    )


if __name__ == "__main__":
    sys.exit(main())
