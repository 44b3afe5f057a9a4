"""Run under ``mpiexec -n N``: ``fused_reduce_scatter`` / ``fused_all_gather`` on backend
"mpi" give exactly what the unfused collectives give, one collective per bucket, and
their pooled buffers never overwrite a result still held.

Each rank builds the same global stacks (N, *shape) from one seed and compares, on its
own rows, the fused "mpi" results with (a) ``reduce_scatter`` / ``all_gather`` of each
stack alone on "mpi" and (b) the "sim" backend on the full stacks. Both paths: node
shared memory (the ranks of this job share one machine) and MPI's own collectives (as
when the ranks span machines). Every op, MPI dtypes and float16, world, permuted, axis
and one-rank groups, mixed split axes, non-contiguous, replicated (stride-0) and empty
stacks. Integer-valued floats add up exactly in any order, so there the fused result
must equal the unfused one bit for bit whatever order MPI adds in; random floats
reduced in node shared memory must equal the sum in member order bit for bit, and agree
with MPI's unfused collective and "sim" within rounding. Then the pool and the shared
window: a held result survives later buckets, a dropped one's buffer is handed out
again, the pool stays bounded, a larger bucket grows the window, a member slow to read
the shared window never sees it overwritten by the next collectives. Any mismatch raises,
which aborts the whole job. Prints "fused rs/ag ok: <count> checks on <N> ranks" on
rank 0.
"""
import time

import numpy as np

import dualmode.communication as comm
from dualmode.communication import axis_groups, fused_all_reduce
from dualmode.communication.fusion import fused_all_gather, fused_reduce_scatter
from dualmode.communication import mpi as mpi_backend
from _job import data as job_data, start          # tests/mpi_scripts/_job.py

B, N, R, SIM = start()
CHECKS = [0]
#: ReduceScatter buckets: every split dim divisible by 4 (and 2); mixed axes
RS_SHAPES, RS_AXES = [(8, 3), (4, 8), (8,), (4, 2, 8), (4,)], [0, 1, 0, 2, 0]
AG_SHAPES, AG_AXES = [(2, 3), (3, 5), (7,), (2, 2, 3), (1,)], [0, 1, 0, 2, 0]


def data(shapes, dtype, seed, exact):
    """One global stack (N, *shape) per shape, the same on every rank; `exact`: small
    integer values (their sums, products and halvings are exact in any order)."""
    return job_data(shapes, dtype, seed, N, ints=(-4, 5), exact=exact)


def same(what, want, got, exact=True):
    """The results `got` (this rank's, (1, *shape) each) equal `want`, bit for bit when
    `exact`, else within float rounding."""
    assert len(want) == len(got), f"{what}: {len(got)} results, want {len(want)}"
    for i, (w, g) in enumerate(zip(want, got)):
        w = np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, \
            f"{what}[{i}]: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        if exact:
            ok = np.array_equal(g, w)
        else:
            rtol = {2: 1e-2, 4: 1e-5}.get(w.dtype.itemsize, 1e-12)
            ok = np.allclose(g, w, rtol=rtol, atol=rtol * N * 10)
        if not ok:
            raise AssertionError(f"rank {R}: {what}[{i}]: fused {g!r} != {w!r}")
        CHECKS[0] += 1


def mine(stacks):
    return [s[R:R + 1] for s in stacks]


def member_order_rs(stacks, members, axes, op):
    """Hand reduction: my part of each stack's reduction over my group, the rows added
    one after the other in member order (as node shared memory and "sim" do)."""
    row = next(r for r in (members or [list(range(N))]) if R in r)
    n, j = len(row), row.index(R)
    ufunc = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
             "prod": np.multiply}[op]
    out = []
    for s, a in zip(stacks, axes):
        acc = s[row[0]].copy()
        for r in row[1:]:
            acc = ufunc(acc, s[r]).astype(s.dtype)
        if op == "mean":
            acc = (acc / np.asarray(n, s.dtype)).astype(s.dtype)
        out.append(np.split(acc, n, axis=a)[j][None])
    return out


def each(axes, stacks):
    """One axis per stack (`axes`: one int for all, or a list)."""
    return [axes] * len(stacks) if isinstance(axes, int) else axes


