"""sinkax's PJRT plugin over jax's CUDA plugin: host-device interactions on a real GPU, counted
(the last part of benchmarks/gpu_check.py).

The plugin's C++ source (plugin/src/sinkax_pjrt.cc) is compiled here with the C++ compiler and
a ``pjrt_c_api.h`` given with --header (default: .whl/include/pjrt_c_api.h, which
`make gpu-wheels` copies from the installed xla-cpu-pjrt; never committed). The plugin copies
the inner plugin's table by its own size, so an older header serves a newer CUDA plugin; both
versions are printed. Then, as platform ``counted`` over the CUDA plugin (jax's own ``cuda``
backend not started, so one client owns the GPU), it checks what the emulated device satisfies:

* per-step training: one launch and one transfer per batch leaf per step, nothing read back;
* a sink (``strategy="scan"``): one launch per call, nothing read back.

The last line says what happened. Exit status 0 only when every count matched (a dry run: when
the plugin compiled, or when there was nothing to compile it with).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLATFORM = "counted"


def header_version(path: str) -> str:
    with open(path) as f:
        text = f.read()
    found = [re.search(rf"#define PJRT_API_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR")]
    return ".".join(m.group(1) if m else "?" for m in found)


def cuda_plugin() -> str:
    """The library of jax's CUDA PJRT plugin (package ``jax_plugins.xla_cuda*``)."""
    for name in ("xla_cuda13", "xla_cuda12"):
        spec = importlib.util.find_spec(f"jax_plugins.{name}")
        if spec and spec.submodule_search_locations:
            found = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.so"))
            if found:
                return found[0]
    raise FileNotFoundError("no jax CUDA plugin (jax_plugins.xla_cuda13/12) is installed")


def plugin_version(library: str) -> str:
    """``major.minor`` of the PJRT C API that the plugin at ``library`` was built with."""
    api = ctypes.CDLL(library).GetPjrtApi
    api.restype = ctypes.POINTER(ctypes.c_size_t)
    table = api()
    # PJRT_Api: struct_size, extension_start, then PJRT_Api_Version {struct_size,
    # extension_start, int major_version, int minor_version}
    version = ctypes.cast(ctypes.addressof(table.contents) + 32, ctypes.POINTER(ctypes.c_int))
    return f"{version[0]}.{version[1]}"


def build(header: str, folder: str) -> str:
    """Compile the plugin into ``folder/sinkax_pjrt`` (with its Python side); returns the folder
    to put on ``sys.path``."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (c++, g++, clang++) on PATH")
    package = os.path.join(folder, "sinkax_pjrt")
    os.makedirs(package)
    shutil.copy(os.path.join(ROOT, "plugin", "sinkax_pjrt", "__init__.py"), package)
    argv = [compiler, "-std=c++17", "-O2", "-shared", "-fPIC", "-fvisibility=hidden"]
    argv += ["-I", os.path.dirname(os.path.abspath(header))]
    argv += [os.path.join(ROOT, "plugin", "src", "sinkax_pjrt.cc"), "-o"]
    argv += [os.path.join(package, "libsinkax_pjrt.so"), "-ldl", "-lpthread"]
    subprocess.run(argv, check=True, timeout=120)
    return folder


def count_checks() -> list[tuple[str, int, int]]:
    """``(what, counted, expected)`` of plain per-step training and of a sink on the GPU."""
    import jax
    import numpy as np
    from _common import workload

    import sinkax
    from sinkax import pjrt

    device = jax.devices(PLATFORM)[0]
    w, steps, calls, sink_size = workload("mlp", 8), 7, 3, 4
    batches, train_step, leaves = w.batches, w.step, len(w.batches[0])
    step = jax.jit(train_step)
    state = jax.block_until_ready(jax.device_put(w.init(), device))
    state, _ = step(state, batches[0])  # compile
    before = pjrt.interactions()
    for i in range(steps):
        state, _ = step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    plain = pjrt.interactions() - before
    before = pjrt.interactions()
    with sinkax.data_sink(train_step, batches, sink_size, device=device, strategy="scan") as sink:
        for _ in range(calls):
            state, loss = sink(state)
        jax.block_until_ready(state)
        sink.close()  # the producer stops: nothing moves after the count below
        stats = sink.stats
    sunk = pjrt.interactions() - before
    print("per-step loop:", plain, "\nsink:", sunk, "losses", np.asarray(loss["loss"]))
    return [
        ("per-step launches", plain.launches, steps),
        ("per-step batch transfers", plain.h2d, steps * leaves),
        ("per-step reads", plain.d2h, 0),
        ("sink launches", sunk.launches, calls + stats.chunks_padded),  # + short chunks' pads
        ("sink transfers", sunk.h2d, stats.chunks_transferred * leaves + 1),  # + one position
        ("sink bytes", sunk.h2d_bytes, stats.bytes_transferred + 4),
        ("sink reads", sunk.d2h, 0),
    ]


def run(header: str, dry_run: bool, inner: str | None) -> int:
    if not os.path.exists(header):
        print(f"no pjrt_c_api.h at {header}: `make gpu-wheels` copies it there; carry .whl")
        print(f"SKIP: no header{' (dry run)' if dry_run else ''}")
        return 0 if dry_run else 3
    print("pjrt_c_api.h:", header, "PJRT C API", header_version(header))
    inner = None if dry_run else inner or cuda_plugin()
    if inner:
        print("inner plugin:", inner, "PJRT C API", plugin_version(inner))
    sys.path.insert(0, build(header, tempfile.mkdtemp()))
    if inner is None:
        print("PASS: the plugin compiled (dry run: no GPU to forward to)")
        return 0
    os.environ["JAX_PLATFORMS"] = f"{PLATFORM},cpu"  # one client on the GPU: ours
    from sinkax import pjrt

    pjrt.use_plugin(inner, PLATFORM, discrete=True)
    checks = count_checks()
    for what, counted, expected in checks:
        verdict = "ok  " if counted == expected else "MISS"
        print(f"  {verdict}  {what}: {counted} (expected {expected})")
    missed = [what for what, counted, expected in checks if counted != expected]
    print(f"MISS: {', '.join(missed)}" if missed else f"PASS: all {len(checks)} counts match")
    return 1 if missed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default = os.path.join(ROOT, ".whl", "include", "pjrt_c_api.h")
    parser.add_argument("--header", default=default, help="the pjrt_c_api.h to build with")
    parser.add_argument("--dry-run", action="store_true", help="only compile (no GPU)")
    parser.add_argument("--inner", help="the PJRT plugin to forward to (default: jax's CUDA one)")
    args = parser.parse_args(argv)
    try:
        return run(args.header, args.dry_run, args.inner)
    except Exception as error:  # the reason is the result: print it as the last line
        print(f"FAIL: {type(error).__name__}: {error}"[:300])
        return 1


if __name__ == "__main__":
    sys.exit(main())
