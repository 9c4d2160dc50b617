"""sinkax's private jax names (sinkax.compat): each removed in turn, sinkax still runs or says
which jax name is missing and which jax versions work."""

import ast
import importlib
import pathlib

import jax
import numpy as np
import pytest

import sinkax
from sinkax import compat, distributed

PACKAGE = pathlib.Path(sinkax.__file__).parent


def remove(monkeypatch, key):
    """Make sinkax look for ``PRIVATE[key]`` under a name jax lacks, as in a jax that renamed
    it (deleting the real one would break jax itself, which uses it too)."""
    module, attribute = compat.PRIVATE[key]
    monkeypatch.setitem(compat.PRIVATE, key, (module, f"{attribute}_renamed"))


def assert_names_the_version(error, key):
    message = str(error.value)
    assert jax.__version__ in message and "0.11.2" in message
    assert ".".join(compat.PRIVATE[key]) in message  # the name it looked for


def test_no_module_but_compat_imports_a_private_jax_module():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(name.startswith("jax._src") for name in names) and path.name != "compat.py":
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


def test_every_private_name_exists_in_this_jax():
    for module, attribute in compat.PRIVATE.values():
        assert hasattr(importlib.import_module(module), attribute), f"{module}.{attribute}"


def test_without_backends_are_initialized_it_assumes_not(monkeypatch):
    remove(monkeypatch, "backends_are_initialized")
    assert compat.backends_are_initialized() is False


def test_without_register_plugin_loading_a_plugin_names_the_jax_version(monkeypatch):
    remove(monkeypatch, "register_plugin")
    with pytest.raises(compat.JaxVersionError) as error:
        compat.register_plugin("another", library_path="/nonexistent.so", priority=-100)
    assert_names_the_version(error, "register_plugin")


def test_without_the_donation_list_sinkax_still_runs_and_donates_nothing_new(monkeypatch):
    remove(monkeypatch, "platforms_with_donation")
    compat.allow_donation("another")  # nothing to append to: skipped, with a warning
    with sinkax.data_sink(lambda s, b: (s + b["x"].sum(), s), [{"x": np.ones(2)}] * 2, 2) as sink:
        state, _ = sink(np.float32(0))
    assert float(state) == 4.0


def test_without_the_distributed_state_sharing_positions_names_the_jax_version(monkeypatch):
    remove(monkeypatch, "distributed_state")
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # one process would share nothing
    with pytest.raises(compat.JaxVersionError) as error:
        distributed.shared_position({"next_index": 0})
    assert_names_the_version(error, "distributed_state")


def test_a_missing_private_module_counts_as_a_missing_name(monkeypatch):
    monkeypatch.setitem(compat.PRIVATE, "register_plugin", ("jax._src.renamed", "register_plugin"))
    with pytest.raises(compat.JaxVersionError, match=r"jax\._src\.renamed\.register_plugin"):
        compat.register_plugin("another", library_path="/nonexistent.so", priority=-100)


def test_without_jax_s_platform_lists_a_fixed_set_names_its_platforms(monkeypatch):
    assert {"cpu", "cuda", "tpu"} <= compat.jax_platform_names()
    remove(monkeypatch, "platform_aliases")
    assert compat.jax_platform_names() == compat.KNOWN_PLATFORMS


def test_without_the_distributed_state_leaving_a_broken_job_names_the_jax_version(monkeypatch):
    remove(monkeypatch, "distributed_state")
    with pytest.raises(compat.JaxVersionError) as error:
        compat.abandon_distributed()
    assert_names_the_version(error, "distributed_state")


def test_without_jax_s_layouts_reader_no_frame_of_jax_counts_as_catching_everything(monkeypatch):
    assert compat.catching_everything()  # this jax has it
    remove(monkeypatch, "layouts_from_executable")
    assert compat.catching_everything() == frozenset()  # a Ctrl-C there is lost, as without sinkax
