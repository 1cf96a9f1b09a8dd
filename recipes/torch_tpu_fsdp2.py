"""A small decoder-only transformer trained with FSDP2 under TorchTPU (torch_tpu), device-agnostic.

One process per TPU device (`--framework torch_tpu`). tpulaunch hands each process its ranks and
the mesh it planned on the slice (`tpulaunch.get_mesh()`: a `DeviceMesh`, axes ("data", "model")
= hosts x devices per host unless `--mesh` says otherwise):

* `fully_shard` over that 2-D mesh is HSDP: parameters sharded over the devices of a host (the
  inner axis, on ICI), replicated across hosts, gradients reduced over both;
* each data-parallel replica (host) reads only its own rows (`DistributedSampler` over the
  replicas);
* `torch.distributed.checkpoint` saves the sharded state every --ckpt-every steps, and a run that
  finds a checkpoint in --ckpt-dir resumes from it.

    tpulaunch run recipes/torch_tpu_fsdp2.py --framework torch_tpu --topology 2x2x2 --accelerator v5p \\
        -- --steps 20 --ckpt-dir /tmp/fsdp2-ckpt

The same file runs on a TPU slice (device "tpu", process group "tpu_dist") and on an emulated one
(device "cpu", gloo): nothing in it names either.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import tpulaunch

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 32, 16, 64, 4, 2


class Progressions(Dataset):
    """Item i: an arithmetic progression mod VOCAB (the next token is learnable)."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> torch.Tensor:
        start, step = i % VOCAB, 1 + (i // VOCAB) % 5
        return (start + step * torch.arange(SEQ + 1)) % VOCAB


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="rows per data-parallel replica and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--ckpt-every", type=int, default=10)
    args = p.parse_args()

    ctx = tpulaunch.context()
    mesh = tpulaunch.get_mesh()  # the default group is open already: a DeviceMesh over every rank
    device = torch.device(ctx.device)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Decoder().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start = 0
    if args.ckpt_dir and os.path.exists(os.path.join(args.ckpt_dir, ".metadata")):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.ckpt_dir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"]) + 1
        if ctx.rank == 0:
            print(f"resumed from step {start - 1}", flush=True)

    # data parallel over the mesh's outer axis: each replica (row of the mesh) reads its own rows
    replica = mesh.get_local_rank(0) if mesh.ndim > 1 else 0
    replicas = mesh.size(0) if mesh.ndim > 1 else 1
    sampler = DistributedSampler(Progressions(), num_replicas=replicas, rank=replica, shuffle=True, seed=0)
    loader = iter(DataLoader(Progressions(), batch_size=args.batch, sampler=sampler, drop_last=True))
    if ctx.rank == 0:
        print(f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} on {ctx.world_size} processes"
              f" ({ctx.local_world_size} per host), device {device.type}", flush=True)

    for step in range(start, args.steps):
        tokens = next(loader).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        avg /= dist.get_world_size()
        tpulaunch.heartbeat(step=step)
        if ctx.rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step} loss {avg.item():.4f}", flush=True)
        if args.ckpt_dir and (step + 1) % args.ckpt_every == 0:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step)}, checkpoint_id=args.ckpt_dir)
            tpulaunch.heartbeat(step=step, checkpoint=True)


if __name__ == "__main__":
    main()
