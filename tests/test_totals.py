"""Pending sums that remember their totals (dualmode.communication.totals): the global
value read from the totals equals the sum of the shares, and only the very stack that
was recorded is read that way."""
import gc

import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor
from dualmode.communication import totals as totals_mod
from dualmode.communication.totals import DeferredShares, known_totals, remember_totals
from dualmode.parallel import CommReport, TensorLayout
from dualmode.parallel.redistribution import executor
from dualmode.parallel.redistribution.executor import global_value
from dualmode.parallel.rules.contract import contract_groups

RNG = np.random.default_rng(5)


def _shares(layout, value):
    """The stack of `value` in `layout` as equal shares over its partial axes, and the
    totals grid (size 1 along the partial and replicated axes)."""
    plain = layout.without_partial()
    parts = int(np.prod([layout.device_matrix[a] for a in layout.partial]))
    stack = plain.local_blocks(value) / np.float32(parts)
    totals = plain.local_blocks_grid(value)
    totals = totals[tuple(slice(0, 1) if a in layout.partial else slice(None)
                          for a in range(len(layout.device_matrix)))]
    return np.ascontiguousarray(stack), np.ascontiguousarray(totals)


@pytest.mark.parametrize("dm_, tmap, partial", [
    ((2, 4), ((0,), ()), (1,)),          # rows split, summed over the other axis
    ((2, 4), ((), (0,)), (1,)),          # columns split over axis 0
    ((2, 2, 2), ((2,), (0,)), (1,)),     # both dims split, summed over the middle axis
    ((8,), ((), ()), (0,)),              # one total for every device
    ((2, 4), ((1,), ()), (0,)),          # the weight-gradient shape of the seed step
])
def test_global_value_from_totals_equals_the_sum_of_shares(dm_, tmap, partial):
    lay = TensorLayout(dm_, tmap, (8, 12), partial=partial)
    value = RNG.standard_normal((8, 12)).astype(np.float32)
    stack, totals = _shares(lay, value)
    slow = lay.assemble(stack)
    remember_totals(stack, totals, dm_, partial)
    fast = global_value(stack, lay)
    np.testing.assert_array_equal(fast, value)           # the exact totals
    np.testing.assert_allclose(fast, slow, rtol=1e-6, atol=1e-6)
    assert not stack.flags.writeable and not totals.flags.writeable


def test_only_the_recorded_stack_and_axes_are_known():
    lay = TensorLayout((2, 4), ((0,), ()), (8, 12), partial=(1,))
    stack, totals = _shares(lay, RNG.standard_normal((8, 12)).astype(np.float32))
    remember_totals(stack, totals, (2, 4), (1,))
    assert known_totals(stack, (2, 4), (1,)) is totals
    assert known_totals(stack, (2, 4), (0,)) is None        # other axes
    assert known_totals(stack, (4, 2), (1,)) is None        # another device matrix
    assert known_totals(stack[:], (2, 4), (1,)) is None     # a view is added up as any
    with pytest.raises(ValueError, match="read-only"):
        stack[0, 0, 0] = 1.0
    key = id(stack)
    assert key in totals_mod._TOTALS
    del stack
    gc.collect()
    assert key not in totals_mod._TOTALS                    # the entry left with it


def test_remember_totals_rejects_totals_that_do_not_fit():
    stack = np.zeros((8, 4, 6), np.float32)
    with pytest.raises(ValueError, match=r"remember_totals: totals of shape \(2, 4, 4, 6\) "
                                         r"do not fit a stack \(8, 4, 6\) summed over "
                                         r"axes \(1,\)"):
        remember_totals(stack, np.zeros((2, 4, 4, 6), np.float32), (2, 4), (1,))
    assert stack.flags.writeable                            # nothing changed


def test_assemble_totals_rejects_a_grid_of_another_shape():
    lay = TensorLayout((2, 4), ((0,), ()), (8, 12), partial=(1,))
    with pytest.raises(Exception, match="assemble_totals got a grid of shape"):
        lay.assemble_totals(np.zeros((2, 4, 4, 12), np.float32))


def test_grouped_matmul_records_its_group_totals():
    """contract_groups' shares add up to the GEMM of each group, and the totals it
    records are those GEMMs."""
    a = RNG.standard_normal((16, 24)).astype(np.float32)
    b = RNG.standard_normal((24, 8)).astype(np.float32)
    dm_ = (2, 4)
    ga = TensorLayout(dm_, ((0,), (1,)), a.shape).local_blocks_grid(a)   # (2, 4, 8, 6)
    gb = TensorLayout(dm_, ((1,), ()), b.shape).local_blocks_grid(b)     # (1, 4, 6, 8)
    out = contract_groups(ga, gb, dm_, (1,))
    lay = TensorLayout(dm_, ((0,), ()), (16, 8), partial=(1,))
    totals = known_totals(out, dm_, (1,))
    assert totals is not None
    np.testing.assert_allclose(lay.assemble_totals(totals), a @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lay.assemble(out), a @ b, rtol=1e-5, atol=1e-5)


