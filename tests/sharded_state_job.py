"""A state sharded over the mesh, trained in a sink, for tests/test_sharded_state.py (a script:
forced host devices must be set before jax starts).

An MLP and its Adam state, FSDP-style (large leaves split over ``"data"``) or over a 2-D mesh
(``("data", "model")``), trained with ``sinkax.data_sink(..., sharding=P("data"))``; prints a
JSON line: whether every leaf came back sharded as it went in, the state's bytes per device,
the live bytes on the first device once the sink is closed, and the largest difference from
plain jitted training.

    python tests/sharded_state_job.py --devices 4 --mesh data --strategy scan
"""

from __future__ import annotations

import argparse
import json
import os
import sys

D, H, BATCH, STEPS, SINK = 128, 512, 16, 12, 4


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--mesh", choices=["data", "data,model"], required=True)
    parser.add_argument("--strategy", default="scan")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import sinkax

    axes = tuple(args.mesh.split(","))
    shape = (args.devices,) if len(axes) == 1 else (args.devices // 2, 2)
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))
    big = P("data") if len(axes) == 1 else P("data", "model")
    where = {"w1": big, "b1": P(), "w2": P("data", None)}
    tx = optax.adam(1e-2)

    def step(state, batch):
        params, opt = state

        def loss_fn(p):
            hidden = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
            return jnp.mean((hidden @ p["w2"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    rng = np.random.default_rng(0)
    init = {
        "w1": rng.normal(size=(D, H)).astype(np.float32) / np.sqrt(D),
        "b1": np.zeros(H, np.float32),
        "w2": rng.normal(size=(H, 1)).astype(np.float32) / np.sqrt(H),
    }
    data = [
        {
            "x": rng.normal(size=(BATCH, D)).astype(np.float32),
            "y": rng.normal(size=(BATCH, 1)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]

    def place(path, leaf):  # params as `where` says, Adam's moments alike, the rest replicated
        name = getattr(path[-1], "key", None) if path else None
        return jax.device_put(leaf, NamedSharding(mesh, where.get(name, P())))

    state = jax.tree_util.tree_map_with_path(place, (init, tx.init(init)))
    before = jax.tree.map(lambda x: x.sharding, state)
    sharding = NamedSharding(mesh, P("data"))
    with sinkax.data_sink(step, data, SINK, sharding=sharding, strategy=args.strategy) as sink:
        for _ in range(STEPS // SINK):
            state, _ = sink(state)
    device = jax.devices()[0]  # the sink closed, its chunks freed: what stays is the state
    live = sum(
        shard.data.nbytes
        for array in jax.live_arrays()
        for shard in array.addressable_shards
        if shard.device == device
    )
    kept = all(
        a.sharding.is_equivalent_to(b, a.ndim)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(before), strict=True)
    )
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))

    reference, run = jax.device_put((init, tx.init(init)), jax.devices()[0]), jax.jit(step)
    for batch in data:
        reference, _ = run(reference, batch)
    error = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True)
    )
    replicated = sum(x.nbytes for x in jax.tree.leaves(state))
    result = {"kept": kept, "per_device": per_device, "replicated": replicated, "live": live}
    print(json.dumps({**result, "max_error": error}))


if __name__ == "__main__":
    main(sys.argv[1:])
