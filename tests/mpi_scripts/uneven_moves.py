"""Moves of pieces of unequal size between MPI processes (one device each): every pair
of layouts below, run under ``mpiexec -n 4 python uneven_moves.py OUT.npz``, gives each
rank exactly its destination piece; rank 0 writes, per case, whether every rank did and
the bytes per device CommReport recorded."""
import sys

import numpy as np

from dualmode import communication
from dualmode.parallel import CommReport, Layout, TensorLayout
from dualmode.parallel.redistribution import redistribute

L = Layout((2, 2), ("a", "b"))
SHAPE = (7, 5)


def cases():
    """(name, src, dst) pairs on 4 devices of a (7, 5) tensor."""
    split0 = L(("a", "b"), "None").bind(SHAPE)              # rows 2, 2, 2, 1
    half = L("a", "None").bind(SHAPE)                       # rows 4, 3 (replicated over b)
    cols = L("None", ("a", "b")).bind(SHAPE)                # columns 2, 1, 1, 1
    grid = L("a", "b").bind(SHAPE)
    whole = TensorLayout.replicated(SHAPE, (2, 2))
    pending = TensorLayout((2, 2), ((), ()), SHAPE, partial=(1,))
    pending_rows = TensorLayout((2, 2), ((0,), ()), SHAPE, partial=(1,))
    return [("split_to_whole", split0, whole), ("whole_to_split", whole, split0),
            ("rows_to_columns", split0, cols), ("four_to_two", split0, half),
            ("two_to_four", half, split0), ("grid_to_rows", grid, split0),
            ("pending_to_split", pending, split0), ("pending_rows_to_grid", pending_rows, grid),
            ("pending_to_whole", pending, whole)]


def stack_of(x, lay, ranks):
    """This process's stack of `x` in `lay`; pending sums as shares 1/4, 3/4."""
    blocks = lay.without_partial().local_blocks_of(x, ranks)
    if not lay.partial:
        return blocks
    coord = lay.rank_coords[list(ranks)][:, list(lay.partial)].sum(axis=1)
    return blocks * np.where(coord == 0, 0.25, 0.75).reshape((-1,) + (1,) * x.ndim)


def run():
    communication.init()
    ranks = communication.get_backend().local_ranks
    x = np.arange(35, dtype=np.float64).reshape(SHAPE) + 1.0
    ok, nbytes = [], []
    for name, src, dst in cases():
        with CommReport() as rep:
            out = redistribute(stack_of(x, src, ranks), src, dst)
        want = dst.local_blocks_of(x, ranks)
        ok.append(bool(out.shape == want.shape and np.allclose(out, want)))
        nbytes.append(sum(r.bytes_per_device for r in rep.records))
    return ok, nbytes


if __name__ == "__main__":
    ok, nbytes = run()
    # every rank's verdict per case: the minimum over the ranks
    every = np.asarray(communication.get_backend().all_reduce(np.asarray([ok], float),
                                                              op="min"))[0]
    if communication.get_rank() == 0:
        np.savez(sys.argv[1], ok=every, nbytes=np.asarray(nbytes))
