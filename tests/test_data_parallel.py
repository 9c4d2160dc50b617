"""Data-parallel sinks: 4 forced host devices in one process, and 2 processes x 2 devices.

Each case runs tests/data_parallel_job.py in fresh processes (forced host devices must be set
before jax starts), through ``sinkax.launch`` for the multi-process ones; the ``job`` fixture
kills whatever is left of them, also when a test fails, and bounds each case in time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_api
import pytest
from data_parallel_job import BATCH, EPOCH

from sinkax import launch

JOB = Path(__file__).with_name("data_parallel_job.py")
LIMIT_S = 120


def forced_devices(devices: int) -> dict[str, str]:
    """The environment of a process whose CPU backend has ``devices`` devices."""
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def run_script(script: str, devices: int) -> list[str]:
    """The lines ``script`` prints, run by a new Python over ``devices`` forced CPU devices;
    it must exit cleanly."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=forced_devices(devices),
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split("\n")


@pytest.fixture
def job(tmp_path):
    """``job(processes, devices, *args) -> [result of each process]``; kills leftovers."""
    started: list[subprocess.Popen] = []

    def run(processes: int, devices: int, *args: str) -> list[dict]:
        out = tmp_path / f"run{len(started)}"
        out.mkdir()
        script = [sys.executable, str(JOB), "--out", str(out), *args]
        if processes == 1:
            env, command = forced_devices(devices), script
        else:
            env = dict(os.environ)
            launch = [sys.executable, "-m", "sinkax.launch", "-n", str(processes)]
            command = [*launch, "--devices", str(devices), "--grace", "20", "--", *script]
        log = open(tmp_path / f"run{len(started)}.log", "w")  # noqa: SIM115 (closed by the OS)
        child = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        started.append(child)
        code = child.wait(timeout=LIMIT_S)
        text = (tmp_path / f"run{len(started) - 1}.log").read_text()
        assert code == 0, text[-4000:]
        return [json.loads((out / f"{i}.json").read_text()) for i in range(processes)]

    yield run
    for child in started:
        if child.poll() is None:  # a Ctrl-C makes the launcher kill its processes (each in its
            child.send_signal(signal.SIGINT)  # own session), then itself
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()


def expected_ids(steps: int) -> list[int]:
    """Row ids of ``steps`` global batches from the start: every row once per epoch, in order."""
    return [(step % EPOCH) * BATCH + row for step in range(steps) for row in range(BATCH)]


