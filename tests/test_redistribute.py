"""Tensor redistribution: hand-computed plans and byte counts, device-matrix unification,
errors, the plan cache, and a property test over random layout pairs on 8, 16 and 64
devices (the executed plan gives every device exactly its block of the destination; the
Cython planner moves no more bytes than the pure-Python reference; replanning hits the
cache).

Byte counts follow dualmode/communication/trace.py: for groups of n devices and S bytes
per device buffer, AllGather (n-1) S, AlltoAll and ReduceScatter (n-1)/n S, AllReduce
2 (n-1)/n S; LocalSlice moves nothing.
"""
import math
import pickle
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualmode._core import _redist
from dualmode.communication import SimBackend
from dualmode.parallel import CommReport, Layout, TensorLayout
from dualmode.parallel.redistribution.planner import _build
from dualmode.parallel.redistribution.reference import _reference_raw
from dualmode.parallel.redistribution import (AllGather, AllReduce, AllToAll, LocalSlice, Plan,
                                            RedistributionError, ReduceScatter, Remesh,
                                            clear_plan_cache, plan_cache_info,
                                            plan_redistribution, redistribute, reference_plan,
                                            run_plan, unify_device_matrices)

E = re.escape
T = TensorLayout
L3 = Layout((2, 2, 2), ("dp", "sp", "mp"))
L24 = Layout((2, 4), ("dp", "mp"))
L8 = Layout((8,), ("x",))


def global_value(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def source_stack(src, g, seed=1):
    """src's stack of g; for partial axes, random shares that sum to each block."""
    blocks = src.without_partial().local_blocks(g)
    if not src.partial:
        return blocks
    dm = src.device_matrix
    parts = math.prod(dm[a] for a in src.partial)
    r = np.random.default_rng(seed).standard_normal(blocks.shape).reshape(dm + src.local_shape)
    shares = r - r.sum(axis=src.partial, keepdims=True) / parts
    return (shares + blocks.reshape(dm + src.local_shape) / parts).reshape(blocks.shape)


def check_result(out, dst, g, tol=1e-12):
    """out is dst's stack of g: every device holds its block (summed over the partial
    group when dst keeps partial axes)."""
    want = dst.without_partial().local_blocks(g)
    assert out.shape == want.shape
    if dst.partial:
        dm = dst.device_matrix
        s = out.reshape(dm + dst.local_shape).sum(axis=dst.partial, keepdims=True)
        out = np.broadcast_to(s, dm + dst.local_shape).reshape(want.shape)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)


def run(src, dst, dtype=np.float32, op_name="Op"):
    """Execute src -> dst on the sim backend under a CommReport; returns (out, report)."""
    g = global_value(src.shape)
    stack = source_stack(src, g).astype(dtype)
    with CommReport() as rep:
        out = redistribute(stack, src, dst, SimBackend(src.device_num), op_name=op_name)
    check_result(out, dst, g, tol=1e-5 if dtype == np.float32 else 1e-12)
    return out, rep


def assert_reported(plan, rep, op_name="Op"):
    """CommReport saw exactly the plan's collectives, bytes and cause."""
    comm = [s for s in plan if s.communicates]
    kinds = ["AlltoAll" if s.kind == "AllToAll" else s.kind for s in comm]
    assert [r.kind for r in rep.records] == kinds
    assert [r.bytes_per_device for r in rep.records] == [s.bytes for s in comm]
    assert [r.group_size for r in rep.records] == [s.parts for s in comm]
    assert all(r.reason == "redistribution" and r.op == op_name for r in rep.records)
    assert rep.bytes() == plan.bytes


# ------------------------------------------------------------------ hand-written plans


def test_plan_batch_split_to_replicated_is_one_allgather():
    src, dst = T.batch_split((16, 8), 8), T.replicated((16, 8), 8)
    plan = plan_redistribution(src, dst)          # float32: S = 2 x 8 x 4 = 64 bytes
    assert plan.steps == (AllGather(0, (0,), 8, 7 * 64.0),)
    assert plan.bytes == 448.0
    _, rep = run(src, dst)
    assert_reported(plan, rep)
    assert rep.count("AllGather", reason="redistribution") == 1


def test_plan_replicated_to_split_is_one_free_local_slice():
    src, dst = T.replicated((16, 8), 8), T.batch_split((16, 8), 8)
    plan = plan_redistribution(src, dst)
    assert plan.steps == (LocalSlice(0, (0,), 8),)
    assert plan.bytes == 0.0 and plan.collectives() == 0
    _, rep = run(src, dst)
    assert len(rep) == 0


