"""Every op's sharding rule against the single-device run (SPEC §3 per-operator rules).

Each case builds a small program around one primitive with a strategy, runs it forward
and backward (``dm.value_and_grad`` of ``sum_k reduce_sum(out_k * w_k)``) on 8
simulated devices in semi_auto_parallel, and compares outputs (rtol 1e-5) and input
gradients (rtol 1e-4) with the same program on one device. The loss's Mul has an
all-ones strategy, so a pending partial output is resolved by a taped redistribution
(see test_partial_output_into_an_op_without_strategy_keeps_the_gradient for why).
CommReport expectations pin the communication that is fixed by the rules.
"""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.ops import REGISTRY
from dualmode.ops._registry import apply
from dualmode.parallel import CommReport, Layout, TensorLayout
from dualmode.parallel.dtensor import distribute

RNG = np.random.default_rng(1234)
LAY = Layout((2, 2, 2), ("dp", "sp", "mp"))
LAY8 = Layout((8,), ("tp",))


def _setup(devices):
    dm.reset_auto_parallel_context()
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=devices)
    communication.init()


def _f32(*shape, low=-1.0, high=1.0):
    return RNG.uniform(low, high, shape).astype(np.float32)


def _weight(shape, k):
    return np.random.default_rng(100 + k).standard_normal(shape).astype(np.float32)


def _loss_terms(outs):
    total = None
    for k, o in enumerate(outs):
        if o.dtype.kind != "f":
            continue
        ones = (1,) * o.ndim
        term = ops.reduce_sum(ops.Mul().shard((ones, ones))(o, Tensor(_weight(o.shape, k))))
        total = term if total is None else total + term
    return total


