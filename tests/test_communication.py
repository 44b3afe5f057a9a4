"""dualmode.communication: every collective of the "sim" backend against a per-device
numpy hand computation, ring == direct, group specs, CommReport, init and groups, and
the error messages."""
import functools
import re

import numpy as np
import pytest

import dualmode as dm
from dualmode import communication as comm
from dualmode.communication import SimBackend, axis_groups
from dualmode.communication import groups as groups_mod
from dualmode.communication.groups import resolve
from dualmode.parallel import CommRecord, CommReport, comm_cause

E = re.escape
UFUNC = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
         "prod": np.multiply}


@pytest.fixture(autouse=True)
def _release():
    comm.release()
    yield
    comm.release()


# ------------------------------------------------------------ hand computations


def ref_reduce(bufs, op):
    red = functools.reduce(UFUNC[op], bufs)
    return red / len(bufs) if op == "mean" else red


def ref_all_reduce(stack, members, op):
    out = stack.copy()
    for row in members:
        red = ref_reduce([stack[r] for r in row], op)
        for r in row:
            out[r] = red
    return out


def ref_all_gather(stack, members, axis):
    n = len(members[0])
    local = list(stack.shape[1:])
    local[axis] *= n
    out = np.zeros((len(stack),) + tuple(local), stack.dtype)
    for row in members:
        cat = np.concatenate([stack[r] for r in row], axis=axis)
        for r in row:
            out[r] = cat
    return out


def ref_reduce_scatter(stack, members, axis, op):
    n = len(members[0])
    out = None
    for row in members:
        parts = np.split(ref_reduce([stack[r] for r in row], op), n, axis=axis)
        if out is None:
            out = np.zeros((len(stack),) + parts[0].shape, stack.dtype)
        for j, r in enumerate(row):
            out[r] = parts[j]
    return out


def ref_all_to_all(stack, members, split_axis, concat_axis):
    n = len(members[0])
    outs = {}
    for row in members:
        parts = [np.split(stack[r], n, axis=split_axis) for r in row]
        for j, r in enumerate(row):
            outs[r] = np.concatenate([parts[i][j] for i in range(n)], axis=concat_axis)
    shape = next(iter(outs.values())).shape
    out = np.array([outs.get(r, stack[r] if stack[r].shape == shape else None)
                    for r in range(len(stack))])
    return out


def ref_broadcast(stack, members, root):
    out = stack.copy()
    for row in members:
        for r in row:
            out[r] = stack[row[root]]
    return out


def ref_reduce_to_root(stack, members, root, op):
    out = stack.copy()
    for row in members:
        out[row[root]] = ref_reduce([stack[r] for r in row], op)
    return out


def ref_scatter(stack, members, root, axis):
    n = len(members[0])
    out = None
    for row in members:
        parts = np.split(stack[row[root]], n, axis=axis)
        if out is None:
            out = np.zeros((len(stack),) + parts[0].shape, stack.dtype)
        for j, r in enumerate(row):
            out[r] = parts[j]
    return out


def ref_gather(stack, members, root, axis):
    full = ref_all_gather(stack, members, axis)
    out = np.zeros_like(full)
    for row in members:
        out[row[root]] = full[row[root]]
    return out


# ------------------------------------------------------------------ configurations


def _cfg(world, dmat, axes):
    return pytest.param(world, ("axes", dmat, axes), id=f"{world}-dm{dmat}-axes{axes}")


def _explicit(world, members, name):
    return pytest.param(world, ("explicit", members), id=f"{world}-{name}")


GROUPS = [
    pytest.param(8, ("world",), id="8-world"),
    _cfg(8, (2, 2, 2), (0,)), _cfg(8, (2, 2, 2), (1,)), _cfg(8, (2, 2, 2), (2,)),
    _cfg(8, (2, 2, 2), (0, 2)), _cfg(8, (2, 2, 2), (2, 0)), _cfg(8, (2, 2, 2), (1, 2)),
    _cfg(8, (2, 2, 2), (0, 1, 2)), _cfg(8, (2, 2, 2), (2, 1, 0)), _cfg(8, (2, 2, 2), ()),
    _cfg(8, (4, 2), (0,)), _cfg(8, (4, 2), (1,)), _cfg(8, (4, 2), (1, 0)),
    _explicit(8, [[0, 5], [3, 2], [7, 1], [4, 6]], "shuffled-pairs"),
    _explicit(8, [[6, 1, 3, 0]], "one-group-of-4"),
    _explicit(8, [[2, 7], [5, 0]], "two-partial-pairs"),
    pytest.param(64, ("world",), id="64-world"),
    _cfg(64, (2, 4, 8), (1,)), _cfg(64, (2, 4, 8), (0, 2)), _cfg(64, (2, 4, 8), (2, 0)),
    _cfg(64, (2, 4, 8), (1, 2)),
    _explicit(64, np.random.default_rng(5).permutation(64).reshape(8, 8).tolist(),
              "permuted-8x8"),
]


