"""Small step functions and datasets shared by the core tests."""

import contextlib
import dataclasses
import dis
import itertools
import os
import signal
import sys
import threading
import time
import traceback

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sinkax
import sinkax.pjrt

# jax's persistent compilation cache: a program compiled once in the session (by any test, in
# any of `make test`'s test processes, or by the subprocesses of the notebook, example and CLI
# tests, which inherit the environment) is read back instead of compiled again; kept between
# sessions (.jax_cache/, git-ignored). An entry read while another process writes it only warns
# and compiles again (jax reads the cache that way).
CACHE_SETTINGS = {
    "jax_compilation_cache_dir": os.environ.get(
        "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")
    ),
    "jax_persistent_cache_min_compile_time_secs": 0.0,  # the suite's programs compile fast
}
for _name, _value in CACHE_SETTINGS.items():
    os.environ[_name.upper()] = str(_value)
    jax.config.update(_name, _value)

# The emulated device (sinkax.pjrt) is registered before jax's backends start, for test_pjrt.py;
# without sinkax's C++ plugin installed (a user's machine, a bare GPU machine), the tests that need
# it skip. SINKAX_TEST_DEVICE=Emulated makes it every test's default device: `make test` runs the
# sink and Model tests that way too, where device memory is not host memory; =GPU runs them on the
# GPU (benchmarks/gpu_check.py).
PLUGIN_MISSING = None
try:
    sinkax.pjrt.use_emulated(os.environ.get("SINKAX_TEST_PRESET", "pcie4-x16"))
except ImportError as missing:
    PLUGIN_MISSING = str(missing)
needs_plugin = pytest.mark.skipif(PLUGIN_MISSING is not None, reason=str(PLUGIN_MISSING))
if os.environ.get("SINKAX_TEST_DEVICE"):
    sinkax.set_context(device_target=os.environ["SINKAX_TEST_DEVICE"])


def default_backend() -> sinkax.backend.Backend:
    """What the tests' default device can do (CPU, or the emulated device)."""
    return sinkax.backend.backend_of(sinkax.backend.default_device())


# "auto" measures its candidates only where XLA:CPU compiles; on a GPU it is "scan" at once
auto_measures = pytest.mark.skipif(
    not default_backend().xla_cpu, reason='"auto" measures only where XLA:CPU compiles'
)


def one_step_strategy() -> str:
    """What ``"auto"`` settles to for one-step sinks on the default device, without measuring."""
    return "step" if default_backend().host_is_device else "scan"


OPTIMIZER = optax.sgd(0.05, momentum=0.9)


def regression_batches(n: int, batch_size: int = 8, seed: int = 0) -> list[dict]:
    """``n`` batches of a noisy linear regression problem, as numpy pytrees."""
    rng = np.random.default_rng(seed)
    true_w = rng.normal(size=(4, 1)).astype(np.float32)
    batches = []
    for _ in range(n):
        x = rng.normal(size=(batch_size, 4)).astype(np.float32)
        batches.append({"x": x, "y": x @ true_w + 0.01 * rng.normal(size=(batch_size, 1))})
    return [{k: v.astype(np.float32) for k, v in b.items()} for b in batches]


def init_state(seed: int = 0):
    params = {"w": jax.random.normal(jax.random.key(seed), (4, 1)), "b": jnp.zeros((1,))}
    return params, OPTIMIZER.init(params)


def train_step(state, batch):
    """One SGD-momentum step of linear regression; returns the loss."""
    params, opt_state = state

    def loss_fn(p):
        return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def reference_run(batches, steps: int):
    """``steps`` plain jitted steps over ``batches`` cycled: final state and losses."""
    state, losses, step = init_state(), [], jax.jit(train_step)
    for i in range(steps):
        state, loss = step(state, batches[i % len(batches)])
        losses.append(float(loss))
    return state, np.array(losses)


def indexed_map_dataset(
    num_samples: int, batch_size: int, seed: int | None = 0
) -> grain.MapDataset:
    """Batches ``{"index": (B,), "x": (B, 2)}`` of a (per-epoch reshuffled) index range."""
    ds = grain.MapDataset.range(num_samples)
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    ds = ds.batch(batch_size, drop_remainder=True)
    return ds.map(lambda idx: {"index": idx.astype(np.int32), "x": np.stack([idx, idx], 1) * 0.5})


def collect_index(state, batch):
    """A step that counts steps and outputs the sample indices it saw."""
    return state + 1, batch["index"]