def test_sharded_matmul_then_relu_equals_one_device(eight, monkeypatch):
    """End to end: a MatMul whose contracted dim is split (its pending sums kept as
    shares with their totals) followed by an op that needs the sum gives the numbers of
    one device and reports the same collectives as when the shares are added up."""
    a = RNG.standard_normal((64, 96)).astype(np.float32)
    w = RNG.standard_normal((96, 32)).astype(np.float32)
    mm = dm.ops.MatMul().shard(((2, 4), (4, 1)))
    relu = dm.ops.ReLU().shard(((4, 1),))

    def run():
        with CommReport() as report:
            out = relu(mm(Tensor(a), Tensor(w))).asnumpy()
        return out, [(r.kind, r.group_size, r.num_groups, r.bytes_per_device)
                     for r in report.records]

    out, fast = run()
    np.testing.assert_allclose(out, np.maximum(a @ w, 0), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(executor, "known_totals", lambda *args: None)   # add shares up
    slow_out, slow = run()
    assert fast == slow and fast
    np.testing.assert_allclose(slow_out, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("dm_, tmap, partial", [
    ((2, 4), ((1,), ()), (0,)),          # the seed step's weight gradient
    ((2, 4), ((0,), ()), (1,)),
    ((2, 2, 2), ((0,), (2,)), (1,)),
    ((8,), ((), ()), (0,)),
])
def test_sim_all_reduce_of_known_totals_equals_adding_the_shares(op, dm_, tmap, partial,
                                                                monkeypatch):
    from dualmode.communication import sim as sim_mod
    from dualmode.communication.totals import group_totals
    found = []

    def spy(*args):
        out = group_totals(*args)
        found.append(out is not None)
        return out

    monkeypatch.setattr(sim_mod, "group_totals", spy)
    sim = sim_mod.SimBackend(8)
    lay = TensorLayout(dm_, tmap, (8, 12), partial=partial)
    stack, totals = _shares(lay, RNG.standard_normal((8, 12)).astype(np.float32))
    plain = stack.copy()                                   # not remembered: shares added
    remember_totals(stack, totals, dm_, partial)
    members = lay.group_members(partial)
    fast = np.asarray(sim.all_reduce(stack, members=members, op=op))
    slow = np.asarray(sim.all_reduce(plain, members=members, op=op))
    np.testing.assert_allclose(fast, slow, rtol=1e-6, atol=1e-6)
    assert True in found                                   # the totals were read
    want = lay.without_partial().local_blocks(lay.assemble_totals(totals))
    if op == "mean":
        want = want / np.float32(members.shape[1])
    np.testing.assert_array_equal(fast, want)              # exactly the totals


def test_group_totals_match_groups_given_as_ranks_only():
    """Groups given by their ranks alone (no device matrix) are matched against the
    recorded ones: the same groups in another order give their totals in that order;
    other groups give None."""
    from dualmode.communication.totals import group_totals
    lay = TensorLayout((2, 4), ((1,), ()), (8, 12), partial=(0,))
    stack, totals = _shares(lay, RNG.standard_normal((8, 12)).astype(np.float32))
    remember_totals(stack, totals, (2, 4), (0,))
    members = lay.group_members((0,))                      # [[0, 4], [1, 5], ...]
    want = stack.reshape(2, 4, 2, 12).sum(axis=0)           # each group's sum
    np.testing.assert_allclose(group_totals(stack, members), want, rtol=1e-6)
    np.testing.assert_allclose(group_totals(stack, members[::-1, ::-1]), want[::-1],
                               rtol=1e-6)
    np.testing.assert_allclose(group_totals(stack, members, (2, 4), (0,)), want, rtol=1e-6)
    assert group_totals(stack, np.array([[0, 1], [2, 3], [4, 5], [6, 7]])) is None
    assert group_totals(stack, np.arange(8).reshape(1, 8)) is None
    assert group_totals(stack.copy(), members) is None


def test_a_deferred_running_sum_adds_totals_in_place():
    """DeferredShares.add_in_place: the written shares are those of the summed totals
    (each device a quarter of its group's total); totals in read-only memory are left
    alone."""
    rng = np.random.default_rng(5)
    t1 = rng.standard_normal((2, 1, 3, 4))
    t2 = rng.standard_normal((2, 1, 3, 4))
    d = DeferredShares(t1.copy(), (2, 4), (1,), 4)
    assert d.add_in_place(t2) and not d.totals.flags.writeable
    stack = d.materialize()
    for i in range(2):
        for j in range(4):
            np.testing.assert_allclose(stack[4 * i + j], (t1[i, 0] + t2[i, 0]) / 4)
    assert not d.add_in_place(t2[:, :, :2])                       # another grid
    frozen = np.frombuffer(t1.tobytes(), t1.dtype).reshape(t1.shape)   # read-only memory
    assert not DeferredShares(frozen, (2, 4), (1,), 4).add_in_place(t2)
