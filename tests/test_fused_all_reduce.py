"""fused_all_reduce: one collective for many stacks, equal to AllReducing each alone.

The simulated backend reduces large stacks straight into their slice of the result and
packs runs of small ones; every path is checked against numpy's reduction of each stack,
with stride-0 (replicated) stacks, every op, sub-world groups (the packed fallback), and
the data-parallel gradient path (reduce_gradients) against the unfused one.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dualmode as dm
from dualmode import Parameter, Tensor, communication as comm
from dualmode.communication import SimBackend, axis_groups
from dualmode.communication import sim as sim_module
from dualmode.communication.sim import equal_shares, share_of
from dualmode.communication.totals import DeferredShares, remember_totals
from dualmode._core import _fusion, fusion_reference
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


# ------------------------------------------------- the C loops against their references
#
# The member loops run in C (dualmode/_core/_fusion.pyx); their pure-Python references
# are fusion_reference.check_stacks / fusion_offsets and
# SimBackend._all_reduce_fused_reference. Results must agree bit for bit (both add each
# column's rows in row order), and both must equal numpy's reduction of each stack.

KERNEL_DTYPES = [np.float32, np.float64, np.int32, np.int64]
OPS_ALL = ["sum", "mean", "max", "min", "prod"]


def _dtype_ops(dtypes):
    """(dtype, op) pairs of `dtypes` x OPS_ALL, but a mean of floating stacks only (an
    integer mean is refused by name, tested on its own)."""
    return [pytest.param(d, op, id=f"{np.dtype(d).name}-{op}") for d in dtypes
            for op in OPS_ALL if op != "mean" or np.dtype(d).kind == "f"]
KINDS = ["plain", "strided", "transposed", "stride0", "shares", "deferred_known",
         "deferred_blocks", "remembered"]
FLOAT_ONLY = {"shares", "deferred_known", "remembered"}    # made of shares total / n


class _ReferenceSim(SimBackend):
    """The simulated backend running the pure-Python fused AllReduce."""
    _all_reduce_fused = SimBackend._all_reduce_fused_reference


def _values(rng, shape, dtype):
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-3, 4, size=shape).astype(dtype)


def _member(rng, kind, n, local, dtype):
    """One stack (or deferred stack) of `kind` with buffers of shape `local`."""
    m = math.prod(local)
    if kind in FLOAT_ONLY and np.dtype(dtype).kind != "f":
        kind = "plain"
    if kind == "plain":
        return _values(rng, (n,) + local, dtype)
    if kind == "strided":                      # rows of every other element
        return _values(rng, (n, 2 * m), dtype)[:, ::2].reshape((n,) + local)[...]
    if kind == "transposed":                   # device axis innermost in memory
        return _values(rng, (m, n), dtype).T.reshape((n,) + local)
    if kind == "stride0":
        return np.broadcast_to(_values(rng, local, dtype), (n,) + local)
    total = _values(rng, local, dtype)
    if kind == "shares":
        return equal_shares(total, n)
    if kind == "deferred_known":
        return DeferredShares(total[None], (n,), (0,), n)
    if kind == "deferred_blocks":              # a deferred stack whose sum is not known
        return DeferredShares(_values(rng, (n,) + local, dtype), (n,), (), 1)
    stack = np.empty((n,) + local, dtype)      # "remembered": written shares, total known
    stack[...] = share_of(total, n)
    return remember_totals(stack, total[None], (n,), (0,))


def _bits(a):
    return a.shape, a.dtype, np.ascontiguousarray(a).tobytes()


LOCALS = [(), (1,), (5,), (2, 3), (40,), (3, 0), (7, 9), (2, 2, 2)]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_c_fused_all_reduce_equals_its_reference_bit_for_bit(data):
    """Mixed members (small and large, deferred, stride-0, strided, remembered totals),
    every op, every kernel dtype: the C loop and the Python reference give the same
    bits and the same read-only stride-0 views, each equal to numpy's reduction."""
    n = data.draw(st.sampled_from([2, 3, 8]), "n")
    dtype = data.draw(st.sampled_from(KERNEL_DTYPES), "dtype")
    floats = np.dtype(dtype).kind == "f"
    op = data.draw(st.sampled_from(OPS_ALL if floats else ["sum", "max", "min", "prod"]),
                   "op")
    specs = data.draw(st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(LOCALS)),
                               min_size=1, max_size=12), "members")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16), "seed"))
    stacks = [_member(rng, kind, n, local, dtype) for kind, local in specs]
    saved = sim_module._PACK_BYTES
    sim_module._PACK_BYTES = 64            # 16 float32 per device: small and large members
    try:
        got = SimBackend(n).all_reduce_fused(stacks, None, op)
        ref = _ReferenceSim(n).all_reduce_fused(stacks, None, op)
    finally:
        sim_module._PACK_BYTES = saved
    assert len(got) == len(ref) == len(stacks)
    for s, g, r in zip(stacks, got, ref):
        assert _bits(g) == _bits(r)
        assert not g.flags.writeable and g.strides[0] == 0
        written = np.asarray(s)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12,
                                                                         atol=1e-12)
        np.testing.assert_allclose(g, _want(written, op), **tol)


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("dtype, op", _dtype_ops(KERNEL_DTYPES))
def test_c_fused_every_kind_of_member_equals_the_reference(dtype, op, n):
    """Every kind of member at every buffer shape in one call, in a shuffled order: the
    C loop and the Python reference agree bit for bit (n=3: summing equal shares does
    not give their total back, so a remembered total must be read as the reference
    reads it)."""
    rng = np.random.default_rng(n)
    specs = [(kind, local) for kind in KINDS for local in LOCALS]
    rng.shuffle(specs)
    stacks = [_member(rng, kind, n, local, dtype) for kind, local in specs]
    saved = sim_module._PACK_BYTES
    sim_module._PACK_BYTES = 64
    try:
        got = SimBackend(n).all_reduce_fused(stacks, None, op)
        ref = _ReferenceSim(n).all_reduce_fused(stacks, None, op)
    finally:
        sim_module._PACK_BYTES = saved
    for (kind, local), g, r in zip(specs, got, ref):
        assert _bits(g) == _bits(r), (kind, local)
        assert not g.flags.writeable and g.strides[0] == 0


