"""torch.distributed on a host: the slice's gloo group, and the user's own `init_process_group`.

tpulaunch opens the CPU (gloo) process group of the slice before the script runs (rank = process
index, world size = hosts), so `dist.all_reduce` works at once and checkpointing has its group.
Scripts written for the slice open it themselves (`dist.init_process_group("gloo",
init_method="xla://")`, or `env://` from `MASTER_ADDR`/`RANK`/`WORLD_SIZE`, which tpulaunch also
pushes). Such a call must not fail with "trying to initialize the default process group twice":

* a call the slice's group already satisfies (gloo or no backend named; world size and rank
  absent or equal to ours; no store of its own) is handed the existing group: it returns at once;
* any other call (another backend, other ranks, its own store) steps around ours: tpulaunch's
  group is destroyed and the user's call runs as it would on a plain host, errors and all.

`dist.destroy_process_group()` by the user works as usual; a later `init_process_group` then
creates a new group from the pushed environment.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpulaunch.plan.contract import HostState

# The group's store listens on a port of its own (`group_address`), never MASTER_PORT: a script
# that destroys it and makes its own group over env:// must not reach a listener that is closing.
# It is held weakly too: a strong reference would keep that store alive after the user destroys
# the group.
_OURS: dict[str, Any] = {"group": lambda: None, "rank": None, "world": None, "backends": ("gloo", "cpu:gloo")}


def dist_timeout() -> datetime.timedelta:
    """How long a collective may wait for the other hosts (`TPULAUNCH_DIST_TIMEOUT`, 300 s)."""
    from tpulaunch import settings

    return datetime.timedelta(seconds=settings.host_seconds("TPULAUNCH_DIST_TIMEOUT"))


def init_slice_group(state: HostState) -> None:
    """Open the slice's gloo group (tcp:// to the coordinator) and let user inits adopt it."""
    init_group("gloo", f"tcp://{state.endpoints.group_address}", state.process_index, state.num_processes)


def init_group(backend: str, init_method: str, rank: int, world_size: int,
               also_satisfies: tuple[str, ...] = ()) -> None:
    """Open the default group and let a user's `init_process_group` that asks for no more (or for
    one of `also_satisfies`, backends this group stands in for) adopt it."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=dist_timeout())
    _OURS.update(group=weakref.ref(dist.distributed_c10d._get_default_group()), rank=rank, world=world_size,
                 backends=(backend, f"cpu:{backend}", *also_satisfies))
    _install_adoption()


def _is_ours_and_alive() -> bool:
    import torch.distributed as dist

    ours = _OURS["group"]()
    return ours is not None and dist.is_initialized() and dist.distributed_c10d._get_default_group() is ours


def _satisfied_by_ours(arguments: dict) -> bool:
    backend = arguments.get("backend")
    backend_ok = backend is None or str(backend).lower() in (*_OURS["backends"], "undefined")
    return (backend_ok
            and int(arguments.get("world_size", -1)) in (-1, _OURS["world"])
            and int(arguments.get("rank", -1)) in (-1, _OURS["rank"])
            and arguments.get("store") is None
            and not arguments.get("group_name"))


def _adopting(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if _is_ours_and_alive():
            import torch.distributed as dist

            if _satisfied_by_ours(signature.bind_partial(*args, **kwargs).arguments):
                return None
            dist.destroy_process_group()
        return original(*args, **kwargs)

    init_process_group.__tpulaunch_adopting__ = True  # type: ignore[attr-defined]  # our mark: patched once
    return init_process_group


def _install_adoption() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if getattr(dist.init_process_group, "__tpulaunch_adopting__", False):
        return
    wrapped = _adopting(c10d.init_process_group)
    dist.init_process_group = wrapped
    c10d.init_process_group = wrapped


def shutdown() -> None:
    """Destroy whatever default group is left (ours, or the one the user made), best effort."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # on the way out
        pass
