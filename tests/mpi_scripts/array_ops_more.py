"""Run under ``mpiexec -n 4``: the array and reduce ops for MindSpore scripts on backend
"mpi" (each rank one device) equal numpy on every rank: ArgMaxWithValue / Argmin over a
split axis (one AllReduce of packed (value, index) keys), the value's gradient, Tile
with a strategy, OneHot's strategy over its output, AssignAdd on a sharded Parameter
(its layout kept). Every rank builds the same inputs from one seed; a mismatch raises
(non-zero exit). Rank 0 prints "array ops ok: <count> checks"."""
import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, ops

N = 4
CHECKS = [0]


def _eq(what, got, want):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=0,
                               err_msg=f"rank {communication.get_rank()}: {what}")
    CHECKS[0] += 1


def main():
    communication.init()
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=N,
                                 full_batch=True)
    communication.init()
    b = communication.get_backend()
    assert b.name == "mpi" and b.world_size == N, b
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 16)).astype(np.float32)
    x[1, 2], x[1, 13] = 5.0, 5.0                   # a tie across ranks: the first index

    i, v = ops.ArgMaxWithValue(axis=1).shard(((1, 4),))(Tensor(x))
    _eq("ArgMaxWithValue index", i.asnumpy(), x.argmax(1))
    _eq("ArgMaxWithValue value", v.asnumpy(), x.max(1))
    j = ops.Argmin(axis=1).shard(((2, 2),))(Tensor(x))
    _eq("Argmin", j.asnumpy(), x.argmin(1))
    w = rng.normal(size=(6,))
    g = dm.grad(lambda t: ops.reduce_sum(
        ops.ArgMinWithValue(axis=1).shard(((1, 4),))(t)[1] * Tensor(w)))(
            Tensor(x.astype(np.float64)))
    want = np.zeros(x.shape)
    want[np.arange(6), x.argmin(1)] = w
    _eq("ArgMinWithValue gradient", g.asnumpy(), want)

    y = ops.Tile().shard(((2, 2),))(Tensor(x[:, :4]), (1, 2))
    _eq("Tile", y.asnumpy(), np.tile(x[:, :4], (1, 2)))

    idx = rng.integers(0, 8, 12).astype(np.int32)
    hot = ops.OneHot().shard(((1, 4), (), ()))(Tensor(idx), 8, 1.0, 0.0)
    assert hot._data.shape[1:] == (12, 2), hot._data.shape
    _eq("OneHot output form", hot.asnumpy(), np.eye(8, dtype=np.float32)[idx])

    p = Parameter(Tensor(np.ones((8, 4), np.float32)), name="p")
    add = ops.AssignAdd().shard(((4, 1), (4, 1)))
    for _ in range(2):
        add(p, Tensor(x[:, :4].repeat(2, axis=0)[:8]))
    assert p._layout is not None and p._data.shape[1:] == (2, 4), p._data.shape
    _eq("AssignAdd", p.asnumpy(), 1 + 2 * x[:, :4].repeat(2, axis=0)[:8])
    if communication.get_rank() == 0:
        print(f"array ops ok: {CHECKS[0]} checks", flush=True)


if __name__ == "__main__":
    main()
