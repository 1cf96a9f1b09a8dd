"""What the real-Ray scale bench launches with `--framework none`: no framework, just the context
every host is pushed (its index, the world size, the coordinator), printed once."""

import tpulaunch

ctx = tpulaunch.context()
print(f"host {ctx.process_index} of {ctx.num_processes} at {ctx.coordinator_address}", flush=True)
