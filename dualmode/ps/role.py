"""``communication.init()`` under ``set_ps_context(enable_ps=True)``: join as this
process's role.

The scheduler and the servers serve until the workers are done and then end the
process (``sys.exit``: 0, or 1 when the job failed), so only workers run the rest of the
script. A worker joins and returns its backend: the MPI backend when ``mpiexec``
started it (its MPI rank is its worker id; the weights not held by the servers are
all-reduced among the workers; under ``python -m dualmode.run --ps`` each worker is its
own MPI job and the workers join into one world, :mod:`.workers_world`), else a
:class:`~.backend.PSWorkerBackend` (worker id and count, no collectives).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from .. import context
from ..communication import management
from ..communication.backend import Backend, backend_factory
from ..communication.mpi import load_mpi
from .backend import PSWorkerBackend
from .env import read_env
from .scheduler import log, run_scheduler
from .server import run_server
from .worker import WorkerClient
from .workers_world import JOIN_DIR_VAR, RANK_VAR, JoinedWorkersBackend, join_workers

__all__ = ["join"]


def join(backend_name: Optional[str]) -> Backend:
    """Join the parameter server cluster as the environment says (never returns on the
    scheduler and the servers)."""
    cfg = context._STATE.ps
    client = context._STATE.ps_role
    if client is not None:                         # init() again on a worker
        return context._STATE.comm.backend
    env = read_env()
    if env.role in ("scheduler", "server"):
        run = run_scheduler if env.role == "scheduler" else run_server
        status = run(env, cfg)
        log(env.role, f"exiting with status {status}")
        sys.stdout.flush()
        sys.exit(status)
    launched = management._mpi_launch()
    if backend_name not in (None, "mpi") + management._MINDSPORE_NAMES:
        raise ValueError(f"init: backend_name={backend_name!r} cannot run a parameter server "
                         "worker; expected None (MPI when launched by mpiexec, else none)")
    if launched is None and backend_name == "mpi":
        management._check_mpi_launch(None)             # raises: mpiexec did not start us
    if launched is not None:
        management._check_mpi_launch(launched)
        join_dir = os.environ.get(JOIN_DIR_VAR)
        if join_dir:
            # the launcher's workers: one-rank MPI jobs that join into one world
            comm = join_workers(load_mpi(), int(os.environ[RANK_VAR]), env.worker_num,
                                join_dir, cfg.connect_timeout)
            os.environ["PMI_RANK"] = str(comm.Get_rank())     # this world's, not the job's
            os.environ["PMI_SIZE"] = str(comm.Get_size())
            backend = JoinedWorkersBackend(context._STATE.auto_parallel.device_num, comm=comm)
        else:
            backend = backend_factory("mpi")(context._STATE.auto_parallel.device_num)
        if backend.world_size != env.worker_num:
            raise ValueError(f"init: DM_WORKER_NUM (MS_WORKER_NUM)={env.worker_num} does not "
                             f"match the {backend.world_size} MPI ranks of this job; start "
                             "one MPI rank per worker")
        rank = backend.local_ranks[0]
    else:
        backend, rank = None, None
    client = WorkerClient(env, cfg, rank)
    client.join()
    context._STATE.ps_role = client
    if backend is None:
        backend = PSWorkerBackend(env.worker_num, client.rank)
    log("worker", f"worker {client.rank} of {env.worker_num} joined (pid {os.getpid()}); "
        f"servers: {', '.join(client.servers)}")
    return backend
