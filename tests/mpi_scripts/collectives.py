"""Run under ``mpiexec -n N``: every collective of the "mpi" backend equals the "sim" one.

Each rank builds the same global stack (N, *shape) from one seed, runs the collective
on the full stack with SimBackend and on its own row with the live "mpi" backend, and
compares its row. Any mismatch raises, which aborts the whole job (non-zero exit).
Prints "collectives ok: <count> checks" on rank 0 at the end.
"""

import numpy as np

import dualmode.communication as comm
from dualmode.communication import axis_groups, fused_all_reduce
from _job import start          # tests/mpi_scripts/_job.py

B, N, R, SIM = start()
CHECKS = [0]


def data(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random((N,) + shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(1, 5, size=(N,) + shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal((N,) + shape)
                + 1j * rng.standard_normal((N,) + shape)).astype(dtype)
    return (rng.standard_normal((N,) + shape) + 2.0).astype(dtype)


def check(what, full, mine):
    want = np.asarray(full)[R]
    assert mine.shape == (1,) + want.shape, f"{what}: shape {mine.shape} vs {want.shape}"
    assert mine.dtype == want.dtype, f"{what}: dtype {mine.dtype} vs {want.dtype}"
    got = mine[0]
    if want.dtype.kind in "fc":
        rtol = {2: 1e-2, 4: 1e-5}.get(want.dtype.itemsize, 1e-12)
        if want.dtype.kind == "c":
            rtol = 1e-5 if want.dtype.itemsize == 8 else 1e-12
        ok = np.allclose(got, want, rtol=rtol, atol=rtol * N * 10)
    else:
        ok = np.array_equal(got, want)
    if not ok:
        raise AssertionError(f"rank {R}: {what}: mpi {got!r} != sim {want!r}")
    CHECKS[0] += 1


def both(name, members, x, **kw):
    full = getattr(SIM, name)(x, members, **kw)
    mine = getattr(B, name)(x[R:R + 1], members, **kw)
    check(f"{name}(members={None if members is None else np.asarray(members).tolist()}, "
          f"{kw}, dtype={x.dtype})", full, mine)


# group specs: full partitions (any collective) and partial ones (shape-keeping only)
FULL = [None, [list(range(N))[::-1]], [[r] for r in range(N)]]
PARTIAL = []
if N == 2:
    PARTIAL = [[[1]], [[0]]]
if N >= 4:
    FULL += [axis_groups((2, N // 2), 0), axis_groups((2, N // 2), 1),
             [[3, 1], [0, 2]] + [[r, r + 1] for r in range(4, N, 2)],
             [[2, 1, 0, 3] + list(range(4, N))]]
    PARTIAL = [[[0, 2]], [[3, 1]], [[1]]]

FLOATS = ["float32", "float64"]
seed = 0
for k, members in enumerate(FULL + PARTIAL):
    full = k < len(FULL)
    for dtype in ["float32", "float64", "int32", "int64", "uint8", "bool", "float16",
                  "complex128"]:
        seed += 1
        x = data((4, 12), dtype, seed)
        ops = ["sum", "max", "min", "prod"] + (["mean"] if np.dtype(dtype).kind in "fc" else [])
        if np.dtype(dtype).kind == "c":
            ops = ["sum", "mean", "prod"]
        for op in ops:
            both("all_reduce", members, x, op=op)
            both("reduce", members, x, op=op, root=0)
            if full:
                both("reduce_scatter", members, x, op=op, axis=1)
        if dtype in ("float32", "int64"):
            both("all_reduce", members, x, op="sum", algorithm="ring")
        n = N if members is None else len(members[0])
        both("broadcast", members, x, root=n - 1)
        both("all_to_all", members, x, split_axis=1, concat_axis=1)
        if full:
            both("all_gather", members, x, axis=1)
            both("all_gather", members, x, axis=0)
            both("all_to_all", members, x, split_axis=1, concat_axis=0)
            both("scatter", members, x, root=0, axis=1)
            both("gather", members, x, root=n - 1, axis=0)
            both("reduce_scatter", members, data((2 * n, 3), dtype, seed), axis=0)

# 0-d buffers and empty buffers
for members in FULL:
    both("all_reduce", members, data((), "float64", 99), op="sum")
    both("broadcast", members, data((), "int32", 98), root=0)
    both("all_reduce", members, np.zeros((N, 0, 3), np.float32), op="max")

# send_recv: a swap, fan-out from one rank, a self pair, nothing
x = data((3, 2), "float64", 7)
pairs_list = [[(0, 1), (1, 0)], [(0, r) for r in range(1, N)], [(1, 1)], []]
for pairs in pairs_list:
    check(f"send_recv({pairs})", SIM.send_recv(x, pairs), B.send_recv(x[R:R + 1], pairs))

# a fused bucket is ONE AllReduce (on one machine through node shared memory)
stacks = [data((3, 4), "float32", 11), data((5,), "float32", 12), data((2, 2, 2), "float32", 13)]
before = B.mpi_calls.get("shared_allreduce", 0) + B.mpi_calls.get("Allreduce", 0)
mine = fused_all_reduce([s[R:R + 1] for s in stacks], None, "mean", backend=B)
after = B.mpi_calls.get("shared_allreduce", 0) + B.mpi_calls.get("Allreduce", 0)
assert after - before == 1, f"fused bucket made {after - before} AllReduces"
full = fused_all_reduce(stacks, None, "mean", backend=SIM)
for i, (f, m) in enumerate(zip(full, mine)):
    check(f"fused_all_reduce[{i}]", f, m)

# named groups
comm.create_group("evens", list(range(0, N, 2)))
if R % 2 == 0:
    assert comm.get_rank("evens") == R // 2
assert comm.get_group_size("evens") == (N + 1) // 2
assert comm.get_local_rank() == R and comm.get_local_rank_size() == N   # one machine
g = comm.group_members("evens")
both("all_reduce", g, data((4,), "float64", 21), op="sum")
B.barrier()
splits = B.mpi_calls.get("Comm_split", 0)
for members in FULL[1:] + PARTIAL:                   # cached: no new Split
    both("all_reduce", members, data((4,), "float64", 22), op="sum")
assert B.mpi_calls.get("Comm_split", 0) == splits, "sub-communicators were not cached"
comm.release()
if R == 0:
    print(f"collectives ok: {CHECKS[0]} checks on {N} ranks", flush=True)