def check_training(results: list[dict], steps: int, devices: int, processes: int) -> None:
    for result in results:
        assert "error" not in result, result
        assert (result["devices"], result["processes"]) == (devices, processes)
        assert result["ids"] == expected_ids(steps)  # exactly once over the global batches
        assert result["max_error"] < 1e-5  # the same as single-device training
        assert result["data_state"] == {"epoch": steps // EPOCH, "step": steps % EPOCH}


@pytest.mark.parametrize("strategy", ["scan", "loop", "auto"])
def test_four_devices_train_like_one(job, strategy):
    results = job(1, 4, "--calls", "3", "--sink-size", "5", "--strategy", strategy)
    check_training(results, steps=15, devices=4, processes=1)
    assert results[0]["sharding"] == "P()"  # the state stays replicated


def test_four_devices_one_step_calls_and_resume(job):
    results = job(1, 4, "--calls", "4", "--sink-size", "1", "--resume-calls", "9")
    check_training(results, steps=13, devices=4, processes=1)
    assert results[0]["strategy"] == "scan"  # not "step": its host batches are unplaced


def test_two_processes_train_like_one_and_resume_exactly(job):
    results = job(2, 2, "--calls", "3", "--sink-size", "5", "--resume-calls", "2")
    check_training(results, steps=25, devices=4, processes=2)
    assert {r["strategy"] for r in results} == {"scan"}  # agreed: auto is scan across processes


@pytest.mark.parametrize("fail_process, fail_at", [(0, 0), (1, 4)])
def test_a_dataset_error_on_one_process_stops_both(job, fail_process, fail_at):
    args = ["--calls", "3", "--sink-size", "5", "--timeout", "20"]
    results = job(2, 2, *args, "--fail-process", str(fail_process), "--fail-at", str(fail_at))
    failed, other = results[fail_process], results[1 - fail_process]
    assert failed["error"] == "ValueError"
    assert failed["message"] == f"bad record in batch {fail_at} of process {fail_process}"
    assert other["error"] == "PeerError"
    assert f"Process {fail_process} failed" in other["message"]
    assert failed["message"] in other["message"]


def test_two_processes_model_checkpoints_and_resumes_exactly(job, tmp_path):
    checkpoint = ["--checkpoint", str(tmp_path / "checkpoints"), "--sink-size", "4"]
    first = job(2, 2, *checkpoint, "--epochs", "1")  # stops mid-pass: 4 of 6 batches
    for result in first:
        assert "error" not in result, result
        positions = result["saved_positions"]["processes"]  # every process's own position
        assert [(p["epoch"], p["step"]) for p in positions] == [(0, 4), (0, 4)]
    resumed = job(2, 2, *checkpoint, "--epochs", "3")
    for result in resumed:
        assert "error" not in result, result
        assert result["steps"] == 12
        assert result["max_error"] < 1e-5  # = 12 plain single-device steps: no batch lost
        assert [(p["epoch"], p["step"]) for p in result["saved_positions"]["processes"]] == [
            (2, 0),
            (2, 0),
        ]


def test_a_process_that_never_makes_the_sink_fails_the_other_in_bounded_time(job):
    results = job(2, 2, "--timeout", "2", "--absent-process", "1")
    assert results[1]["message"] == "absent"
    assert results[0]["error"] == "PeerTimeoutError"
    assert "Process 1 did not create this sink within 4.0 s" in results[0]["message"]


def test_a_process_that_fails_before_its_first_call_fails_the_other_in_bounded_time(job):
    # the first call places the state over both processes: only once they agreed to dispatch
    results = job(2, 2, "--timeout", "2", "--fail-before-call", "1")
    assert results[1]["message"] == "failed between making its sink and calling it"
    assert results[0]["error"] == "PeerTimeoutError" and results[0]["failed_after_s"] < 20


def test_processes_whose_meshes_order_the_devices_otherwise_fail_with_a_value_error(job):
    results = job(2, 2, "--timeout", "10", "--reorder-mesh", "1")
    for result in results:
        assert result["error"] == "ValueError", result
        assert re.search(r'mesh: process \d has "devices \[[\d, ]+\] in order', result["message"])


def test_every_process_is_told_of_every_step_by_its_progress_hook(job):
    results = job(2, 2, "--calls", "3", "--sink-size", "5", "--strategy", "scan", "--progress")
    check_training(results, steps=15, devices=4, processes=2)
    assert [result["progress_steps"] for result in results] == [15, 15]


def test_a_sink_that_one_process_fails_to_make_fails_the_others_by_name(job):
    args = ["--timeout", "10", "--calls", "1", "--resume-calls", "1", "--sink-size", "2"]
    results = job(2, 2, *args, "--other-data-on-resume", "1")
    assert results[1]["error"] == "ReplayDiffersError"
    assert results[0]["error"] == "PeerError" and "ReplayDiffersError" in results[0]["message"]
    assert results[0]["failed_after_s"] < 10  # told, not timed out


def test_a_callback_failing_on_one_process_fails_the_others_checkpoint_in_bounded_time(
    job, tmp_path
):
    args = ["--timeout", "2", "--checkpoint", str(tmp_path / "ck"), "--sink-size", "3"]
    results = job(2, 2, *args, "--fail-callback", "1")
    assert results[1]["message"] == "a callback failed"
    assert results[0]["error"] == "PeerTimeoutError"
    assert "Process 1 did not share its data position within 4.0 s" in results[0]["message"]


def test_processes_at_different_speeds_run_the_same_chunks(job):
    # one process waits 20 ms for each batch, the other none: a waiting consumer must not cut
    # its chunks elsewhere than the other's (their offsets meet in the same collectives)
    args = ["--calls", "100", "--sink-size", "1", "--strategy", "scan", "--known-calls"]
    results = job(2, 2, *args, "--delays", "0.02", "0")
    check_training(results, steps=100, devices=4, processes=2)
    assert results[0]["chunks"] == results[1]["chunks"]  # the same chunks, whatever the speed
    # (with calls= known, neither producer reads ahead past them: the count is the layout's)


def test_processes_with_different_chunk_sizes_fail_with_a_value_error(job):
    results = job(2, 2, "--calls", "2", "--chunk-bytes", "1000000", "64")
    for result in results:
        assert result["error"] == "ValueError", result
        assert "max_chunk_bytes" in result["message"]
        assert "1000000" in result["message"] and "64" in result["message"]


def test_the_time_a_process_waits_for_the_other_is_counted(job):
    # process 1 stops for 1.5 s before its 2nd call (both have finished the 1st: the job
    # gathers each call's ids): process 0 waits for it before that call's dispatch
    stopped = ["--stop-process", "1", "--stop-at", "1", "--stop-for", "1.5"]
    results = job(2, 2, "--calls", "3", "--sink-size", "2", *stopped)
    check_training(results, steps=6, devices=4, processes=2)
    assert results[0]["peer_wait_s"] > 1.0
    assert results[1]["peer_wait_s"] < 1.0  # it came last


def test_a_process_stopped_past_the_timeout_fails_both_in_bounded_time(job):
    # process 1 stops (SIGSTOP) before its 4th call for 6.5 s; the timeout is 3 s. Process 0
    # raises within 2 x timeout of that call's start (by design 4 to 5 s, the service checking
    # barrier deadlines once a second: 1 s of the bound is left for a loaded machine), then
    # waits to leave the job for 4 to 5 s more; process 1 wakes in between, fails at once,
    # and both leave together
    stopped = ["--stop-process", "1", "--stop-at", "3", "--stop-for", "6.5"]
    t0 = time.monotonic()
    results = job(2, 2, "--calls", "6", "--sink-size", "2", "--timeout", "3", *stopped)
    healthy, woken = results
    assert healthy.get("error") == "PeerTimeoutError", results
    assert "Process 1 did not get its data ready within 6.0 s" in healthy["message"]
    assert healthy["failed_after_s"] < 2 * 3
    assert woken.get("error") == "PeerTimeoutError", results  # it does not run on alone
    assert "gave up waiting for this process" in woken["message"]
    assert woken["failed_after_s"] < 3
    assert time.monotonic() - t0 < 6.5 + 40  # both end: no hang in a collective or at shutdown


def test_a_killed_process_leaves_the_other_to_fail_and_exit_in_bounded_time(tmp_path):
    # process 1 is killed (SIGKILL) before its 4th call; the timeout is 2 s. Process 0 raises
    # within 2 x timeout of that call's start, then leaves the job within 2 x timeout more,
    # with its own exit status: jax's shutdown would wait for the dead one until jax's
    # heartbeat timeout (100 s) and then abort it
    killed = ["--stop-process", "1", "--stop-at", "3", "--kill", "--timeout", "2"]
    environments = launch.environments(2, 2, launch.free_port())
    codes, exited, out = start(tmp_path, environments, "--calls", "6", "--sink-size", "2", *killed)
    assert codes == [0, -signal.SIGKILL]
    survivor = json.loads((out / "0.json").read_text())
    assert survivor.get("error") == "PeerTimeoutError", survivor
    assert "Process 1 did not get its data ready" in survivor["message"]
    assert survivor["failed_after_s"] < 2 * 2
    # the clocks are the same (CLOCK_MONOTONIC); + 1 s for the interpreter's exit (0.4 s)
    assert exited[0] - survivor["call_started"] < 4 * 2 + 1


def soak(job, calls: int, seed: int) -> None:
    # sinks of random sizes, each resumed from the last one's position; each process's batches
    # come after random delays of its own (up to 10 ms, and none for the other's)
    results = job(2, 2, "--soak", str(calls), "--seed", str(seed), "--delays", "0.01", "0.01")
    assert "error" not in results[0] and "error" not in results[1], results
    check_training(results, steps=results[0]["steps"], devices=4, processes=2)
    assert results[0]["steps"] == results[1]["steps"]


def test_processes_at_random_speeds_over_resized_resumed_sinks(job):
    soak(job, calls=40, seed=1)


@pytest.mark.slow
def test_processes_at_random_speeds_soak(job):
    soak(job, calls=500, seed=2)


CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "KUBERNETES_", "JAX_COORDINATOR_")
CLUSTER_NAMES = {"JOB_COMPLETION_INDEX", "SINKAX_PROCESS_ID", "SINKAX_NUM_PROCESSES"}
CLUSTER_NAMES |= {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
PROXIES = {"http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "no_proxy", "no_grpc_proxy"}


def unclustered(environ) -> dict[str, str]:
    """``environ`` without the variables of any cluster launcher jax or sinkax detects (one the
    test runs in must not stand in for the one a test starts) and without proxies (the job's
    processes, and the Kubernetes API, are on this machine)."""
    return {
        name: value
        for name, value in environ.items()
        if not name.startswith(CLUSTER_PREFIXES)
        and name not in CLUSTER_NAMES
        and name.lower() not in PROXIES
    }


def start(
    tmp_path, environments: list[dict[str, str]], *args: str, wrap=list
) -> tuple[list, list, Path]:
    """Run the job as one process per environment (as a cluster's launcher starts them), its
    command line passed through ``wrap``; each one's exit code and the time
    (``time.monotonic()``) it was seen to end by, and the folder of their results."""
    out = tmp_path / "cluster"
    out.mkdir()
    script = wrap([sys.executable, str(JOB), "--out", str(out), "--initialize", *args])
    children, exited = [], []
    for i, extra in enumerate(environments):
        log = open(tmp_path / f"process{i}.log", "w")  # noqa: SIM115 (closed by the OS)
        env = {**unclustered(os.environ), **extra}
        children.append(subprocess.Popen(script, env=env, stdout=log, stderr=log))
    try:
        for child in children:
            child.wait(timeout=LIMIT_S)
            exited.append(time.monotonic())
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return [child.returncode for child in children], exited, out


def cluster(tmp_path, environments: list[dict[str, str]], *args: str, wrap=list) -> list[dict]:
    """Every process's result of the job run as one process per environment, each with 2
    forced devices; all must succeed."""
    devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    environments = [{**env, **devices} for env in environments]
    codes, _, out = start(tmp_path, environments, *args, wrap=wrap)
    logs = [(tmp_path / f"process{i}.log").read_text()[-3000:] for i in range(len(codes))]
    assert codes == [0] * len(codes), logs
    return [json.loads((out / f"{i}.json").read_text()) for i in range(len(codes))]


def free_slurm_job_id() -> str:
    """A job id whose coordinator port (jax: 61440 + id % 4096) is free on localhost."""
    for job_id in range(1000 + os.getpid() % 3000, 1000 + 4096):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + job_id % 4096))
            except OSError:
                continue
        return str(job_id)
    pytest.skip("no free port in jax's SLURM coordinator range")


