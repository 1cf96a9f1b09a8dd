"""Ray Train's `TorchTrainer` on a TPU slice: torch_xla SPMD, the mesh planned by tpulaunch.

A plain Ray Train driver. The only tpulaunch piece is `XlaSpmdConfig`: it boots each worker as
its TPU host (SPMD mode, the slice's gloo group, the mesh; process index = TPU worker id), so
the loop just asks for `tpulaunch.get_mesh()`.

    tpulaunch cluster up --topology 2x8        # emulated here; on a slice: cluster up --tpu NAME
    eval "$(tpulaunch cluster env)"
    python recipes/ray_train_xla.py --steps 20

The model (a two-layer MLP learning a linear map) is sharded over the mesh's "model" axis and the
batch over "data". Every host builds the same global batch from one seed; SPMD uploads each host's
shards of it.
"""

from __future__ import annotations

import argparse

import ray.train
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from tpulaunch.ray_train import XlaSpmdConfig

FEATURES, HIDDEN = 64, 256


def train_loop(config: dict) -> None:
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs

    import tpulaunch

    ctx = tpulaunch.context()
    mesh = tpulaunch.get_mesh()
    device = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)).to(device)
    xs.mark_sharding(model[0].weight, mesh, ("model", None))  # hidden units split over "model"
    xs.mark_sharding(model[2].weight, mesh, (None, "model"))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    data = torch.Generator().manual_seed(1)
    target = torch.randn(FEATURES, 1, generator=data) / FEATURES**0.5  # targets of unit variance
    if ctx.is_coordinator:
        print(f"host {ctx.process_index}/{ctx.num_processes} (TPU worker {ctx.worker_id} of {ctx.slice_name}),"
              f" mesh {dict(zip(mesh.axis_names, mesh.mesh_shape))}", flush=True)
    for step in range(config["steps"]):
        x = torch.randn(config["batch"], FEATURES, generator=data)  # the same global batch on every host
        x, y = x.to(device), (x @ target).to(device)
        xs.mark_sharding(x, mesh, ("data", None))
        xs.mark_sharding(y, mesh, ("data", None))
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_xla.sync()
        if step % 5 == 0 or step == config["steps"] - 1:
            value = loss.item()
            if ctx.is_coordinator:
                print(f"step {step} loss {value:.4f}", flush=True)
            ray.train.report({"step": step, "loss": value})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64, help="global batch (a multiple of the data axis)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--topology", default="2x8")
    p.add_argument("--accelerator-type", default="TPU-V6E")
    p.add_argument("--workers", type=int, default=4, help="TPU hosts of the slice(s)")
    p.add_argument("--chips-per-host", type=int, default=4)
    p.add_argument("--mesh", default=None, help="e.g. data=4,model=4 (default: hosts x chips per host)")
    p.add_argument("--storage", default=None, help="Ray Train storage path (default: Ray's)")
    args = p.parse_args()
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"steps": args.steps, "batch": args.batch, "lr": args.lr},
        torch_config=XlaSpmdConfig(mesh=args.mesh),
        scaling_config=ScalingConfig(num_workers=args.workers, use_tpu=True, topology=args.topology,
                                     accelerator_type=args.accelerator_type,
                                     resources_per_worker={"TPU": args.chips_per_host}),
        run_config=RunConfig(storage_path=args.storage, failure_config=FailureConfig(max_failures=1)),
    )
    result = trainer.fit()
    print(f"trained {args.steps} steps; errors: {result.error}")


if __name__ == "__main__":
    main()