def test_plan_dim0_split_to_dim1_split_is_one_alltoall():
    src, dst = T.batch_split((16, 8), 8), T.batch_split((16, 8), 8, dim=1)
    plan = plan_redistribution(src, dst)          # (8-1)/8 x 64 bytes, not 448 + slice
    assert plan.steps == (AllToAll(0, 1, (0,), 8, 56.0),)
    _, rep = run(src, dst)
    assert_reported(plan, rep)


def test_plan_partial_to_replicated_is_allreduce():
    src, dst = T.replicated((16, 8), 8).with_partial(0), T.replicated((16, 8), 8)
    plan = plan_redistribution(src, dst)          # S = 16 x 8 x 4 = 512: 2 x 7/8 x 512
    assert plan.steps == (AllReduce((0,), 8, 896.0),)
    _, rep = run(src, dst)
    assert_reported(plan, rep)


def test_plan_partial_to_split_is_reduce_scatter():
    src, dst = T.replicated((16, 8), 8).with_partial(0), T.batch_split((16, 8), 8)
    plan = plan_redistribution(src, dst)          # 7/8 x 512, not 896 + a slice
    assert plan.steps == (ReduceScatter(0, (0,), 8, 448.0),)
    _, rep = run(src, dst)
    assert_reported(plan, rep)


def test_plan_keeps_some_partial_axes_and_resolves_the_others():
    src = L3("dp", "None").bind((8, 8)).with_partial(("sp", "mp"))
    plan = plan_redistribution(src, L3("dp", "sp").bind((8, 8)))
    # S = 4 x 8 x 4 = 128: ReduceScatter over sp (64), then AllReduce over mp at S = 64
    assert plan.steps == (ReduceScatter(1, (1,), 2, 64.0), AllReduce((2,), 2, 64.0))
    kept = L3("dp", "None").bind((8, 8)).with_partial("mp")
    plan = plan_redistribution(src, kept)
    assert plan.steps == (AllReduce((1,), 2, 128.0),)
    _, rep = run(src, kept)
    assert_reported(plan, rep)
    plan8 = plan_redistribution(src, kept, itemsize=8)
    _, rep = run(src, kept, dtype=np.float64)
    assert_reported(plan8, rep)


def test_plan_between_2x4_and_8_device_matrices():
    a, b = L24("dp", "mp").bind((16, 8)), L8("x", "None").bind((16, 8))
    # unified (2, 4): x = (dp, mp), so only mp moves from dim 1 to dim 0; S = 8 x 2 x 4
    p = plan_redistribution(a, b)
    assert p.device_matrix == (2, 4)
    assert p.steps == (AllToAll(1, 0, (1,), 4, 48.0),)
    q = plan_redistribution(b, a)
    assert q.steps == (AllToAll(0, 1, (1,), 4, 48.0),)
    for s, d in ((a, b), (b, a)):
        _, rep = run(s, d)
        assert_reported(plan_redistribution(s, d), rep)


def test_plan_8_to_2x4_inner_axis_uses_alltoalls_not_a_full_gather():
    src, dst = L8("x", "None").bind((16, 8)), L24("mp", "None").bind((16, 8))
    plan = plan_redistribution(src, dst)
    # dim 0 is cut (dp, mp) but must end cut by mp alone: park both on dim 1, bring mp
    # back, gather dp: 56 + 48 + 64 = 168 bytes, against 448 for gathering everything
    assert plan.steps == (AllToAll(0, 1, (0, 1), 8, 56.0), AllToAll(1, 0, (1,), 4, 48.0),
                          AllGather(1, (0,), 2, 64.0))
    _, rep = run(src, dst)
    assert_reported(plan, rep)


def test_plan_merged_axes():
    src = L3("mp", ("sp", "dp")).bind((8, 8))     # dim 1 cut in 4: sp outer, dp inner
    to_rep = plan_redistribution(src, L3("None", "None").bind((8, 8)))
    # S = 4 x 2 x 4 = 32: gather mp on dim 0 (32), then (sp, dp) together on dim 1 (3 x 64)
    assert to_rep.steps == (AllGather(0, (2,), 2, 32.0), AllGather(1, (1, 0), 4, 192.0))
    dst = L3(("dp", "sp"), "mp").bind((8, 8))
    plan = plan_redistribution(src, dst)
    assert plan.steps == (AllGather(0, (2,), 2, 32.0), AllToAll(1, 0, (0,), 2, 32.0),
                          AllToAll(1, 0, (1,), 2, 32.0), LocalSlice(1, (2,), 2))
    for d in (to_rep.dst, dst):
        _, rep = run(src, d)
        assert_reported(plan_redistribution(src, d), rep)


