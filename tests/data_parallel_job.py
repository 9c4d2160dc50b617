"""One process of a data-parallel sink job, for tests/test_data_parallel.py (run as a script).

Trains a linear model by SGD over ``EPOCH`` global batches of ``BATCH`` rows, each process feeding
its contiguous block of every global batch, with ``sinkax.data_sink(..., sharding=...)``; writes
a JSON file per process into ``--out``: the row ids every step saw (over all processes), the
final state's largest difference from plain single-device training on the same global batches,
the data position.

    python tests/data_parallel_job.py --out /tmp/r --calls 3 --sink-size 5    # one process
    python -m sinkax.launch -n 2 --devices 2 -- python tests/data_parallel_job.py --out /tmp/r
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

EPOCH, BATCH, FEATURES = 6, 8, 3


def global_batch(k: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(k)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
    return {"x": x, "y": y, "ids": np.arange(k * BATCH, (k + 1) * BATCH, dtype=np.int32)}


class LocalBatches:
    """This process's block of every global batch; raises at batch ``fail_at`` if given, and
    sleeps ``delay`` seconds before each batch."""

    def __init__(
        self, process: int, processes: int, fail_at: int | None = None, delay: float = 0.0
    ):
        self.process, self.processes, self.fail_at, self.delay = process, processes, fail_at, delay
        self.delays = lambda: self.delay  # the delay before each batch

    def __len__(self) -> int:
        return EPOCH

    def __iter__(self):
        rows = BATCH // self.processes
        for k in range(EPOCH):
            time.sleep(self.delays())
            if k == self.fail_at:
                raise ValueError(f"bad record in batch {k} of process {self.process}")
            block = slice(self.process * rows, (self.process + 1) * rows)
            yield {key: value[block] for key, value in global_batch(k).items()}


def step(state, batch):
    import jax
    import jax.numpy as jnp

    def loss_fn(params):
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state)
    state = jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)
    return state, {"loss": loss, "ids": batch["ids"]}


def initial_state() -> dict:
    import numpy as np

    return {"w": np.zeros(FEATURES, np.float32), "b": np.float32(0.0)}


def reference(steps: int) -> dict:
    """Plain jitted single-device training over the first ``steps`` global batches."""
    import jax

    run = jax.jit(step)
    state = initial_state()
    for s in range(steps):
        state, _ = run(state, global_batch(s % EPOCH))
    return jax.device_get(state)


def train_sink(args, data, sharding, result: dict) -> tuple[dict, int]:
    """``--calls`` calls of a sink, then ``--resume-calls`` of a new one from its data_state."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import sinkax

    options = dict(strategy=args.strategy, sharding=sharding, timeout=args.timeout)
    if args.progress:  # the steps this process's hook was told of
        result["progress_steps"] = 0

        def told(steps, out):
            result["progress_steps"] += steps

        options.update(progress=told, progress_every=2)
    if args.chunk_bytes is not None:
        options["max_chunk_bytes"] = args.chunk_bytes[jax.process_index()]
    ids, state, data_state = [], initial_state(), None
    for calls in (args.calls, args.resume_calls):
        if not calls:
            continue
        if data_state and args.other_data_on_resume == jax.process_index():
            data = [{**batch, "x": -batch["x"]} for batch in data]  # a replay that differs
        known = {"calls": calls} if args.known_calls else {}
        sink = sinkax.data_sink(
            step, data, args.sink_size, data_state=data_state, **options, **known
        )
        with sink:
            if args.fail_before_call == jax.process_index():
                raise RuntimeError("failed between making its sink and calling it")
            for call in range(calls):
                if (jax.process_index(), call) == (args.stop_process, args.stop_at):
                    os.kill(os.getpid(), signal.SIGKILL) if args.kill else stop(args.stop_for)
                result["call_started"] = time.monotonic()
                state, outs = sink(state)
                seen = multihost_utils.process_allgather(outs["ids"], tiled=True)
                ids.extend(np.asarray(seen).ravel().tolist())
                if args.stop_at is not None:  # every process is through this collective
                    # before one is stopped or killed there (a kill within it fails the
                    # others' part of this job's own collective at once, not a sink's)
                    client = sinkax.compat.coordination_client()
                    client.wait_at_barrier(f"job/{calls}/call{call}", 60_000)
            data_state = sink.data_state()
            result["strategy"] = sink.stats.strategy
            result["chunks"] = sink.stats.chunks_transferred
            result["peer_wait_s"] = sink.stats.peer_wait_s
    result["ids"] = ids
    result["data_state"] = {k: data_state[k] for k in ("epoch", "step")}
    return state, (args.calls + args.resume_calls) * args.sink_size


def soak(args, data, sharding, result: dict) -> tuple[dict, int]:
    """``--soak`` calls over a chain of sinks: each of a random sink size (the same on every
    process: one seed), making a few calls, then handing its data position to the next;
    every process's batches come after random delays of its own (``data.delay`` at most)."""
    import random

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import sinkax

    plan, waits = random.Random(args.seed), random.Random(args.seed + 1 + jax.process_index())
    data.delays = lambda: waits.choice([0.0, 0.0, 0.0, data.delay])
    ids, state, data_state, calls, steps = [], initial_state(), None, 0, 0
    while calls < args.soak:
        sink_size = plan.randint(1, 7)
        options = dict(sharding=sharding, timeout=args.timeout, data_state=data_state)
        with sinkax.data_sink(step, data, sink_size, strategy="scan", **options) as sink:
            for _ in range(min(plan.randint(1, 12), args.soak - calls)):
                state, outs = sink(state)
                seen = multihost_utils.process_allgather(outs["ids"], tiled=True)
                ids.extend(np.asarray(seen).ravel().tolist())
                calls, steps = calls + 1, steps + sink_size
            data_state = sink.data_state()
    result["ids"] = ids
    result["data_state"] = {k: data_state[k] for k in ("epoch", "step")}
    return state, steps


