"""init / release, ranks and named groups (``mindspore.communication.management``).

All state lives in one :class:`CommState` instance: the live backend and the named
groups (name -> tuple of world ranks, in group-rank order). ``init()`` may be called
again: it builds a fresh backend following the *current* ``device_num`` and drops the
groups made by :func:`create_group`.
"""
from __future__ import annotations

import numbers
import os
import warnings
from typing import Optional, Tuple

import numpy as np

from .. import context
from .backend import Backend, backend_factory, registered_backends

__all__ = ["GlobalComm", "HCCL_WORLD_COMM_GROUP", "init", "release", "get_backend", "get_rank",
           "get_local_rank", "get_group_size", "get_local_rank_size", "create_group",
           "destroy_group", "get_group_rank_from_world_rank",
           "get_world_rank_from_group_rank", "group_members"]

HCCL_WORLD_COMM_GROUP = "hccl_world_group"
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_MPI_RANK_VARS = {"OMPI_COMM_WORLD_SIZE": "OMPI_COMM_WORLD_RANK", "PMI_SIZE": "PMI_RANK"}
# MindSpore's backend names: they select the default backend here.
_MINDSPORE_NAMES = ("hccl", "nccl", "mccl")
_MAX_DEVICE_NUM = 4096


class GlobalComm:
    """World communication information (as ``mindspore.communication.GlobalComm``)."""

    BACKEND = "sim"
    WORLD_COMM_GROUP = HCCL_WORLD_COMM_GROUP
    INITED = False


#: the live backend and the named groups: process state, kept in the context
_STATE = context._STATE.comm


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


# ------------------------------------------------------------------ init


def _mpi_launch() -> Optional[Tuple[str, str]]:
    for var in _MPI_SIZE_VARS:
        if os.environ.get(var):
            return var, os.environ[var]
    return None


def _configured_device_num() -> int:
    """``device_num`` as set by the user, else ``RANK_SIZE``, else 1.

    Reads the stored setting, not ``get_auto_parallel_context("device_num")``: when it was
    never set, that getter asks the backend, which is what is being replaced here.
    """
    set_num = context._STATE.auto_parallel.device_num
    if set_num is not None:
        return set_num
    env = os.environ.get("RANK_SIZE")
    if env is None or env.strip() == "":
        return 1
    try:
        value = int(env)
    except ValueError:
        value = 0
    if not 1 <= value <= _MAX_DEVICE_NUM:
        raise ValueError(f"init: environment variable RANK_SIZE={env!r} is not valid; expected "
                         f"an int in [1, {_MAX_DEVICE_NUM}]")
    return value


def _check_hand_started(launched: Optional[Tuple[str, str]]) -> None:
    """Refuse a process that says it is one of several ranks (``RANK_SIZE > 1``, as
    MindSpore's launch scripts set) but was not started by mpiexec: it would otherwise run
    alone, as rank 0 of 1, without a word."""
    if launched is not None:
        return
    raw = os.environ.get("RANK_SIZE", "").strip()
    if not raw.isdigit() or int(raw) <= 1:
        return
    n = int(raw)
    rank = os.environ.get("RANK_ID")
    which = f" (RANK_ID={rank})" if rank is not None else ""
    raise RuntimeError(f"init: environment variable RANK_SIZE={n}{which} says this process is "
                       f"one of {n} ranks, but mpiexec did not start it, so it would run "
                       f"alone; start all {n} ranks with python -m dualmode.run --worker_num "
                       f"{n} script.py (or mpiexec -n {n} python script.py), or unset "
                       f"RANK_SIZE and set_auto_parallel_context(device_num={n}) to simulate "
                       f"the {n} devices in this process (or call init('sim'))")


def _check_mpi_launch(launched: Optional[Tuple[str, str]]) -> None:
    """Refuse "mpi" in a process that mpiexec did not start (before MPI is initialised)."""
    if launched is None:
        raise RuntimeError("init: backend_name='mpi' was given, but this process was not "
                           "started by mpiexec (PMI_SIZE / OMPI_COMM_WORLD_SIZE are unset); "
                           "run it with mpiexec -n N python script.py or python -m "
                           "dualmode.run --worker_num N script.py, or use backend 'sim' to "
                           "simulate the devices in one process")
    var, value = launched
    rank_var = _MPI_RANK_VARS[var]
    if not os.environ.get(rank_var):
        raise RuntimeError(f"init: this process looks launched under MPI ({var}={value}) but "
                           f"{rank_var} is not set, so mpiexec did not start it; run it with "
                           f"mpiexec -n {value} python script.py, or unset {var} to use "
                           "backend 'sim'")


