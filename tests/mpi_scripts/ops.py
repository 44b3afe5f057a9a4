"""Run under ``mpiexec -n 4``: sharded ops on backend "mpi" equal numpy on every rank.

    mpiexec -n 4 python ops.py ops     # forward and backward of a set of sharded ops
    mpiexec -n 4 python ops.py view    # asnumpy() is the global value on every rank

Every rank builds the same inputs from one seed, runs the op with a strategy (each rank
holds one device's shards) and compares the global values (``asnumpy()``, an AllGather
every rank makes in the same order) of the output and of the input gradients of
``sum(out * w)`` with numpy. A mismatch raises, which aborts the job (non-zero exit).
"ops" then runs the same checks on the "sim" backend in the same process and compares
the collectives CommReport recorded per op (count and bytes per device). Rank 0 prints
"<mode> ok: <count> checks" at the end.
"""
import sys

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication, ops
from dualmode.parallel import CommReport

N = 4
CHECKS = [0]
REPORTS = []      # (op, collectives, bytes per device) of each check
RANK = [0]        # this process's MPI rank (the "sim" comparison re-inits the backend)


def _setup(backend=None):
    dm.reset_auto_parallel_context()
    communication.init(backend)
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=N)
    communication.init(backend)
    b = communication.get_backend()
    assert b.world_size == N, (b, N)
    if backend is None:
        assert b.name == "mpi", b
        assert b.local_ranks == (communication.get_rank(),), b.local_ranks


def _f32(seed, *shape):
    return np.random.default_rng(seed).uniform(-1.0, 1.0, shape).astype(np.float32)


def _close(what, got, want, rtol=1e-5, atol=1e-6):
    got = np.asarray(got)
    if got.shape != np.shape(want):
        raise AssertionError(f"rank {RANK[0]}: {what}: shape {got.shape}, "
                             f"expected {np.shape(want)}")
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                               err_msg=f"rank {RANK[0]}: {what}")
    CHECKS[0] += 1


