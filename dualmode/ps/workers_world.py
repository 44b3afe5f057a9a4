"""The MPI world of the workers of ``python -m dualmode.run --ps``, made of independent
processes.

The launcher starts each worker as its own one-rank MPI job (``mpiexec -n 1``), so that
a worker that dies does not take the others with it: mpiexec kills every rank of a job
when one of them dies. At ``init()`` the workers join into one communicator with MPI's
dynamic processes (``MPI_Open_port`` / ``MPI_Comm_accept`` / ``MPI_Comm_connect``):
worker 0 opens a port and writes its name to ``$DM_PS_JOIN_DIR/port``; every other
worker connects to it, and the workers already joined accept (collectively) until all
``DM_WORKER_NUM`` are in. The result, ordered by worker id, is the world of the "mpi"
backend, over which the weights that are not server-held are all-reduced. A worker that
only pushes and pulls never communicates over it, so its death harms nobody; a
collective over it waits for every worker, and the launcher ends a job whose workers
wait for a dead one.
"""
from __future__ import annotations

import os
import time

from ..communication.mpi import MPIBackend

__all__ = ["JOIN_DIR_VAR", "RANK_VAR", "join_workers", "JoinedWorkersBackend"]

#: the directory where worker 0 publishes its port (set by the launcher)
JOIN_DIR_VAR = "DM_PS_JOIN_DIR"
#: this worker's id (set by the launcher for each worker's one-rank MPI job; the rank
#: wrapper and monitor read it as the rank)
RANK_VAR = "DM_PS_WORKER_RANK"


def join_workers(mpi, rank: int, size: int, join_dir: str, timeout: float):
    """The communicator of the `size` workers, in which this one (worker `rank`) has
    rank `rank`. RuntimeError when worker 0's port does not appear within `timeout`
    seconds."""
    comm = mpi.COMM_WORLD
    if size == 1:
        return comm
    path = os.path.join(join_dir, "port")
    if rank == 0:
        port = mpi.Open_port()
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(port)
        os.replace(tmp, path)
    else:
        end = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > end:
                raise RuntimeError(f"init: parameter server worker {rank}: worker 0 did not "
                                   f"publish its MPI port in {join_dir} within "
                                   f"connect_timeout={timeout:g} s; the workers of python -m "
                                   "dualmode.run --ps join through it")
            time.sleep(0.02)
        with open(path, encoding="utf-8") as fh:
            port = fh.read()
        comm = _merge(comm.Connect(port), high=True)
    while comm.Get_size() < size:
        joined = _merge(comm.Accept(port if comm.Get_rank() == 0 else None, root=0),
                        high=False)
        if comm != mpi.COMM_WORLD:
            comm.Free()
        comm = joined
    if rank == 0:
        mpi.Close_port(port)
    ordered = comm.Split(0, rank)
    comm.Free()
    return ordered


def _merge(inter, high: bool):
    """The intra-communicator of both groups of `inter` (the joined workers first)."""
    merged = inter.Merge(high=high)
    inter.Free()
    return merged


class JoinedWorkersBackend(MPIBackend):
    """The "mpi" backend over the joined workers' world. MPI places processes of
    different jobs on one machine in one node (``Split_type``), but cannot give them
    shared memory windows: the collectives take MPI's own path, never the node
    shared-memory one."""

    def _node_local(self, comm) -> bool:
        return False
