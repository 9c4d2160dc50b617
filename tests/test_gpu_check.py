"""`make gpu-check` without a GPU: its dry run (CPU, tiny sizes) runs every part and writes every
file, so the command stays ready for the next GPU machine."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 420  # the check's parts stop within its --budget


@pytest.mark.timeout(BUDGET_S + 120)  # about a minute on 2 quiet cores; several beside other work
def test_the_gpu_check_dry_run_passes_every_part_and_writes_its_files(tmp_path):
    check = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"]
    result = subprocess.run(
        [*check, "--budget", str(BUDGET_S), "--out", tmp_path],
        capture_output=True,
        text=True,
        timeout=BUDGET_S + 60,
    )
    assert result.returncode == 0, result.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.splitlines()[0] in result.stdout.splitlines()  # the summary is printed last
    assert "DRY RUN" in summary.splitlines()[0]
    parts = {line.split()[0]: line.split()[1] for line in summary.splitlines()[1:]}
    workloads = {"mlp", "lenet", "transformer", "mlp-while"}  # (an XLA_FLAGS variant)
    benchmarks = {f"bench-{w}" for w in workloads}
    expected = {"imports", "env", "tests", "plugin", "live-mlp", "auto-mlp", "profile-mlp"}
    expected |= {"quiet-mlp"}
    expected |= benchmarks
    assert set(parts) - {"wheels"} == expected
    assert set(parts.values()) == {"PASS"}, summary
    results = json.loads((tmp_path / "gpu_sink_sizes.json").read_text())
    assert results["dry_run"] and set(results["workloads"]) == workloads
    assert "+WHILE" in results["workloads"]["mlp-while"]["xla_flags"]
    modes = [row["mode"] for row in results["workloads"]["transformer"]["rows"]]
    assert modes[:3] == ["plain", "jit, put 2 ahead", "scan 100, put next first"]
    assert "sinkax 1" in modes and "device scan" in modes
    mlp = results["workloads"]["mlp"]
    varied = {row["mode"] for row in mlp["rows"]}  # compiler_options={}; feeders not paused
    assert {"XLA defaults 2", "not quiet 2"} <= varied
    assert mlp["sinkax_compiler_options"] == {}  # the CPU's: XLA's defaults
    assert (tmp_path / "gpu_sink_sizes.png").stat().st_size > 0
    summary = (tmp_path / "tests.log").read_text().strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ skipped in [\d.]+s", summary)  # tests/test_gpu.py: no GPU here
    profile = (tmp_path / "profile.log").read_text()
    rates = (
        r"sink 10: \d+ steps/s; idle step \d+ \(staged in pinned memory \d+\); device windows \d+"
    )
    assert re.search(rates, profile)
    assert re.search(r"producer parked \d+; switch every 0.1 ms \d+;", profile)
    assert re.search(r"window call returns after \d+ us just after its chunk's device_put", profile)
    assert "thread sinkax-producer" in profile and "thread MainThread" in profile
    live = (tmp_path / "bench.log").read_text().split("=== live-mlp")[1]
    assert re.search(r"stop_if_nonfinite +\d+", live) and "JAX's host callback alone" in live
    auto = (tmp_path / "bench.log").read_text().split("=== auto-mlp")[1]
    assert re.search(r"mlp +0.05 +cold .* +\d+/2 ", auto) and "first 3 calls, cold" in auto
    assert len(list(tmp_path.iterdir())) <= 8  # what comes back from a device machine
