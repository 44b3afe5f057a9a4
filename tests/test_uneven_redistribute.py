"""Redistribution of pieces of unequal size (splits that do not divide their dims):
every move between two layouts of one tensor gives exactly the destination's pieces
(numpy.array_split's, padded with zeros), pending sums included; CommReport records
the plan's collectives with the bytes the real pieces move (hand-computed here)."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dualmode as dm
from dualmode.parallel import CommReport, Layout, TensorLayout
from dualmode.parallel.redistribution import plan_redistribution, reference_plan, redistribute


def _matrix(draw, n):
    """A device matrix of `n` devices (a random factorisation)."""
    out, left = [], n
    while left > 1:
        f = draw(st.sampled_from([d for d in (2, 3, 4) if left % d == 0] or [left]))
        out.append(f)
        left //= f
    return tuple(draw(st.permutations(out))) or (1,)


def _tmap(draw, dmat, ndim, partial_ok):
    axes = list(range(len(dmat)))
    owner = [draw(st.integers(-2 if partial_ok else -1, ndim - 1)) for _ in axes]
    order = draw(st.permutations(axes))
    tmap = tuple(tuple(a for a in order if owner[a] == d) for d in range(ndim))
    partial = tuple(a for a in axes if owner[a] == -2)
    return tmap, partial


@st.composite
def pairs(draw):
    n = draw(st.sampled_from([4, 6, 8]))
    ndim = draw(st.integers(1, 3))
    dm_a = _matrix(draw, n)
    dm_b = dm_a if draw(st.booleans()) else _matrix(draw, n)
    ta, pa = _tmap(draw, dm_a, ndim, True)
    tb, pb = _tmap(draw, dm_b, ndim, False)
    parts = [max(math.prod(dm_a[a] for a in x), math.prod(dm_b[a] for a in y))
             for x, y in zip(ta, tb)]
    shape = tuple(draw(st.integers(p, 2 * p + 3)) for p in parts)
    src = TensorLayout(dm_a, ta, shape, partial=pa)
    dst = TensorLayout(dm_b, tb, shape)
    keep = draw(st.booleans()) and pa and dm_a == dm_b
    if keep:      # a destination that keeps some of the source's pending sums
        kept = tuple(a for a in pa if not any(a in m for m in tb))
        if kept:
            dst = TensorLayout(dm_b, tb, shape, partial=kept)
    return src, dst


def _source_stack(src, x, rng):
    """The stack of `x` in `src`: pending sums as random shares adding up to it."""
    whole = src.without_partial().local_blocks(x)
    if not src.partial:
        return whole
    grid = whole.reshape(src.device_matrix + src.local_shape).copy()
    weights = rng.random(tuple(src.device_matrix[a] if a in src.partial else 1
                               for a in range(len(src.device_matrix))))
    weights = weights / weights.sum(axis=src.partial, keepdims=True)
    grid = grid * weights.reshape(weights.shape + (1,) * src.ndim)
    return grid.reshape(src.stack_shape)


@settings(max_examples=200, deadline=None)
@given(pairs(), st.integers(0, 2**31 - 1))
def test_any_move_gives_exactly_the_destination_pieces(pair, seed):
    src, dst = pair
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(src.shape)
    stack = _source_stack(src, x, rng)
    np.testing.assert_allclose(src.assemble(stack), x, rtol=1e-12, atol=1e-12)
    out = redistribute(stack, src, dst)
    assert out.shape == dst.stack_shape
    np.testing.assert_allclose(dst.assemble(out), x, rtol=1e-12, atol=1e-12)
    if not dst.partial:
        np.testing.assert_allclose(out, dst.local_blocks(x), rtol=1e-12, atol=1e-12)
    # the pads of every device hold zeros
    for r, shape in enumerate(dst.local_shapes):
        pad = np.ones(dst.local_shape, bool)
        pad[tuple(slice(0, s) for s in shape)] = False
        assert not out[r][pad].any()


@settings(max_examples=100, deadline=None)
@given(pairs())
def test_plans_move_at_least_what_each_device_lacks(pair):
    """A lower bound the bytes of any plan must reach: each device receives at least the
    part of its destination piece that its source piece does not hold."""
    src, dst = pair
    if src.partial or dst.partial or src.device_matrix != dst.device_matrix:
        return
    plan = plan_redistribution(src, dst, 4)
    lack = []
    for a, b in zip(src.device_slices(), dst.device_slices()):
        inter = math.prod(max(0, min(x.stop, y.stop) - max(x.start, y.start))
                          for x, y in zip(a, b))
        lack.append(math.prod(y.stop - y.start for y in b) - inter)
    assert plan.bytes >= 4 * np.mean(lack) - 1e-9
    assert plan.bytes <= reference_plan(src, dst, 4).bytes + 1e-9


def _records(src, dst, x):
    with CommReport() as rep:
        out = redistribute(src.local_blocks(x) if not src.partial else x, src, dst)
    return rep.records, out


def test_split_to_whole_is_an_allgather_of_the_real_pieces():
    x = np.arange(90, dtype=np.float32).reshape(30, 3)
    src = TensorLayout.from_strategy((4, 1), (30, 3), 4)            # 8, 8, 7, 7 rows
    dst = TensorLayout.replicated((30, 3), (4,))
    recs, out = _records(src, dst, x)
    assert [r.kind for r in recs] == ["AllGather"]
    # each device receives the rows it lacks: 22, 22, 23, 23 rows of 12 bytes
    assert recs[0].bytes_per_device == pytest.approx(np.mean([22, 22, 23, 23]) * 12)
    assert np.array_equal(out, np.broadcast_to(x, (4, 30, 3)))


def test_whole_to_split_moves_nothing():
    x = np.arange(90, dtype=np.float32).reshape(30, 3)
    src = TensorLayout.replicated((30, 3), (4,))
    dst = TensorLayout.from_strategy((4, 1), (30, 3), 4)
    with CommReport() as rep:
        out = redistribute(np.broadcast_to(x, (4, 30, 3)), src, dst)
    assert rep.records == []
    assert np.array_equal(out, dst.local_blocks(x))
    assert not out[3, 7].any()


def test_split_dim_change_is_an_alltoall_of_exact_bytes():
    x = np.arange(180, dtype=np.float32).reshape(30, 6)
    src = TensorLayout.from_strategy((4, 1), (30, 6), 4)            # rows 8, 8, 7, 7
    dst = TensorLayout.from_strategy((1, 4), (30, 6), 4)            # cols 2, 2, 1, 1
    recs, out = _records(src, dst, x)
    assert [r.kind for r in recs] == ["AlltoAll"]
    rows, cols = [8, 8, 7, 7], [2, 2, 1, 1]
    sent = [rows[g] * (6 - cols[g]) for g in range(4)]              # all but its own block
    assert recs[0].bytes_per_device == pytest.approx(np.mean(sent) * 4)
    assert np.array_equal(dst.assemble(out), x)


def test_split_count_change():
    x = np.arange(6 * 5, dtype=np.float64).reshape(6, 5)
    L = Layout((2, 2), ("a", "b"))
    src = L(("a", "b"), "None").bind((6, 5))                        # rows 0-2, 2-4, 4, 5
    dst = L("a", "None").bind((6, 5))                               # rows 0-3, 3-6
    out = redistribute(src.local_blocks(x), src, dst)
    assert np.array_equal(out, dst.local_blocks(x))
    # the pieces do not nest: rank 1 holds rows 2-3 and needs rows 0-2 (2 rows it lacks)
    assert [s[0] for s in src.device_slices()][1] == slice(2, 4)
    assert [s[0] for s in dst.device_slices()][1] == slice(0, 3)
    plan = plan_redistribution(src, dst, 8)
    lack = [math.prod(b.stop - b.start for b in bs) -
            math.prod(max(0, min(a.stop, b.stop) - max(a.start, b.start)) for a, b in zip(as_, bs))
            for as_, bs in zip(src.device_slices(), dst.device_slices())]
    assert plan.bytes == pytest.approx(np.mean(lack) * 8)


def test_pending_sum_to_split_is_a_reducescatter():
    x = np.arange(90, dtype=np.float32).reshape(30, 3)
    src = TensorLayout((4,), ((), ()), (30, 3), partial=(0,))
    dst = TensorLayout.from_strategy((4, 1), (30, 3), 4)
    shares = np.stack([x * w for w in (0.5, 0.25, 0.125, 0.125)])
    with CommReport() as rep:
        out = redistribute(shares, src, dst)
    assert [r.kind for r in rep.records] == ["ReduceScatter"]
    # each device sends its whole buffer but its own piece: 22, 22, 23, 23 rows
    assert rep.records[0].bytes_per_device == pytest.approx(np.mean([22, 22, 23, 23]) * 12)
    np.testing.assert_allclose(dst.assemble(out), x, rtol=1e-6)
    np.testing.assert_allclose(out, dst.local_blocks(x), rtol=1e-6)


def test_padded_moves_cost_no_more_than_the_next_dividing_shape():
    for n in (2047, 30, 9):
        src = TensorLayout.batch_split((n, 16), 8) if n >= 8 else None
        if src is None:
            continue
        up = -(-n // 8) * 8
        for dst_tmap in [((), ()), ((), (0,))]:
            a = plan_redistribution(src, TensorLayout((8,), dst_tmap, (n, 16)), 4)
            b = plan_redistribution(TensorLayout.batch_split((up, 16), 8),
                                    TensorLayout((8,), dst_tmap, (up, 16)), 4)
            assert a.kinds == b.kinds and a.bytes <= b.bytes


def test_tensors_move_between_unequal_layouts_eagerly():
    dm.reset_auto_parallel_context()
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    dm.communication.init()
    try:
        x = np.arange(30 * 7, dtype=np.float32).reshape(30, 7)
        L = Layout((2, 4), ("dp", "mp"))
        t = dm.reshard(dm.Tensor(x), L("dp", "mp"))
        assert t._data.shape == (8, 15, 2)
        u = dm.reshard(t, L("mp", "None"))
        v = dm.reshard(u, (8, 1))
        assert [dm.parallel.local_shape(v, rank=r)[0] for r in range(8)] == [4] * 6 + [3] * 2
        with pytest.raises(ValueError, match="out_strategy\\[0\\]\\[1\\]=8 exceeds dim 1 "
                                             "\\(size 7\\) of output 0: 1 device would hold "
                                             "an empty piece"):
            dm.reshard(u, (1, 8))
        for y, spec in ((t, L("dp", "mp")), (u, L("mp", "None"))):
            assert np.array_equal(y.asnumpy(), x)
            assert np.array_equal(y._data, spec.bind((30, 7)).local_blocks(x))
        assert np.array_equal(v.asnumpy(), x)
    finally:
        dm.reset_auto_parallel_context()


def test_a_local_slice_of_pieces_that_do_not_nest_moves_the_missing_rows():
    """8 rows cut in 2 (4, 4), then each half in 3 over another axis: the flat rule cuts
    8 in 6 (2, 2, 1, 1, 1, 1), so device (0, 2) needs row 4, which the other half holds;
    a slice that dividing shapes make for free is an AlltoAll of that one row here."""
    src = TensorLayout((2, 3), ((0,), ), (8,))
    dst = TensorLayout((2, 3), ((0, 1), ), (8,))
    assert [s[0] for s in dst.device_slices()][2] == slice(4, 5)
    x = np.arange(8, dtype=np.float32)
    with CommReport() as rep:
        out = redistribute(src.local_blocks(x), src, dst)
    assert np.array_equal(out, dst.local_blocks(x))
    assert [(r.kind, r.group_size, r.num_groups) for r in rep.records] == [("AlltoAll", 3, 2)]
    assert rep.records[0].bytes_per_device == pytest.approx(4 / 6)     # one row of 6
    assert plan_redistribution(src, dst, 4).bytes == pytest.approx(4 / 6)