def _run(devices, build, inputs, grad_pos, prep=None):
    """Outputs, gradients (None without grad_pos), CommReport and output tensors."""
    _setup(devices)
    dm.set_seed(11)
    fn = build()
    args = [Tensor(x) if isinstance(x, np.ndarray) else x for x in inputs]
    if prep is not None and devices > 1:
        args = prep(args)

    def f(*xs):
        out = fn(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        return _loss_terms(outs), outs

    with CommReport() as rep:
        if grad_pos is None:
            _, outs = f(*args)
            grads = None
        else:
            (_, outs), g = dm.value_and_grad(f, grad_pos, has_aux=True)(*args)
            grads = [x.asnumpy() for x in (g if isinstance(g, tuple) else (g,))]
    return [o.asnumpy() for o in outs], grads, rep, outs


def _check(build, inputs, grad_pos=0, prep=None):
    ref_out, ref_g, _, _ = _run(1, build, inputs, grad_pos)
    out, g, rep, tensors = _run(8, build, inputs, grad_pos, prep)
    assert len(out) == len(ref_out)
    for a, b in zip(out, ref_out):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if grad_pos is not None:
        for a, b in zip(g, ref_g):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    return rep, tensors


def _prim(cls, strategy, *args, **kw):
    return lambda: cls(*args, **kw).shard(strategy)


# ---------------------------------------------------------------------------
# MatMul / BatchMatMul / BiasAdd
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("ta,tb,strategy", [
    (False, False, ((2, 4), (4, 1))),          # contracted dim split: pending sums
    (False, False, ((1, 8), (8, 1))),
    (False, False, ((8, 1), (1, 1))),
    (False, False, ((2, 1), (1, 4))),          # repeated calculation (product < 8)
    (True, False, ((4, 2), (4, 1))),           # transpose_a: dim 0 of a is contracted
    (False, True, ((2, 4), (2, 4))),           # transpose_b: dim 1 of b is contracted
    (False, False, (LAY("mp", ("sp", "dp")), LAY(("sp", "dp"), "None"))),
    (False, False, (LAY8("None", "tp"), LAY8("tp", "None"))),
], ids=lambda v: str(v))
def test_matmul(ta, tb, strategy):
    a = _f32(16, 8) if ta else _f32(8, 16)
    b = _f32(8, 16) if tb else _f32(16, 8)

    def build():
        mm = ops.MatMul(ta, tb).shard(strategy)
        return lambda x, y: mm(x, y)
    _check(build, [a, b], (0, 1))


@pytest.mark.parametrize("strategy", [
    ((2, 1, 4), (2, 4, 1)),                    # batch split + contracted split
    ((8, 1, 1), (8, 1, 1)),
    ((1, 2, 2), (1, 2, 2)),
    ((2, 2, 1), (2, 1, 1)),                    # repeated calculation
    (LAY("dp", "sp", "mp"), LAY("dp", "mp", "None")),
], ids=str)
def test_batch_matmul(strategy):
    _check(lambda: (lambda x, y: ops.BatchMatMul().shard(strategy)(x, y)),
           [_f32(8, 8, 8), _f32(8, 8, 4)], (0, 1))


@pytest.mark.parametrize("strategy", [((2, 4, 1), (4,)), ((8, 1, 1), (1,)), ((1, 2, 2), (2,))],
                         ids=str)
def test_bias_add(strategy):
    _check(lambda: (lambda x, b: ops.BiasAdd().shard(strategy)(x, b)),
           [_f32(8, 8, 4), _f32(8)], (0, 1))


# ---------------------------------------------------------------------------
# elementwise: every unary/binary op, Cast, comparisons, broadcasting
# ---------------------------------------------------------------------------
UNARY = ["Neg", "Exp", "Log", "Sqrt", "Square", "Tanh", "Sigmoid", "ReLU", "Abs"]


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("strategy", [((2, 1, 2),), ((8, 1, 1),),
                                      (LAY("mp", "None", ("sp", "dp")),)], ids=str)
def test_unary(name, strategy):
    x = _f32(8, 3, 4, low=0.2, high=2.0) if name in ("Log", "Sqrt") else _f32(8, 3, 4)
    _check(lambda: (lambda t: getattr(ops, name)().shard(strategy)(t)), [x])


BINARY = ["Add", "Sub", "Mul", "RealDiv", "Div", "Maximum", "Minimum", "Pow"]


@pytest.mark.parametrize("name", BINARY)
@pytest.mark.parametrize("shapes,strategy", [
    (((8, 4), (8, 4)), ((2, 4), (2, 4))),
    (((8, 1, 6), (4, 6)), ((2, 1, 2), (4, 2))),     # broadcast dims, splits on them
    (((8, 4), (4,)), ((8, 1), (1,))),              # the rank-1 operand is repeated
    (((8, 4), (1, 4)), ((4, 2), (1, 2))),
], ids=str)
def test_binary(name, shapes, strategy):
    xs = [_f32(*s, low=0.5, high=2.0) for s in shapes]
    _check(lambda: (lambda a, b: getattr(ops, name)().shard(strategy)(a, b)), xs, (0, 1))


@pytest.mark.parametrize("name", ["Equal", "Greater", "Less"])
def test_comparisons(name):
    a = np.round(_f32(8, 1, 6) * 2)
    b = np.round(_f32(4, 6) * 2)
    _check(lambda: (lambda x, y: ops.Cast()(getattr(ops, name)().shard(
        ((2, 1, 2), (4, 2)))(x, y), dm.float32)), [a, b], None)


@pytest.mark.parametrize("dtype", [dm.float64, dm.float16, dm.int32])
def test_cast(dtype):
    x = _f32(8, 4) * 4
    grad = 0 if np.dtype(dtype).kind == "f" else None
    _check(lambda: (lambda t: ops.Cast().shard(((2, 4),))(t, dtype)), [x], grad)


def test_scalar_operand_on_a_split_tensor():
    _check(lambda: (lambda t: ops.Mul().shard(((2, 4),))(t, 3.0) + 1.5), [_f32(8, 4)])


# ---------------------------------------------------------------------------
# reductions, softmax
# ---------------------------------------------------------------------------
_REDUCE_CASES = [
    (((1, 8),), 1, False),                     # reduced dim split
    (((2, 4),), (0, 1), True),
    (((4, 2),), 0, False),
    (((2, 2),), 1, True),                      # repeated calculation
    ((LAY(("sp", "dp"), "mp"),), 0, False),
]


@pytest.mark.parametrize("name,strategy,axis,keep", [
    (name, *case) for name in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin")
    for case in _REDUCE_CASES], ids=str)
def test_reductions(name, strategy, axis, keep):
    _check(lambda: (lambda t: getattr(ops, name)(keep).shard(strategy)(t, axis)), [_f32(8, 16)])


@pytest.mark.parametrize("name", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("strategy,axis", [
    (((2, 4),), -1),                           # softmax axis split: redistributed
    (((8, 1),), -1),
    (((1, 8),), 0),
    (((2, 2, 2),), 1),
    ((LAY("dp", "sp", "mp"),), 2),
], ids=str)
def test_softmax(name, strategy, axis):
    shape = (8, 8, 4) if len(strategy[0] if isinstance(strategy[0], tuple) else
                             strategy[0].spec) == 3 else (8, 16)
    _check(lambda: (lambda t: getattr(ops, name)(axis).shard(strategy)(t)), [_f32(*shape)])


# ---------------------------------------------------------------------------
# reshape family (Reshape, Flatten, ExpandDims, Squeeze), Transpose
# ---------------------------------------------------------------------------
X3 = (8, 4, 6)


@pytest.mark.parametrize("build_op,shape,strategy", [
    (lambda st: lambda t: ops.Reshape().shard(st)(t, (8, 24)), X3, ((8, 1, 1),)),
    (lambda st: lambda t: ops.Reshape().shard(st)(t, (4, 2, 24)), X3, ((2, 2, 2),)),
    (lambda st: lambda t: ops.Reshape().shard(st)(t, (32, 6)), X3, ((4, 1, 2),)),
    (lambda st: lambda t: ops.Flatten().shard(st)(t), X3, ((8, 1, 1),)),
    (lambda st: lambda t: ops.Flatten().shard(st)(t), X3, ((2, 2, 2),)),
    (lambda st: lambda t: ops.ExpandDims().shard(st)(t, 0), X3, ((2, 2, 2),)),
    (lambda st: lambda t: ops.ExpandDims().shard(st)(t, 1), X3, ((8, 1, 1),)),
    (lambda st: lambda t: ops.ExpandDims().shard(st)(t, -1), X3, ((2, 2, 2),)),
    (lambda st: lambda t: ops.Squeeze(1).shard(st)(t), (8, 1, 6), ((8, 1, 1),)),
    (lambda st: lambda t: ops.Squeeze(1).shard(st)(t), (8, 1, 6), ((2, 1, 2),)),
    (lambda st: lambda t: ops.Squeeze().shard(st)(t), (1, 8, 6), ((1, 4, 2),)),
    (lambda st: lambda t: ops.Transpose().shard(st)(t, (2, 0, 1)), X3, ((2, 2, 2),)),
    (lambda st: lambda t: ops.Transpose().shard(st)(t, (1, 0, 2)), X3,
     (LAY("mp", ("sp", "dp"), "None"),)),
], ids=lambda v: str(v) if not callable(v) else "")
def test_reshape_family(build_op, shape, strategy):
    _check(lambda: build_op(strategy), [_f32(*shape)])


@pytest.mark.parametrize("build_op,shape", [
    (lambda t: ops.ExpandDims().shard(((8, 1, 1),))(t, 0), X3),       # (1, 8, 4, 6)
    (lambda t: ops.Squeeze(1).shard(((1, 1, 8),))(t), (8, 1, 8)),       # (8, 8)
], ids=["expand_dims_0", "squeeze_unit_dim"])
def test_unit_dims_keep_their_splits_without_communication(build_op, shape):
    _setup(8)
    x = Tensor(_f32(*shape))
    with CommReport() as rep:
        out = build_op(x)
    np.testing.assert_allclose(out.asnumpy().reshape(-1), x.asnumpy().reshape(-1))
    assert rep.count() == 0


# ---------------------------------------------------------------------------
# Concat / Split / StridedSlice / indexing
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("axis,strategy", [
    (1, ((8, 1, 1), (8, 1, 1))),
    (1, ((2, 1, 4), (2, 1, 4))),
    (1, ((1, 4, 1), (1, 2, 1))),               # the concat axis split: gathered first
    (0, ((2, 2, 2), (2, 2, 2))),
    (0, ((2, 2, 2), (1, 2, 2))),               # each input's concat axis split its own way
    (2, ((4, 1, 1), (4, 1, 1))),               # repeated calculation
    (1, (LAY("dp", "None", ("sp", "mp")), LAY("dp", "None", ("sp", "mp")))),
], ids=str)
def test_concat(axis, strategy):
    a, b = _f32(8, 4, 8), _f32(8, 4, 8)
    _check(lambda: (lambda x, y: ops.Concat(axis).shard(strategy)((x, y))), [a, b], (0, 1))


@pytest.mark.parametrize("axis,num,strategy", [
    (1, 2, ((8, 1, 1),)), (1, 4, ((2, 2, 2),)), (0, 2, ((4, 1, 2),)), (2, 2, ((2, 2, 1),)),
    (2, 2, (LAY(("dp", "mp"), "sp", "None"),)),
], ids=str)
def test_split(axis, num, strategy):
    _check(lambda: (lambda t: ops.Split(axis, num).shard(strategy)(t)), [_f32(8, 4, 8)])


@pytest.mark.parametrize("begin,end,strides,shrink,strategy", [
    ((0, 1, 0), (8, 4, 6), (1, 2, 1), 0, ((8, 1, 1),)),
    ((0, 1, 0), (8, 4, 6), (1, 2, 1), 0, ((2, 2, 2),)),
    ((0, 1, 0), (8, 2, 6), (1, 1, 1), 2, ((1, 4, 2),)),   # shrink the sliced dim
    ((2, 0, 0), (6, 4, 6), (1, 1, 1), 0, ((2, 2, 1),)),
], ids=str)
def test_strided_slice(begin, end, strides, shrink, strategy):
    _check(lambda: (lambda t: ops.StridedSlice(shrink_axis_mask=shrink).shard(strategy)(
        t, begin, end, strides)), [_f32(8, 4, 6)])


def _as_layout(strategy):
    """prep: move the (plain) inputs into strategy layouts without an op."""
    from dualmode.parallel.strategy import _to

    def prep(args):
        return [_to(a, TensorLayout.from_strategy(s, tuple(a.shape), 8), "test")
                for a, s in zip(args, strategy)]
    return prep


@pytest.mark.parametrize("index", [
    (slice(None), 1), (Ellipsis, slice(1, 5)), (slice(None), None, slice(0, 4, 2)), (3,),
    (slice(None), slice(None), -1), (slice(0, 8), slice(None)),
    (np.array([0, 3, 3]),), (slice(None), np.array([1, 0])),      # advanced: gathered
], ids=str)
@pytest.mark.parametrize("strategy", [(2, 2, 2), (1, 4, 2), (4, 1, 1)], ids=str)
def test_getitem(index, strategy):
    _check(lambda: (lambda t: t[index]), [_f32(8, 4, 6)], prep=_as_layout((strategy,)))


def test_getitem_array_on_a_batch_split_tensor():
    _check(lambda: (lambda t: t[np.array([0, 3, 3])]), [_f32(8, 4, 6)],
           prep=_as_layout(((8, 1, 1),)))


# ---------------------------------------------------------------------------
# Gather (vocabulary-split tables, repeated indices) and GatherGrad
# ---------------------------------------------------------------------------
TABLE = (16, 8)
IDX = np.array([[0, 3, 3, 15], [7, 8, 8, 1]], np.int32)       # repeated indices


@pytest.mark.parametrize("strategy", [
    ((8, 1), (1, 1)),                          # vocab split: offset, mask, pending sum
    ((1, 8), (1, 1)),                          # hidden split: output split on last dim
    ((1, 1), (2, 1)),                          # indices split
    ((2, 4), (1, 1)),
    ((2, 1), (1, 1)),                          # repeated calculation
    ((4, 1), (2, 1)),
    ((2, 2), (2, 1)),
    (LAY(("sp", "dp"), "mp"), LAY("None", "None")),
    (LAY("mp", "None"), LAY("None", ("dp", "sp"))),
], ids=str)
def test_gather(strategy):
    _check(lambda: (lambda t, i: ops.Gather().shard(strategy)(t, i, 0)),
           [_f32(*TABLE), IDX])


@pytest.mark.parametrize("strategy", [((1, 2, 1), (1, 1)), ((1, 8, 1), (1, 1)),
                                      ((2, 2, 2), (1, 1)), ((2, 1, 2), (2, 1))], ids=str)
def test_gather_inner_axis(strategy):
    idx = np.array([[9, 0], [3, 3], [5, 15], [1, 9]], np.int64)
    _check(lambda: (lambda t, i: ops.Gather().shard(strategy)(t, i, 1)),
           [_f32(4, 16, 6), idx])


def test_gather_out_of_range_index_is_an_error_on_a_split_table():
    _setup(8)
    g = ops.Gather().shard(((8, 1), (1,)))
    with pytest.raises(ValueError, match=r"Gather: index 16 is out of range for dim 0 "
                                         r"\(size 16\) of input 0"):
        g(Tensor(_f32(*TABLE)), Tensor(np.array([0, 16], np.int32)), 0)


def _dist(strategy):
    """prep: distribute every input in its strategy's layout (leaves keep it)."""
    def prep(args):
        return [distribute(a, TensorLayout.from_strategy(s, tuple(a.shape), 8))
                for a, s in zip(args, strategy)]
    return prep


@pytest.mark.parametrize("idx_st,g_st", [
    ((2, 1), (2, 1, 1)),                       # indices split: a pending sum
    ((1, 1), (1, 1, 1)),                       # free axes: each device adds its rows
    ((1, 1), (1, 1, 4)),
    ((2, 2), (2, 2, 2)),
    ((1, 2), (2, 1, 1)),
], ids=str)
def test_gather_grad(idx_st, g_st):
    gg = REGISTRY["GatherGrad"]
    idx = np.array([[1, 7, 7, 2], [0, 3, 7, 7]], np.int32)

    def build():
        return lambda i, g: apply(gg, {"axis": 0, "shape": (8, 8)}, (i, g))
    _check(build, [idx, _f32(2, 4, 8)], 1, prep=_dist((idx_st, g_st)))


def test_gather_grad_with_split_indices_is_a_pending_sum():
    _setup(8)
    idx = distribute(Tensor(IDX), TensorLayout.from_strategy((2, 1), IDX.shape, 8))
    g = distribute(Tensor(_f32(2, 4, 8)), TensorLayout.from_strategy((2, 1, 1), (2, 4, 8), 8))
    with CommReport() as rep:
        out = apply(REGISTRY["GatherGrad"], {"axis": 0, "shape": TABLE}, (idx, g))
    assert out.layout.partial and rep.count() == 0
    ref = np.zeros(TABLE, np.float32)
    np.add.at(ref, IDX.reshape(-1), g.asnumpy().reshape(-1, 8))
    np.testing.assert_allclose(out.asnumpy(), ref, rtol=1e-5, atol=1e-6)


def test_vocab_split_gather_costs_one_allreduce_when_consumed_whole():
    _setup(8)
    table, idx = Tensor(_f32(*TABLE)), Tensor(IDX)
    g = ops.Gather().shard(((8, 1), (1, 1)))
    with CommReport() as rep:
        out = g(table, idx, 0)
        assert out.layout.partial == (0,)
        y = ops.relu(out)                      # needs the whole value: one AllReduce
    np.testing.assert_allclose(y.asnumpy(), np.maximum(table.asnumpy()[IDX], 0), rtol=1e-6)
    assert rep.count() == 1 and rep.count(kind="AllReduce") == 1
    assert rep.bytes(kind="AllReduce") > 0


def test_gather_splits_without_communication():
    _setup(8)
    table, idx = Tensor(_f32(*TABLE)), Tensor(IDX)
    with CommReport() as rep:
        a = ops.Gather().shard(((1, 8), (1, 1)))(table, idx, 0)   # hidden split
        b = ops.Gather().shard(((1, 1), (2, 1)))(table, idx, 0)   # indices split
    assert rep.count() == 0
    assert a.layout.tensor_map[-1] and not a.layout.partial
    assert b.layout.tensor_map[0] and not b.layout.partial
    np.testing.assert_allclose(a.asnumpy(), table.asnumpy()[IDX])
    np.testing.assert_allclose(b.asnumpy(), table.asnumpy()[IDX])


def test_vocab_split_gather_backward_adds_rows_in_place():
    """The table's gradient arrives split like the table, without backward traffic."""
    _setup(8)
    table = Tensor(_f32(*TABLE))
    w = _weight((2, 4, 8), 0)
    g = ops.Gather().shard(((8, 1), (1, 1)))
    fn = dm.value_and_grad(lambda t: _loss_terms((g(t, Tensor(IDX), 0),)), 0)
    with CommReport() as rep:
        _, grad = fn(table)
    assert rep.count(reason="backward") == 0
    assert grad.layout is not None and grad.layout.tensor_map[0] and not grad.layout.partial
    ref = np.zeros(TABLE, np.float32)
    np.add.at(ref, IDX.reshape(-1), w.reshape(-1, 8))
    np.testing.assert_allclose(grad.asnumpy(), ref, rtol=1e-5, atol=1e-6)


def _embedding_step(devices):
    _setup(devices)
    dm.set_seed(5)
    table = Parameter(Tensor(_weight(TABLE, 7)), name="table")
    gather = ops.Gather().shard(((8, 1), (1, 1)))
    mm = ops.MatMul().shard(((1, 1), (1, 1)))
    proj = Tensor(_weight((8, 4), 8))
    opt = nn.SGD([table], learning_rate=0.5)
    fn = dm.value_and_grad(lambda i: ops.reduce_sum(ops.square(mm(
        ops.reshape(gather(table, i, 0), (8, 8)), proj))), None, opt.parameters)
    losses = []
    for _ in range(2):
        loss, grads = fn(Tensor(IDX))
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, table.asnumpy()


def test_vocab_split_embedding_trains_like_one_device():
    ref_losses, ref_table = _embedding_step(1)
    losses, table = _embedding_step(8)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(table, ref_table, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------
# IndexAdd (GetItem's gradient op), Dropout, OneHot
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("index,strategy", [
    ((slice(None), 1), (2, 2)),
    ((slice(None), slice(1, 3)), (4, 2, 1)),
    ((Ellipsis, None, slice(None)), (2, 1, 1, 4)),
    ((2, slice(None), slice(None)), (2, 4)),
    ((np.array([0, 2, 2, 5]),), (2, 2, 2)),    # advanced: gathered, np.add.at
], ids=str)
def test_index_add(index, strategy):
    ia = REGISTRY["IndexAdd"]
    shape = (8, 4, 8)
    gshape = np.empty(shape)[index].shape
    _check(lambda: (lambda g: apply(ia, {"index": index, "shape": shape}, (g,))),
           [_f32(*gshape)], prep=_dist((strategy,)))


@pytest.mark.parametrize("strategy", [((8, 1, 1),), ((2, 2, 2),), ((1, 4, 1),), ((2, 1, 1),),
                                      (LAY("mp", "None", ("dp", "sp")),)], ids=str)
def test_dropout_draws_the_single_device_mask(strategy):
    rep, outs = _check(lambda: (lambda t: ops.Dropout(0.7).shard(strategy)(t)),
                       [_f32(8, 4, 8)])
    assert rep.count(reason="forward") == 0 and rep.count(reason="backward") == 0


def test_dropout_keeps_the_random_stream():
    """A sharded Dropout draws exactly what one device draws, so later draws agree too."""
    def run(devices):
        _setup(devices)
        dm.set_seed(3)
        d = ops.Dropout(0.5).shard(((2, 4),))
        x = Tensor(np.ones((8, 8), np.float32))
        return [d(x)[1].asnumpy() for _ in range(3)]
    for a, b in zip(run(8), run(1)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("strategy,axis", [(((8, 1),), -1), (((2, 4),), -1), (((2, 2),), 1),
                                           (((4, 2),), 0)], ids=str)
def test_one_hot(strategy, axis):
    idx = (np.arange(32).reshape(8, 4) * 7 % 6).astype(np.int32)
    _check(lambda: (lambda i: ops.OneHot(axis).shard(strategy)(
        i, 6, 1.0, 0.0)), [idx], None)


# ---------------------------------------------------------------------------
# problems found while writing these rules (fixed; kept as regression tests)
# ---------------------------------------------------------------------------
def test_partial_output_into_an_op_without_strategy_keeps_the_gradient():
    a, b, w = _f32(8, 16), _f32(16, 4), _weight((8, 4), 0)

    def run(devices):
        _setup(devices)
        mm = ops.MatMul().shard(((2, 4), (4, 1)))
        return dm.grad(lambda x, y: ops.reduce_sum(mm(x, y) * Tensor(w)), (0, 1))(
            Tensor(a), Tensor(b))
    for g8, g1 in zip(run(8), run(1)):
        np.testing.assert_allclose(g8.asnumpy(), g1.asnumpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("other", ["scalar", "plain"])
def test_partial_times_a_plain_value(other):
    _setup(8)
    a, b = _f32(8, 16), _f32(16, 4)
    p = ops.MatMul().shard(((1, 8), (8, 1)))(Tensor(a), Tensor(b))
    assert p.layout.partial
    o = 2.0 if other == "scalar" else Tensor(np.full((8, 4), 2.0, np.float32))
    np.testing.assert_allclose((p * o).asnumpy(), 2 * (a @ b), rtol=1e-5, atol=1e-5)


def test_numpy_input_keeps_its_strategy_slot():
    _setup(8)
    a, b = _f32(8, 12), _f32(12, 4)
    out = ops.MatMul().shard(((8, 1), (1, 1)))(a, Tensor(b))
    np.testing.assert_allclose(out.asnumpy(), a @ b, rtol=1e-5, atol=1e-6)


def test_elementwise_takes_the_layout_split_over_more_devices_when_it_moves_less():
    """Mul of a value split over 2 of 8 devices (repeated 4 times) and one split over
    all 8, in either order: the output takes the 8-way split, the 2-way input being
    cut from each device's own block (no collective, nothing computed twice). When the
    finer split does not nest in the coarser one (rows over axes (0, 1) vs over axis
    1), the finer one still decides only because it moves no more bytes per device
    than letting the first input decide. The numbers are numpy's."""
    from dualmode.parallel.redistribution.planner import plan_redistribution
    _setup(8)
    try:
        a, b = _f32(16, 6), _f32(16, 6)
        fine = distribute(Tensor(b), TensorLayout((8,), ((0,), ()), (16, 6)))
        coarse = distribute(Tensor(a), TensorLayout((2, 4), ((0,), ()), (16, 6)))
        for x, y in ((coarse, fine), (fine, coarse)):
            with CommReport() as rep:
                out = ops.Mul()(x, y)
            assert rep.records == []
            assert out.layout.dim_parts == (8, 1)
            np.testing.assert_allclose(out.asnumpy(), a * b, rtol=1e-6)
        other = distribute(Tensor(a), TensorLayout((2, 4), ((1,), ()), (16, 6)))
        with CommReport() as rep:
            out = ops.Mul()(other, fine)
        np.testing.assert_allclose(out.asnumpy(), a * b, rtol=1e-6)
        moved = sum(r.bytes_per_device for r in rep.records)
        fine_on_grid = TensorLayout((2, 4), ((0, 1), ()), (16, 6))
        assert out.layout.dim_parts == (8, 1)
        assert moved <= plan_redistribution(fine_on_grid, other.layout, 4).bytes
    finally:
        _setup(1)