def _members(world, spec):
    if spec[0] == "world":
        return None, np.arange(world)[None]
    if spec[0] == "axes":
        m = axis_groups(spec[1], spec[2])
        return m, m
    m = np.asarray(spec[1])
    return m, m


def _stack(world, local=(4, 6), dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(world,) + local).astype(dtype)


def _full(members, world):
    return members.size == world


# ------------------------------------------------------------------ collectives


@pytest.mark.parametrize("world,spec", GROUPS)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
def test_all_reduce_matches_hand_computation(world, spec, op):
    b = SimBackend(world)
    m, rows = _members(world, spec)
    x = _stack(world)
    out = b.all_reduce(x, m, op=op)
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_allclose(out, ref_all_reduce(x, rows, op), rtol=1e-12, atol=1e-12)
    if op == "sum":
        ring = b.all_reduce(x, m, op=op, algorithm="ring")
        np.testing.assert_allclose(ring, out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world,spec", GROUPS)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather_matches_hand_computation(world, spec, axis):
    b = SimBackend(world)
    m, rows = _members(world, spec)
    x = _stack(world)
    if not _full(rows, world) and rows.shape[1] > 1:
        with pytest.raises(ValueError, match="all_gather: members cover"):
            b.all_gather(x, m, axis=axis)
        return
    out = b.all_gather(x, m, axis=axis)
    np.testing.assert_array_equal(out, ref_all_gather(x, rows, axis % 2))


@pytest.mark.parametrize("world,spec", GROUPS)
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter_matches_hand_computation(world, spec, op):
    b = SimBackend(world)
    m, rows = _members(world, spec)
    n = rows.shape[1]
    x = _stack(world, local=(2 * n, 3))
    if not _full(rows, world) and n > 1:
        with pytest.raises(ValueError, match="reduce_scatter: members cover"):
            b.reduce_scatter(x, m, axis=0, op=op)
        return
    out = b.reduce_scatter(x, m, axis=0, op=op)
    np.testing.assert_allclose(out, ref_reduce_scatter(x, rows, 0, op), rtol=1e-12, atol=1e-12)
    y = _stack(world, local=(3, n))
    out = b.reduce_scatter(y, m, axis=1, op=op)
    np.testing.assert_allclose(out, ref_reduce_scatter(y, rows, 1, op), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world,spec", GROUPS)
@pytest.mark.parametrize("split_axis,concat_axis", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_all_to_all_matches_hand_computation(world, spec, split_axis, concat_axis):
    b = SimBackend(world)
    m, rows = _members(world, spec)
    n = rows.shape[1]
    x = _stack(world, local=(2 * n, n))
    if not _full(rows, world) and n > 1 and split_axis != concat_axis:
        with pytest.raises(ValueError, match="all_to_all: members cover"):
            b.all_to_all(x, m, split_axis, concat_axis)
        return
    out = b.all_to_all(x, m, split_axis=split_axis, concat_axis=concat_axis)
    np.testing.assert_array_equal(out, ref_all_to_all(x, rows, split_axis, concat_axis))


@pytest.mark.parametrize("world,spec", GROUPS)
def test_broadcast_reduce_scatter_gather_match_hand_computation(world, spec):
    b = SimBackend(world)
    m, rows = _members(world, spec)
    n = rows.shape[1]
    x = _stack(world, local=(n, 5))
    for root in sorted({0, n - 1}):
        np.testing.assert_array_equal(b.broadcast(x, m, root=root),
                                      ref_broadcast(x, rows, root))
        np.testing.assert_allclose(b.reduce(x, m, root=root, op="sum"),
                                   ref_reduce_to_root(x, rows, root, "sum"), rtol=1e-12)
        np.testing.assert_array_equal(b.reduce(x, m, root, "max"),
                                      ref_reduce_to_root(x, rows, root, "max"))
        if _full(rows, world) or n == 1:
            np.testing.assert_array_equal(b.scatter(x, m, root=root, axis=0),
                                          ref_scatter(x, rows, root, 0))
            np.testing.assert_array_equal(b.gather(x, m, root=root, axis=1),
                                          ref_gather(x, rows, root, 1))


def test_send_recv_swaps_and_keeps_others():
    b = SimBackend(8)
    x = _stack(8, local=(3,))
    out = b.send_recv(x, [(0, 1), (1, 0), (5, 7), (5, 6)])
    want = x.copy()
    want[1], want[0], want[7], want[6] = x[0], x[1], x[5], x[5]
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(b.send_recv(x, []), x)


# --------------------------------------------------------- replicated results


def test_world_all_reduce_is_one_read_only_buffer():
    b = SimBackend(8)
    x = _stack(8, local=(16, 16), dtype=np.float32)
    out = b.all_reduce(x)
    assert out.strides[0] == 0 and not out.flags.writeable
    np.testing.assert_allclose(out[3], x.sum(0), rtol=1e-5, atol=1e-5)
    again = b.all_reduce(out, op="max")          # a replicated input stays cheap
    np.testing.assert_array_equal(again, out)
    gathered = b.all_gather(x)
    assert gathered.strides[0] == 0 and gathered.shape == (8, 128, 16)
    bc = b.broadcast(x, root=3)
    assert bc.strides[0] == 0
    root = x[3].copy()
    x[3] = 0                                     # the result does not alias the input
    np.testing.assert_array_equal(bc[7], root)


def test_group_all_reduce_writes_each_device_once():
    b = SimBackend(8)
    x = _stack(8, local=(5,))
    out = b.all_reduce(x, axis_groups((2, 4), 1))
    assert out.flags.writeable and out.flags.c_contiguous
    np.testing.assert_allclose(out[:4], np.broadcast_to(x[:4].sum(0), (4, 5)))


def test_integer_and_float32_stacks_keep_their_dtype():
    b = SimBackend(8)
    xi = np.arange(8 * 6, dtype=np.int32).reshape(8, 6)
    out = b.all_reduce(xi, axis_groups((2, 4), 0))
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, ref_all_reduce(xi, axis_groups((2, 4), 0), "sum"))
    ring = b.all_reduce(xi, None, "prod", algorithm="ring")
    np.testing.assert_array_equal(ring, b.all_reduce(xi, None, "prod"))
    xf = _stack(8, dtype=np.float32)
    assert b.all_reduce(xf, op="mean").dtype == np.float32
    xh = _stack(8, dtype=np.float16)
    assert b.all_reduce(xh, axis_groups((2, 4), 0)).dtype == np.float16


@pytest.mark.parametrize("world,spec", [g for g in GROUPS if g.values[1][0] != "explicit"
                                        or len(g.values[1][1]) * len(g.values[1][1][0])
                                        == g.values[0]])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_ring_all_reduce_equals_direct(world, spec, op, dtype):
    """Ring sums in another order: float32 agrees within n * eps of sum |x|."""
    if op == "mean" and dtype == np.int64:
        return
    b = SimBackend(world)
    m, rows = _members(world, spec)
    rng = np.random.default_rng(1)
    if dtype == np.int64:
        x = rng.integers(-3, 4, size=(world, 7, 3)).astype(dtype)
    else:
        x = rng.uniform(0.5, 1.5, size=(world, 7, 3)).astype(dtype)   # prod stays finite
    direct = b.all_reduce(x, m, op)
    ring = b.all_reduce(x, m, op, algorithm="ring")
    assert ring.dtype == direct.dtype
    if dtype == np.int64 or op in ("max", "min"):
        np.testing.assert_array_equal(ring, direct)
    else:
        eps = np.finfo(dtype).eps
        n = rows.shape[1]
        np.testing.assert_allclose(ring, direct, rtol=4 * n * eps, atol=4 * n * eps)


def test_ring_with_more_devices_than_elements():
    b = SimBackend(8)
    x = _stack(8, local=(3,))
    np.testing.assert_allclose(b.all_reduce(x, algorithm="ring"), b.all_reduce(x),
                               rtol=1e-12)


# ---------------------------------------------------------------- group specs


def test_axis_groups_rows_and_member_order():
    np.testing.assert_array_equal(axis_groups((2, 4), 0), [[0, 4], [1, 5], [2, 6], [3, 7]])
    np.testing.assert_array_equal(axis_groups((2, 4), 1), [[0, 1, 2, 3], [4, 5, 6, 7]])
    np.testing.assert_array_equal(axis_groups((2, 2, 2), (2, 0)), [[0, 4, 1, 5], [2, 6, 3, 7]])
    np.testing.assert_array_equal(axis_groups((2, 2, 2), ()), np.arange(8)[:, None])
    np.testing.assert_array_equal(axis_groups((2, 2, 2), -1), axis_groups((2, 2, 2), 2))
    assert not axis_groups((4, 2), 0).flags.writeable


def test_axis_groups_agree_with_layout_group_members():
    from dualmode.parallel import tensor_layout as layout_mod
    lay = layout_mod.TensorLayout.replicated((8, 8), (2, 2, 2))
    for axes in [(0,), (1, 2), (2, 0)]:
        np.testing.assert_array_equal(lay.group_members(axes), axis_groups((2, 2, 2), axes))


@pytest.mark.parametrize("dmat,axes", [((2, 2, 2), (0, 2)), ((2, 4, 8), (2, 0)),
                                       ((4, 1, 2), (1, 2)), ((8,), (0,)), ((2, 3), ()),
                                       ((3, 5, 2), (1,)), ((2, 2, 2), (2, 1, 0))])
def test_plain_arrays_of_axis_groups_take_the_reshape_path(monkeypatch, dmat, axes):
    """Groups computed elsewhere (e.g. TensorLayout.group_members) are recognised as
    axis groups from their values alone, and every collective still matches."""
    members = np.array(axis_groups(dmat, axes)).tolist()
    monkeypatch.setattr(groups_mod, "_CACHE", {})          # forget axis_groups' plan
    world = int(np.prod(dmat))
    plan = resolve("t", members, world)
    assert plan.device_matrix is not None and plan.full
    np.testing.assert_array_equal(
        groups_mod._axis_members(plan.device_matrix, plan.group_axes), members)
    b = SimBackend(world)
    rows = np.asarray(members)
    n = rows.shape[1]
    x = _stack(world, local=(2 * n, 3))
    np.testing.assert_allclose(b.all_reduce(x, members), ref_all_reduce(x, rows, "sum"),
                               rtol=1e-12)
    np.testing.assert_array_equal(b.all_gather(x, members, 1), ref_all_gather(x, rows, 1))
    np.testing.assert_allclose(b.reduce_scatter(x, members, 0),
                               ref_reduce_scatter(x, rows, 0, "sum"), rtol=1e-12)
    np.testing.assert_array_equal(b.all_to_all(x, members, 0, 1),
                                  ref_all_to_all(x, rows, 0, 1))
    np.testing.assert_array_equal(b.broadcast(x, members, n - 1),
                                  ref_broadcast(x, rows, n - 1))


@pytest.mark.parametrize("members", [[[0, 3, 1, 2]], [[0, 1], [3, 2]], [[0, 1, 2], [4, 5, 6]],
                                     [[1, 0], [2, 3]], [[0, 3], [1, 2]]])
def test_lookalike_groups_are_not_mistaken_for_axis_groups(monkeypatch, members):
    monkeypatch.setattr(groups_mod, "_CACHE", {})
    world = 4 if len(members) * len(members[0]) == 4 else 8
    plan = resolve("t", members, world)
    assert plan.device_matrix is None


def test_irregular_groups_take_the_fancy_index_path():
    plan = resolve("t", [[0, 5], [3, 2], [7, 1], [4, 6]], 8)
    assert plan.device_matrix is None and plan.full
    plan = resolve("t", [[2, 7]], 8)
    assert not plan.full


# ------------------------------------------------------------------- CommReport


def test_comm_report_counts_and_bytes_for_each_kind():
    b = SimBackend(8)
    x = _stack(8, local=(8, 4), dtype=np.float32)           # S = 128 bytes per device
    s = 128
    pairs = axis_groups((4, 2), 1)                          # 4 groups of 2
    with CommReport() as r:
        b.all_reduce(x)
        b.all_gather(x, pairs)
        b.reduce_scatter(x, pairs)
        b.all_to_all(x, None)
        b.broadcast(x, pairs, root=1)
        b.reduce(x, pairs, 0, "max")
        b.scatter(x, None, 0, 0)
        b.gather(x, pairs, 1, 0)
        b.send_recv(x, [(0, 3)])
    kinds = [rec.kind for rec in r.records]
    assert kinds == ["AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "Broadcast",
                     "Reduce", "Scatter", "Gather", "Send/Recv"]
    assert r.bytes("AllReduce") == 2 * 7 / 8 * s
    assert r.bytes("AllGather") == 1 * s
    assert r.bytes("ReduceScatter") == s / 2
    assert r.bytes("AlltoAll") == 7 / 8 * s
    assert r.bytes("Broadcast") == s and r.bytes("Reduce") == s
    assert r.bytes("Scatter") == 7 / 8 * s
    assert r.bytes("Gather") == 1 / 2 * (2 * s)
    assert r.bytes("Send/Recv") == s
    assert r.count() == 9 and r.count("AllGather") == 1
    assert r.records[1] == CommRecord("AllGather", 2, 4, float(s), None, "user")
    assert r.bytes() == sum(rec.bytes_per_device for rec in r.records)
    assert r.peak_memory >= 2 * s
    table = str(r)
    for kind in kinds:
        assert kind in table


def test_comm_report_nesting_and_causes():
    b = SimBackend(4)
    x = _stack(4, local=(4,))
    with CommReport() as outer:
        b.all_reduce(x)
        with CommReport() as inner:
            with comm_cause("MatMul", "forward"):
                b.all_reduce(x)
                with comm_cause("MatMul", "backward"):
                    b.reduce_scatter(x)
                b.all_gather(x)
        with comm_cause(None, "gradient"):
            b.all_reduce(x, op="mean")
        with comm_cause("fc.weight", "parameter_broadcast"):
            b.broadcast(x)
    b.all_reduce(x)                                         # no report active: not recorded
    assert outer.count() == 6 and inner.count() == 3
    assert outer.records[-1] == CommRecord("Broadcast", 4, 1, 32.0, "fc.weight",
                                           "parameter_broadcast")
    assert [(r.op, r.reason) for r in inner.records] == [
        ("MatMul", "forward"), ("MatMul", "backward"), ("MatMul", "forward")]
    assert outer.count(reason="user") == 1 and outer.count(reason="gradient") == 1
    assert outer.count("AllReduce", reason="forward") == 1
    assert outer.bytes("ReduceScatter", "backward") == 3 / 4 * 32


def test_comm_report_records_single_device_groups_with_zero_bytes():
    b = SimBackend(4)
    x = _stack(4, local=(4,))
    with CommReport() as r:
        b.all_reduce(x, axis_groups((4,), ()))
        b.broadcast(x, axis_groups((4,), ()))
    assert r.count() == 2 and r.bytes() == 0
    assert r.records[0].group_size == 1 and r.records[0].num_groups == 4


def test_comm_report_fused_all_reduce_is_one_collective():
    dm.set_auto_parallel_context(device_num=8)
    comm.init()
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(8,) + s).astype(np.float32) for s in [(3, 4), (5,), (2, 2, 2)]]
    with CommReport() as r:
        out = comm.fused_all_reduce(grads, op="mean")
    assert r.count("AllReduce") == 1
    assert r.bytes() == 2 * 7 / 8 * (12 + 5 + 8) * 4
    for g, o in zip(grads, out):
        assert o.shape == g.shape
        np.testing.assert_allclose(o, np.broadcast_to(g.mean(0), g.shape), rtol=1e-6)


