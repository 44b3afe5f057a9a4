"""Fused ReduceScatter / AllGather over groups whose members are not in rank order (a
permuted world, irregular pairs) give, per stack, exactly what the unfused collective
gives: member j -- the j-th rank listed, not rank j -- gets part j. On "sim" and through
the generic packing implementation every other backend inherits (integer-valued data:
any order of adding is exact, so equality is bit for bit)."""
import numpy as np
import pytest

from dualmode.communication import SimBackend
from dualmode.communication.backend import Backend

N = 4
GROUPS = {"reversed world": [[3, 2, 1, 0]], "shuffled world": [[2, 0, 3, 1]],
          "irregular pairs": [[3, 1], [0, 2]]}
SHAPES, AXES = [(8, 3), (4, 8), (8,)], [0, 1, 0]


class PackedSim(SimBackend):
    """"sim" running Backend's generic (packing) fused collectives."""
    _reduce_scatter_fused = Backend._reduce_scatter_fused
    _all_gather_fused = Backend._all_gather_fused


def _stacks(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(-4, 5, size=(N,) + s).astype(np.float32) for s in SHAPES]


@pytest.mark.parametrize("backend", [SimBackend, PackedSim], ids=["sim", "packed"])
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_fused_reduce_scatter_over_permuted_members_equals_each_alone(backend, group, op):
    b, members = backend(N), GROUPS[group]
    stacks = _stacks(1)
    fused = b.reduce_scatter_fused(stacks, members, AXES, op)
    for s, a, f in zip(stacks, AXES, fused):
        np.testing.assert_array_equal(f, b.reduce_scatter(s, members, a, op))
    # and by hand: rank members[g][j] holds part j of its group's reduction
    red = {"sum": np.sum, "mean": np.mean, "max": np.max}[op]
    for row in members:
        for j, r in enumerate(row):
            for s, a, f in zip(stacks, AXES, fused):
                want = np.split(red(s[row], axis=0), len(row), axis=a)[j]
                np.testing.assert_array_equal(f[r], want.astype(np.float32))


@pytest.mark.parametrize("backend", [SimBackend, PackedSim], ids=["sim", "packed"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_fused_all_gather_over_permuted_members_equals_each_alone(backend, group):
    b, members = backend(N), GROUPS[group]
    stacks = _stacks(2)
    fused = b.all_gather_fused(stacks, members, AXES)
    for s, a, f in zip(stacks, AXES, fused):
        np.testing.assert_array_equal(f, b.all_gather(s, members, a))
    for row in members:
        for r in row:
            for s, a, f in zip(stacks, AXES, fused):
                np.testing.assert_array_equal(f[r], np.concatenate(list(s[row]), axis=a))