def test_plan_equal_layouts_is_empty_and_returns_the_stack():
    src = L3("dp", "mp").bind((8, 8))
    plan = plan_redistribution(src, L3("dp", "mp").bind((8, 8)))
    assert len(plan) == 0 and plan.bytes == 0.0
    stack = src.local_blocks(global_value((8, 8)))
    assert redistribute(stack, src, src, SimBackend(8)) is stack


def test_plan_accepts_an_applied_layout_as_destination():
    src = L3("dp", "None").bind((8, 8))
    assert plan_redistribution(src, L3("None", "dp")) == \
        plan_redistribution(src, L3("None", "dp").bind((8, 8)))


def test_plan_between_matrices_that_do_not_nest_goes_through_replication():
    src, dst = T((2, 3), ((0,), (1,)), (6, 6)), T((3, 2), ((0,), (1,)), (6, 6))
    plan = plan_redistribution(src, dst)
    # float32, S = 3 x 2 x 4 = 24: gather dim 0 (24), then dim 1 at 48 bytes (2 x 48)
    assert plan.steps == (AllGather(0, (0,), 2, 24.0), AllGather(1, (1,), 3, 96.0),
                          Remesh((3, 2)), LocalSlice(0, (0,), 3), LocalSlice(1, (1,), 2))
    _, rep = run(src, dst)
    assert_reported(plan, rep)


def test_plan_steps_are_immutable_hashable_and_pickle():
    plan = plan_redistribution(T.batch_split((16, 8), 8), T.replicated((16, 8), 8))
    assert isinstance(plan, Plan) and isinstance(plan, tuple)
    with pytest.raises(AttributeError, match="immutable"):
        plan.bytes = 0
    with pytest.raises(AttributeError):
        plan[0].dim = 1
    assert hash(plan[0]) == hash(AllGather(0, (0,), 8, 448.0))
    assert AllGather(0, (0,), 8, 1.0) != LocalSlice(0, (0,), 8, 1.0)
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and again.src == plan.src and type(again[0]) is AllGather
    assert repr(plan[0]) == "AllGather(dim=0, axes=(0,), parts=8, bytes=448)"
    assert "AllGather" in str(plan)


def test_plan_bytes_scale_with_itemsize():
    src, dst = T.batch_split((16, 8), 8), T.replicated((16, 8), 8)
    assert plan_redistribution(src, dst, itemsize=8).bytes == 896.0
    g = global_value((16, 8))
    with CommReport() as rep:
        redistribute(src.local_blocks(g), src, dst, SimBackend(8))
    assert rep.bytes() == 896.0


def test_redistribute_defaults_to_a_sim_backend_for_full_stacks():
    src, dst = T.batch_split((16, 8), 8), T.batch_split((16, 8), 8, dim=1)
    g = global_value((16, 8))
    check_result(redistribute(src.local_blocks(g), src, dst), dst, g)


# ------------------------------------------------------------------ unification


def test_unify_device_matrices_common_refinement():
    assert unify_device_matrices((8,), (2, 4)) == ((2, 4), ((0, 1),), ((0,), (1,)))
    assert unify_device_matrices((4, 2), (2, 4)) == ((2, 2, 2), ((0, 1), (2,)),
                                                     ((0,), (1, 2)))
    assert unify_device_matrices((2, 2, 2), (8,)) == ((2, 2, 2), ((0,), (1,), (2,)),
                                                      ((0, 1, 2),))
    assert unify_device_matrices((1, 8), (8,)) == ((8,), ((), (0,)), ((0,),))
    assert unify_device_matrices((2, 3), (3, 2)) is None
    with pytest.raises(ValueError, match=E("(2, 4) and (4, 4) hold different numbers")):
        unify_device_matrices((2, 4), (4, 4))


def test_unified_plan_keeps_rank_order():
    """(4, 2) -> (2, 4) over the unified (2, 2, 2): ranks stay row-major in all three."""
    src = T((4, 2), ((0,), (1,)), (8, 8))
    dst = T((2, 4), ((1,), (0,)), (8, 8))
    plan = plan_redistribution(src, dst)
    assert plan.device_matrix == (2, 2, 2)
    g = global_value((8, 8))
    check_result(redistribute(src.local_blocks(g), src, dst, SimBackend(8)), dst, g)