def test_comm_report_validates_selectors():
    r = CommReport()
    with pytest.raises(ValueError, match=E("CommReport.count: kind='Allreduce' is not valid")):
        r.count("Allreduce")
    with pytest.raises(ValueError, match=E("CommReport.bytes: reason='fwd' is not valid")):
        r.bytes(reason="fwd")
    with pytest.raises(ValueError, match=E("comm_cause: reason='grads' is not valid")):
        with comm_cause("MatMul", "grads"):
            pass


# --------------------------------------------------------------- init and groups


def test_init_follows_device_num_each_time():
    dm.set_auto_parallel_context(device_num=8)
    comm.init()
    assert comm.get_group_size() == 8 and comm._current_device_num() == 8
    assert comm.get_backend().local_ranks == tuple(range(8))
    comm.create_group("pair", [0, 1])
    dm.set_auto_parallel_context(device_num=4)
    comm.init()
    assert comm.get_group_size() == 4
    assert comm.get_backend().world_size == 4
    with pytest.raises(ValueError, match=E("group 'pair' does not exist")):
        comm.get_group_size("pair")
    comm.release()
    assert comm._current_device_num() is None and not comm.GlobalComm.INITED


def test_init_without_device_num_uses_rank_size_then_one(monkeypatch):
    monkeypatch.delenv("RANK_SIZE", raising=False)
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    comm.init()
    assert comm.get_group_size() == 1
    monkeypatch.setenv("RANK_SIZE", "3")
    comm.init("sim")                    # explicit "sim": RANK_SIZE simulated devices
    assert comm.get_group_size() == 3
    # init() of a process started by hand as one of 3 ranks: refused, never 1 of 1
    monkeypatch.setenv("RANK_ID", "1")
    with pytest.raises(RuntimeError, match=E("init: environment variable RANK_SIZE=3 (RANK_ID=1) "
                                             "says this process is one of 3 ranks, but mpiexec "
                                             "did not start it")):
        comm.init()
    monkeypatch.setenv("RANK_SIZE", "three")
    with pytest.raises(ValueError, match=E("init: environment variable RANK_SIZE='three' is "
                                           "not valid")):
        comm.init()


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_init_under_partial_mpi_environment_is_refused(monkeypatch, var):
    rank_var = {"OMPI_COMM_WORLD_SIZE": "OMPI_COMM_WORLD_RANK", "PMI_SIZE": "PMI_RANK"}[var]
    monkeypatch.setenv(var, "4")
    monkeypatch.delenv(rank_var, raising=False)
    with pytest.raises(RuntimeError, match=E(f"launched under MPI ({var}=4)") + ".*"
                       + E(f"{rank_var} is not set")):
        comm.init()
    comm.init("sim")                                   # an explicit "sim" still works
    assert comm.get_backend().name == "sim"


