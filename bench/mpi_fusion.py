"""Run under mpiexec: ``count`` gradients of ``elems`` float32 per rank through one
collective five ways, round by round in the same job. Rank 0 prints the medians as JSON
on its last line.

``KIND`` is the collective:

* ``allreduce``: each gradient AllReduced;
* ``reduce_scatter``: each gradient reduce-scattered along its first axis (each rank
  keeps ``elems / ranks`` of it, as a sharded optimizer's gradient);
* ``all_gather``: each rank's ``elems / ranks`` shard of every gradient gathered back
  to ``elems`` (as sharded weights before their use).

The five variants:

* ``unfused``: the backend's collective on each gradient (one MPI call each);
* ``fused``: ``fused_all_reduce`` / ``fused_reduce_scatter`` / ``fused_all_gather`` on
  all of them (packed into one pooled buffer; through node shared memory when the ranks
  share a machine, else one MPI call);
* ``generic``: the same fused collective the backend-agnostic way (``Backend``'s packing
  implementation: fresh buffers each call, then one MPI collective) -- what the "mpi"
  backend ran before it had its own;
* ``raw_unfused`` / ``raw_fused``: the same with no dualmode code at all -- mpi4py's
  collective on each preallocated gradient into a preallocated result, and ONE
  collective on a preallocated buffer of all of them (no packing, no unpacking). Their
  ratio is what fusing gains with MPI's own collective alone, the reference beside
  fused / unfused.

Each round runs the five once each, after a ``Barrier``, starting at a different one
each round (so none always runs first after the barrier); a round's time for a variant
is the slowest rank's (a collective ends when its last rank does). The medians over
rounds are printed as seconds: ``{"<variant>_s", "rounds", "ranks", "kind", "pinned",
"load"}``, with the
quartiles of each in ``"q1_s"``/``"q3_s"`` to show the noise, and rank 0's median minor
page faults per call of each variant in ``"faults"``.

The machine's load average before and after the job is printed too (``"load"``): with
4 busy-polling ranks on 2 cores, any other process running makes the many small
collectives of the unfused variants several times slower (see bench/test_bench_mpi.py).

``PIN=1`` binds each rank to one core first (:func:`pin_rank`); the default 0 leaves
the placement to the kernel. On this 2-core machine binding 4 ranks made the jobs
slower, not steadier (bench/test_bench_mpi.py); kept to repeat that measurement.

Usage: ``mpiexec -n 4 python bench/mpi_fusion.py KIND ELEMS COUNT ROUNDS [PIN]``
"""
import json
import os
import resource
import sys
import time

import numpy as np

from dualmode.communication import fused_all_reduce
from dualmode.communication.backend import Backend
from dualmode.communication.fusion import fused_all_gather, fused_reduce_scatter
from dualmode.communication.mpi import MPIBackend

VARIANTS = ("unfused", "fused", "generic", "raw_unfused", "raw_fused")
KINDS = ("allreduce", "reduce_scatter", "all_gather")
WARMUP = 2