@pytest.mark.parametrize("op", ["max", "min"])
def test_c_fused_max_min_propagate_nan_as_numpy(op):
    b = SimBackend(N)
    x = np.arange(N * 6, dtype=np.float32).reshape(N, 6)
    x[2, 1] = np.nan                           # NaN on one device
    x[:, 4] = np.nan                           # on every device
    x[3, 0] = -np.inf
    got = comm.fused_all_reduce([x, x[:, :3].copy()], op=op, backend=b)
    np.testing.assert_array_equal(got[0][3], _want(x, op)[0])
    np.testing.assert_array_equal(got[1][0], _want(x[:, :3], op)[0])


@pytest.mark.parametrize("kind", ["plain", "strided", "transposed", "remembered"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_c_fused_large_members_equal_unfused_all_reduce(kind, op):
    """Members over 64 KiB per device (the default threshold) against the unfused
    AllReduce of each (bit for bit: the same row kernel, or the same numpy reduction
    for strided rows, or the remembered total)."""
    b = SimBackend(N)
    rng = np.random.default_rng(4)
    stacks = [_member(rng, kind, N, (130, 131), np.float32),
              _member(rng, "plain", N, (3,), np.float32)]
    got = comm.fused_all_reduce(stacks, op=op, backend=b)
    for s, g in zip(stacks, got):
        assert _bits(g) == _bits(b.all_reduce(s, None, op))


@pytest.mark.parametrize("dtype", [np.float16, np.complex64, np.int8, np.bool_])
def test_fused_other_dtypes_take_the_python_form(dtype):
    b = SimBackend(N)
    rng = np.random.default_rng(6)
    stacks = [_values(rng, (N,) + local, np.float32).astype(dtype)
              for local in [(5,), (2, 3), (20000,)]]
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == np.float16 else dict(rtol=1e-6)
    for s, o in zip(stacks, comm.fused_all_reduce(stacks, op="sum", backend=b)):
        assert o.dtype == s.dtype and not o.flags.writeable
        np.testing.assert_allclose(o, _want(s, "sum"), **tol)


def test_c_fused_mean_of_deferred_and_replicated_members_reads_no_shares(deferred_writes):
    b = SimBackend(N)
    rng = np.random.default_rng(8)
    total = rng.standard_normal((200, 100)).astype(np.float32)
    one = rng.standard_normal(7).astype(np.float32)
    out = b.all_reduce_fused([DeferredShares(total[None], (N,), (0,), N),
                              np.broadcast_to(one, (N, 7)),
                              rng.standard_normal((N, 4)).astype(np.float32)], None, "mean")
    assert deferred_writes == []
    np.testing.assert_array_equal(out[0][3], share_of(total, N))
    np.testing.assert_array_equal(out[1][3], one)        # the mean of equal buffers


_ITEMS = st.one_of(
    st.tuples(st.just("array"), st.sampled_from([np.float32, np.float64]),
              st.sampled_from([(4, 3), (4,), (2, 3), (), (4, 0, 2)])),
    st.tuples(st.just("deferred"), st.sampled_from([np.float32, np.float64]),
              st.sampled_from([(4, 3), (3, 3)])),
    st.tuples(st.just("list"), st.just(None), st.just(None)))


def _item(kind, dtype, shape):
    if kind == "array":
        return np.zeros(shape, dtype)
    if kind == "deferred":
        return DeferredShares(np.ones(shape, dtype), (shape[0],), (), 1)
    return [1.0, 2.0]


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except (TypeError, ValueError) as e:
        return type(e), str(e)


@settings(max_examples=200, deadline=None)
@given(items=st.lists(_ITEMS, max_size=5), deferred=st.booleans())
def test_check_stacks_equals_its_reference(items, deferred):
    stacks = [_item(*it) for it in items]
    got = _outcome(_fusion.check_stacks, "fused_all_reduce", stacks, 4, deferred)
    want = _outcome(fusion_reference.check_stacks, "fused_all_reduce", stacks, 4, deferred)
    if got[0] != "ok" or want[0] != "ok":
        assert got == want
        return
    assert got[1] is not stacks and len(got[1]) == len(want[1])
    assert all(a is b for a, b in zip(got[1], want[1]))
    assert all(isinstance(s, np.ndarray) for s in got[1]) or deferred


def test_check_stacks_errors_name_the_stack():
    b = SimBackend(N)
    with pytest.raises(TypeError, match=r"fused_all_reduce: stacks\[1\] has dtype float64 "
                                        r"but stacks\[0\] has float32; fuse buffers of one"):
        comm.fused_all_reduce([np.zeros((N, 2), np.float32), np.zeros((N, 2))], backend=b)
    with pytest.raises(ValueError, match=r"fused_all_reduce: stacks\[0\] has shape \(3, 2\); "
                                         r"every stack needs the leading \(device\) dim 4"):
        comm.fused_all_reduce([np.zeros((3, 2))], backend=b)


@settings(max_examples=100, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=4), max_size=6))
def test_fusion_offsets_equals_its_reference(shapes):
    stacks = [np.empty(s, np.float32) for s in shapes]
    stacks += [DeferredShares(np.ones((2, 3), np.float32), (2,), (), 1)]
    assert _fusion.fusion_offsets(stacks) == fusion_reference.fusion_offsets(stacks)
    assert comm.fusion_offsets(stacks) == fusion_reference.fusion_offsets(stacks)