def init(backend_name: Optional[str] = None) -> None:
    """Start the communication backend.

    Parameters
    ----------
    backend_name : str or None
        ``None`` (default) picks ``"sim"`` unless the process was launched under MPI
        (``OMPI_COMM_WORLD_SIZE`` or ``PMI_SIZE`` set, as ``mpiexec`` does), which picks
        ``"mpi"`` (one device per rank). MindSpore's ``"hccl"``, ``"nccl"`` and ``"mccl"``
        mean the same default; any other name must have been registered with
        :func:`register_backend`.

    Notes
    -----
    Under "sim" the device count is the current ``device_num`` of
    :func:`dualmode.set_auto_parallel_context`; when it was never set, the environment
    variable ``RANK_SIZE``, else 1. Under "mpi" it is the MPI world size, and a
    ``device_num``, ``global_rank``, ``RANK_SIZE``, ``RANK_ID`` or ``RANK_TABLE_FILE``
    that disagrees with the world is an error raised on every rank before any collective.
    Calling ``init()`` again builds a new backend following the current ``device_num``
    and removes the groups made by :func:`create_group`.

    Raises
    ------
    RuntimeError
        ``"mpi"`` is asked for but mpi4py cannot be imported, or the MPI world does not
        match the launcher's environment.
    ValueError
        An unknown backend name, an invalid ``RANK_SIZE``, or (under "mpi") settings that
        do not match the MPI world.
    """
    if backend_name is not None and not isinstance(backend_name, str):
        raise TypeError(f"init: backend_name={backend_name!r} has type "
                        f"{type(backend_name).__name__}; expected a str or None")
    if context._STATE.ps.enable_ps:
        # parameter server mode: the role from the environment; the scheduler
        # and the servers never return from the join
        if _PS_JOIN[0] is None:
            raise RuntimeError("init: set_ps_context(enable_ps=True) needs dualmode.ps, "
                               "which is not loaded; import dualmode")
        _install(_PS_JOIN[0](backend_name))
        return
    launched = _mpi_launch()
    name = backend_name
    if name is None or name in _MINDSPORE_NAMES:
        _check_hand_started(launched)
        name = "mpi" if launched else "sim"
        if backend_name is not None:
            warnings.warn(f"init: backend_name={backend_name!r} is MindSpore's device "
                          f"backend; dualmode runs backend {name!r} in its place ("
                          + ("one device per MPI rank)" if launched else
                             "devices simulated in this process)"), stacklevel=2)
    factory = backend_factory(name)
    if factory is None:
        raise ValueError(f"init: backend_name={backend_name!r} is not a registered backend; "
                         "expected None or one of "
                         + ", ".join(repr(b) for b in registered_backends() + _MINDSPORE_NAMES))
    if name == "mpi":
        _check_mpi_launch(launched)
        # the world size comes from MPI; a configured device_num is only checked
        device_num = context._STATE.auto_parallel.device_num
    else:
        device_num = _configured_device_num()
    backend = factory(device_num)
    if not isinstance(backend, Backend):
        raise TypeError(f"init: the factory registered for {name!r} returned "
                        f"{type(backend).__name__}; expected a dualmode.communication.Backend")
    _install(backend)


def _install(backend: Backend) -> None:
    """Make `backend` the live one (after checking a configured ``global_rank``)."""
    set_rank = context._STATE.auto_parallel.global_rank
    if (set_rank is not None and len(backend.local_ranks) < backend.world_size
            and set_rank not in backend.local_ranks):
        raise ValueError(f"init: global_rank={set_rank} (set_auto_parallel_context) does not "
                         f"match this process's rank {backend.local_ranks[0]} in the "
                         f"{backend.name} backend; leave global_rank unset under "
                         f"{backend.name!r}")
    if world_backend() is not backend:
        _close(world_backend())
    _STATE.backend = stage_backend(backend, context._STATE.auto_parallel)
    _STATE.groups = {HCCL_WORLD_COMM_GROUP: tuple(range(backend.world_size))}
    _STATE.member_arrays = {}
    GlobalComm.BACKEND = backend.name
    GlobalComm.INITED = True