def test_two_processes_start_as_srun_starts_them(tmp_path):
    # the variables srun sets for 2 tasks on one node; jax.distributed.initialize() detects them
    job_id = free_slurm_job_id()
    slurm = {"SLURM_JOB_ID": job_id, "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2"}
    slurm["SLURM_STEP_NUM_NODES"] = "1"
    environments = [{**slurm, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)} for i in range(2)]
    results = cluster(tmp_path, environments, "--calls", "2", "--sink-size", "3")
    check_training(results, steps=6, devices=4, processes=2)


def test_two_processes_start_as_open_mpi_mpirun_starts_them(tmp_path):
    # the variables Open MPI's mpirun (4.x: ORTE) sets for 2 ranks; jax reads the coordinator's
    # host from the launcher's URI, and its port from JAX_COORDINATOR_PORT (else the job id)
    mpirun = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://127.0.0.1:34911"}
    mpirun |= {"OMPI_COMM_WORLD_SIZE": "2", "JAX_COORDINATOR_PORT": str(launch.free_port())}
    environments = [
        {**mpirun, "OMPI_COMM_WORLD_RANK": str(i), "OMPI_COMM_WORLD_LOCAL_RANK": str(i)}
        for i in range(2)
    ]
    results = cluster(tmp_path, environments, "--calls", "2", "--sink-size", "3")
    check_training(results, steps=6, devices=4, processes=2)