def test_whole_world_all_reduce_refuses_what_it_cannot_reduce():
    b = SimBackend(N)
    x = np.ones((N, 3), np.float32)
    with pytest.raises(ValueError, match=r"whole_world_all_reduce: op='avg' is not valid; "
                                         r"expected one of 'sum', 'mean', 'max'"):
        _fusion.whole_world_all_reduce([x], N, "avg", 16, b)
    with pytest.raises(ValueError, match=r"whole_world_all_reduce: n=1 is not valid"):
        _fusion.whole_world_all_reduce([x[:1]], 1, "sum", 16, b)
    with pytest.raises(ValueError, match=r"whole_world_all_reduce: stacks\[1\] has shape "
                                         r"\(3, 3\); expected the leading \(device\) dim 4"):
        _fusion.whole_world_all_reduce([x, x[:3]], N, "sum", 16, b)
    with pytest.raises(TypeError, match=r"whole_world_all_reduce: stacks\[1\] has dtype "
                                        r"float64 but the others float32"):
        _fusion.whole_world_all_reduce([x, np.ones((N, 2))], N, "sum", 16, b)
    with pytest.raises(TypeError, match=r"whole_world_all_reduce: op='mean' needs a "
                                        r"floating-point stack, got dtype int32"):
        _fusion.whole_world_all_reduce([np.ones((N, 2), np.int32)], N, "mean", 16, b)
    with pytest.raises(TypeError, match=r"whole_world_all_reduce: the row kernel takes float32, "
                                        r"float64, int32 and int64 stacks, got dtype float16"):
        _fusion.whole_world_all_reduce([np.ones((N, 2), np.float16)], N, "sum", 16, b)


