"""What runs on a TPU host: the Ray actor that supervises it (`agent`), the process that trains
(`bootstrap`), the framework adapters (`frameworks`), and what the user's script sees
(`context`: `tpulaunch.context()`, `tpulaunch.get_mesh()`)."""
