"""A small decoder-only transformer trained with FSDPv2 on the whole slice, the way long runs are:

* parameters and activations sharded over every device with torch_xla's
  `SpmdFullyShardedDataParallel` (FSDPv2) on the global mesh (tpulaunch's planned mesh, its two
  axes named ("data", "fsdp"): hosts x devices per host);
* per-host input: each host reads only its own rows (`DistributedSampler` over the hosts) and
  `MpDeviceLoader(..., ShardingSpec(..., minibatch=True))` forms the global batch;
* checkpoints with torch_xla's `CheckpointManager` every --ckpt-every steps; a run that finds a
  checkpoint in --ckpt-dir resumes from the newest one (so a restarted run picks up where it was).

    tpulaunch run recipes/fsdpv2_decoder.py --topology 2x8 -- --steps 40 --ckpt-dir /tmp/fsdpv2-ckpt

The same script runs unchanged on a TPU slice (point --ckpt-dir at a gs:// path there).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.spmd as xs
import torch_xla.experimental.distributed_checkpoint as xc
import torch_xla.runtime as xr
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

import tpulaunch

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 32, 16, 64, 4, 2


class Progressions(Dataset):
    """Item i: an arithmetic progression mod VOCAB (the next token is learnable), the same on
    every host and in every run, so a resumed run sees exactly the batches it would have."""

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        start, step = torch.randint(0, VOCAB, (2,), generator=g).tolist()
        seq = (start + (step | 1) * torch.arange(SEQ + 1)) % VOCAB
        return seq[:-1], seq[1:]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Parameter(torch.zeros(SEQ, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32, help="global batch (all hosts together)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--ckpt-dir", default="/tmp/fsdpv2-ckpt")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder blocks (compile time grows with them)")
    args = p.parse_args()

    xr.use_spmd()
    device = torch_xla.device()
    planned = tpulaunch.get_mesh()  # hosts x devices per host; FSDPv2 wants an axis named "fsdp"
    shape = tuple(planned.mesh_shape) if len(planned.mesh_shape) == 2 else (1, planned.size())
    mesh = xs.Mesh(planned.device_ids, shape, ("data", "fsdp"))
    xs.set_global_mesh(mesh)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="xla://")  # CheckpointManager needs a CPU group

    torch.manual_seed(0)  # every host builds the same initial weights
    model = FSDPv2(Decoder(args.layers).to(device), extra_data_axis="data")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if "://" not in args.ckpt_dir:
        # Hosts sharing a filesystem (NFS, Filestore, an emulated slice) would race in
        # CheckpointManager's own exists-then-mkdir; a gs:// bucket needs no directory.
        os.makedirs(args.ckpt_dir, exist_ok=True)
    ckpt = xc.CheckpointManager(args.ckpt_dir, args.ckpt_every)

    start = 0
    if ckpt.all_steps():
        start = max(ckpt.all_steps())
        xc.prime_optimizer(optimizer)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        ckpt.restore(start, state)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        xm.master_print(f"resumed from the checkpoint of step {start}")

    hosts, me = xr.process_count(), xr.process_index()
    rows = Subset(Progressions(), range(start * args.batch_size, args.steps * args.batch_size))
    loader = DataLoader(rows, batch_size=args.batch_size // hosts, drop_last=True,
                        sampler=DistributedSampler(rows, num_replicas=hosts, rank=me, shuffle=False))
    batches = pl.MpDeviceLoader(loader, device,
                                input_sharding=xs.ShardingSpec(mesh, (("data", "fsdp"), None), minibatch=True))
    for step, (tokens, targets) in enumerate(batches, start=start + 1):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(tokens).view(-1, VOCAB), targets.view(-1))
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        print(f"host {me} step {step} loss {loss.item():.5f}", flush=True)
        tpulaunch.heartbeat(step=step)  # `tpulaunch goodput` counts the steps (a no-op outside a launch)
        if ckpt.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()}):
            tpulaunch.heartbeat(step=step, checkpoint=True)  # the save's time, and where a restart resumes
            xm.master_print(f"saved the checkpoint of step {step}")


if __name__ == "__main__":
    main()