def test_init_rejects_unknown_backend_and_accepts_mindspore_names(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=E("init: backend_name='gloo' is not a registered "
                                           "backend")):
        comm.init("gloo")
    with pytest.raises(RuntimeError, match=E("backend_name='mpi' was given")):
        comm.init("mpi")
    with pytest.warns(UserWarning, match=E("init: backend_name='hccl' is MindSpore's device "
                                           "backend; dualmode runs backend 'sim'")):
        comm.init("hccl")
    assert comm.GlobalComm.BACKEND == "sim" and comm.GlobalComm.INITED


def test_register_backend_factory_is_used():
    made = []

    def factory(n):
        made.append(n)
        return SimBackend(n)

    comm.register_backend("sim-test", factory)
    dm.set_auto_parallel_context(device_num=2)
    comm.init("sim-test")
    assert made == [2] and comm.get_group_size() == 2
    comm.register_backend("bad-test", lambda n: object())
    with pytest.raises(TypeError, match=E("factory registered for 'bad-test' returned object")):
        comm.init("bad-test")
    with pytest.raises(TypeError, match=E("register_backend: factory for 'x' is 3")):
        comm.register_backend("x", 3)


def test_ranks_and_groups():
    dm.set_auto_parallel_context(device_num=8, global_rank=5)
    comm.init()
    assert comm.GlobalComm.WORLD_COMM_GROUP == "hccl_world_group"
    assert comm.get_rank() == 5 and comm.get_local_rank() == 5
    comm.create_group("odd", [7, 5, 3, 1])
    assert comm.get_group_size("odd") == 4
    assert comm.get_rank("odd") == 1
    assert comm.get_group_rank_from_world_rank(3, "odd") == 2
    assert comm.get_world_rank_from_group_rank("odd", 0) == 7
    np.testing.assert_array_equal(comm.group_members("odd"), [[7, 5, 3, 1]])
    b = comm.get_backend()
    x = _stack(8, local=(2,))
    out = b.all_reduce(x, comm.group_members("odd"))
    np.testing.assert_allclose(out[[1, 3, 5, 7]], np.broadcast_to(x[1::2].sum(0), (4, 2)))
    np.testing.assert_array_equal(out[::2], x[::2])
    comm.create_group("even", (0, 2, 4, 6))
    with pytest.raises(ValueError, match=E("get_rank: this process (world rank 5) is not a "
                                           "member of group 'even'")):
        comm.get_rank("even")
    comm.destroy_group("odd")
    with pytest.raises(ValueError, match=E("group 'odd' does not exist")):
        comm.group_members("odd")
    dm.reset_auto_parallel_context()
    assert comm.get_rank() == 0