def _follow_context(cfg) -> None:
    """Called by :func:`dualmode.set_auto_parallel_context` before it applies ``cfg``:
    a live "sim" backend is rebuilt for a new ``device_num`` (MindSpore's order:
    ``init()`` first, then the context), keeping the named groups that still fit."""
    b = world_backend()
    _check_stages(cfg, b)
    if b is None or b.name != "sim" or cfg.device_num is None or cfg.device_num == b.world_size:
        _STATE.backend = stage_backend(b, cfg)
        return
    backend = backend_factory("sim")(cfg.device_num)
    keep = {k: v for k, v in _STATE.groups.items()
            if k != HCCL_WORLD_COMM_GROUP and max(v) < cfg.device_num}
    _install(backend)
    _STATE.backend = stage_backend(backend, cfg)
    _STATE.groups.update(keep)


context._AUTO_PARALLEL_HOOKS.append(_follow_context)

_PIPELINE_MODES = ("semi_auto_parallel", "auto_parallel")


def world_backend() -> Optional[Backend]:
    """The whole job's backend (None before :func:`init`): the live backend, or the one
    it is a pipeline stage of."""
    b = _STATE.backend
    return b.world if b is not None and b.world is not None else b


def stage_backend(world: Optional[Backend], cfg) -> Optional[Backend]:
    """The backend the parallel layer runs on: `world`, or, under pipeline parallelism
    (``pipeline_stages`` > 1 in semi_auto_parallel / auto_parallel), one stage's
    (``world.stage_view``): each stage runs its cells sharded over its
    ``device_num // pipeline_stages`` devices."""
    stages = cfg.pipeline_stages
    if world is None or stages <= 1 or cfg.parallel_mode not in _PIPELINE_MODES \
            or world.world_size % stages:
        return world
    return world.stage_view(stages)


def _check_stages(cfg, world: Optional[Backend]) -> None:
    """``pipeline_stages`` must divide the device count (the configured one, else the
    MPI world's: a "sim" backend follows ``device_num`` rather than defining it)."""
    n = cfg.device_num
    if n is None and world is not None and len(world.local_ranks) < world.world_size:
        n = world.world_size
    if cfg.pipeline_stages > 1 and n is not None and n % cfg.pipeline_stages:
        raise ValueError(f"set_auto_parallel_context: pipeline_stages="
                         f"{cfg.pipeline_stages} does not divide device_num={n}; each "
                         f"stage runs on device_num / pipeline_stages devices, so "
                         f"pipeline_stages must be a divisor of {n}")


def ensure_init(func: str) -> Backend:
    """The live backend; before any ``init()``, the one ``init()`` would make when a
    parallel mode is set with a ``device_num`` (or the process was started by mpiexec),
    else a ValueError naming ``device_num`` (never a silent single device)."""
    if _STATE.backend is not None:
        return _STATE.backend
    cfg = context._STATE.auto_parallel
    if cfg.device_num is None and _mpi_launch() is None:
        raise no_device_num_error(cfg.parallel_mode)
    init()
    return _STATE.backend


def started_backend(func: str) -> Optional[Backend]:
    """The live backend, or None in a process that runs alone. A process launched as one
    of several MPI ranks whose backend was never started gets a RuntimeError naming
    ``init()`` (`func` is the caller's op): what it asked for needs the other ranks, so
    it never runs as a silent single device."""
    if _STATE.backend is not None:
        return _STATE.backend
    launched = _mpi_launch()
    if launched is not None and launched[1].strip() not in ("", "1"):
        var, size = launched
        raise RuntimeError(f"{func}: this process is one of {size} MPI ranks ({var}={size}) "
                           f"but the communication backend is not started; call "
                           f"dualmode.communication.init() first")
    return None


def no_device_num_error(parallel_mode: str) -> ValueError:
    """The error for a parallel mode that would run on one simulated device."""
    return ValueError(f"device_num is not set: parallel_mode={parallel_mode!r} would run on "
                      "1 simulated device; "
                      "call dualmode.set_auto_parallel_context(device_num=N) (before or after "
                      "communication.init()), or launch N ranks with python -m dualmode.run "
                      "--worker_num N script.py; set device_num=1 to run one device on "
                      "purpose")


#: ``join(backend_name) -> Backend``: joining a parameter server cluster, installed by
#: :mod:`dualmode.ps` (a layer above this one) when it is imported
_PS_JOIN = [None]


def set_ps_join(join) -> None:
    """Install the function ``init()`` calls under ``set_ps_context(enable_ps=True)``."""
    _PS_JOIN[0] = join


