"""Ops on pieces of unequal size (strategies that do not divide the shapes): every
result and gradient equals the single-device run, in PyNative mode (each primitive
sharded at once) and compiled (ops.shard over the same function); the pads of the
outputs hold zeros; ops whose rules do not handle unequal pieces refuse them by name."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, communication, ops
from dualmode.parallel import Layout

RNG = np.random.default_rng(7)
LAY = Layout((2, 2, 2), ("dp", "sp", "mp"))


def _setup(devices):
    dm.reset_auto_parallel_context()
    dm.set_context(mode=dm.PYNATIVE_MODE)
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=devices)
    communication.init()


def _f32(*shape, low=-1.0, high=1.0):
    return RNG.uniform(low, high, shape).astype(np.float32)


def _loss(outs):
    total = None
    for k, o in enumerate(outs):
        if o.dtype.kind != "f":
            continue
        w = np.random.default_rng(50 + k).standard_normal(o.shape).astype(np.float32)
        term = ops.reduce_sum(o * Tensor(w))
        total = term if total is None else total + term
    return total


def _pads_are_zero(t):
    lay = t._layout
    if lay is None or lay.even:
        return True
    stack = np.asarray(t._data)
    for r, shape in enumerate(lay.local_shapes):
        pad = np.ones(lay.local_shape, bool)
        pad[tuple(slice(0, s) for s in shape)] = False
        if stack[r][pad].any():
            return False
    return True


def _run(devices, build, inputs, grad_pos, compiled=False):
    _setup(devices)
    dm.set_seed(11)
    fn = build()
    args = [Tensor(x) for x in inputs]

    def f(*xs):
        out = fn(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        return _loss(outs), outs

    if compiled and devices > 1:
        f = ops.shard(f, in_strategy=(None,) * len(args))
    if grad_pos is None:
        _, outs = f(*args)
        grads = []
    else:
        (_, outs), g = dm.value_and_grad(f, grad_pos, has_aux=True)(*args)
        grads = [x.asnumpy() for x in (g if isinstance(g, tuple) else (g,))]
    if devices > 1 and not compiled:
        assert all(_pads_are_zero(o) for o in outs)
    return [o.asnumpy() for o in outs], grads


def _check(build, inputs, grad_pos=0, compiled=False, devices=8):
    ref, ref_g = _run(1, build, inputs, grad_pos)
    out, g = _run(devices, build, inputs, grad_pos, compiled)
    assert len(out) == len(ref)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(g, ref_g):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


MODES = pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])


@pytest.fixture(autouse=True)
def _reset():
    yield
    dm.reset_auto_parallel_context()
    dm.set_context(mode=dm.PYNATIVE_MODE)


# ---------------------------------------------------------------- MatMul family

@MODES
@pytest.mark.parametrize("ta,tb,strategy,shapes", [
    (False, False, ((8, 1), (1, 1)), ((10, 7), (7, 6))),      # rows 2,2,1,1,1,1,1,1
    (False, False, ((2, 4), (4, 1)), ((10, 7), (7, 6))),      # contracted 2,2,2,1
    (False, False, ((1, 8), (8, 1)), ((5, 11), (11, 3))),     # contracted over 8
    (False, False, ((2, 1), (1, 4)), ((9, 5), (5, 6))),       # cols 2,2,1,1; repeats
    (True, False, ((4, 2), (4, 1)), ((7, 9), (7, 3))),        # transpose_a
    (False, True, ((2, 4), (2, 4)), ((9, 7), (3, 7))),        # transpose_b
    (False, False, (LAY("mp", ("sp", "dp")), LAY(("sp", "dp"), "None")), ((5, 6), (6, 3))),
], ids=str)
def test_matmul(ta, tb, strategy, shapes, compiled):
    a, b = (_f32(*s) for s in shapes)

    def build():
        mm = ops.MatMul(ta, tb).shard(strategy)
        return lambda x, y: mm(x, y)
    _check(build, [a, b], (0, 1), compiled)


@MODES
@pytest.mark.parametrize("strategy", [((2, 1, 4), (2, 4, 1)), ((8, 1, 1), (8, 1, 1)),
                                      ((1, 2, 2), (1, 2, 2))], ids=str)
def test_batch_matmul(strategy, compiled):
    _check(lambda: (lambda x, y: ops.BatchMatMul().shard(strategy)(x, y)),
           [_f32(9, 5, 7), _f32(9, 7, 3)], (0, 1), compiled)


@MODES
def test_bias_add_and_dense_chain(compiled):
    w = _f32(7, 5)

    def build():
        mm = ops.MatMul().shard(((4, 1), (1, 1)))
        ba = ops.BiasAdd().shard(((4, 1), (1,)))
        return lambda x, wt, b: ops.tanh(ba(mm(x, wt), b))
    _check(build, [_f32(30, 7), w, _f32(5)], (0, 1, 2), compiled, devices=4)


# ---------------------------------------------------------------- elementwise

@MODES
@pytest.mark.parametrize("name", ["Exp", "Tanh", "Sigmoid", "Neg", "Square", "Log"])
def test_unary(name, compiled):
    x = _f32(10, 3, 5, low=0.2, high=2.0)
    _check(lambda: (lambda t: getattr(ops, name)().shard(((4, 1, 2),))(t)), [x], 0, compiled)


@MODES
@pytest.mark.parametrize("name", ["Add", "Sub", "Mul", "RealDiv", "Maximum"])
@pytest.mark.parametrize("shapes,strategy", [
    (((10, 6), (10, 6)), ((4, 2), (4, 2))),
    (((10, 1, 6), (5, 6)), ((2, 1, 4), (2, 4))),          # broadcast; 6 in 4 parts
    (((10, 6), (6,)), ((8, 1), (1,))),
], ids=str)
def test_binary(name, shapes, strategy, compiled):
    xs = [_f32(*s, low=0.5, high=2.0) for s in shapes]
    _check(lambda: (lambda a, b: getattr(ops, name)().shard(strategy)(a, b)), xs, (0, 1),
           compiled)


# ---------------------------------------------------------------- reductions, softmax

@MODES
@pytest.mark.parametrize("name", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("strategy,axis,keep", [
    (((1, 8),), 1, False),                     # the reduced dim split unevenly
    (((4, 2),), (0, 1), True),
    (((8, 1),), 0, False),
    (((4, 1),), 1, True),                      # the kept dim uneven: its pads cleared
], ids=str)
def test_reductions(name, strategy, axis, keep, compiled):
    x = _f32(10, 13) - 2.0 if name == "ReduceMax" else _f32(10, 13) + 2.0
    _check(lambda: (lambda t: getattr(ops, name)(keep).shard(strategy)(t, axis)), [x], 0,
           compiled)


@MODES
@pytest.mark.parametrize("cls,kw", [(ops.Argmax, {"axis": 0}), (ops.Argmin, {"axis": 0}),
                                    (ops.ArgMaxWithValue, {"axis": 0})], ids=str)
def test_index_reductions_over_an_uneven_split(cls, kw, compiled):
    x = -np.abs(_f32(13, 5)) - 1.0 if cls is not ops.Argmin else np.abs(_f32(13, 5)) + 1.0
    x[12, 1] = 5.0 if cls is not ops.Argmin else -5.0     # the best in the short piece
    grad = 0 if cls is ops.ArgMaxWithValue else None
    _check(lambda: (lambda t: cls(**kw).shard(((8, 1),))(t)), [x], grad, compiled)


@MODES
@pytest.mark.parametrize("name", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("strategy,axis", [(((4, 2),), -1), (((8, 1),), 0), (((2, 4),), 0)],
                         ids=str)
def test_softmax(name, strategy, axis, compiled):
    _check(lambda: (lambda t: getattr(ops, name)(axis).shard(strategy)(t)), [_f32(10, 7)], 0,
           compiled)


# ---------------------------------------------------------------- refused

def test_an_op_without_unequal_pieces_refuses_them_by_name():
    _setup(4)
    x = Tensor(_f32(10, 6))
    with pytest.raises(ValueError, match=r"MatMul: in_strategy\[0\]\[0\]=8 exceeds dim 0 "
                                         r"\(size 5\) of input 0: some devices would hold an "
                                         r"empty piece"):
        ops.MatMul().shard(((8, 1), (1, 1)))(Tensor(_f32(5, 3)), Tensor(_f32(3, 2)))
    # (every sharding rule handles unequal pieces now; a rule registered without
    # uneven=True is refused by name, as sharding.check_even says)
    from dualmode.parallel.sharding import check_even
    y = dm.reshard(x, (4, 1))
    with pytest.raises(ValueError, match=r"NewOp: input 0 is split into pieces of unequal "
                                         r"size \(dim 0, size 10, in 4 parts: 3 or 2 rows "
                                         r"each\); NewOp does not handle unequal pieces yet"):
        check_even(lambda attrs, lays, dtypes: None, "NewOp", [y._layout])


# ---------------------------------------------------------------- the rest of the families

@MODES
def test_transpose_moves_the_uneven_split(compiled):
    _check(lambda: (lambda t: ops.Transpose().shard(((4, 1, 2),))(t, (2, 0, 1))),
           [_f32(10, 3, 5)], 0, compiled)


@MODES
def test_prelu(compiled):
    _check(lambda: (lambda t, w: ops.PReLU().shard(((4, 2), (2,)))(t, w)),
           [_f32(10, 5), _f32(5) * 0.3], (0, 1), compiled)


@MODES
@pytest.mark.parametrize("axis,strategy", [(0, ((1, 4),)), (1, ((4, 1),))])
def test_l2_normalize(axis, strategy, compiled):
    _check(lambda: (lambda t: ops.L2Normalize(axis).shard(strategy)(t)), [_f32(10, 7)], 0,
           compiled)


@MODES
def test_select_and_addn(compiled):
    cond = RNG.uniform(size=(10, 5)) > 0.5

    def build():
        sel = ops.Select().shard(((4, 2), (4, 2), (4, 2)))
        add = ops.AddN().shard(((4, 2), (4, 2), (4, 2)))
        return lambda a, b: add((sel(Tensor(cond), a, b), a, b))
    _check(build, [_f32(10, 5), _f32(10, 5)], (0, 1), compiled)


@MODES
def test_square_sum_all(compiled):
    _check(lambda: (lambda a, b: ops.SquareSumAll().shard(((4, 2), (8, 1)))(a, b)),
           [_f32(10, 7), _f32(10, 7)], (0, 1), compiled)


@MODES
def test_reshape_keeps_a_split_only_where_rows_stay(compiled):
    def build():
        e = ops.Exp().shard(((4, 1, 1),))
        return lambda t: ops.reshape(e(t), (10, 12)) + ops.reshape(e(t), (120,))[:12]
    _check(build, [_f32(10, 3, 4)], 0, compiled)


# ---------------------------------------------------------------- normalisations

@MODES
@pytest.mark.parametrize("strategy", [((4, 1, 1), (1,), (1,)), ((4, 1, 1), (1, 1), (1, 1))],
                         ids=str)
def test_layer_norm(strategy, compiled):
    gamma, beta = _f32(6) + 1.0, _f32(6)
    bpa = 2 if len(strategy[1]) == 1 else 1
    if bpa == 1:
        gamma, beta = _f32(3, 6) + 1.0, _f32(3, 6)
    _check(lambda: (lambda t, g, b: ops.LayerNorm(2, bpa).shard(strategy)(t, g, b)[0]),
           [_f32(10, 3, 6), gamma, beta], (0, 1, 2), compiled)


@MODES
@pytest.mark.parametrize("strategy", [((4, 1, 1, 1),) + ((1,),) * 4,
                                      ((2, 4, 1, 1),) + ((4,),) * 4], ids=str)
def test_batch_norm_training_statistics_of_the_global_batch(strategy, compiled):
    def build():
        bn = ops.BatchNorm(is_training=True).shard(strategy)
        mean = dm.Parameter(Tensor(np.zeros(6, np.float32)), name="mean",
                            requires_grad=False)
        var = dm.Parameter(Tensor(np.ones(6, np.float32)), name="var", requires_grad=False)
        if compiled:       # (a compiled block returning BatchNorm's statistics too fails
            return lambda x, s, b: bn(x, s, b, mean, var)[0]    # for any shape: KeyError)
        return lambda x, s, b: bn(x, s, b, mean, var)       # y and the batch's statistics
    _check(build, [_f32(10, 6, 3, 3), _f32(6) + 1.0, _f32(6)], (0, 1, 2), compiled)


# ---------------------------------------------------------------- Gather

@MODES
@pytest.mark.parametrize("strategy", [
    ((8, 1), (1, 1)),          # the vocabulary (50 rows) in 8 pieces: 7, 7, 6, ...
    ((1, 4), (2, 1)),          # embedding columns 2, 2, 1, 1; index rows 5, 5
    ((1, 1), (4, 1)),          # data parallel indices: 10 rows in 3, 3, 2, 2
    ((2, 4), (1, 1)),
], ids=str)
def test_gather(strategy, compiled):
    table = _f32(50, 6)
    idx = RNG.integers(0, 50, (10, 3)).astype(np.int32)
    idx[0, 0], idx[1, 1], idx[2, 2], idx[3, 0] = 6, 7, 49, 20    # edges of the pieces

    def build():
        g = ops.Gather().shard(strategy)
        ids = Tensor(idx)
        return lambda t: g(t, ids, 0)
    _check(build, [table], 0, compiled)


# ---------------------------------------------------------------- array ops

@MODES
@pytest.mark.parametrize("axis", [0, 1])
def test_concat_and_split(axis, compiled):
    def build():
        cat = ops.Concat(axis).shard(((1, 4), (1, 4)) if axis == 0 else ((4, 1), (4, 1)))
        split = ops.Split(axis, 2).shard(((1, 4),) if axis == 0 else ((4, 1),))
        return lambda a, b: split(ops.exp(cat((a, b))))
    _check(build, [_f32(10, 7), _f32(10, 7)], (0, 1), compiled)


@MODES
@pytest.mark.parametrize("index", [(slice(None), slice(1, 3)), (2,), (slice(None), 0),
                                   (Ellipsis, None)], ids=str)
def test_basic_indexing_and_its_gradient(index, compiled):
    def build():
        e = ops.Exp().shard(((4, 2),))
        return lambda t: e(t)[index]
    _check(build, [_f32(10, 7)], 0, compiled)


@MODES
def test_dropout_draws_the_single_device_mask(compiled):
    _check(lambda: (lambda t: ops.Dropout(0.7).shard(((4, 2),))(t)), [_f32(10, 7)], 0,
           compiled)


@MODES
@pytest.mark.parametrize("mult", [(1, 2), (2, 1, 1)], ids=str)
def test_tile_of_unequal_pieces(mult, compiled):
    # (Tile's own strategies, over its output's dims, must still divide them)
    def build():
        e = ops.Exp().shard(((4, 1),))
        return lambda t: ops.Tile()(e(t), mult)
    _check(build, [_f32(10, 3)], 0, compiled)


@MODES
def test_diag_of_unequal_pieces(compiled):
    def build():
        e = ops.Exp().shard(((4,),))
        return lambda t: ops.Diag()(e(t))
    _check(build, [_f32(10)], 0, compiled)


# ---------------------------------------------------------------- images

@MODES
@pytest.mark.parametrize("strategy", [
    ((4, 1, 1, 1), (1, 1, 1, 1)),          # the batch: 10 images in 3, 3, 2, 2
    ((1, 1, 1, 1), (4, 1, 1, 1)),          # output channels 6 in 2, 2, 1, 1
    ((1, 4, 1, 1), (1, 4, 1, 1)),          # input channels 5 (contracted) in 2, 1, 1, 1
    ((1, 1, 4, 1), (1, 1, 1, 1)),          # rows 9 in 4: made whole (halos need equal rows)
    ((2, 2, 1, 2), (1, 2, 1, 1)),
], ids=str)
def test_conv2d(strategy, compiled):
    _check(lambda: (lambda x, w: ops.Conv2D(6, 3, pad_mode="same").shard(strategy)(x, w)),
           [_f32(10, 5, 9, 7), _f32(6, 5, 3, 3)], (0, 1), compiled)


@MODES
@pytest.mark.parametrize("cls", [ops.MaxPool, ops.AvgPool])
@pytest.mark.parametrize("strategy", [((4, 1, 1, 1),), ((1, 4, 1, 1),), ((2, 1, 4, 1),)],
                         ids=str)
def test_pooling(cls, strategy, compiled):
    _check(lambda: (lambda x: cls(2, 2).shard(strategy)(x)), [_f32(10, 5, 9, 8)], 0,
           compiled)


@MODES
@pytest.mark.parametrize("strategy,mult", [(((4, 1),), (1, 2)), (((4, 2),), (1, 2)),
                                           (((2, 4, 1),), (2, 1, 1))], ids=str)
def test_tile_strategies_over_unequal_pieces(strategy, mult, compiled):
    # (a tiled dim's entry still divides its multiple: each device makes its copies)
    _check(lambda: (lambda t: ops.Tile().shard(strategy)(t, mult)), [_f32(10, 3)], 0,
           compiled)


@MODES
def test_fill_strategy_over_unequal_pieces(compiled):
    def build():
        fill = ops.FillV2().shard(((4, 2), ()))
        return lambda t: fill((10, 7), ops.reduce_sum(t)) * t
    _check(build, [_f32(10, 7)], 0, compiled)
