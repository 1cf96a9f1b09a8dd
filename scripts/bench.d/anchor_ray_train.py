"""The anchor: Ray Train's TorchTrainer with 4 workers running the same no-op, end to end.

Starts a local Ray, runs 4 workers that each import torch_xla and build a 16-device CPU mesh
(what an emulated 2x8 host does), and shuts down.
"""

import os
import time

t0 = time.time()
import ray  # noqa: E402
from ray.train import ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402


def noop(_config=None):  # noqa: ANN001, ANN201
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "16")
    import numpy as np
    import torch_xla  # noqa: F401
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    xs.Mesh(np.arange(16), (4, 4), ("data", "model"))


ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
trainer = TorchTrainer(
    noop,
    scaling_config=ScalingConfig(num_workers=4, use_gpu=False),
    torch_config=None,
)
trainer.fit()
ray.shutdown()
print(f"anchor done in {time.time() - t0:.2f}s", flush=True)
