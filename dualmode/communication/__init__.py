"""dualmode.communication: devices, groups and collectives (MindSpore's names).

    import dualmode as dm
    dm.set_auto_parallel_context(device_num=8)
    dm.communication.init()              # backend "sim": 8 devices in this process
    dm.communication.get_group_size()    # 8

Under ``mpiexec -n 8 python script.py`` (or ``python -m dualmode.run --worker_num 8
script.py``) the same ``init()`` starts backend "mpi": one device per rank.

Layers above use :func:`get_backend` and its collectives on stacks (see
:mod:`~dualmode.communication.backend`), :func:`axis_groups` / :func:`group_members` for
group specs, and :mod:`~dualmode.communication.trace` to attribute collectives to ops.
"""
from . import sim  # noqa: F401  (registers the "sim" backend)
from . import mpi  # noqa: F401  (registers the "mpi" backend; imports mpi4py only at init)
from .backend import OPS, Backend, register_backend, registered_backends
from .fusion import fused_all_reduce, fusion_offsets
from .groups import GroupPlan, axis_groups
from .management import (HCCL_WORLD_COMM_GROUP, GlobalComm, _current_device_num,
                         _current_rank, _live_backend, create_group, destroy_group, get_backend,
                         get_group_rank_from_world_rank, get_group_size, get_local_rank,
                         get_local_rank_size, get_rank, get_world_rank_from_group_rank,
                         group_members, init, release)
from .mpi import MPIBackend
from .rank_table import RankTable, load_rank_table
from .sim import SimBackend
from .trace import comm_cause

__all__ = [
    "init", "release", "get_rank", "get_local_rank", "get_group_size", "get_local_rank_size",
    "create_group", "destroy_group", "get_group_rank_from_world_rank",
    "get_world_rank_from_group_rank", "group_members", "GlobalComm", "HCCL_WORLD_COMM_GROUP",
    "register_backend", "registered_backends", "get_backend", "Backend", "SimBackend",
    "MPIBackend", "RankTable", "load_rank_table",
    "GroupPlan", "axis_groups", "OPS", "fused_all_reduce", "fusion_offsets", "comm_cause",
]
