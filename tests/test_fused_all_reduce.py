"""fused_all_reduce: one collective for many stacks, equal to AllReducing each alone.

The simulated backend reduces large stacks straight into their slice of the result and
packs runs of small ones; every path is checked against numpy's reduction of each stack,
with stride-0 (replicated) stacks, every op, sub-world groups (the packed fallback), and
the data-parallel gradient path (reduce_gradients) against the unfused one.
"""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication as comm
from dualmode.communication import SimBackend, axis_groups
from dualmode.communication import sim as sim_module
from dualmode._core._tensor import wrap_dist
from dualmode.parallel import CommReport, reduce_gradients
from dualmode.parallel.tensor_layout import TensorLayout

N = 4
SHAPES = [(3, 4), (20000,), (5,), (2, 2, 2), (17000,), (1,)]   # small and > 64 KiB


def _stacks(rng, dtype=np.float32, replicated=()):
    out = []
    for k, shape in enumerate(SHAPES):
        if k in replicated:
            one = rng.standard_normal(shape).astype(dtype)
            out.append(np.broadcast_to(one, (N,) + shape))
        else:
            out.append(rng.standard_normal((N,) + shape).astype(dtype))
    return out


def _want(stack, op):
    f = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op]
    return np.broadcast_to(f(stack, axis=0).astype(stack.dtype), stack.shape)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("replicated", [(), (1, 2), tuple(range(len(SHAPES)))])
def test_fused_equals_numpy_per_stack(op, replicated):
    b = SimBackend(N)
    stacks = _stacks(np.random.default_rng(3), replicated=replicated)
    out = comm.fused_all_reduce(stacks, op=op, backend=b)
    assert len(out) == len(stacks)
    for s, o in zip(stacks, out):
        assert o.shape == s.shape and o.dtype == s.dtype
        np.testing.assert_allclose(o, _want(s, op), rtol=1e-5, atol=1e-6)


def test_fused_mean_of_replicated_stack_is_exact():
    b = SimBackend(6)
    one = np.float32([0.1, 1 / 3, 7.7])
    out = comm.fused_all_reduce([np.broadcast_to(one, (6, 3)), np.ones((6, 2), np.float32)],
                                op="mean", backend=b)
    assert np.array_equal(out[0][5], one)


def test_fused_results_are_one_read_only_buffer():
    b = SimBackend(N)
    out = comm.fused_all_reduce(_stacks(np.random.default_rng(0)), backend=b)
    base = out[0].base
    while base.base is not None:
        base = base.base
    for o in out:
        assert not o.flags.writeable
        assert np.shares_memory(o, base)


@pytest.mark.parametrize("pack_bytes", [0, 1 << 30])   # every stack in place / all packed
def test_fused_paths_agree(monkeypatch, pack_bytes):
    monkeypatch.setattr(sim_module, "_PACK_BYTES", pack_bytes)
    b = SimBackend(N)
    stacks = _stacks(np.random.default_rng(5), dtype=np.float64, replicated=(2,))
    for s, o in zip(stacks, comm.fused_all_reduce(stacks, op="sum", backend=b)):
        np.testing.assert_allclose(o, _want(s, "sum"), rtol=1e-12)


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_runs_of_small_stacks_between_large_ones(monkeypatch, op):
    """Small stacks packed in runs that large ones (reduced in place) interrupt, at the
    start, in the middle and at the end: each result equals numpy's reduction."""
    monkeypatch.setattr(sim_module, "_PACK_BYTES", 64)          # 16 float32 per device
    b = SimBackend(N)
    rng = np.random.default_rng(11)
    sizes = [3, 16, 40, 5, 2, 100, 7, 17, 1, 9]                  # > 16: reduced in place
    stacks = [rng.standard_normal((N, m)).astype(np.float32) for m in sizes]
    out = comm.fused_all_reduce(stacks, op=op, backend=b)
    for s, o in zip(stacks, out):
        want = s.sum(axis=0) if op == "sum" else s.mean(axis=0)
        assert o.shape == s.shape
        for d in range(N):
            np.testing.assert_allclose(o[d], want, rtol=1e-5, atol=1e-6)


def test_fused_over_sub_groups_packs_and_reduces_each_group():
    b = SimBackend(8)
    members = axis_groups((2, 4), (1,))          # 2 groups of 4
    rng = np.random.default_rng(1)
    stacks = [rng.standard_normal((8, 3)).astype(np.float32),
              rng.standard_normal((8, 2, 2)).astype(np.float32)]
    out = comm.fused_all_reduce(stacks, members, "sum", backend=b)
    for s, o in zip(stacks, out):
        np.testing.assert_allclose(o, b.all_reduce(s, members, "sum"), rtol=1e-6)


def test_fused_records_one_all_reduce_of_all_bytes():
    b = SimBackend(N)
    stacks = _stacks(np.random.default_rng(0))
    with CommReport() as r:
        comm.fused_all_reduce(stacks, backend=b)
    assert r.count("AllReduce") == 1
    nbytes = sum(s[0].nbytes for s in stacks)
    assert r.bytes() == 2 * (N - 1) / N * nbytes


def test_fused_bad_input_names_the_stack():
    b = SimBackend(N)
    with pytest.raises(TypeError, match=r"fused_all_reduce: stacks\[1\] must be a numpy array"):
        comm.fused_all_reduce([np.zeros((N, 2)), [1, 2]], backend=b)
    with pytest.raises(ValueError, match=r"fused_all_reduce: op='avg' is not valid"):
        comm.fused_all_reduce([np.zeros((N, 2))], op="avg", backend=b)


@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("fusion", [None, {"allreduce": {"mode": "size", "config": 1}},
                                    {"allreduce": {"mode": "index", "config": [2]}}])
def test_reduce_gradients_fused_equals_single_device_gradient(mean, fusion):
    """Shares p_d of each gradient (summing to the single-device gradient G): the
    reduced gradient is G with gradients_mean, else device_num * G, fused or not."""
    dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=N,
                                 gradients_mean=mean)
    if fusion is not None:
        dm.set_auto_parallel_context(comm_fusion=fusion)
    comm.init()
    try:
        rng = np.random.default_rng(7)
        params, grads, whole = [], [], []
        for k, shape in enumerate([(400, 400), (8,), (5, 3), (600, 200)]):
            shares = rng.standard_normal((N,) + shape).astype(np.float32)
            params.append(Parameter(Tensor(np.zeros(shape, np.float32)), name=f"w{k}"))
            g = wrap_dist(shares, _dp_partial(shape))
            grads.append(g)
            whole.append(shares.sum(axis=0) * (1 if mean else N))
        with CommReport() as r:
            out = reduce_gradients(grads, params)
        # 1 MB buckets: [w0 (640 KB), w1, w2], [w3 (480 KB)]; index [2]: [w0, w1], [w2, w3]
        buckets = {None: 4, "size": 2, "index": 2}[fusion and fusion["allreduce"]["mode"]]
        assert r.count("AllReduce") == buckets
        for o, w in zip(out, whole):
            np.testing.assert_allclose(o.asnumpy(), w, rtol=1e-5, atol=1e-5)
    finally:
        dm.reset_auto_parallel_context()
        comm.init()


def _dp_partial(shape):
    return TensorLayout((N,), ((),) * len(shape), shape, (0,))
