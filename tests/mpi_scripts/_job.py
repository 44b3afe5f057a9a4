"""The start the collectives check scripts share (run under ``mpiexec -n N script.py
N``): the live "mpi" backend, checked to hold this rank alone out of the N the command
line names, and a "sim" backend of N devices to compare with."""
import sys

import dualmode.communication as comm
from dualmode.communication import SimBackend


def start():
    """``(backend, world size, rank, sim backend)`` after ``init()``."""
    comm.init()
    backend = comm.get_backend()
    n, rank = backend.world_size, comm.get_rank()
    assert backend.name == "mpi", backend
    assert backend.local_ranks == (rank,), backend.local_ranks
    assert comm.get_group_size() == n, comm.get_group_size()
    assert n == int(sys.argv[1]), (n, sys.argv)
    return backend, n, rank, SimBackend(n)