def stop(seconds: float) -> None:
    """Stop this process (SIGSTOP) for ``seconds``: a helper process continues it."""
    wake = f"sleep {seconds}; kill -CONT {os.getpid()}"
    subprocess.Popen(["sh", "-c", wake], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def train_model(args, data, sharding, result: dict) -> tuple[dict, int]:
    """``Model.train`` up to epoch ``--epochs`` of ``--sink-size`` steps, checkpointing each into
    ``--checkpoint`` and resuming from it when it holds one."""
    import jax
    import jax.numpy as jnp
    import optax

    import sinkax

    model = sinkax.Model(
        lambda params, x: x @ params["w"] + params["b"],
        initial_state(),
        lambda out, y: jnp.mean((out - y) ** 2),
        optax.sgd(0.1),
        input_key="x",
        label_key="y",
        sink_options={"sharding": sharding, "timeout": args.timeout},
    )
    checkpoint = sinkax.ModelCheckpoint(args.checkpoint)
    resume = checkpoint if checkpoint.latest_step() is not None else None
    callbacks = [checkpoint]
    if args.fail_callback == jax.process_index():  # fails at the epoch's end, before the save

        class Fails(sinkax.train.Callback):
            def on_epoch_end(self, run):
                raise RuntimeError("a callback failed")

        callbacks.insert(0, Fails())
    run = model.train(args.epochs, data, callbacks, sink_size=args.sink_size, resume_from=resume)
    result["saved_positions"] = checkpoint.restore(model.state)[1]["data_state"]
    return model.state.params, run.step


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="folder for each process's JSON result")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--initialize", action="store_true", help="a cluster's process")
    parser.add_argument("--known-calls", action="store_true", help="each sink gets calls=")
    parser.add_argument("--resume-calls", type=int, default=0, help="then a new sink, resumed")
    parser.add_argument("--sink-size", type=int, default=5)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--fail-process", type=int, default=None)
    parser.add_argument("--fail-at", type=int, default=None)
    parser.add_argument("--absent-process", type=int, default=None)
    parser.add_argument("--fail-before-call", type=int, default=None, help="this process fails")
    parser.add_argument("--reorder-mesh", type=int, default=None, help="this process's mesh")
    parser.add_argument("--progress", action="store_true", help="count the progress reports")
    parser.add_argument("--other-data-on-resume", type=int, default=None, help="this process's")
    parser.add_argument("--fail-callback", type=int, default=None, help="on this process")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--delays", type=float, nargs="+", default=None, help="s/batch, each")
    parser.add_argument("--chunk-bytes", type=int, nargs="+", default=None, help="each process's")
    parser.add_argument("--soak", type=int, default=0, help="calls over sinks of random sizes")
    parser.add_argument("--seed", type=int, default=0, help="of the soak's sink sizes")
    parser.add_argument("--stop-process", type=int, default=None, help="SIGSTOPped before ...")
    parser.add_argument("--stop-at", type=int, default=None, help="... this call ...")
    parser.add_argument("--stop-for", type=float, default=0.0, help="... for this many seconds")
    parser.add_argument("--kill", action="store_true", help="... or killed (SIGKILL) there")
    parser.add_argument("--checkpoint", default=None, help="Model.train with ModelCheckpoint")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    import sinkax

    distributed = args.initialize or "SINKAX_PROCESS_ID" in os.environ  # or by sinkax.launch
    if distributed:
        sinkax.distributed.initialize()
    fail_at = args.fail_at if args.fail_process == jax.process_index() else None
    delay = args.delays[jax.process_index()] if args.delays else 0.0
    data = LocalBatches(jax.process_index(), jax.process_count(), fail_at, delay)
    if args.fail_before_call is not None:  # the processes' collectives are set up already
        from jax.experimental import multihost_utils

        multihost_utils.process_allgather(np.zeros(1, np.float32))
    started = time.monotonic()
    result: dict = {"devices": jax.device_count(), "processes": jax.process_count()}
    try:
        if args.absent_process == jax.process_index():  # makes no sink at all
            raise RuntimeError("absent")
        train = train_model if args.checkpoint else soak if args.soak else train_sink
        sharding = sinkax.distributed.batch_sharding()
        if args.reorder_mesh == jax.process_index():  # its devices in another order
            mesh = sharding.mesh
            devices = np.roll(mesh.devices, 2)
            sharding = jax.sharding.NamedSharding(
                jax.sharding.Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types),
                sharding.spec,
            )
        state, steps = train(args, data, sharding, result)
    except Exception as error:  # reported, for the test to check on every process
        result["error"] = type(error).__name__
        result["failed_after_s"] = time.monotonic() - result.get("call_started", started)
        result["message"] = str(error)
    else:
        expected, got = reference(steps), jax.device_get(state)
        result["max_error"] = max(float(np.max(np.abs(got[k] - expected[k]))) for k in expected)
        result["steps"] = steps
        result["sharding"] = str(getattr(state["w"].sharding, "spec", "one device"))
    with open(os.path.join(args.out, f"{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)
    if distributed:  # waits for every process still there: the coordinator (process 0)
        sinkax.distributed.shutdown()  # must outlive the others' reads of its key-value store


if __name__ == "__main__":
    main(sys.argv[1:])