@pytest.fixture
def batches():
    return regression_batches(10)


@pytest.fixture
def restore_context():
    """Put sinkax's context and jax's default device back after the test (``set_context`` and
    ``sinkax train``'s ``main`` set them for the whole process)."""
    saved, device = sinkax.get_context(), jax.config.jax_default_device
    yield
    sinkax.set_context(**dataclasses.asdict(saved))
    jax.config.update("jax_default_device", device)


# -- Ctrl-C where CPython can deliver one -------------------------------------------------------
def signal_checks(code):
    """Offsets in ``code`` after which CPython runs pending signal handlers: calls, back jumps."""
    return {i.offset for i in dis.get_instructions(code) if i.opname.startswith(("CALL", "JUMP_B"))}


SINKAX_DIR = os.path.dirname(sinkax.__file__) + os.sep


@contextlib.contextmanager
def ctrl_c_at_check(k, function=None, also=()):
    """Press Ctrl-C at the ``k``-th point of a run of ``function`` -- without one, of every sinkax
    frame the run passes through (sink, ring, source, strategy, feed, ...) -- where a real one
    can land: a frame's start, or right after one of its calls or backward jumps (none if the
    run has fewer); with ``also``, the frames of those source files too. Only the calling thread
    is traced: only it receives ``KeyboardInterrupt``."""
    if function is None:
        traced = lambda code: code.co_filename.startswith(SINKAX_DIR) or code.co_filename in also  # noqa: E731
    else:
        traced = lambda code: code is function.__code__  # noqa: E731
    checks, last, after = itertools.count(), {}, {}

    def on_opcode(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "exception":  # CPython checks after a call that returned, not one that
            last[id(frame)] = -1  # raised: no check before the handler's first opcode
        elif event == "opcode":
            code = frame.f_code
            if code not in after:
                after[code] = signal_checks(code)
            previous = last.get(id(frame))
            if (previous is None or previous in after[code]) and next(checks) == k:
                signal.raise_signal(signal.SIGINT)
            last[id(frame)] = frame.f_lasti
        return on_opcode

    def on_call(frame, *_):
        if not traced(frame.f_code):
            return None
        last[id(frame)] = None  # a new frame (ids are reused)
        return on_opcode

    sys.settrace(on_call)
    try:
        yield checks
    finally:
        sys.settrace(None)


def assert_no_slot_leaked(sink, timeout=60.0):
    """Every device slot of ``sink``'s ring is queued or handed out once its producer (over an
    endless dataset) has filled them all: none went missing."""
    ring, deadline = sink._cursor.ring, time.monotonic() + timeout
    while ring._ready.qsize() + len(ring._handed_out) < sink.config.prefetch + 1:
        assert time.monotonic() < deadline, "a device slot leaked"
        time.sleep(0.002)


# -- threads, without timing assumptions --------------------------------------------------------
def producer_threads() -> set[threading.Thread]:
    """The sinks' producer threads alive now, whichever test started them."""
    return {t for t in threading.enumerate() if t.name == "sinkax-producer"}


def threads_but_copiers() -> set[threading.Thread]:
    """The live threads but the copier pool's, which the sinks of a process share and leave
    idle (on a host of 8 or more cores they copy a list's or a MapDataset's batches)."""
    return {t for t in threading.enumerate() if not t.name.startswith("sinkax-copier")}


def producers_left(before: set[threading.Thread], timeout: float = 60.0) -> list[str]:
    """The producer threads started since ``before`` that are still alive after waiting up to
    ``timeout`` for them: a producer that has closed its source may still be finishing its
    thread, and an earlier test's producers are not this test's."""
    return [t.name for t in _left(producer_threads, before, timeout)]


def threads_left(before: set[threading.Thread], timeout: float = 60.0) -> set[threading.Thread]:
    """:func:`threads_but_copiers` started since ``before`` and still alive after waiting up to
    ``timeout`` for them (a thread whose work has ended may have a few bytecodes left)."""
    return _left(threads_but_copiers, before, timeout)


def _left(alive, before, timeout):
    deadline = time.monotonic() + timeout
    for thread in alive() - before:
        thread.join(max(0.0, deadline - time.monotonic()))
    return alive() - before


def thread_stacks(name: str) -> str:
    """Where every thread called ``name`` is now: to say why one did not stop."""
    frames = sys._current_frames()
    return "\n".join(
        "".join(traceback.format_stack(frames[t.ident]))
        for t in threading.enumerate()
        if t.name == name and t.ident in frames
    )
