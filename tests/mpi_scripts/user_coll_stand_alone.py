"""Run on N ranks (``python -m dualmode.run --worker_num N`` or ``mpiexec -n N``) without
setting a parallel mode: the user's collectives communicate among the ranks, as in
MindSpore's communication tutorial, and give what N simulated devices give.

1. A collective called before ``init()`` is a RuntimeError naming ``init()``.
2. ``init(); print(ops.AllReduce()(Tensor(np.ones(3))))`` prints ``[N. N. N.]``.
3. AllReduce (sum, max), AllGather, ReduceScatter, Broadcast and AlltoAll of a value
   every rank computes alike, forward and the gradient of ``sum(out * coef)``: equal to
   hand-computed values, and to the same program on N simulated devices
   (``parallel_mode="stand_alone"``, ``device_num=N``) run afterwards in this process.

A mismatch raises, which fails the job; rank 0 prints "stand-alone collectives ok".
"""
import numpy as np

import dualmode as dm
from dualmode import Tensor, communication, ops


def _f32(seed, *shape):
    return np.random.default_rng(seed).uniform(-1.0, 1.0, shape).astype(np.float32)


def programs(n):
    """name -> (prim, expected output, expected gradient) for x = _f32(1, 2n, 3) and
    coef of the output's shape (None: per-device outputs, compared with sim only):
    every device holds x, so its gradient is the sum of the n devices' contributions."""
    x = _f32(1, 2 * n, 3)

    def coef(shape):
        return _f32(2, *shape)

    out = {}
    c = coef(x.shape)
    out["AllReduce(sum)"] = (ops.AllReduce(), n * x, n * c)
    out["AllReduce(max)"] = (ops.AllReduce("max"), x, c)        # n ties share it
    c = coef((2 * n * n, 3))
    out["AllGather"] = (ops.AllGather(), np.concatenate([x] * n), c.reshape(n, 2 * n, 3).sum(0))
    out["ReduceScatter"] = (ops.ReduceScatter(), None, None)
    out["Broadcast"] = (ops.Broadcast(0), x, coef(x.shape))
    out["AlltoAll"] = (ops.AlltoAll(n, 0, 0), None, None)
    return x, out


def run(backend, n=None):
    """Every program's output and input gradient (``asnumpy()``) on `backend`."""
    dm.reset_auto_parallel_context()
    if n is not None:
        dm.set_auto_parallel_context(device_num=n)
    communication.init(backend)
    n = communication.get_group_size()
    x, progs = programs(n)
    res = {}
    for name, (prim, _, _) in progs.items():
        y = prim(Tensor(x))
        shape = y.shape
        coef = Tensor(_f32(2, *shape))
        res[name] = y.asnumpy()
        grad = dm.grad(lambda t: ops.reduce_sum(prim(t) * coef))(Tensor(x))
        res[name + " dx"] = grad.asnumpy()
    return res


def main():
    try:
        ops.AllReduce()(Tensor(np.ones(3, np.float32)))
    except RuntimeError as e:
        assert "communication.init()" in str(e), str(e)
    else:
        raise AssertionError("a collective before init() on several ranks did not raise")
    communication.init()
    n = communication.get_group_size()
    rank = communication.get_rank()
    ones = ops.AllReduce()(Tensor(np.ones(3, np.float32)))
    print(ones, flush=True)
    np.testing.assert_array_equal(ones.asnumpy(), np.full(3, n, np.float32))
    assert dm.get_auto_parallel_context("parallel_mode") == "stand_alone"
    x, progs = programs(n)
    got = run(None)
    assert communication.get_backend().name == "mpi"
    for name, (_, fw, bw) in progs.items():
        if fw is not None:
            np.testing.assert_allclose(got[name], fw, rtol=1e-6, err_msg=f"rank {rank} {name}")
            np.testing.assert_allclose(got[name + " dx"], bw, rtol=1e-5,
                                       err_msg=f"rank {rank} {name} dx")
    want = run("sim", n)
    assert list(got) == list(want)
    for key in want:
        g, w = np.asarray(got[key]), np.asarray(want[key])
        assert g.shape == w.shape, f"rank {rank} {key}: {g.shape} under mpi, {w.shape} sim"
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} {key}")
    if rank == 0:
        print(f"stand-alone collectives ok: {len(want)} values on {n} ranks", flush=True)


if __name__ == "__main__":
    main()
