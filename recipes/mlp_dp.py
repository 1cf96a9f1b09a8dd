"""Data-parallel MLP regression with torch_xla SPMD: the batch is split over every mesh axis.

Runs unchanged on an emulated slice (`tpulaunch run recipes/mlp_dp.py --topology 2x8`) and on a
TPU slice (`tpulaunch run recipes/mlp_dp.py --tpu NAME --address auto`). Every host feeds the same
global batch (same seed); SPMD uploads only the shards each host owns.
"""

import argparse

import torch
import torch_xla
import torch_xla.distributed.spmd as xs

import tpulaunch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=64, help="global batch; a multiple of the device count")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    mesh = tpulaunch.get_mesh()
    ctx = tpulaunch.context()
    device = torch_xla.device()
    torch.manual_seed(0)
    w_true = torch.randn(args.dim, 1)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.dim, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1234)
    batch_axes = tuple(mesh.axis_names)  # data parallel over the whole mesh
    for step in range(args.steps):
        x = torch.randn(args.batch, args.dim, generator=data)
        y = x @ w_true
        x, y = x.to(device), y.to(device)
        xs.mark_sharding(x, mesh, (batch_axes, None))
        xs.mark_sharding(y, mesh, (batch_axes, None))
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_xla.sync()
        tpulaunch.heartbeat(step=step)  # `tpulaunch goodput` counts the steps (a no-op outside a launch)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"host {ctx.process_index} step {step} loss {loss.item():.5f}", flush=True)


if __name__ == "__main__":
    main()
