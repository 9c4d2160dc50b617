"""A state sharded over the mesh (FSDP-style, or over a 2-D ``("data", "model")`` mesh) trains
in a sink and comes back sharded as it went in, at its sharded size per device.

Each case runs tests/sharded_state_job.py in a fresh process (forced host devices must be set
before jax starts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("sharded_state_job.py")


@pytest.mark.parametrize(
    "devices, mesh, strategy",
    [(4, "data", "scan"), (4, "data", "loop"), (8, "data,model", "scan")],
)
def test_a_sharded_state_stays_sharded_through_a_sink(devices, mesh, strategy):
    command = [sys.executable, str(JOB), "--devices", str(devices), "--mesh", mesh]
    done = subprocess.run(
        [*command, "--strategy", strategy],
        capture_output=True,
        text=True,
        timeout=240,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["kept"]  # every leaf as it went in: no gather to replicated
    assert result["per_device"] < 1.1 * result["replicated"] / devices  # about 1/N per device
    assert result["live"] <= 1.05 * result["per_device"]  # and no replicated copy kept alive
    assert result["max_error"] < 1e-5  # trains as plain jitted steps on one device do
