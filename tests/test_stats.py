"""``Sink.stats``' waits: a call waiting for the device is not waiting for its data."""

import time

import jax
import jax.numpy as jnp
import numpy as np

import sinkax


def products(n):
    """``n`` matrix products, one after another."""
    w = jnp.eye(256, dtype=jnp.float32) * 0.5
    return jax.lax.fori_loop(0, n, lambda _, x: jnp.tanh(x @ w), w)


def step_of(seconds):
    """A step that computes for about ``seconds`` on this machine (matrix products, timed here:
    a host callback would make XLA:CPU run the call before it returns)."""
    timed = jax.jit(products)
    jax.block_until_ready(timed(100))
    t0 = time.perf_counter()
    jax.block_until_ready(timed(100))
    n = max(1, round(seconds / ((time.perf_counter() - t0) / 100)))
    return lambda state, batch: (state + 0 * products(n).mean() + batch["x"], ())


def waits(step, dataset, calls):
    """The stats after ``calls`` calls of sink size 2, a chunk each (of scalar batches), none
    waited for but the last, and their seconds."""
    options = {"strategy": "scan", "prefetch": 1, "max_chunk_bytes": 8}
    with sinkax.data_sink(step, dataset, 2, **options) as sink:
        state, _ = sink(jnp.float32(0))  # compiles
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(calls):
            state, _ = sink(state)
        jax.block_until_ready(state)
        return sink.stats, time.perf_counter() - t0


def test_calls_ahead_of_the_device_wait_for_it_not_for_their_data():
    # the producer has every batch at once, but a slot is refilled only once the device is
    # done with it: the calls, dispatched ahead, wait for the device to free one
    stats, seconds = waits(step_of(0.03), [{"x": np.float32(0)}] * 8, calls=12)
    assert stats.slot_wait_s > 0.5 * seconds  # the producer waited for the device ...
    assert stats.data_wait_s < 0.2 * seconds, (stats.data_wait_s, seconds)  # ... not the calls
    assert stats.bound == "compute"


class Slow:
    """Batches that take 20 ms each to read."""

    def __iter__(self):
        for _ in range(64):
            time.sleep(0.02)
            yield {"x": np.float32(0)}


def test_calls_ahead_of_a_slow_dataset_wait_for_their_data():
    stats, seconds = waits(lambda state, batch: (state + batch["x"], ()), Slow(), calls=8)
    assert stats.data_wait_s > 0.5 * seconds, (stats.data_wait_s, seconds)
    assert stats.bound == "input"


def test_a_device_computing_longer_than_the_timeout_times_no_call_out():
    # each call computes about 0.6 s, the data's timeout is 0.1 s: a call waits for its chunk
    # while the producer, reading no batch, waits for the device to free a slot
    data = [{"x": np.float32(1)}] * 8
    options = {"strategy": "scan", "prefetch": 1, "max_chunk_bytes": 8, "timeout": 0.1}
    with sinkax.data_sink(step_of(0.3), data, 2, **options) as sink:
        state = jnp.float32(0)
        for _ in range(4):
            state, _ = sink(state)
        assert float(state) == 8.0 and sink.stats.bound == "compute"