def _close(backend: Optional[Backend]) -> None:
    """Let a backend free what it holds (MPI sub-communicators), if it can."""
    close = getattr(backend, "close", None)
    if callable(close):
        close()


def release() -> None:
    """Stop the backend and forget every group (``init()`` starts again)."""
    _close(world_backend())
    _STATE.backend = None
    _STATE.groups = {}
    _STATE.member_arrays = {}
    GlobalComm.INITED = False


def get_backend() -> Backend:
    """The live backend (under pipeline parallelism, this process's stage's); RuntimeError
    before :func:`init`."""
    _backend("get_backend")
    return _STATE.backend


def _backend(func: str) -> Backend:
    if _STATE.backend is None:
        raise RuntimeError(f"{func}: the communication backend is not initialised; call "
                           "dualmode.communication.init() first")
    return world_backend()


def _live_backend() -> Optional[Backend]:
    """The live backend, or None before :func:`init` (no error)."""
    return _STATE.backend


def _current_device_num() -> Optional[int]:
    """The live backend's device count, or None before :func:`init` (the hook
    ``dualmode.context._backend_device_num`` can read)."""
    return None if _STATE.backend is None else world_backend().world_size


def _current_rank() -> Optional[int]:
    """The first rank this process holds, or None before :func:`init` (the hook
    ``dualmode.context._backend_global_rank`` can read)."""
    return None if _STATE.backend is None else world_backend().local_ranks[0]


# ------------------------------------------------------------------ ranks


def _ranks(func: str, group) -> Tuple[int, ...]:
    if not isinstance(group, str):
        raise TypeError(f"{func}: group={group!r} has type {type(group).__name__}; expected a "
                        "group name (str)")
    _backend(func)
    ranks = _STATE.groups.get(group)
    if ranks is None:
        raise ValueError(f"{func}: group {group!r} does not exist; existing groups: "
                         + ", ".join(repr(g) for g in _STATE.groups))
    return ranks


def _my_rank(func: str) -> int:
    backend = _backend(func)
    set_rank = context._STATE.auto_parallel.global_rank
    rank = backend.local_ranks[0] if set_rank is None else set_rank
    if not 0 <= rank < backend.world_size:
        raise ValueError(f"{func}: global_rank={rank} (set_auto_parallel_context) is out of "
                         f"range for the {backend.world_size} device(s) of the {backend.name} "
                         f"backend; expected 0 <= global_rank < {backend.world_size}")
    return rank


def get_rank(group: str = HCCL_WORLD_COMM_GROUP) -> int:
    """This process's rank in ``group``.

    Under "sim" the world rank is the ``global_rank`` of
    :func:`dualmode.set_auto_parallel_context` (default 0).
    """
    rank = _my_rank("get_rank")
    if group == HCCL_WORLD_COMM_GROUP:
        return rank
    ranks = _ranks("get_rank", group)
    if rank not in ranks:
        raise ValueError(f"get_rank: this process (world rank {rank}) is not a member of group "
                         f"{group!r} (ranks {list(ranks)})")
    return ranks.index(rank)


def _node_members(func: str, group: str) -> Tuple[int, ...]:
    """The ranks of ``group`` on this process's node, in group order."""
    ranks = _ranks(func, group)
    nodes = getattr(world_backend(), "node_ids", None)
    if nodes is None:                      # every device in this process: one node
        return ranks
    mine = nodes[_my_rank(func)]
    arr = np.asarray(ranks, dtype=np.int64)
    return tuple(arr[nodes[arr] == mine].tolist())


def get_local_rank(group: str = HCCL_WORLD_COMM_GROUP) -> int:
    """This process's rank among the ranks of ``group`` on its node; under "sim" every
    device is on this node, so it equals :func:`get_rank`."""
    if getattr(world_backend(), "node_ids", None) is None:
        return get_rank(group)
    rank = _my_rank("get_local_rank")
    local = _node_members("get_local_rank", group)
    if rank not in local:
        raise ValueError(f"get_local_rank: this process (world rank {rank}) is not a member "
                         f"of group {group!r} (ranks {list(_STATE.groups[group])})")
    return local.index(rank)


def get_group_size(group: str = HCCL_WORLD_COMM_GROUP) -> int:
    """Number of ranks in ``group``."""
    return len(_ranks("get_group_size", group))


def get_local_rank_size(group: str = HCCL_WORLD_COMM_GROUP) -> int:
    """Ranks of ``group`` on this process's node; under "sim", all of them."""
    return len(_node_members("get_local_rank_size", group))