def test_create_group_errors_name_the_group_and_value():
    dm.set_auto_parallel_context(device_num=4)
    comm.init()
    comm.create_group("g", [0, 1])
    cases = [
        (TypeError, (3, [0]), "create_group: group name 3 has type int; expected a str"),
        (ValueError, ("", [0]), "create_group: group name '' is empty"),
        (ValueError, ("hccl_world_group", [0]), "group name 'hccl_world_group' is the world"),
        (ValueError, ("g", [2, 3]), "create_group: group 'g' already exists (ranks [0, 1])"),
        (TypeError, ("h", "0,1"), "create_group: rank_ids for group 'h' is '0,1'; expected a "
                                  "list of ints"),
        (TypeError, ("h", [0, 1.0]), "create_group: rank_ids[1]=1.0 for group 'h' is not an "
                                     "int"),
        (TypeError, ("h", [True]), "rank_ids[0]=True for group 'h' is not an int"),
        (ValueError, ("h", []), "create_group: rank_ids for group 'h' is empty"),
        (ValueError, ("h", [0, 4]), "create_group: rank 4 in rank_ids of group 'h' is out of "
                                    "range for world_size=4"),
        (ValueError, ("h", [1, 2, 1]), "create_group: rank 1 appears twice in rank_ids of "
                                       "group 'h'"),
    ]
    for exc, args, msg in cases:
        with pytest.raises(exc, match=E(msg)):
            comm.create_group(*args)
    with pytest.raises(ValueError, match=E("destroy_group: the world group 'hccl_world_group' "
                                           "cannot be destroyed")):
        comm.destroy_group("hccl_world_group")
    with pytest.raises(ValueError, match=E("get_world_rank_from_group_rank: group_rank_id=2 is "
                                           "out of range for group 'g' of 2 ranks")):
        comm.get_world_rank_from_group_rank("g", 2)
    with pytest.raises(ValueError, match=E("get_group_rank_from_world_rank: world rank 3 is not "
                                           "a member of group 'g'")):
        comm.get_group_rank_from_world_rank(3, "g")


