"""Data-parallel MLP regression with JAX: `jax.jit` + `NamedSharding` over the launch's mesh.

Runs unchanged on an emulated slice (`tpulaunch run recipes/jax_mlp.py --topology 2x8`) and on a
TPU slice (`tpulaunch run recipes/jax_mlp.py --tpu NAME --address auto`). tpulaunch has already
called `jax.distributed.initialize` and built the mesh; this script only uses it.

Parameters are replicated; the batch is split over every mesh axis. The global batch is a pure
function of the step, and `jax.make_array_from_callback` asks each host only for the rows its
own devices hold (a real input pipeline would read just those rows). XLA inserts the gradient
all-reduce across hosts.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import tpulaunch


def init_params(key, dim, hidden):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (dim, hidden)) * (1.0 / np.sqrt(dim)),
        "b1": jnp.zeros((hidden,)),
        "w2": jax.random.normal(k2, (hidden, 1)) * (1.0 / np.sqrt(hidden)),
        "b2": jnp.zeros((1,)),
    }


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2)


def global_batch(step, batch, dim, w_true):
    """The whole global batch of one step, the same on every host (seeded by the step)."""
    rng = np.random.default_rng(1234 + step)
    x = rng.standard_normal((batch, dim), dtype=np.float32)
    return x, x @ w_true


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64, help="global batch; a multiple of the device count")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.02)
    args = p.parse_args()

    mesh = tpulaunch.get_mesh()  # jax.sharding.Mesh over every device of the slice
    ctx = tpulaunch.context()
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names), None))  # data parallel over the whole mesh

    w_true = np.random.default_rng(0).standard_normal((args.dim, 1), dtype=np.float32) / np.sqrt(args.dim)
    params = jax.jit(init_params, static_argnums=(1, 2), out_shardings=replicated)(
        jax.random.key(0), args.dim, args.hidden)

    @jax.jit
    def train_step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params = jax.tree.map(lambda w, g: w - args.lr * g, params, grads)
        return params, loss

    for step in range(args.steps):
        x_np, y_np = global_batch(step, args.batch, args.dim, w_true)
        x = jax.make_array_from_callback(x_np.shape, batch_sharding, lambda idx: x_np[idx])
        y = jax.make_array_from_callback(y_np.shape, batch_sharding, lambda idx: y_np[idx])
        params, loss = train_step(params, x, y)
        tpulaunch.heartbeat(step=step)  # `tpulaunch goodput` counts the steps (a no-op outside a launch)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"host {ctx.process_index} step {step} loss {float(loss):.5f}", flush=True)


if __name__ == "__main__":
    main()