def test_c_fused_reads_equal_shares_and_replicas_without_a_pass():
    """A sum of equal shares is a view of their remembered total, a mean of a stack
    stored once a view of that stack: nothing read or written (the reference's views
    hold the same memory)."""
    b = SimBackend(N)
    rng = np.random.default_rng(9)
    total = rng.standard_normal((6, 5)).astype(np.float32)
    shares = equal_shares(total, N)
    one = rng.standard_normal(7).astype(np.float32)
    replicas = np.broadcast_to(one, (N, 7))
    summed = b.all_reduce_fused([shares, rng.standard_normal((N, 2)).astype(np.float32)],
                                None, "sum")[0]
    meaned = b.all_reduce_fused([replicas], None, "mean")[0]
    ref = _ReferenceSim(N)
    for got, want, source in [
            (summed, ref.all_reduce_fused([shares], None, "sum")[0], total),
            (meaned, ref.all_reduce_fused([replicas], None, "mean")[0], one)]:
        assert np.shares_memory(got, source) and np.shares_memory(want, source)
        assert _bits(got) == _bits(want) and _strides(got) == _strides(want)
        assert not got.flags.writeable
    np.testing.assert_array_equal(summed[N - 1], total)


GROUPS = {"axis 1 of (2, 4)": axis_groups((2, 4), (1,)),
          "axis 0 of (2, 4)": axis_groups((2, 4), (0,)),
          "ranks in no order": np.array([[5, 0, 3], [1, 7, 2]]),    # 4 and 6 in no group
          "one rank each": np.arange(8)[:, None]}


@pytest.mark.parametrize("dtype, op", _dtype_ops([np.float32, np.float64, np.int64,
                                                  np.float16]))
@pytest.mark.parametrize("groups", list(GROUPS), ids=list(GROUPS))
def test_c_fused_over_groups_equals_the_packed_reference(groups, dtype, op):
    """Over groups other than the whole world the stacks are packed and reduced at once:
    the C packing and views give the base backend's results bit for bit (same views:
    shape, strides, writability), each equal to the unfused AllReduce of its stack."""
    members = GROUPS[groups]
    rng = np.random.default_rng(12)
    kinds = ["plain", "strided", "transposed", "stride0", "deferred_blocks", "plain"]
    specs = [(kind, local) for kind in kinds for local in [(3,), (2, 5), (40,), (3, 0)]]
    stacks = [_member(rng, kind, 8, local, dtype) for kind, local in specs]
    got = SimBackend(8).all_reduce_fused(stacks, members, op)
    ref = _ReferenceSim(8).all_reduce_fused(stacks, members, op)
    b = SimBackend(8)
    # numpy adds float16 in another order over a packed buffer than over one stack
    tol = {np.float16: dict(rtol=1e-2, atol=1e-2), np.float32: dict(rtol=1e-6, atol=1e-6)}
    for (kind, local), s, g, r in zip(specs, stacks, got, ref):
        assert _bits(g) == _bits(r), (kind, local)
        assert _strides(g) == _strides(r) and g.flags.writeable == r.flags.writeable
        np.testing.assert_allclose(g, b.all_reduce(np.asarray(s), members, op),
                                   **tol.get(dtype, dict(rtol=1e-12, atol=0)))


def _strides(a):
    """The strides that place `a`'s elements (those of dims longer than 1; none when
    `a` is empty): numpy leaves the others to chance."""
    return None if a.size == 0 else tuple(st for d, st in zip(a.shape, a.strides) if d > 1)
