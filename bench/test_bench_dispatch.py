"""Eager dispatch overhead: ``a + b`` on (8, 8) float32 against numpy's ``a + b``.

Targets: <= 3x numpy without gradient recording, <= 6x with it (PyTorch eager
measures about 4.5x and 7x on this machine).
"""
import numpy as np
import pytest

import dualmode as dm
from dualmode._core import _tensor as core

pytestmark = pytest.mark.benchmark(group="dispatch a+b (8,8) f32")


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((8, 8)).astype(np.float32),
            rng.standard_normal((8, 8)).astype(np.float32))


def test_numpy_add(benchmark, arrays, record):
    a, b = arrays
    out = benchmark(np.add, a, b)
    benchmark.extra_info["correct"] = bool(np.array_equal(out, a + b))
    record(benchmark, "numpy a+b")


def test_dualmode_add(benchmark, arrays, record):
    a, b = (dm.Tensor(x) for x in arrays)
    out = benchmark(a.__add__, b)
    benchmark.extra_info["correct"] = bool(np.array_equal(out.asnumpy(), arrays[0] + arrays[1]))
    record(benchmark, "dualmode a+b", "numpy a+b", target=3.0)


def test_dualmode_add_recording(benchmark, arrays, record):
    a, b = (dm.Tensor(x) for x in arrays)
    tape = core.begin_tape()
    try:
        a._node = core.make_leaf(0, tape)
        out = benchmark(a.__add__, b)
        recorded = out._node is not None
    finally:
        core.end_tape()
        a._node = None
    benchmark.extra_info["correct"] = recorded and bool(
        np.array_equal(out.asnumpy(), arrays[0] + arrays[1]))
    record(benchmark, "dualmode a+b (recording)", "numpy a+b", target=6.0)


@pytest.mark.benchmark(group="dispatch sharded MatMul (16,16) on 8 devices")
def test_numpy_matmul_16(benchmark, arrays, record):
    a = np.tile(arrays[0], (2, 2))
    out = benchmark(np.matmul, a, a)
    benchmark.extra_info["correct"] = bool(np.allclose(out, a @ a))
    record(benchmark, "numpy matmul (16,16)")


@pytest.mark.benchmark(group="dispatch sharded MatMul (16,16) on 8 devices")
def test_dualmode_sharded_matmul_call(benchmark, arrays, record, parallel_context):
    """One eager MatMul.shard(((2, 4), (4, 1))) call on 8 simulated devices: the
    dispatch overhead of a sharded op, the call's median minus numpy's matmul of the
    same global value (``extra_info["overhead_us"]``; issue 17 target: <= 30 us)."""
    parallel_context("semi_auto_parallel", 8)
    a = np.tile(arrays[0], (2, 2))
    x = dm.Tensor(a)
    w = dm.Parameter(dm.Tensor(a.copy()), name="w")
    mm = dm.ops.MatMul().shard(((2, 4), (4, 1)))
    out = benchmark(mm, x, w)
    benchmark.extra_info["correct"] = bool(np.allclose(out.asnumpy(), a @ a, rtol=1e-5))
    ratio = record(benchmark, "dualmode sharded MatMul call", "numpy matmul (16,16)")
    if ratio:
        median = benchmark.extra_info["median_s"]
        benchmark.extra_info["overhead_us"] = (median - median / ratio) * 1e6