def rs(what, stacks, members, axes, op, path, exact):
    """The fused ReduceScatter (counting `path` calls) vs each stack alone, "sim" and
    the member-order reduction; `exact`: integer-valued data (any order is exact)."""
    before = B.mpi_calls.get(path, 0)
    got = fused_reduce_scatter(mine(stacks), members, axes, op, backend=B)
    calls = B.mpi_calls.get(path, 0) - before
    alone = [B.reduce_scatter(s, members, a, op)
             for s, a in zip(mine(stacks), each(axes, stacks))]
    sim = [f[R:R + 1] for f in fused_reduce_scatter(stacks, members, axes, op, backend=SIM)]
    shared = path == "shared_reduce_scatter"    # member order: bit for bit
    same(f"{what} vs unfused mpi", alone, got, exact)   # MPI adds in its own order
    same(f"{what} vs sim", sim, got, exact)     # "sim" adds a permuted world in rank order
    if shared:
        same(f"{what} vs member order",
             member_order_rs(stacks, members, each(axes, stacks), op), got)
    return got, calls


def ag(what, stacks, members, axes, path):
    before = B.mpi_calls.get(path, 0)
    got = fused_all_gather(mine(stacks), members, axes, backend=B)
    calls = B.mpi_calls.get(path, 0) - before
    alone = [B.all_gather(s, members, a) for s, a in zip(mine(stacks), each(axes, stacks))]
    sim = [f[R:R + 1] for f in fused_all_gather(stacks, members, axes, backend=SIM)]
    same(f"{what} vs unfused mpi", alone, got)
    same(f"{what} vs sim", sim, got)
    return got, calls


