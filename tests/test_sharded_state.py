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


def run_fresh(*args: str, devices: int | None = None) -> dict:
    """The JSON a fresh Python process prints last, run with ``args`` on ``devices`` forced host
    devices (``None``: the process forces its own)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "devices, mesh, strategy",
    [(4, "data", "scan"), (4, "data", "loop"), (8, "data,model", "scan")],
)
def test_a_sharded_state_stays_sharded_through_a_sink(devices, mesh, strategy):
    command = [str(JOB), "--devices", str(devices), "--mesh", mesh, "--strategy", strategy]
    result = run_fresh(*command)  # (the job sets its own device count)
    assert result["kept"]  # every leaf as it went in: no gather to replicated
    assert result["per_device"] < 1.1 * result["replicated"] / devices  # about 1/N per device
    assert result["live"] <= 1.05 * result["per_device"]  # and no replicated copy kept alive
    assert result["max_error"] < 1e-5  # trains as plain jitted steps on one device do


MODEL_JOB = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import sinkax
mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
rows = NamedSharding(mesh, P("data"))
data = [{"image": np.random.default_rng(i).normal(size=(8, 8)).astype(np.float32),
         "label": np.arange(8, dtype=np.int32) % 2} for i in range(4)]
def model():
    params = {"w": jax.device_put(jnp.zeros((8, 2)), rows), "b": jnp.zeros(2)}
    return sinkax.Model(lambda p, x: x @ p["w"] + p["b"], params, sinkax.train.cross_entropy,
                        optax.adam(0.1), sink_options={"sharding": rows})
def spec(x):
    return str(getattr(x.sharding, "spec", type(x.sharding).__name__))
first, seen = model(), {}
seen["made"] = spec(first.params["w"])
first.train(1, data, [sinkax.ModelCheckpoint(sys.argv[1])], sink_size=2)
seen["trained"] = spec(first.params["w"])
resumed = model()
resumed.train(2, data, resume_from=sys.argv[1], sink_size=2)
seen["resumed"] = spec(resumed.params["w"])
seen["resumed moments"] = spec(resumed.state.opt_state[0].mu["w"])
print(json.dumps(seen))
"""


def test_a_models_sharded_params_stay_sharded_through_training_and_resume(tmp_path):
    seen = run_fresh("-c", MODEL_JOB, str(tmp_path / "checkpoints"), devices=4)
    assert set(seen.values()) == {"P('data',)"}, seen


PLACING_JOB = """
import json
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import sinkax
from sinkax import placement
mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
host = np.zeros(4, np.float32)
seen = {
    "as replicated": placement.planned({"w": host}, rows)
    == placement.planned({"w": jax.device_put(host, whole)}, rows),
    "as sharded": placement.planned({"w": host}, rows)
    != placement.planned({"w": jax.device_put(host, rows)}, rows),
}
params = {"w": jax.device_put(jnp.zeros((4, 2)), jax.devices()[1]), "b": jnp.zeros(2)}
model = sinkax.Model(lambda p, x: x @ p["w"] + p["b"], params, sinkax.train.cross_entropy,
                     optax.adam(0.1))
seen["one device"] = len({d for x in jax.tree.leaves(model.state) for d in x.devices()}) == 1
jax.jit(lambda state: state)(model.state)  # a state split over devices fails here
print(json.dumps(seen))
"""


def test_processes_compare_where_their_states_go_and_a_model_keeps_one_on_one_device():
    seen = run_fresh("-c", PLACING_JOB, devices=4)
    assert all(seen.values()), seen