def pin_rank(rank):
    """Bind this process to one of the cores it may run on: rank ``r`` to the
    ``r % cores``-th (as MPICH's ``mpiexec -bind-to core`` places ranks). Unbound, the
    kernel moves oversubscribed ranks between cores as it likes, and which ranks share
    a core swings a job of many small collectives by up to 10x from one job to the
    next; bound, two ranks that exchange messages may share a core for good, as here
    with 4 ranks on 2 cores. Every thread of the process is bound (MPI or BLAS may have started some);
    threads started later inherit the binding. Returns the core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {core})
    return core


def _faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _variants(kind, b, elems, count):
    """name -> no-argument function for each variant, after checking that the fused
    results equal the unfused ones."""
    mpi, comm, rank, n = b._mpi, b.comm, b.local_ranks[0], b.world_size
    rng = np.random.default_rng(rank)
    size = elems // n if kind == "all_gather" else elems
    grads = [rng.standard_normal((1, size), dtype=np.float32) for _ in range(count)]
    flat = [g[0] for g in grads]
    # in place, so round after round sums the buffer into itself: zeros keep it finite
    # (the sum of float32s takes the same time whatever the values)
    whole = np.zeros(size * count, dtype=np.float32)
    if kind == "allreduce":
        plan = b.plan("fused_all_reduce", None)
        alone, fused = (lambda: [b.all_reduce(g) for g in grads],
                        lambda: fused_all_reduce(grads, backend=b))
        generic = lambda: Backend._all_reduce_fused(b, grads, plan, "sum")
        outs = [np.empty_like(f) for f in flat]

        def raw_unfused():
            for f, o in zip(flat, outs):
                comm.Allreduce(f, o, op=mpi.SUM)

        raw_fused = lambda: comm.Allreduce(mpi.IN_PLACE, whole, op=mpi.SUM)
    elif kind == "reduce_scatter":
        plan = b.plan("fused_reduce_scatter", None)
        alone, fused = (lambda: [b.reduce_scatter(g, axis=0) for g in grads],
                        lambda: fused_reduce_scatter(grads, backend=b))
        generic = lambda: Backend._reduce_scatter_fused(b, grads, plan, [0] * count, "sum")
        outs = [np.empty(size // n, np.float32) for _ in flat]

        def raw_unfused():
            for f, o in zip(flat, outs):
                comm.Reduce_scatter_block(f, o, op=mpi.SUM)

        raw_fused = lambda: comm.Reduce_scatter_block(mpi.IN_PLACE, whole, op=mpi.SUM)
    else:
        plan = b.plan("fused_all_gather", None)
        alone, fused = (lambda: [b.all_gather(g, axis=0) for g in grads],
                        lambda: fused_all_gather(grads, backend=b))
        generic = lambda: Backend._all_gather_fused(b, grads, plan, [0] * count)
        outs = [np.empty(size * n, np.float32) for _ in flat]
        gathered = np.empty(size * count * n, np.float32)

        def raw_unfused():
            for f, o in zip(flat, outs):
                comm.Allgather(f, o)

        raw_fused = lambda: comm.Allgather(whole, gathered)
    # MPI may pick another reduction order for the larger buffer: equal within rounding
    for name, fn in (("fused", fused), ("generic", generic)):
        assert all(np.allclose(w, g, rtol=1e-5, atol=1e-5) for w, g in zip(alone(), fn())), \
            f"{kind}: {name} != unfused"
    return {"unfused": alone, "fused": fused, "generic": generic,
            "raw_unfused": raw_unfused, "raw_fused": raw_fused}


def main(kind, elems, count, rounds, pin=0):
    if kind not in KINDS:
        raise SystemExit(f"mpi_fusion.py: KIND={kind!r} is not valid; expected one of {KINDS}")
    b = MPIBackend(None)
    comm, rank = b.comm, b.local_ranks[0]
    if pin:
        pin_rank(rank)
    fns = _variants(kind, b, elems, count)
    load = [os.getloadavg()[0]]
    times = np.empty((WARMUP + rounds, len(VARIANTS)))
    faults = np.empty_like(times)
    for r in range(WARMUP + rounds):
        for k in range(len(VARIANTS)):
            j = (r + k) % len(VARIANTS)
            fn = fns[VARIANTS[j]]
            comm.Barrier()
            f0 = _faults()
            t = time.perf_counter()
            fn()
            times[r, j] = time.perf_counter() - t
            faults[r, j] = _faults() - f0
    load.append(os.getloadavg()[0])
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=b._mpi.MAX)
    if rank == 0:
        kept = slowest[WARMUP:]
        med, q1, q3 = (np.percentile(kept, q, axis=0) for q in (50, 25, 75))
        out = {f"{v}_s": float(m) for v, m in zip(VARIANTS, med)}
        out.update(q1_s=dict(zip(VARIANTS, q1.tolist())), q3_s=dict(zip(VARIANTS, q3.tolist())),
                   faults=dict(zip(VARIANTS, np.median(faults[WARMUP:], axis=0).tolist())),
                   rounds=rounds, ranks=b.world_size, kind=kind, pinned=bool(pin), load=load)
        print(json.dumps(out))
    b.close()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:6]))