FULL = [None, [list(range(N))[::-1]], [[r] for r in range(N)]]
if N >= 4:
    FULL += [axis_groups((2, N // 2), 0), axis_groups((2, N // 2), 1)]

seed = 0
NODE_LOCAL = B._node_local
PATHS = {"shared": ("shared_reduce_scatter", "shared_all_gather"),
         "mpi": ("Reduce_scatter_block", "Allgather")}
for path, (rs_call, ag_call) in PATHS.items():
    if path == "mpi":                                # as when the ranks span machines
        B._node_local = lambda c: False
    for members in FULL:
        members = None if members is None else np.asarray(members).tolist()
        n = len((members or [range(N)])[0])
        for dtype in ["float32", "float64", "int32", "bool", "float16"]:
            kind = np.dtype(dtype).kind
            ops = ["sum", "max", "min", "prod"] + (["mean"] if kind == "f" else [])
            direct = path == "shared" or dtype != "float16"   # else gathered by numpy
            for op in ops:
                for exact in ([True, False] if kind == "f" else [True]):
                    seed += 1
                    tag = f"rs[{path}](members={members}, {dtype}, {op}, exact={exact})"
                    _, calls = rs(tag, data(RS_SHAPES, dtype, seed, exact), members,
                                  RS_AXES, op, rs_call, exact)
                    if direct:
                        assert calls == (n > 1), f"{tag}: {calls} {rs_call} calls"
            seed += 1
            tag = f"ag[{path}](members={members}, {dtype})"
            _, calls = ag(tag, data(AG_SHAPES, dtype, seed, False), members, AG_AXES, ag_call)
            assert calls == (n > 1), f"{tag}: {calls} {ag_call} calls"
        # one axis for every stack (all parts through the one packing call)
        seed += 1
        rs(f"rs[{path}](axis=0, {members})", data(RS_SHAPES, "float32", seed, True), members,
           0, "sum", rs_call, True)
        ag(f"ag[{path}](axis=0, {members})", data(AG_SHAPES, "float32", seed, False),
           members, 0, ag_call)

    # non-contiguous, replicated (stride 0) and empty stacks; the inputs are kept
    x = data([(8, 6), (4,)], "float32", 500 + len(path), False)
    stacks = [x[0][:, :, ::2], np.broadcast_to(x[1][0], (N, 4)), np.zeros((N, 0, 4), np.float32)]
    kept = [np.array(s) for s in stacks]
    rs(f"rs[{path}](non-contiguous, replicated, empty)", stacks, None, [0, 0, 1], "sum",
       rs_call, False)
    ag(f"ag[{path}](non-contiguous, replicated, empty)", stacks, None, [1, 0, 0], ag_call)
    for s, k in zip(stacks, kept):
        assert np.array_equal(s, k), "a fused collective wrote into its input"
    empty = [np.zeros((N, 0), np.float32)]
    same(f"rs[{path}](all empty)", [np.zeros((1, 0), np.float32)],
         fused_reduce_scatter(mine(empty), backend=B))
    same(f"ag[{path}](all empty)", [np.zeros((1, 0), np.float32)],
         fused_all_gather(mine(empty), backend=B))

    # the pool: a held result is never overwritten, a dropped one's buffer comes back
    a = data([(8, 8), (16,)], "float64", 600, False)
    b = data([(8, 8), (16,)], "float64", 601, False)
    held, _ = rs(f"rs[{path}](a)", a, None, 0, "sum", rs_call, False)
    want = [h.copy() for h in held]
    held_ag, _ = ag(f"ag[{path}](a)", a, None, [1, 0], ag_call)
    want_ag = [h.copy() for h in held_ag]
    later, _ = rs(f"rs[{path}](b), a held", b, None, 0, "sum", rs_call, False)
    later_ag, _ = ag(f"ag[{path}](b), a held", b, None, [1, 0], ag_call)
    fused_all_reduce(mine(b), backend=B)             # the shared window used by another kind
    assert not np.shares_memory(held[0], later[0]), "a held result's buffer was reused"
    assert not np.shares_memory(held_ag[0], later_ag[0]), "a held result's buffer was reused"
    same(f"rs[{path}](a) after later buckets", want, held)
    same(f"ag[{path}](a) after later buckets", want_ag, held_ag)
    del held, later, held_ag, later_ag
    again = fused_reduce_scatter(mine(a), backend=B)
    assert any(np.shares_memory(again[0], p) for p in B._fusion_pool), \
        "the reduce-scatter result is not in a pooled buffer"
    base = next(k for k, p in enumerate(B._fusion_pool) if np.shares_memory(again[0], p))
    del again                                        # (holding the buffer would keep it)
    again = fused_reduce_scatter(mine(a), backend=B)
    assert np.shares_memory(again[0], B._fusion_pool[base]), \
        "a free pooled buffer was not reused"
    del again
    many = [rs(f"rs[{path}](held {k})", data([(8,), (4, 4)], "float32", 700 + k, True),
               None, 0, "sum", rs_call, True)[0] for k in range(2 * mpi_backend._FUSION_POOL)]
    assert len(B._fusion_pool) == mpi_backend._FUSION_POOL, len(B._fusion_pool)
    for k, got in enumerate(many):                  # none overwritten by another
        s = data([(8,), (4, 4)], "float32", 700 + k, True)
        same(f"rs[{path}](held {k}) after all", member_order_rs(s, None, [0, 0], "sum"), got)
    del many
    # a bucket larger than any before grows the shared window
    big = data([(4 * 4096,), (8, 512)], "float32", 800, True)
    rs(f"rs[{path}](big)", big, None, [0, 1], "mean", rs_call, True)
    ag(f"ag[{path}](big)", big, None, [0, 1], ag_call)
    B._node_local = NODE_LOCAL

# the shared input windows are used in turn with one barrier per collective: a member
# slow to read the window after the barrier (held back here) must not see it
# overwritten by the others' next collectives -- AllGather, ReduceScatter and AllReduce
# back to back, no other collective between them, then each checked
SYNC = B._shared_sync


def slow_sync(c, win):
    SYNC(c, win)
    time.sleep(0.05)


for k in range(2 * N):
    slow = k % N
    if R == slow:
        B._shared_sync = slow_sync
    x = data([(4, 8), (8,)], "float32", 900 + k, True)
    got = [fused_all_gather(mine(x), None, [1, 0], backend=B),
           fused_reduce_scatter(mine(x), backend=B),
           fused_all_reduce(mine(x), backend=B)]
    B._shared_sync = SYNC
    want = [fused_all_gather(x, None, [1, 0], backend=SIM), fused_reduce_scatter(x, backend=SIM),
            fused_all_reduce(x, backend=SIM)]
    for name, w, g in zip(["ag", "rs", "ar"], want, got):
        same(f"{name}(rank {slow} slow to read, {k})", [f[R:R + 1] for f in w], g)

comm.release()
if R == 0:
    print(f"fused rs/ag ok: {CHECKS[0]} checks on {N} ranks")
