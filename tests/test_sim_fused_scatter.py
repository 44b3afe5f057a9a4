"""The simulated fused ReduceScatter over the whole world: each result is a view of its
stack's reduction (no copy per device), equal to numpy's reduction split in parts (the
oracle) for every op, axis and kind of stack (stride-0 replicated, equal shares,
plain), and recorded as one collective."""
import numpy as np
import pytest

from dualmode.communication import SimBackend
from dualmode.communication.sim import equal_shares
from dualmode.parallel import CommReport

N = 4
SHAPES, AXES = [(8, 3), (5, 16), (12,), (2, 4, 8)], [0, 1, 0, 2]
F = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}


def _stacks(rng):
    out = []
    for k, shape in enumerate(SHAPES):
        one = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        if k == 1:
            out.append(np.broadcast_to(one, (N,) + shape))          # replicated
        elif k == 3:
            out.append(equal_shares(one, N))                         # equal shares
        else:
            out.append(rng.uniform(0.5, 1.5, (N,) + shape).astype(np.float32))
    return out


@pytest.mark.parametrize("op", list(F))
def test_whole_world_fused_scatter_is_each_devices_part_of_the_reduction(op):
    b = SimBackend(N)
    stacks = _stacks(np.random.default_rng(0))
    with CommReport() as rep:
        out = b.reduce_scatter_fused(stacks, None, AXES, op)
    assert len(rep.records) == 1 and rep.records[0].kind == "ReduceScatter"
    for s, o, ax in zip(stacks, out, AXES):
        red = F[op](np.array(s, dtype=np.float64), axis=0)
        parts = np.split(red, N, axis=ax)
        assert o.shape == (N,) + parts[0].shape and o.dtype == s.dtype
        for d in range(N):
            np.testing.assert_allclose(o[d], parts[d], rtol=1e-5)


def test_whole_world_fused_scatter_results_are_views_of_one_reduction_each():
    b = SimBackend(N)
    stacks = _stacks(np.random.default_rng(1))
    out = b.reduce_scatter_fused(stacks, None, AXES, "sum")
    for o in out:
        base = o
        while base.base is not None:
            base = base.base
        # every device's part lies in one buffer of the reduced value's size
        assert base.size == o.size and all(np.shares_memory(o[d], base) for d in range(N))