# ------------------------------------------------------------------ errors


def test_error_different_shapes():
    src, dst = T.batch_split((16, 8), 8), T.batch_split((8, 8), 8)
    plan_redistribution(src, T.batch_split((16, 8), 8))     # cached: must not answer for dst
    with pytest.raises(RedistributionError, match=E(f"from {src!r} to {dst!r}: the global "
                                                    "shapes differ ((16, 8) vs (8, 8))")):
        plan_redistribution(src, dst)


def test_error_different_device_counts():
    src, dst = T.batch_split((16, 8), 8), T.batch_split((16, 8), 4)
    with pytest.raises(ValueError, match=E(f"from {src!r} to {dst!r}: the device counts "
                                           "differ (8 vs 4)")):
        plan_redistribution(src, dst)


def test_error_partial_destination():
    src = L3("dp", "None").bind((8, 8)).with_partial("sp")
    dst = L3("dp", "None").bind((8, 8)).with_partial("mp")
    with pytest.raises(RedistributionError,
                       match=E(f"to {dst!r}: the destination keeps partial sums over "
                               "('mp',), which are not pending in the source (partial over "
                               "('sp',))")):
        plan_redistribution(src, dst)
    with pytest.raises(RedistributionError, match="never creates them"):
        reference_plan(L3("dp", "None").bind((8, 8)), dst)


def test_error_destination_split_does_not_divide():
    src = T.replicated((3, 8), 8)
    dst = L3(("dp", "sp"), "None")
    with pytest.raises(RedistributionError,
                       match=E(f"from {src!r} to {dst!r}: the destination splits dim 0 "
                               "(size 3) into 4 parts (dp, sp), more than it has rows: some "
                               "pieces would be empty")):
        plan_redistribution(src, dst)
    with pytest.raises(RedistributionError, match="the destination does not fit: the "
                                                  "destination: .* maps 3 dims"):
        plan_redistribution(src, L3("dp", "None", "None"))


def test_error_partial_across_matrices_that_do_not_nest():
    src = T((2, 3), ((), ()), (6, 6), (0, 1))
    dst = T((3, 2), ((), ()), (6, 6), (0,))
    with pytest.raises(RedistributionError, match="no common refinement, so partial sums"):
        plan_redistribution(src, dst)


def test_error_not_layouts():
    with pytest.raises(TypeError, match="src must be a TensorLayout"):
        plan_redistribution("dp", T.replicated((4,), 2))
    with pytest.raises(TypeError, match="dst must be a TensorLayout"):
        plan_redistribution(T.replicated((4,), 2), (2,))


def test_error_stack_shape():
    src = T.batch_split((16, 8), 8)
    with pytest.raises(ValueError, match=E("the stack has shape (8, 16, 8), expected "
                                           "(8, 2, 8)")):
        redistribute(np.zeros((8, 16, 8)), src, T.replicated((16, 8), 8), SimBackend(8))
    with pytest.raises(ValueError, match="the backend has 4 devices"):
        redistribute(np.zeros((8, 2, 8)), src, T.replicated((16, 8), 8), SimBackend(4))


# ------------------------------------------------------------------ cache and fallbacks


def test_cache_returns_the_same_plan_for_equal_pairs():
    clear_plan_cache()
    a, b = L3("dp", "mp").bind((8, 8)), L3("mp", "dp").bind((8, 8))
    p = plan_redistribution(a, b)
    assert plan_cache_info() == (0, 1, 1)
    assert plan_redistribution(a, b) is p                         # same objects
    assert plan_redistribution(L3("dp", "mp").bind((8, 8)),       # equal objects
                               L3("mp", "dp").bind((8, 8))) is p
    assert plan_cache_info() == (2, 1, 1)
    assert plan_redistribution(a, b, itemsize=8) is not p         # bytes differ
    assert reference_plan(a, b) == p and reference_plan(a, b) is not p


def test_budget_exhausted_gives_the_direct_plan_in_both_planners():
    src, dst = L3("dp", "sp", "mp").bind((8, 8, 8)), L3("mp", "dp", "sp").bind((8, 8, 8))
    args = (src.device_matrix, src.tensor_map, src.partial, dst.device_matrix,
            dst.tensor_map, dst.partial, src.shape, 4, 0)
    raw = _redist.plan(*args)
    assert raw == _reference_raw(*args)
    direct = _build(raw, src, dst, 4)
    # float32, S = 4 x 4 x 4 x 4 = 256: gather each dim in turn (256 + 512 + 512), slicing
    # as soon as a destination split is free; the search finds 768 (one gather, two
    # AlltoAlls)
    assert direct.kinds == ("AllGather", "AllGather", "LocalSlice", "AllGather",
                            "LocalSlice", "LocalSlice")
    assert direct.bytes == 1280.0 and plan_redistribution(src, dst).bytes == 768.0
    g = global_value((8, 8, 8))
    check_result(run_plan(direct, src.local_blocks(g), SimBackend(8)), dst, g)


