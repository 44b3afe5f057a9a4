"""The start the collectives check scripts share (run under ``mpiexec -n N script.py
N``): the live "mpi" backend, checked to hold this rank alone out of the N the command
line names, and a "sim" backend of N devices to compare with."""
import sys

import numpy as np

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


def data(shapes, dtype, seed, n, ints=(1, 5), exact=False):
    """One global stack ``(n, *shape)`` per shape, the same on every rank: booleans,
    integers drawn from `ints` (low, high), floats around 2 — or, when `exact`, integers
    from `ints` in a float dtype too (sums, products and halvings of such small values
    are exact in any order)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    out = []
    for shape in shapes:
        if dtype.kind == "b":
            out.append(rng.random((n,) + shape) < 0.5)
        elif dtype.kind in "iu" or exact:
            out.append(rng.integers(*ints, size=(n,) + shape).astype(dtype))
        else:
            out.append((rng.standard_normal((n,) + shape) + 2.0).astype(dtype))
    return out
