"""Run under ``mpiexec -n N``: ``fused_all_reduce`` on backend "mpi" equals the "sim"
backend's, and its pooled fusion buffers never overwrite a result still held.

Each rank builds the same global stacks (N, *shape) from one seed, fuses them with
SimBackend on the full stacks and with the live "mpi" backend on its own rows, and
compares its rows: every op, MPI dtypes and float16, world, permuted, axis and partial
groups, through node shared memory (one shared AllReduce per bucket) and through MPI's
``Allreduce`` (one per bucket; float16 gathered), non-contiguous and empty stacks. Then
the pool: a held result survives later buckets of the same size
(whose buffers are new), a dropped one's buffer is handed out again, the pool stays
bounded. Any mismatch raises, which aborts the whole job. Prints
"fused ok: <count> checks on <N> ranks" on rank 0.
"""

import numpy as np

import dualmode.communication as comm
from dualmode.communication import axis_groups, fused_all_reduce
from dualmode.communication import mpi as mpi_backend
from _job import data as job_data, start          # tests/mpi_scripts/_job.py

B, N, R, SIM = start()
CHECKS = [0]
SHAPES = [(3, 4), (5,), (2, 2, 2), ()]


def data(shapes, dtype, seed):
    """One global stack (N, *shape) per shape, the same on every rank."""
    return job_data(shapes, dtype, seed, N)


def check(what, full, mine):
    """My rows of the sim results `full` equal the mpi results `mine`."""
    assert len(full) == len(mine), f"{what}: {len(mine)} results, want {len(full)}"
    for i, (f, m) in enumerate(zip(full, mine)):
        want = np.asarray(f)[R]
        assert m.shape == (1,) + want.shape, f"{what}[{i}]: shape {m.shape} vs {want.shape}"
        assert m.dtype == want.dtype, f"{what}[{i}]: dtype {m.dtype} vs {want.dtype}"
        if want.dtype.kind == "f":         # MPI may add in another order: within rounding
            rtol = {2: 1e-2, 4: 1e-5}.get(want.dtype.itemsize, 1e-12)
            ok = np.allclose(m[0], want, rtol=rtol, atol=rtol * N * 10)
        else:
            ok = np.array_equal(m[0], want)
        if not ok:
            raise AssertionError(f"rank {R}: {what}[{i}]: mpi {m[0]!r} != sim {want!r}")
        CHECKS[0] += 1


def both(what, stacks, members=None, op="sum"):
    mine = fused_all_reduce([s[R:R + 1] for s in stacks], members, op, backend=B)
    check(what, fused_all_reduce(stacks, members, op, backend=SIM), mine)
    return mine


FULL = [None, [list(range(N))[::-1]], [[r] for r in range(N)]]
PARTIAL = [[[1]]]                       # rank 0 (and others) in no group
if N >= 4:
    FULL += [axis_groups((2, N // 2), 0), axis_groups((2, N // 2), 1)]
    PARTIAL += [[[0, 2]], [[3, 1]]]

seed = 0
NODE_LOCAL = B._node_local
for path in ("shared_allreduce", "Allreduce"):      # node shared memory, then plain MPI
    if path == "Allreduce":                          # as when the ranks span machines
        B._node_local = lambda c: False
    for members in FULL + PARTIAL:
        in_group = members is None or any(R in row for row in members)
        grouped = in_group and (members is None or
                                len(next(r for r in members if R in r)) > 1)
        for dtype in ["float32", "float64", "int32", "bool", "float16"]:
            kind = np.dtype(dtype).kind
            ops = ["sum", "max", "min", "prod"] + (["mean"] if kind == "f" else [])
            for op in ops:
                seed += 1
                tag = f"fused[{path}](members={members}, {dtype}, {op})"
                before = B.mpi_calls.get(path, 0)
                both(tag, data(SHAPES, dtype, seed), members, op)
                calls = B.mpi_calls.get(path, 0) - before
                if path == "shared_allreduce" or dtype != "float16":   # else: gathered
                    assert calls == (1 if grouped else 0), f"{tag}: {calls} {path} calls"
    B._node_local = NODE_LOCAL

# a non-contiguous stack, an empty one; the inputs are left as they were
x = data([(4, 6), (3,)], "float32", 500)
stacks = [x[0][:, :, ::2], np.zeros((N, 0, 3), np.float32), x[1]]
kept = [s.copy() for s in stacks]
both("fused(non-contiguous, empty)", stacks)
for s, k in zip(stacks, kept):
    assert np.array_equal(s, k), "fused_all_reduce wrote into its input"
assert fused_all_reduce([], backend=B) == []

# the pool: a held result is never overwritten, a dropped one's buffer comes back
a, b = data([(64,), (8, 8)], "float32", 600), data([(64,), (8, 8)], "float32", 601)
held = both("fused(a)", a)
want_a = [h.copy() for h in held]
later = both("fused(b), a held", b)     # same sizes: must not reuse a's buffer
assert not np.shares_memory(held[0], later[0]), "a held result's buffer was reused"
for h, w in zip(held, want_a):
    assert np.array_equal(h, w), "a later bucket overwrote a result still held"
pooled = len(B._fusion_pool)
del held, later, h
again = both("fused(a) again", a)
assert any(again[0].base is p for p in B._fusion_pool), "a free pooled buffer was not reused"
assert len(B._fusion_pool) == pooled, (len(B._fusion_pool), pooled)
del again
many = [both(f"fused(held {k})", data([(16,), (4,)], "float64", 700 + k))
        for k in range(2 * mpi_backend._FUSION_POOL)]       # all held at once
assert len(B._fusion_pool) == mpi_backend._FUSION_POOL, len(B._fusion_pool)
for k, got in enumerate(many):                              # none overwritten by another
    check(f"fused(held {k}) after all", fused_all_reduce(
        data([(16,), (4,)], "float64", 700 + k), backend=SIM), got)

comm.release()
if R == 0:
    print(f"fused ok: {CHECKS[0]} checks on {N} ranks")
