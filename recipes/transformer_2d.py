"""A small decoder-only transformer trained with 2D (data x model) SPMD sharding.

The batch is split along the mesh's first axis (`data`); attention and MLP weights are split
Megatron-style along its last axis (`model`: column-parallel in, row-parallel out), which
tpulaunch's default mesh keeps inside one host. The task is learnable in a few steps (continue a
counting sequence), so the loss must fall. Runs unchanged emulated and on a TPU slice.
"""

import argparse

import torch
import torch.nn as nn
import torch_xla
import torch_xla.distributed.spmd as xs

import tpulaunch


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1))

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        x = self.emb(tok) + self.pos[: tok.shape[1]]
        for blk in self.blocks:
            x = blk(x, self.mask)
        return self.head(x)


def shard_megatron(model: TinyLM, mesh: xs.Mesh, model_axis: str | None) -> None:
    if model_axis is None:
        return
    for blk in model.blocks:
        for col in (blk.qkv, blk.fc1):  # split output features
            xs.mark_sharding(col.weight, mesh, (model_axis, None))
        for row in (blk.proj, blk.fc2):  # split input features
            xs.mark_sharding(row.weight, mesh, (None, model_axis))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    mesh = tpulaunch.get_mesh()
    ctx = tpulaunch.context()
    data_axis = mesh.axis_names[0]
    model_axis = mesh.axis_names[-1] if len(mesh.axis_names) > 1 else None
    device = torch_xla.device()
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, 4, 2, args.seq).to(device)
    shard_megatron(model, mesh, model_axis)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(7)
    if ctx.is_coordinator:
        print(f"mesh {dict(zip(mesh.axis_names, mesh.mesh_shape))}, {ctx.num_processes} host(s), "
              f"{'emulated' if ctx.emulated else ctx.accelerator_type}", flush=True)
    for step in range(args.steps):
        start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
        seq = (start + torch.arange(args.seq + 1)) % args.vocab  # learn: next = previous + 1
        tok, tgt = seq[:, :-1].to(device), seq[:, 1:].to(device)
        xs.mark_sharding(tok, mesh, (data_axis, None))
        xs.mark_sharding(tgt, mesh, (data_axis, None))
        logits = model(tok)
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), tgt.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_xla.sync()
        tpulaunch.heartbeat(step=step)  # `tpulaunch goodput` counts the steps (a no-op outside a launch)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"host {ctx.process_index} step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