def test_two_processes_start_as_torchrun_starts_them(tmp_path):
    # torchrun's (and a PyTorchJob's) variables; here no torch store holds MASTER_PORT
    torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(launch.free_port())}
    torchrun["WORLD_SIZE"] = "2"
    environments = [{**torchrun, "RANK": str(i), "LOCAL_RANK": str(i)} for i in range(2)]
    results = cluster(tmp_path, environments, "--calls", "2", "--sink-size", "3")
    check_training(results, steps=6, devices=4, processes=2)


@pytest.mark.parametrize("jobset", [None, "run"])
def test_two_processes_start_as_a_kubernetes_indexed_job_starts_them(tmp_path, jobset):
    # two pods of an indexed Job (or of a JobSet's Job) at 127.0.0.1: jax finds the process count
    # and the coordinator through the API, the process id in JOB_COMPLETION_INDEX
    if (reason := kubernetes_api.unavailable()) is not None:
        pytest.skip(reason)
    job = "run-workers-0" if jobset else "train"
    coordinator = f"{job}-0.{jobset or 'jaxpods'}"
    with kubernetes_api.api_server(tmp_path, job, parallelism=2, jobset=jobset) as (port, asked):
        pod = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)}
        pod |= {"HOSTNAME": socket.gethostname(), "JAX_COORDINATOR_PORT": str(launch.free_port())}
        environments = [{**pod, "JOB_COMPLETION_INDEX": str(i)} for i in range(2)]

        def wrap(command):
            return kubernetes_api.pod_command(tmp_path, coordinator, command)

        results = cluster(tmp_path, environments, "--calls", "2", "--sink-size", "3", wrap=wrap)
    check_training(results, steps=6, devices=4, processes=2)
    namespace = f"/namespaces/{kubernetes_api.NAMESPACE}/"
    assert f"/apis/batch/v1{namespace}jobs/{job}" in asked
    assert f"/api/v1{namespace}pods?fieldSelector=status.podIP%3D127.0.0.1" in asked


