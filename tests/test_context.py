"""``set_context`` as ``Model.train`` sees it: modes, device targets, graph dumps, profiling."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import needs_plugin
from test_model import History, assert_trees_close, blobs, new_model

import sinkax
from sinkax.backend import available

pytestmark = pytest.mark.usefixtures("restore_context")


def train(**train_options):
    model, history = new_model(sink_options={}), History()
    run = model.train(2, blobs(6), callbacks=history, **train_options)
    return model.state, history.losses, run


@pytest.mark.parametrize("train_options", [{"sink_size": 4}, {"dataset_sink_mode": False}])
def test_graph_and_pynative_modes_train_alike(train_options):
    sinkax.set_context(mode=sinkax.GRAPH_MODE)
    graph_state, graph_losses, graph_run = train(**train_options)
    sinkax.set_context(mode=sinkax.PYNATIVE_MODE)
    eager_state, eager_losses, eager_run = train(**train_options)
    assert_trees_close(eager_state, graph_state, rtol=1e-5, atol=1e-6)
    assert_trees_close(eager_losses, graph_losses, rtol=1e-5, atol=1e-6)
    if train_options.get("dataset_sink_mode", True):
        assert graph_run.sink_stats.strategy != "eager" and graph_run.sink_stats.compiles >= 1
        assert eager_run.sink_stats.strategy == "eager" and eager_run.sink_stats.compiles == 0


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"mode": True}, "mode must be"),
        ({"mode": 3}, "mode must be"),
        ({"device_id": "0"}, "device_id must be an int"),
        ({"device_id": 0.0}, "device_id must be an int"),
        ({"profiling_options": None}, "profiling_options must be a dict"),
        ({"profiling_options": "{bad"}, "profiling_options is not valid JSON"),
        ({"enable_profiling": "no"}, "enable_profiling must be True or False"),
        ({"save_graphs": 123}, "save_graphs must be a folder"),
        ({"save_graphs": "/proc/graphs"}, "save_graphs cannot write to /proc/graphs"),
        ({"profiling_options": {"result_path": 5}}, r"result_path\"\] must be a folder"),
    ],
)
def test_bad_settings_are_value_errors_that_change_nothing(setting, match):
    before = sinkax.get_context()
    with pytest.raises(ValueError, match=match):
        sinkax.set_context(**setting)
    assert sinkax.get_context() == before
    with pytest.raises(ValueError, match="Unknown context setting 'save_graph'; known"):
        sinkax.get_context("save_graph")


def test_an_unavailable_device_target_lists_the_available_ones():
    if "GPU" in available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match=r"device_target='GPU' is not available.*CPU: \d+ device"):
        sinkax.set_context(device_target="GPU")
    assert sinkax.get_context("device_target") != "GPU"


@needs_plugin
def test_a_misspelt_target_is_refused_before_jax_starts_so_the_right_one_still_loads():
    code = (
        "import sinkax\n"
        "try:\n"
        "    sinkax.set_context(device_target='emulated')\n"
        "except ValueError as error:\n"
        "    print(str(error).split(',')[0])\n"
        "sinkax.set_context(device_target='Emulated')  # the plugin loads: jax had not started\n"
        "print(repr(sinkax.backend.default_device()))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [
        "device_target must be one of ['CPU'", "EmuDevice(id=0)"
    ]  # fmt: skip


@needs_plugin
def test_a_target_sinkaxs_plugin_cannot_give_in_this_process_says_why():
    emulated = "import sinkax\nsinkax.set_context(device_target='Emulated')\n"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the plugin loads; jax does not start it
    run = subprocess.run([sys.executable, "-c", emulated], env=env, capture_output=True, text=True)
    assert "JAX_PLATFORMS='cpu' leaves it out: set JAX_PLATFORMS=cpu,emu" in run.stderr
    ascend = emulated + "sinkax.set_context(device_target='Ascend')\n"  # loaded as emu already
    env = {**os.environ, "SINKAX_ASCEND_PJRT": "/some/plugin.so"}
    run = subprocess.run([sys.executable, "-c", ascend], env=env, capture_output=True, text=True)
    assert "loaded in this process as 'emu' already" in run.stderr, run.stderr[-2000:]


def test_the_context_returned_is_a_copy_and_so_is_the_one_kept():
    options = {"result_path": "here"}
    sinkax.set_context(profiling_options=options)
    try:
        options["result_path"] = "elsewhere"  # the caller's dict, changed later
        sinkax.get_context().profiling_options["result_path"] = "there"
        sinkax.get_context("profiling_options")["result_path"] = "there"
        assert sinkax.get_context("profiling_options") == {"result_path": "here"}
    finally:
        sinkax.set_context(profiling_options={})


def test_save_graphs_dumps_the_sink_executables_with_their_loop(tmp_path):
    sinkax.set_context(save_graphs=str(tmp_path))
    train(sink_size=3)
    stablehlo = sorted(tmp_path.glob("*.stablehlo.mlir"))
    hlo = sorted(tmp_path.glob("*.hlo.txt"))
    assert stablehlo and len(stablehlo) == len(hlo)
    assert any("stablehlo.while" in path.read_text() for path in stablehlo)
    assert any("while" in path.read_text() for path in hlo)


def test_profiling_writes_a_trace(tmp_path):
    options = {"result_path": str(tmp_path / "profile"), "training_trace": "on"}
    sinkax.set_context(enable_profiling=True, profiling_options=json.dumps(options))
    try:  # jaxlib's own profiler writes the trace; TensorBoard/xprof are only for viewing it
        train(sink_size=3)
    except ImportError as error:
        pytest.skip(f"jax.profiler cannot trace here: {error}")
    traces = list((tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb"))
    assert traces, list((tmp_path / "profile").rglob("*"))


def test_one_default_device_even_when_jax_s_is_set_outside_set_context():
    # Model, data_sink and the context used to ask two default_device()s that could disagree
    if sinkax.context.get_context("device_target") is not None:
        pytest.skip("set_context chose the device")
    other = jax.devices(sinkax.pjrt.EMULATED_PLATFORM)[0]
    with jax.default_device(other):
        assert sinkax.backend.default_device() == other
        model = new_model(sink_options={})
        assert {d for x in jax.tree.leaves(model.state) for d in x.devices()} == {other}
        with sinkax.data_sink(lambda b: b, [np.float32(1)] * 2, 1) as sink:
            assert sink.config.sharding.device_set == {other}
