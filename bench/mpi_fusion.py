"""Run under mpiexec: 100 gradients of `elems` float32 per rank AllReduced one by one vs
fused (``fused_all_reduce``: one packed buffer, one Allreduce). Rank 0 prints the median
seconds of each as JSON on its last line."""
import json
import sys
import time

import numpy as np

from dualmode.communication import fused_all_reduce
from dualmode.communication.mpi import MPIBackend


def _median(fn, rounds):
    times = []
    for _ in range(rounds + 2):                      # two warm-up rounds
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times[2:]))


def main(elems, count, rounds):
    b = MPIBackend(None)
    rng = np.random.default_rng(b.local_ranks[0])
    grads = [rng.standard_normal((1, elems), dtype=np.float32) for _ in range(count)]
    want = [b.all_reduce(g)[0] for g in grads]
    got = fused_all_reduce(grads, backend=b)
    # MPI may pick another reduction order for the larger buffer: equal within rounding
    assert all(np.allclose(w, g[0], rtol=1e-5, atol=1e-5) for w, g in zip(want, got)), \
        "fused != unfused"
    b.barrier()
    unfused = _median(lambda: [b.all_reduce(g) for g in grads], rounds)
    b.barrier()
    fused = _median(lambda: fused_all_reduce(grads, backend=b), rounds)
    if b.local_ranks[0] == 0:
        print(json.dumps({"unfused_s": unfused, "fused_s": fused}))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