@pytest.mark.parametrize("devices", [4, 1])
def test_a_two_process_checkpoint_resumes_on_one_process(job, tmp_path, devices):
    # written by 2 processes x 2 devices mid-pass (4 of 6 global batches), resumed by one
    # process over `devices` devices: it continues with global batch 4, none skipped or repeated
    checkpoint = ["--checkpoint", str(tmp_path / "checkpoints"), "--sink-size", "4"]
    job(2, 2, *checkpoint, "--epochs", "1")
    (resumed,) = job(1, devices, *checkpoint, "--epochs", "3")
    assert "error" not in resumed, resumed
    assert (resumed["devices"], resumed["processes"]) == (devices, 1)
    assert resumed["steps"] == 12
    assert resumed["max_error"] < 1e-5  # = 12 plain single-device steps on the global batches
    assert (resumed["saved_positions"]["epoch"], resumed["saved_positions"]["step"]) == (2, 0)


SPLITS = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
import sinkax
from jax.sharding import NamedSharding, PartitionSpec as P
if "SINKAX_PROCESS_ID" in os.environ:
    sinkax.distributed.initialize()
mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
sharding = NamedSharding(mesh, P("data"))
result = {}
for rows in (3, 4, None):  # None: a scalar leaf
    x = np.ones((rows, 2) if rows else (), np.float32)
    state = jnp.float32(0)
    step = lambda s, b: (s + jnp.sum(b["x"]), jnp.sum(b["x"]))
    with sinkax.data_sink(step, [{"x": x}] * 4, 2, sharding=sharding) as sink:
        try:
            state, _ = sink(state)
            result[str(rows)] = float(state)
        except sinkax.BatchSpecError as error:
            result[str(rows)] = [str(error), not state.is_deleted()]
