"""The direct executor (run_plan_direct): when this process holds every device, a plan
runs through the global value, and must give exactly run_plan's shards and CommReport
records; layouts' block views."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from dualmode.communication import SimBackend
from dualmode.parallel import CommReport, TensorLayout
from dualmode.parallel.redistribution import (blocks_of, execute, global_value,
                                            plan_redistribution, run_plan, run_plan_direct)

from test_redistribute import check_result, layout_pairs, source_stack

T = TensorLayout


def _records(rep):
    return [(r.kind, r.group_size, r.num_groups, r.bytes_per_device, r.op, r.reason)
            for r in rep.records]


def _both(src, dst, stack):
    plan = plan_redistribution(src, dst, stack.itemsize)
    with CommReport() as rep_steps:
        steps = run_plan(plan, stack, SimBackend(src.device_num), op_name="P")
    with CommReport() as rep_direct:
        direct = run_plan_direct(plan, stack, SimBackend(src.device_num), op_name="P")
    return plan, steps, direct, rep_steps, rep_direct


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs())
def test_run_plan_direct_equals_run_plan(pair):
    src, dst = pair
    g = np.random.default_rng(0).standard_normal(src.shape)
    plan, steps, direct, rep_steps, rep_direct = _both(src, dst, source_stack(src, g))
    check_result(direct, dst, g)
    if not dst.partial:
        np.testing.assert_allclose(direct, steps, rtol=1e-12, atol=1e-12)
    assert _records(rep_direct) == _records(rep_steps)
    assert rep_direct.peak_memory == rep_steps.peak_memory
    assert rep_direct.bytes() == pytest.approx(plan.bytes)


def test_run_plan_direct_partial_to_split_float32():
    src = T((2, 4), ((0,), ()), (16, 8), partial=(1,))
    dst = T((2, 4), ((1,), ()), (16, 8))
    g = np.random.default_rng(1).standard_normal(src.shape)
    stack = source_stack(src, g).astype(np.float32)
    plan, steps, direct, rep_steps, rep_direct = _both(src, dst, stack)
    assert [s.kind for s in plan] == ["AllToAll", "ReduceScatter", "AllGather"]
    assert direct.dtype == np.float32
    np.testing.assert_allclose(direct, steps, rtol=1e-5, atol=1e-5)
    assert _records(rep_direct) == _records(rep_steps)


def test_run_plan_direct_int_partial_keeps_dtype():
    src = T((8,), ((),), (8,), partial=(0,))
    dst = T((8,), ((0,),), (8,))
    stack = np.arange(64, dtype=np.int32).reshape(8, 8)
    out = run_plan_direct(plan_redistribution(src, dst, 4), stack, SimBackend(8))
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out[:, 0], stack.sum(axis=0))


def test_global_value_of_equal_shares_reads_one_buffer():
    lay = T((8,), ((), ()), (3, 2), partial=(0,))
    one = np.arange(6, dtype=np.float32).reshape(3, 2)
    stack = np.broadcast_to(one, (8, 3, 2))
    np.testing.assert_array_equal(global_value(stack, lay), one * 8)
    rep = T((8,), ((), ()), (3, 2))
    assert global_value(stack, rep) is one or np.shares_memory(global_value(stack, rep), one)


def test_blocks_of_column_split_is_a_read_only_view():
    value = np.arange(32.0).reshape(4, 8)
    lay = T((4,), ((), (0,)), (4, 8))
    out = blocks_of(value, lay)
    np.testing.assert_array_equal(out, lay.local_blocks(value))
    assert np.shares_memory(out, value) and not out.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        out[0, 0, 0] = 1.0


def test_local_blocks_view_copies_when_no_strided_grid_exists():
    value = np.arange(64.0).reshape(8, 8)
    lay = T((2, 4), ((0,), (1,)), (8, 8))           # 2x4 tiles: no single stride per rank
    out = lay.local_blocks_view(value)
    np.testing.assert_array_equal(out, lay.local_blocks(value))
    assert not np.shares_memory(out, value)
    rep = T((2, 4), ((1,), ()), (8, 8))             # replicated over axis 0: copies too
    np.testing.assert_array_equal(rep.local_blocks_view(value), rep.local_blocks(value))


def test_execute_runs_local_slices_step_by_step():
    src, dst = T.replicated((8, 4), 8), T.batch_split((8, 4), 8)
    stack = np.broadcast_to(np.arange(32.0).reshape(8, 4), (8, 8, 4))
    plan = plan_redistribution(src, dst, 8)
    assert not any(s.communicates for s in plan)
    out = execute(plan, stack, SimBackend(8))
    np.testing.assert_array_equal(out, dst.local_blocks(stack[0]))
