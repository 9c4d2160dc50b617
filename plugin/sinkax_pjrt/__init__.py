"""sinkax's PJRT plugin library, and its on-demand ``jax_plugins`` entry point.

The library (``libsinkax_pjrt.so``) is a PJRT C API plugin that forwards to another one; the
Python side that configures it lives in ``sinkax.pjrt``. jax imports this module whenever its
backends initialize; :func:`initialize` registers the plugin only if the environment variable
``SINKAX_PJRT`` names an emulated-device preset (e.g. ``SINKAX_PJRT=pcie4-x16``), so processes
that do not ask for it never load it.
"""

import importlib.util
import os


def library_path() -> str:
    """The path of the plugin library built with this package."""
    return os.path.join(os.path.dirname(__file__), "libsinkax_pjrt.so")


def cpu_plugin_path() -> str:
    """The path of the XLA:CPU PJRT plugin (package ``xla-cpu-pjrt``) the emulator forwards to."""
    try:
        spec = importlib.util.find_spec("xla_plugins.xla_cpu_pjrt")
    except ModuleNotFoundError:  # no xla_plugins package at all
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sinkax-pjrt needs the xla-cpu-pjrt package: pip install xla-cpu-pjrt")
    return os.path.join(spec.submodule_search_locations[0], "xla_cpu_pjrt.so")


def initialize() -> None:
    """Called by jax at start-up: registers the emulated device if ``SINKAX_PJRT`` is set,
    unless the program registered the plugin itself (its own call, and costs, stand)."""
    preset = os.environ.get("SINKAX_PJRT")
    if preset:
        from sinkax import pjrt

        if pjrt.loaded_platform() is None:
            pjrt.use_emulated(preset)
