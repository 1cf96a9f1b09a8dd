"""The plan: pure data from the slice to every host's environment. No network, no runtime.

`catalog` (TPU generations) -> `topology` (one slice) -> `mesh` (the device mesh) ->
`launch` (per-host environment); `slicespec` is what discovery found. Only the standard
library is imported here, so `--dry-run`, `mesh inspect` and most tests are fast and exact.
"""
