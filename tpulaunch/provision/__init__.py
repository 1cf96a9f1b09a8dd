"""Making capacity: slices created, deleted and made again through queued resources (Cloud TPU API).

Apart from `discover/`, which only reads what exists: `provision/capacity.py` changes what exists
(`slice create/delete`, `run --recreate`), through the same Cloud TPU API client (`tpulaunch.cloud_tpu`).
"""
