"""A small decoder-only transformer trained with 2D (data x model) sharding in JAX: the JAX
counterpart of `transformer_2d.py`, and the JAX demo of the persistent compilation cache.

The batch is split along the mesh's first axis (`data`); attention and MLP weights are split
Megatron-style along its last axis (`model`: column-parallel in, row-parallel out) with
`NamedSharding`, and XLA's SPMD partitioner inserts the collectives. The optimizer is AdamW,
written out so the recipe needs nothing beyond JAX. The task is learnable in a few steps
(continue a counting sequence), so the loss must fall. Runs unchanged emulated
(`tpulaunch run recipes/jax_transformer.py --topology 2x8 --framework jax`) and on a TPU slice.

Its train step is one `jax.jit` of forward, backward and update: compiling it is most of the time
to the first step, which is what the compile cache saves on the next run.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import tpulaunch


def init_params(key, vocab, dim, layers, seq):
    keys = iter(jax.random.split(key, 4 + 4 * layers))

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out)) * (1.0 / np.sqrt(n_in))

    blocks = [{"ln1": jnp.ones((dim,)), "ln2": jnp.ones((dim,)),
               "qkv": dense(dim, 3 * dim), "proj": dense(dim, dim),
               "fc1": dense(dim, 4 * dim), "fc2": dense(4 * dim, dim)} for _ in range(layers)]
    return {"emb": dense(vocab, dim), "pos": jnp.zeros((seq, dim)), "blocks": blocks,
            "ln_f": jnp.ones((dim,)), "head": dense(dim, vocab)}


def param_specs(params, model_axis):
    """Megatron split: qkv and fc1 by output features, proj and fc2 by input features."""
    split = {"qkv": P(None, model_axis), "fc1": P(None, model_axis), "proj": P(model_axis, None),
             "fc2": P(model_axis, None)}
    blocks = [{k: split.get(k, P()) for k in blk} for blk in params["blocks"]]
    return {"emb": P(), "pos": P(), "blocks": blocks, "ln_f": P(), "head": P()}


def layer_norm(x, scale):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * scale


def forward(params, tok, heads):
    b, t = tok.shape
    x = params["emb"][tok] + params["pos"][:t]
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    for blk in params["blocks"]:
        d = x.shape[-1]
        q, k, v = jnp.split(layer_norm(x, blk["ln1"]) @ blk["qkv"], 3, axis=-1)
        q, k, v = (z.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3) for z in (q, k, v))
        att = jnp.where(mask, (q @ k.transpose(0, 1, 3, 2)) / np.sqrt(d // heads), -jnp.inf)
        out = (jax.nn.softmax(att, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + out @ blk["proj"]
        x = x + jax.nn.relu(layer_norm(x, blk["ln2"]) @ blk["fc1"]) @ blk["fc2"]
    return layer_norm(x, params["ln_f"]) @ params["head"]


def loss_fn(params, tok, tgt, heads):
    logits = forward(params, tok, heads)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, tgt[..., None], axis=-1).mean()


def adamw(params, grads, state, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.01):
    step = state["step"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    params = jax.tree.map(lambda p, m, v: p - lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + wd * p), params, m, v)
    return params, {"step": step, "m": m, "v": v}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32, help="global batch; a multiple of the data axis")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    mesh = tpulaunch.get_mesh()  # jax.sharding.Mesh over every device of the slice
    ctx = tpulaunch.context()
    data_axis = mesh.axis_names[0]
    model_axis = mesh.axis_names[-1] if len(mesh.axis_names) > 1 else None
    init = functools.partial(init_params, vocab=args.vocab, dim=args.dim, layers=args.layers, seq=args.seq)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                             param_specs(jax.eval_shape(init, jax.random.key(0)), model_axis))
    params = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
    replicated = NamedSharding(mesh, P())
    opt_shardings = {"step": replicated, "m": shardings, "v": shardings}
    zeros = jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t), out_shardings=shardings)
    opt = {"step": jax.device_put(jnp.zeros((), jnp.int32), replicated), "m": zeros(params), "v": zeros(params)}
    batch_sharding = NamedSharding(mesh, P(data_axis, None))

    # Outputs sharded as the inputs are: the second step reuses the first step's executable.
    @functools.partial(jax.jit, out_shardings=(shardings, opt_shardings, replicated), donate_argnums=(0, 1))
    def train_step(params, opt, tok, tgt):
        loss, grads = jax.value_and_grad(loss_fn)(params, tok, tgt, args.heads)
        params, opt = adamw(params, grads, opt, args.lr)
        return params, opt, loss

    if ctx.is_coordinator:
        print(f"mesh {dict(mesh.shape)}, {ctx.num_processes} host(s), "
              f"{'emulated' if ctx.emulated else ctx.accelerator_type}", flush=True)
    rng = np.random.default_rng(7)  # the same global batch on every host; each gives only its rows
    for step in range(args.steps):
        start = rng.integers(0, args.vocab, (args.batch, 1))
        seq = ((start + np.arange(args.seq + 1)) % args.vocab).astype(np.int32)  # learn: next = previous + 1
        tok, tgt = (jax.make_array_from_callback(a.shape, batch_sharding, lambda idx, a=a: a[idx])
                    for a in (seq[:, :-1], seq[:, 1:]))
        params, opt, loss = train_step(params, opt, tok, tgt)
        tpulaunch.heartbeat(step=step)  # `tpulaunch goodput` counts the steps (a no-op outside a launch)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"host {ctx.process_index} step {step} loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