# ------------------------------------------------------------------ groups


def create_group(name: str, rank_ids) -> None:
    """Create the group ``name`` of the world ranks ``rank_ids`` (group rank i is
    ``rank_ids[i]``).

    Raises
    ------
    TypeError
        ``name`` is not a str, ``rank_ids`` not a list (or tuple) of ints.
    ValueError
        ``name`` empty, the world group's name or already used; ``rank_ids`` empty,
        with duplicates, or out of range.
    """
    func = "create_group"
    backend = _backend(func)
    if not isinstance(name, str):
        raise TypeError(f"{func}: group name {name!r} has type {type(name).__name__}; "
                        "expected a str")
    if not name:
        raise ValueError(f"{func}: group name {name!r} is empty; expected a non-empty str")
    if name == HCCL_WORLD_COMM_GROUP:
        raise ValueError(f"{func}: group name {name!r} is the world group's; pick another name")
    if name in _STATE.groups:
        raise ValueError(f"{func}: group {name!r} already exists (ranks "
                         f"{list(_STATE.groups[name])}); destroy_group({name!r}) first or "
                         "pick another name")
    if isinstance(rank_ids, np.ndarray) and rank_ids.ndim == 1:
        rank_ids = rank_ids.tolist()
    if not isinstance(rank_ids, (list, tuple)):
        raise TypeError(f"{func}: rank_ids for group {name!r} is {rank_ids!r}; expected a list "
                        "of ints")
    for i, r in enumerate(rank_ids):
        if not _is_int(r):
            raise TypeError(f"{func}: rank_ids[{i}]={r!r} for group {name!r} is not an int; "
                            "expected a list of ints")
    if len(rank_ids) == 0:
        raise ValueError(f"{func}: rank_ids for group {name!r} is empty; expected at least one "
                         "rank")
    n = backend.world_size
    for r in rank_ids:
        if not 0 <= r < n:
            raise ValueError(f"{func}: rank {int(r)} in rank_ids of group {name!r} is out of "
                             f"range for world_size={n}; expected ranks in [0, {n})")
    seen = set()
    for r in rank_ids:
        if int(r) in seen:
            raise ValueError(f"{func}: rank {int(r)} appears twice in rank_ids of group "
                             f"{name!r}; expected distinct ranks")
        seen.add(int(r))
    _STATE.groups[name] = tuple(int(r) for r in rank_ids)


def destroy_group(name: str) -> None:
    """Remove the group ``name`` made by :func:`create_group`."""
    func = "destroy_group"
    if name == HCCL_WORLD_COMM_GROUP:
        raise ValueError(f"{func}: the world group {name!r} cannot be destroyed")
    _ranks(func, name)
    del _STATE.groups[name]
    _STATE.member_arrays.pop(name, None)


def get_group_rank_from_world_rank(world_rank_id: int, group: str) -> int:
    """The rank in ``group`` of the world rank ``world_rank_id``."""
    func = "get_group_rank_from_world_rank"
    ranks = _ranks(func, group)
    if not _is_int(world_rank_id):
        raise TypeError(f"{func}: world_rank_id={world_rank_id!r} is not an int")
    if world_rank_id not in ranks:
        raise ValueError(f"{func}: world rank {world_rank_id} is not a member of group "
                         f"{group!r} (ranks {list(ranks)})")
    return ranks.index(int(world_rank_id))


def get_world_rank_from_group_rank(group: str, group_rank_id: int) -> int:
    """The world rank of rank ``group_rank_id`` of ``group``."""
    func = "get_world_rank_from_group_rank"
    ranks = _ranks(func, group)
    if not _is_int(group_rank_id):
        raise TypeError(f"{func}: group_rank_id={group_rank_id!r} is not an int")
    if not 0 <= group_rank_id < len(ranks):
        raise ValueError(f"{func}: group_rank_id={group_rank_id} is out of range for group "
                         f"{group!r} of {len(ranks)} ranks; expected [0, {len(ranks)})")
    return ranks[group_rank_id]


def group_members(name: str) -> np.ndarray:
    """The group spec of a named group: a read-only int64 array of shape (1, n), ready to
    pass as ``members`` to the backend's collectives."""
    ranks = _ranks("group_members", name)
    arr = _STATE.member_arrays.get(name)
    if arr is None:
        arr = np.asarray(ranks, dtype=np.int64).reshape(1, -1)
        arr.flags.writeable = False
        _STATE.member_arrays[name] = arr
    return arr