with open(os.path.join(sys.argv[1], f"{jax.process_index()}.json"), "w") as f:
    json.dump(result, f)
"""


@pytest.mark.parametrize("processes, devices", [(1, 2), (2, 1)])
def test_batches_the_sharding_cannot_split_fail_by_name_and_keep_the_state(
    tmp_path, processes, devices
):
    # each process puts its own rows on its own devices: 3 rows split over 2 devices of one
    # process fail (a scalar leaf always does), over 1 device in each of 2 processes they fit
    command = [sys.executable, "-c", SPLITS, str(tmp_path)]
    if processes > 1:
        command = [sys.executable, "-m", "sinkax.launch", "-n", "2", "--devices", "1", "--"]
        command += [sys.executable, "-c", SPLITS, str(tmp_path)]
    done = subprocess.run(
        command, env=forced_devices(devices), capture_output=True, text=True, timeout=LIMIT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for i in range(processes):
        result = json.loads((tmp_path / f"{i}.json").read_text())
        assert result["4"] == 2 * 4 * 2 * processes  # 2 steps of the global batch's ones
        message, alive = result["None"]
        assert "Batch leaf ['x'] has shape ()" in message and "not a scalar" in message, message
        assert alive
        if devices == 2:
            message, alive = result["3"]
            assert "shape (3, 2)" in message and "3 does not divide by 2" in message, message
            assert "multiple of 2" in message and alive
        else:
            assert result["3"] == 2 * 3 * 2 * processes


GUARDED_OVER_DEVICES = """
import jax, jax.numpy as jnp, numpy as np, sinkax
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
data = [{"x": np.full((8, 3), i, np.float32)} for i in range(12)]
def step(s, b):
    m = jnp.mean(b["x"])  # an all-reduce over the 4 devices
    return s + m, {"loss": jnp.where(m == 7, jnp.nan, s + m)}
for every in (None, 2):  # one guarded window a call, or blocks of 2 steps and a join
    options = {"progress": lambda steps, out: None, "progress_every": every} if every else {}
    sharding = NamedSharding(mesh, P("data"))
    with sinkax.data_sink(
        step, data, 6, sharding=sharding, strategy="scan", stop_if_nonfinite="loss", **options
    ) as sink:
        state, _ = sink(jnp.float32(0))
        state, second = sink(state)
        print(every, float(state), len(second["loss"]), sink.step, sink.nonfinite.step_in_call)
"""


def test_a_guarded_sink_over_devices_stops_at_the_first_nonfinite_step_also_in_blocks():
    lines = run_script(GUARDED_OVER_DEVICES, devices=4)
    # batch 7 (mean 7) is the second call's 2nd step: only batch 6 of that call is kept
    assert lines[:2] == ["None 21.0 1 7 1", "2 21.0 1 7 1"]


CALLS_IN_FLIGHT = """
import jax, jax.numpy as jnp, numpy as np, sinkax
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
sharding = NamedSharding(mesh, P("data"))
data = [{"x": np.full((8, 3), i, np.float32)} for i in range(50)]
step = lambda s, b: (s + jnp.mean(b["x"]), s)  # an all-reduce over the 4 devices each step
for size, timed in ((5, {}), ("auto", {"call_seconds": 0.01})):
    with sinkax.data_sink(step, data, size, sharding=sharding, **timed) as sink:
        state = jnp.float32(0)
        for _ in range(200):  # none waited for
            state, outs = sink(state)
        print(size, sink.stats.steps, float(state))
"""


def test_many_calls_in_flight_over_forced_cpu_devices_run_to_the_end():
    # XLA:CPU's forced devices deadlocked in an all-reduce (the process aborted after 40 s)
    # with many windows in flight; each window now waits for the last one's compute there
    lines = run_script(CALLS_IN_FLIGHT, devices=4)
    assert lines[0] == "5 1000 24500.0"  # sum over 1000 steps of the batches' means (0..49)
    assert lines[1].startswith("auto ")
