"""Run under mpiexec: ``count`` gradients of ``elems`` float32 per rank, AllReduced four
ways, round by round in the same job. Rank 0 prints the medians as JSON on its last line.

* ``unfused``: ``backend.all_reduce`` on each gradient (one MPI ``Allreduce`` each);
* ``fused``: ``fused_all_reduce`` on all of them (packed into one buffer, reduced at once:
  through node shared memory when the ranks share a machine, else one ``Allreduce``);
* ``raw_unfused`` / ``raw_fused``: the same two with no dualmode code at all -- mpi4py's
  ``Allreduce`` on each preallocated gradient into a preallocated result, and ONE
  ``Allreduce(MPI.IN_PLACE)`` on a preallocated buffer of all of them (no packing). Their
  ratio is what fusing gains with MPI's own collective alone, the reference beside
  fused / unfused.

Each round runs the four once each, after a ``Barrier``, starting at a different one each
round (so none always runs first after the barrier); a round's time for a variant is the
slowest rank's (a collective ends when its last rank does). The medians over rounds are
printed as seconds: ``{"unfused_s", "fused_s", "raw_unfused_s", "raw_fused_s", "rounds",
"ranks"}``, with the quartiles of each in ``"q1_s"``/``"q3_s"`` to show the noise.

Usage: ``mpiexec -n 4 python bench/mpi_fusion.py ELEMS COUNT ROUNDS``
"""
import json
import sys
import time

import numpy as np

from dualmode.communication import fused_all_reduce
from dualmode.communication.mpi import MPIBackend

VARIANTS = ("unfused", "fused", "raw_unfused", "raw_fused")
WARMUP = 2


def main(elems, count, rounds):
    b = MPIBackend(None)
    mpi, comm, rank = b._mpi, b.comm, b.local_ranks[0]
    rng = np.random.default_rng(rank)
    grads = [rng.standard_normal((1, elems), dtype=np.float32) for _ in range(count)]

    want = [b.all_reduce(g)[0] for g in grads]
    got = fused_all_reduce(grads, backend=b)
    # MPI may pick another reduction order for the larger buffer: equal within rounding
    assert all(np.allclose(w, g[0], rtol=1e-5, atol=1e-5) for w, g in zip(want, got)), \
        "fused != unfused"

    flat = [g[0] for g in grads]
    outs = [np.empty_like(f) for f in flat]
    # in place, so round after round sums the buffer into itself: zeros keep it finite
    # (the sum of float32s takes the same time whatever the values)
    whole = np.zeros(elems * count, dtype=np.float32)

    def raw_unfused():
        for f, o in zip(flat, outs):
            comm.Allreduce(f, o, op=mpi.SUM)

    fns = {"unfused": lambda: [b.all_reduce(g) for g in grads],
           "fused": lambda: fused_all_reduce(grads, backend=b),
           "raw_unfused": raw_unfused,
           "raw_fused": lambda: comm.Allreduce(mpi.IN_PLACE, whole, op=mpi.SUM)}
    times = np.empty((WARMUP + rounds, len(VARIANTS)))
    for r in range(WARMUP + rounds):
        for k in range(len(VARIANTS)):
            j = (r + k) % len(VARIANTS)
            fn = fns[VARIANTS[j]]
            comm.Barrier()
            t = time.perf_counter()
            fn()
            times[r, j] = time.perf_counter() - t
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=mpi.MAX)
    if rank == 0:
        kept = slowest[WARMUP:]
        med, q1, q3 = (np.percentile(kept, q, axis=0) for q in (50, 25, 75))
        out = {f"{v}_s": float(m) for v, m in zip(VARIANTS, med)}
        out.update(q1_s=dict(zip(VARIANTS, q1.tolist())), q3_s=dict(zip(VARIANTS, q3.tolist())),
                   rounds=rounds, ranks=b.world_size)
        print(json.dumps(out))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