def test_calls_before_init_raise():
    msg = "call dualmode.communication.init() first"
    for fn in (comm.get_backend, comm.get_rank, comm.get_group_size,
               lambda: comm.create_group("a", [0])):
        with pytest.raises(RuntimeError, match=E(msg)):
            fn()
    assert comm._current_device_num() is None and comm._live_backend() is None


# ------------------------------------------------------------------------ errors


def test_collective_errors_name_collective_parameter_and_value():
    b = SimBackend(8)
    x = _stack(8, local=(6, 4))
    cases = [
        (ValueError, lambda: b.all_reduce(x, op="avg"),
         "all_reduce: op='avg' is not valid; expected one of 'sum', 'mean', 'max', 'min', "
         "'prod'"),
        (TypeError, lambda: b.all_reduce(x.astype(np.int32), op="mean"),
         "all_reduce: op='mean' needs a floating-point stack, got dtype int32"),
        (ValueError, lambda: b.all_reduce(x, algorithm="tree"),
         "all_reduce: algorithm='tree' is not valid for the sim backend; expected one of "
         "'direct', 'ring'"),
        (TypeError, lambda: b.all_reduce(x.astype(np.float16), algorithm="ring"),
         "all_reduce: algorithm='ring' supports float32, float64, int32 and int64 buffers, got "
         "dtype float16"),
        (ValueError, lambda: b.all_reduce(x[:4]),
         "all_reduce: stack has shape (4, 6, 4), but this process holds 8 device(s) (sim "
         "backend); expected a leading dim of 8"),
        (TypeError, lambda: b.all_reduce(x.tolist()),
         "all_reduce: stack must be a numpy array (local devices, *buffer shape), got list"),
        (ValueError, lambda: b.all_reduce(x, [[0, 8]]),
         "all_reduce: members contains rank 8, out of range for world_size=8; expected ranks "
         "in [0, 8)"),
        (ValueError, lambda: b.all_reduce(x, [[0, 1], [1, 2]]),
         "all_reduce: members lists rank 1 more than once; expected disjoint groups"),
        (ValueError, lambda: b.all_reduce(x, [0, 1, 2]),
         "all_reduce: members has shape (3,); expected a 2-D int array"),
        (ValueError, lambda: b.all_reduce(x, [[0, 1], [2]]),
         "all_reduce: members=[[0, 1], [2]] is not valid; expected a 2-D int array"),
        (TypeError, lambda: b.all_reduce(np.array([["a"]] * 8)),
         "all_reduce: op='sum' needs a numeric or bool stack, got dtype <U1"),
        (TypeError, lambda: b.broadcast(x, np.array([[0.0, 1.0]])),
         "broadcast: members has dtype float64; expected an int array"),
        (ValueError, lambda: b.reduce_scatter(x, axis_groups((2, 4), 1)),
         "reduce_scatter: dim 0 of the device buffers (size 6, local shape (6, 4), axis=0) is "
         "not divisible by the group size 4"),
        (ValueError, lambda: b.all_to_all(x, None, split_axis=1, concat_axis=0),
         "all_to_all: dim 1 of the device buffers (size 4, local shape (6, 4), split_axis=1) "
         "is not divisible by the group size 8"),
        (ValueError, lambda: b.all_gather(x, None, axis=2),
         "all_gather: axis=2 is out of range for device buffers of shape (6, 4); expected an "
         "int in [-2, 2)"),
        (ValueError, lambda: b.all_gather(np.zeros(8), None),
         "all_gather: axis=0 needs device buffers with at least one dimension"),
        (ValueError, lambda: b.all_gather(x, [[0, 1]]),
         "all_gather: members cover 2 of 8 ranks (rank 2 is in no group); AllGather changes "
         "the buffer shape, so every rank must be in exactly one group"),
        (ValueError, lambda: b.broadcast(x, axis_groups((2, 4), 0), root=2),
         "broadcast: root=2 is out of range for groups of 2 ranks; root is an index within "
         "each group, expected an int in [0, 2)"),
        (ValueError, lambda: b.scatter(x, None, root=0, axis=0),
         "scatter: dim 0 of the device buffers (size 6, local shape (6, 4), axis=0) is not "
         "divisible by the group size 8"),
        (ValueError, lambda: b.send_recv(x, [(0, 9)]),
         "send_recv: pairs[0]=(0, 9) names rank 9, out of range for world_size=8"),
        (ValueError, lambda: b.send_recv(x, [(0, 1), (2, 1)]),
         "send_recv: rank 1 receives twice (pairs[1]=(2, 1)); expected each dst_rank at most "
         "once"),
        (TypeError, lambda: b.send_recv(x, [(0, 1, 2)]),
         "send_recv: pairs[0]=(0, 1, 2) is not valid; expected a sequence of (src_rank, "
         "dst_rank) int pairs"),
        (ValueError, lambda: axis_groups((2, 4), 2),
         "axis_groups: axis 2 in axes=(2,) is out of range for a device matrix of 2 axes"),
        (ValueError, lambda: axis_groups((2, 4), (1, 1)),
         "axis_groups: axes=(1, 1) names axis 1 twice"),
        (ValueError, lambda: axis_groups((2, 0), 1),
         "axis_groups: device_matrix[1]=0 is not valid; expected an int >= 1"),
        (ValueError, lambda: SimBackend(0),
         "SimBackend: device_num=0 is not valid; expected an int >= 1"),
    ]
    for exc, fn, msg in cases:
        with pytest.raises(exc, match=E(msg)):
            fn()


def test_fused_all_reduce_errors():
    b = SimBackend(4)
    with pytest.raises(TypeError, match=E("fused_all_reduce: stacks[1] has dtype float64 but "
                                          "stacks[0] has float32")):
        comm.fused_all_reduce([np.zeros((4, 2), np.float32), np.zeros((4, 2))], backend=b)
    with pytest.raises(ValueError, match=E("fused_all_reduce: stacks[1] has shape (2, 2); every "
                                           "stack needs the leading (device) dim 4")):
        comm.fused_all_reduce([np.zeros((4, 2)), np.zeros((2, 2))], backend=b)
    assert comm.fused_all_reduce([], backend=b) == []


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
def test_all_reduce_of_a_stride0_stack_equals_the_materialised_one(op):
    """Equal per-device buffers stored once (a stride-0 view) take a shortcut in "sim";
    the result must equal reducing n real copies."""
    b = SimBackend(8)
    row = np.random.default_rng(0).uniform(0.5, 1.5, (3, 4)).astype(np.float64)
    view = np.broadcast_to(row, (8, 3, 4))
    out = b.all_reduce(view, op=op)
    ref = b.all_reduce(np.ascontiguousarray(view), op=op)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(out)[0], ref_reduce(list(view), op), rtol=1e-12)