def test_kernel_entry_validates_its_arrays():
    with pytest.raises(ValueError, match="names device axis 3"):
        _redist.plan((2, 4), ((3,),), (), (8,), ((),), (), (8,))
    with pytest.raises(ValueError, match="uses device axis 0 twice"):
        _redist.plan((2, 4), ((0,), (0,)), (), (8,), ((), ()), (), (8, 8))
    with pytest.raises(ValueError, match="hold the same number of devices"):
        _redist.plan((2, 4), ((0,),), (), (4,), ((),), (), (8,))
    with pytest.raises(ValueError, match="the destination splits dim 0"):
        _redist.plan((8,), ((),), (), (8,), ((0,),), (), (6,))


def test_problems_beyond_the_kernel_limits_use_the_reference():
    shape = (4,) + (1,) * (_redist.LIMITS["dims"])
    src, dst = T.batch_split(shape, 4), T.replicated(shape, 4)
    with pytest.raises(OverflowError, match="exceed the kernel's limits"):
        _redist.plan(src.device_matrix, src.tensor_map, (), dst.device_matrix,
                     dst.tensor_map, (), shape)
    plan = plan_redistribution(src, dst)
    assert plan.steps == (AllGather(0, (0,), 4, 12.0),)


# ------------------------------------------------------------------ property test


def _factorizations(n, max_axes=4):
    out = []

    def rec(rest, cur):
        if rest == 1:
            out.append(tuple(cur))
            return
        if len(cur) < max_axes:
            for f in range(2, rest + 1):
                if rest % f == 0:
                    rec(rest // f, cur + [f])

    rec(n, [])
    return out


FACTORS = {n: _factorizations(n) for n in (8, 16, 64)}


@st.composite
def layout_pairs(draw):
    n = draw(st.sampled_from((8, 16, 64)))
    dm_s = draw(st.sampled_from(FACTORS[n]))
    dm_d = draw(st.sampled_from(FACTORS[n]))
    ndim = draw(st.integers(1, 3))

    def assign(dm, allow_partial):
        tmap, partial = [[] for _ in range(ndim)], []
        for a in draw(st.permutations(range(len(dm)))):
            role = draw(st.integers(0, 3 if allow_partial else 2))
            if role < 2:
                tmap[draw(st.integers(0, ndim - 1))].append(a)
            elif role == 3:
                partial.append(a)
        return tuple(tuple(t) for t in tmap), tuple(sorted(partial))

    map_s, part_s = assign(dm_s, True)
    keep = bool(part_s) and draw(st.booleans())           # keep some partial axes
    if keep:
        dm_d = dm_s
    map_d, _ = assign(dm_d, False)
    part_d = ()
    if keep:
        used = {a for t in map_d for a in t}
        part_d = tuple(a for a in part_s if a not in used and draw(st.booleans()))
    shape = []
    for d in range(ndim):
        ps = math.prod(dm_s[a] for a in map_s[d])
        pd = math.prod(dm_d[a] for a in map_d[d])
        shape.append(ps * pd // math.gcd(ps, pd) * draw(st.integers(1, 2)))
    return T(dm_s, map_s, tuple(shape), part_s), T(dm_d, map_d, tuple(shape), part_d)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs())
def test_property_random_layout_pairs(pair):
    src, dst = pair
    plan = plan_redistribution(src, dst, itemsize=8)
    # (a) executing the plan gives exactly dst's blocks
    g = global_value(src.shape)
    with CommReport() as rep:
        out = run_plan(plan, source_stack(src, g), SimBackend(src.device_num), op_name="P")
    check_result(out, dst, g)
    assert rep.bytes() == pytest.approx(plan.bytes)
    # (b) the Cython plan moves no more bytes than the reference plan (they agree)
    ref = reference_plan(src, dst, itemsize=8)
    assert plan.bytes <= ref.bytes
    assert plan.steps == ref.steps
    # (c) replanning hits the cache
    hits = plan_cache_info()[0]
    assert plan_redistribution(src, dst, itemsize=8) is plan
    assert plan_cache_info()[0] == hits + 1