def _check(name, fn, inputs, ref_out, ref_grads, grad_pos):
    """fn(*tensors) -> out; compare out and d sum(out * w) / d inputs[grad_pos]."""
    w = _f32(99, *np.shape(ref_out))
    ones = (1,) * np.ndim(ref_out)

    def loss(*xs):
        out = fn(*xs)
        # an all-ones strategy: a pending-sum output is resolved on the tape
        return ops.reduce_sum(ops.Mul().shard((ones, ones))(out, Tensor(w))), out

    args = [Tensor(x) for x in inputs]
    with CommReport() as rep:
        (_, out), grads = dm.value_and_grad(loss, grad_pos, has_aux=True)(*args)
    REPORTS.append((name, rep.count(), rep.bytes()))
    assert out.layout is not None, f"{name}: the output is not distributed"
    local = len(communication.get_backend().local_ranks)
    assert out._data.shape[0] == local, f"{name}: a stack of {out._data.shape[0]} devices"
    _close(f"{name} forward", out.asnumpy(), ref_out)
    grads = grads if isinstance(grads, tuple) else (grads,)
    for k, (g, r) in enumerate(zip(grads, ref_grads(w))):
        _close(f"{name} gradient {k}", g.asnumpy(), r, rtol=1e-4, atol=1e-5)


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def run_ops():
    # MatMul with the contracted dim split: pending sums, resolved by an AllReduce
    a, b = _f32(1, 8, 16), _f32(2, 16, 4)
    _check("MatMul", lambda x, y: ops.MatMul().shard(((1, N), (N, 1)))(x, y), [a, b], a @ b,
           lambda w: (w @ b.T, a.T @ w), (0, 1))
    # ReduceSum over a split dim: a pending sum
    x = _f32(3, 8, 12)
    _check("ReduceSum", lambda t: ops.ReduceSum().shard(((N, 1),))(t, 0), [x], x.sum(0),
           lambda w: (np.broadcast_to(w, x.shape),), 0)
    # Softmax over a split axis: the axis is gathered first
    y = _softmax(x, 1)
    _check("Softmax", lambda t: ops.Softmax(axis=1).shard(((2, N // 2),))(t), [x], y,
           lambda w: (y * (w - (w * y).sum(1, keepdims=True)),), 0)
    # Reshape across split dims
    _check("Reshape", lambda t: ops.Reshape().shard(((2, N // 2),))(t, (4, 24)), [x],
           x.reshape(4, 24), lambda w: (w.reshape(x.shape),), 0)
    # Gather on a vocab-split table: offsets, masks and a pending sum
    table = _f32(4, 16, 8)
    idx = np.array([[0, 3, 3, 15], [7, 8, 8, 1]], np.int32)

    def table_grad(w):
        g = np.zeros_like(table)
        np.add.at(g, idx, w)
        return (g,)

    _check("Gather", lambda t, i: ops.Gather().shard(((N, 1), (1, 1)))(t, i, 0),
           [table, idx], table[idx], table_grad, 0)
    # Concat along a dim another input splits its own way
    c1, c2 = _f32(5, 8, 4, 6), _f32(6, 8, 4, 6)
    _check("Concat", lambda p, q: ops.Concat(1).shard(((2, 2, 1), (2, 1, 1)))((p, q)),
           [c1, c2], np.concatenate([c1, c2], 1),
           lambda w: (w[:, :4], w[:, 4:]), (0, 1))


def run_view():
    a, b = _f32(7, 8, 16), _f32(8, 16, 8)
    with CommReport() as rep:
        part = ops.MatMul().shard(((1, N), (N, 1)))(Tensor(a), Tensor(b))   # pending sums
        split = ops.MatMul().shard(((N, 1), (1, 1)))(Tensor(a), Tensor(b))  # rows split
        grid = ops.MatMul().shard(((2, 1), (1, N // 2)))(Tensor(a), Tensor(b))
        before = rep.count()
        assert part.layout.partial and split.layout.tensor_map[0], (part.layout, split.layout)
        for name, t in (("partial", part), ("rows", split), ("grid", grid)):
            assert t._data.shape[0] == 1, (name, t._data.shape)
            _close(f"asnumpy of {name}", t.asnumpy(), a @ b)
            _close(f"np.asarray of {name}", np.asarray(t), a @ b)
        # reading values is an observation, not a collective of the program
        assert rep.count() == before, (before, rep.count())
        # an op no rule runs sharded (advanced indexing): its input is gathered
        picked = split[np.array([0, 3, 3])]
        assert rep.count("AllGather", reason="redistribution") == 1, rep
        _close("gathered fallback", picked.asnumpy(), (a @ b)[[0, 3, 3]])
    # batch-split inputs of a network call: each rank holds only its rows
    from dualmode.parallel.inputs import distribute_inputs
    dm.set_auto_parallel_context(parallel_mode="data_parallel")
    x = _f32(9, 8, 5)
    (t,) = distribute_inputs((Tensor(x),))
    r = communication.get_rank()
    _close("local rows", t._data[0], x[r * 2:(r + 1) * 2])
    _close("asnumpy of a batch split", t.asnumpy(), x)
    _close("asnumpy after an op", (t * 2.0).asnumpy(), x * 2.0)


def run_ops_and_compare_with_sim():
    """run_ops under "mpi", then under "sim" in this process: same numbers, and the same
    collectives (count and bytes per device) recorded for every op."""
    run_ops()
    on_mpi = list(REPORTS)
    REPORTS.clear()
    _setup("sim")
    run_ops()
    if on_mpi != REPORTS:
        raise AssertionError(f"rank {RANK[0]}: CommReport under mpi "
                             f"{on_mpi} differs from sim {REPORTS}")
    CHECKS[0] += 1


if __name__ == "__main__":
    mode = sys.argv[1]
    _setup()
    RANK[0] = communication.get_rank()
    {"ops": run_ops_and_compare_with_sim, "view": run_view}[mode]()
    if RANK[0] == 0:
        print(f"{mode} ok: {CHECKS[0]} checks")
