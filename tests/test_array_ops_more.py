"""MindSpore's array and reduce ops used by its parallel scripts: StridedSlice, Tile,
ExpandDims, Squeeze, ArgMaxWithValue / ArgMinWithValue / Argmax, Assign / AssignAdd /
AssignSub, OneHot's strategy over its output, and a batch smaller than the device count.

Each op: its numbers against numpy on one device, then the same network (the primitive
with a strategy, a Dense before it so parameters get gradients) in every mode on 8
simulated devices -- PyNative semi-auto, GRAPH_MODE, ``ops.shard`` and ``Cell.shard``
(strategies chosen by propagation) -- against the stand-alone run: loss, the input's
gradient and every parameter's gradient (rtol 1e-5). Strategies MindSpore refuses are
refused by name."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel import CommReport

from _devices import devices

RTOL, ATOL = 1e-5, 1e-6


# ---------------------------------------------------------------------------
# every mode against the stand-alone run
# ---------------------------------------------------------------------------
class _Net(nn.Cell):
    """x -> Dense-like weight (elementwise scale W, shape of x) -> body(prims, h)."""

    def __init__(self, shape, body, prims, seed=3):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.w = Parameter(Tensor(rng.uniform(0.5, 1.5, shape).astype(np.float32)), name="w")
        self.body = body
        self.prims = prims
        self.mul = ops.Mul()

    def construct(self, x):
        return self.body(self.prims, self.mul(x, self.w))


def _run(shape, body, make_prims, x, mode, strategies, outer=None):
    """(loss, dx, dw) of the network in `mode` ("single", "pynative", "graph",
    "ops.shard", "Cell.shard") on 8 devices (one for "single")."""
    sharded = mode in ("pynative", "graph")
    prims = make_prims()
    if sharded:
        for p, s in zip(prims, strategies):
            if s is not None:
                p.shard(s)
    if mode == "single":
        ctx = devices(None)
    else:
        ctx = devices(8, full_batch=True)
    with ctx:
        net = _Net(shape, body, prims)
        f = net
        if mode == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)
        elif mode == "ops.shard":
            f = ops.shard(lambda a: net(a), in_strategy=(outer,))
        elif mode == "Cell.shard":
            net.shard(in_strategy=(outer,))
        with CommReport() as rep:
            loss, (dx, (dw,)) = dm.value_and_grad(f, 0, [net.w])(Tensor(x))
        return loss.asnumpy(), dx.asnumpy(), dw.asnumpy(), rep


MODES = ["pynative", "graph", "ops.shard", "Cell.shard"]


def check_every_mode(shape, body, make_prims, strategies, outer, x=None, seed=0):
    """The network in every mode equals the stand-alone run; returns the CommReports."""
    if x is None:
        x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    ref = _run(shape, body, make_prims, x, "single", strategies)
    reps = {}
    for mode in MODES:
        got = _run(shape, body, make_prims, x, mode, strategies, outer)
        for what, a, b in zip(("loss", "dx", "dw"), got[:3], ref[:3]):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{what} differs in mode {mode}")
        reps[mode] = got[3]
    return reps


def _sq(h):
    return ops.reduce_sum(ops.mul(h, h))


# ---------------------------------------------------------------------------
# Tile
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("xshape,mult", [((2, 3), (2, 2)), ((2, 3), (3, 1, 2)),
                                         ((4,), (1,)), ((2, 1, 3), (1, 4, 1))])
def test_tile_numpy_and_gradient(xshape, mult):
    x = np.random.default_rng(1).normal(size=xshape).astype(np.float32)
    y = ops.Tile()(Tensor(x), mult)
    np.testing.assert_array_equal(y.asnumpy(), np.tile(x, mult))
    w = np.random.default_rng(2).normal(size=np.tile(x, mult).shape)
    g = dm.grad(lambda t: ops.reduce_sum(ops.tile(t, mult) * Tensor(w)))(
        Tensor(x.astype(np.float64)))
    # d/dx sum(tile(x) * w): the sum of w over the copies of each element
    pad = (1,) * (len(mult) - len(xshape)) + xshape
    want = w.reshape([v for m, s in zip(mult, pad) for v in (m, s)]).sum(
        axis=tuple(range(0, 2 * len(mult), 2))).reshape(xshape)
    np.testing.assert_allclose(g.asnumpy(), want, rtol=1e-12)


def test_tile_errors():
    x = Tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"Tile: multiples=\(2,\) has 1 entries but input 0 "
                                         r"has rank 2"):
        ops.tile(x, (2,))
    with pytest.raises(ValueError, match=r"Tile: multiples=\(2, 0\) must be ints >= 1"):
        ops.tile(x, (2, 0))
    with pytest.raises(TypeError, match=r"Tile: multiples=2 must be a non-empty tuple"):
        ops.tile(x, 2)


def _tile_body(mult):
    return lambda p, h: _sq(p[0](ops.tanh(h), mult))


@pytest.mark.parametrize("mult,strategy,outer", [
    ((1, 2), ((4, 2),), (4, 1)),          # tiled dim 1 split 2 ways (its multiple)
    ((2, 1), ((2, 4),), (1, 4)),          # tiled dim 0 split over the copies
    ((2, 1, 4), ((2, 1, 4),), (2, 2)),    # a new leading dim, tiled dims split
    ((1, 1), ((8, 1),), (8, 1)),          # nothing tiled: the input's split
], ids=["cols", "rows", "new-dim", "untiled"])
def test_tile_every_mode(mult, strategy, outer):
    check_every_mode((8, 4), _tile_body(mult), lambda: [ops.Tile()], [strategy], outer)
    # on a whole input, Tile with a strategy moves nothing: each device makes its block
    # of the output in the strategy's layout (a tiled dim: its share of the copies)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    with devices(8, full_batch=True):
        with CommReport() as rep:
            y = ops.Tile().shard(strategy)(Tensor(x), mult)
        np.testing.assert_array_equal(y.asnumpy(), np.tile(x, mult))
        want = tuple(d // k for d, k in zip(np.tile(x, mult).shape, strategy[0]))
        assert y._layout.local_shape == want
    assert not rep.records


def test_tile_strategy_refused_by_name():
    x = Tensor(np.zeros((8, 4), np.float32))
    with devices(8, full_batch=True):
        with pytest.raises(ValueError, match=r"Tile: in_strategy\[0\]\[1\]=4 does not divide "
                                             r"multiples\[1\]=2"):
            ops.Tile().shard(((2, 4),))(x, (1, 2))
        with pytest.raises(ValueError, match=r"Tile: in_strategy\[0\]=\(2, 1\) has 2 entries "
                                             r"but multiples=\(1, 1, 2\) has 3"):
            ops.Tile().shard(((2, 1),))(x, (1, 1, 2))
        with pytest.raises(ValueError, match=r"Tile: in_strategy\[0\]\[0\]=2 splits a new dim "
                                             r"of size 1"):
            ops.Tile().shard(((2, 1, 1),))(x, (1, 1, 2))
        with pytest.raises(ValueError, match=r"Tile: in_strategy\[0\]\[0\]=4 exceeds dim 0 "
                                             r"\(size 2\) of input 0: some devices would hold "
                                             r"an empty piece"):
            ops.Tile().shard(((4, 1),))(Tensor(np.zeros((2, 4), np.float32)), (1, 2))
        with pytest.raises(ValueError, match=r"Tile: in_strategy\[0\]=\(3, 1\) needs 3 "
                                             r"devices \(its product\) but device_num is 8"):
            ops.Tile().shard(((3, 1),))(x, (1, 2))
        with pytest.raises(ValueError, match=r"Tile: in_strategy\[0\]=\(4, 4\) needs 16 "
                                             r"devices \(its product\) but device_num is 8"):
            ops.Tile().shard(((4, 4),))(x, (1, 4))
    # stand-alone: the strategy is ignored, as MindSpore does
    y = ops.Tile().shard(((4, 4),))(x, (1, 2))
    assert y.shape == (8, 8)


# ---------------------------------------------------------------------------
# StridedSlice
# ---------------------------------------------------------------------------
def test_strided_slice_numpy_and_masks():
    x = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)
    ss = ops.StridedSlice()
    np.testing.assert_array_equal(ss(Tensor(x), (1, 0, 0), (3, 4, 5), (1, 2, 1)).asnumpy(),
                                  x[1:3, 0:4:2, 0:5])
    # begin_mask / end_mask: the dim's start / end; shrink_axis_mask removes the dim
    got = ops.StridedSlice(begin_mask=0b010, end_mask=0b100, shrink_axis_mask=0b001)(
        Tensor(x), (2, 3, 1), (3, 1, 0), (1, 1, 2))
    np.testing.assert_array_equal(got.asnumpy(), x[2, :1, 1::2])
    # fewer entries than dims: the rest whole; negative strides
    np.testing.assert_array_equal(ss(Tensor(x), (2,), (0,), (-1,)).asnumpy(), x[2:0:-1])
    # ellipsis_mask: that entry stands for the dims the others leave; new_axis_mask: a
    # new dim of size 1 (their begin/end/strides are not read)
    got = ops.StridedSlice(ellipsis_mask=0b001)(Tensor(x), (0, 1), (0, 4), (1, 2))
    np.testing.assert_array_equal(got.asnumpy(), x[..., 1:4:2])
    got = ops.StridedSlice(new_axis_mask=0b010, shrink_axis_mask=0b100)(
        Tensor(x), (1, 0, 2), (3, 0, 3), (1, 1, 1))
    np.testing.assert_array_equal(got.asnumpy(), x[1:3, None, 2])
    got = ops.StridedSlice(new_axis_mask=0b001, ellipsis_mask=0b100, end_mask=0b010)(
        Tensor(x), (0, 1, 0), (0, 0, 0), (1, 1, 1))
    np.testing.assert_array_equal(got.asnumpy(), x[None, 1:, ...])
    with pytest.raises(ValueError, match=r"StridedSlice: ellipsis_mask=3 sets 2 bits; at most "
                                         r"one entry can be the ellipsis"):
        ops.StridedSlice(ellipsis_mask=3)(Tensor(x), (0, 0), (1, 1), (1, 1))
    with pytest.raises(ValueError, match=r"StridedSlice: begin has 5 entries \(4 of them name "
                                         r"input dims\) but input 0 has rank 3"):
        ops.StridedSlice(new_axis_mask=1)(Tensor(x), (0,) * 5, (1,) * 5, (1,) * 5)
    with pytest.raises(ValueError, match=r"StridedSlice: begin\[2\]=5 is out of range for dim 1 "
                                         r"\(size 4\)"):
        ops.StridedSlice(new_axis_mask=1, shrink_axis_mask=4)(Tensor(x), (0, 0, 5), (1, 1, 6),
                                                              (1, 1, 1))


def _ss_body(begin, end, strides, masks=(0, 0, 0, 0, 0)):
    return lambda p, h: _sq(p[0](ops.tanh(h), begin, end, strides))


@pytest.mark.parametrize("args,strategy,outer", [
    (((0, 1), (8, 4), (1, 2)), ((8, 1),), (8, 1)),       # rows whole: split; cols sliced
    (((2, 0), (6, 4), (1, 1)), ((1, 4),), (2, 4)),       # rows sliced, cols split
    (((0, 0), (8, 4), (2, 1)), ((1, 2),), (4, 2)),
], ids=["rows8", "cols4", "stride-rows"])
def test_strided_slice_every_mode(args, strategy, outer):
    check_every_mode((8, 4), _ss_body(*args), lambda: [ops.StridedSlice()], [strategy],
                     outer)


def test_strided_slice_new_axis_and_ellipsis_every_mode():
    """x[None, ..., 1:3] on (8, 4): the new dim and the kept rows, cols sliced."""
    body = lambda p, h: _sq(p[0](ops.tanh(h), (0, 0, 1), (0, 0, 3), (1, 1, 1)))  # noqa
    check_every_mode((8, 4), body,
                     lambda: [ops.StridedSlice(new_axis_mask=0b001, ellipsis_mask=0b010)],
                     [((8, 1),)], (4, 2))


def test_strided_slice_shrink_every_mode():
    body = lambda p, h: _sq(p[0](ops.tanh(h), (0, 1, 0), (4, 2, 4), (1, 1, 1)))  # noqa
    check_every_mode((4, 3, 4), body, lambda: [ops.StridedSlice(shrink_axis_mask=0b010)],
                     [((2, 1, 4),)], (2, 1, 2))


def test_strided_slice_split_of_a_sliced_dim_is_gathered():
    """Dims taken whole with stride 1 keep their split (no communication); a sliced dim
    is made whole first (an AllGather of that dim), so the numbers equal numpy's."""
    x = np.random.default_rng(2).normal(size=(8, 4)).astype(np.float32)
    with devices(8, full_batch=True):
        t = ops.StridedSlice().shard(((8, 1),))(Tensor(x), (0, 0), (8, 4), (1, 1))
        with CommReport() as whole:
            y = ops.StridedSlice(begin_mask=1, end_mask=1).shard(((8, 1),))(
                t, (3, 1), (5, 3), (1, 1))
        np.testing.assert_array_equal(y.asnumpy(), x[:, 1:3])
        assert y._layout.local_shape == (1, 2) and not whole.records
        with CommReport() as sliced:
            z = ops.StridedSlice().shard(((4, 2),))(Tensor(x), (0, 1), (8, 4), (2, 2))
            w = ops.StridedSlice(shrink_axis_mask=1).shard(((8, 1),))(t, (2, 0), (3, 4),
                                                                      (1, 1))
        np.testing.assert_array_equal(z.asnumpy(), x[0:8:2, 1:4:2])
        np.testing.assert_array_equal(w.asnumpy(), x[2])
    assert {r.kind for r in sliced.records} == {"AllGather"}


# ---------------------------------------------------------------------------
# ExpandDims / Squeeze: splits carry over
# ---------------------------------------------------------------------------
def test_expand_dims_squeeze_numpy():
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    for ax in (0, 1, 2, -1, -3):
        np.testing.assert_array_equal(ops.ExpandDims()(Tensor(x), ax).asnumpy(),
                                      np.expand_dims(x, ax))
    y = np.zeros((1, 3, 1, 2), np.float32)
    assert ops.Squeeze()(Tensor(y)).shape == (3, 2)
    assert ops.Squeeze(2)(Tensor(y)).shape == (1, 3, 2)
    assert ops.Squeeze((0, 2))(Tensor(y)).shape == (3, 2)
    with pytest.raises(ValueError, match=r"Squeeze: axis=1 has size 3"):
        ops.Squeeze(1)(Tensor(y))
    with pytest.raises(ValueError, match=r"ExpandDims: axis=3 is out of range"):
        ops.ExpandDims()(Tensor(x), 3)


def _expand_squeeze(p, h):
    e = p[0](ops.tanh(h), 1)              # (8, 1, 4)
    return _sq(p[1](ops.exp(e)))          # Squeeze(1): (8, 4)


@pytest.mark.parametrize("strategies,outer", [
    ([((2, 4),), ((2, 1, 4),)], (2, 4)),
    ([((8, 1),), ((8, 1, 1),)], (8, 1)),
    ([((1, 4),), ((2, 1, 4),)], (1, 2)),    # the squeeze moves its input
], ids=["2x4", "rows8", "different"])
def test_expand_dims_squeeze_every_mode(strategies, outer):
    reps = check_every_mode((8, 4), _expand_squeeze,
                            lambda: [ops.ExpandDims(), ops.Squeeze(1)], strategies, outer)
    if strategies[0][0] == strategies[1][0][::2]:        # same splits: nothing to move
        assert not [r for r in reps["pynative"].records
                    if r.op in ("ExpandDims", "Squeeze", "Reshape")]


def test_squeeze_split_of_a_unit_dim_is_refused():
    x = Tensor(np.zeros((8, 1, 4), np.float32))
    with devices(8, full_batch=True):
        with pytest.raises(ValueError, match=r"Squeeze: in_strategy\[0\]\[1\]=2 exceeds "
                                             r"dim 1 \(size 1\)"):
            ops.Squeeze(1).shard(((1, 2, 4),))(x)


# ---------------------------------------------------------------------------
# ArgMaxWithValue / ArgMinWithValue / Argmax / Argmin
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ArgMaxWithValue", "ArgMinWithValue"])
@pytest.mark.parametrize("axis,keep", [(0, False), (1, True), (-1, False)])
def test_arg_with_value_numpy_and_gradient(name, axis, keep):
    x = np.random.default_rng(4).normal(size=(4, 6, 3)).astype(np.float32)
    idx, val = getattr(ops, name)(axis=axis, keep_dims=keep)(Tensor(x))
    pick = np.argmax if name == "ArgMaxWithValue" else np.argmin
    want_i = pick(x, axis=axis, keepdims=keep)
    assert idx.dtype == dm.int32 and val.dtype == dm.float32
    np.testing.assert_array_equal(idx.asnumpy(), want_i)
    np.testing.assert_array_equal(val.asnumpy(), np.take_along_axis(
        x, pick(x, axis=axis, keepdims=True), axis).reshape(want_i.shape))
    # the value's gradient: the upstream gradient at the index's position, zero elsewhere
    w = np.random.default_rng(5).normal(size=want_i.shape)
    g = dm.grad(lambda t: ops.reduce_sum(getattr(ops, name)(axis=axis, keep_dims=keep)(t)[1]
                                         * Tensor(w)))(Tensor(x.astype(np.float64)))
    want = np.zeros(x.shape)
    np.put_along_axis(want, pick(x, axis=axis, keepdims=True),
                      w.reshape(np.take_along_axis(x, pick(x, axis=axis, keepdims=True),
                                                   axis).shape), axis)
    np.testing.assert_array_equal(g.asnumpy(), want)


def test_arg_ties_pick_the_first_and_argmax_output_type():
    x = np.array([[1, 3, 3, 0], [2, 2, 2, 2]], np.float32)
    i, v = ops.ArgMaxWithValue(axis=1)(Tensor(x))
    np.testing.assert_array_equal(i.asnumpy(), [1, 0])
    np.testing.assert_array_equal(v.asnumpy(), [3, 2])
    i, v = ops.ArgMinWithValue(axis=0)(Tensor(x))
    np.testing.assert_array_equal(i.asnumpy(), [0, 1, 1, 0])
    out = ops.Argmax()(Tensor(x))
    assert out.dtype == dm.int32
    np.testing.assert_array_equal(out.asnumpy(), [1, 0])
    out = ops.Argmax(axis=0, output_type=dm.int64)(Tensor(x))
    assert out.dtype == dm.int64
    np.testing.assert_array_equal(out.asnumpy(), [1, 0, 0, 1])
    np.testing.assert_array_equal(ops.Argmin(axis=1)(Tensor(x)).asnumpy(), [3, 0])
    # integer inputs: the index and value, no gradient
    i, v = ops.ArgMaxWithValue(axis=1)(Tensor(x.astype(np.int32)))
    assert v.dtype == dm.int32
    np.testing.assert_array_equal(v.asnumpy(), [3, 2])


def test_arg_errors():
    x = Tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"ArgMaxWithValue: axis=2 is out of range"):
        ops.ArgMaxWithValue(axis=2)(x)
    with pytest.raises(TypeError, match=r"ArgMinWithValue: keep_dims must be a bool"):
        ops.ArgMinWithValue(keep_dims=1)
    with pytest.raises(TypeError, match=r"Argmax: output_type=.*float32.* is not supported; "
                                        r"expected int32 or int64"):
        ops.Argmax(output_type=dm.float32)(x)
    with pytest.raises(TypeError, match=r"Argmax: axis=1.5 must be an int"):
        ops.Argmax(axis=1.5)
    with pytest.raises(ValueError, match=r"Argmin: cannot reduce the empty dim 1"):
        ops.Argmin()(Tensor(np.zeros((2, 0), np.float32)))
    with pytest.raises(TypeError, match=r"Argmax: input 0 has dtype bool"):
        ops.Argmax()(Tensor(np.zeros((2, 3), np.bool_)))


def _arg_value_body(p, h):
    i, v = p[0](ops.tanh(h))
    # the index enters the loss (its value, no gradient), the value with its gradient
    return _sq(v) + ops.reduce_sum(ops.cast(i, dm.float32)) * 0.25


@pytest.mark.parametrize("name", ["ArgMaxWithValue", "ArgMinWithValue"])
@pytest.mark.parametrize("axis,strategy,outer", [
    (1, ((8, 1),), (8, 1)),          # rows split, the axis whole: no communication
    (1, ((2, 4),), (2, 4)),          # the reduced axis split: gathered, global indices
    (0, ((4, 2),), (1, 8)),
], ids=["rows", "axis-split", "axis0"])
def test_arg_with_value_every_mode(name, axis, strategy, outer):
    reps = check_every_mode((8, 16), _arg_value_body,
                            lambda: [getattr(ops, name)(axis=axis)], [strategy], outer)
    if strategy[0][axis] == 1:
        assert not [r for r in reps["pynative"].records if r.op == name]


def _argmax_body(p, h):
    i = p[0](h)                              # (8,) indices of the row maxima
    return _sq(ops.mul(ops.one_hot(i, 16, 1.0, 0.0), ops.tanh(h)))


@pytest.mark.parametrize("strategy,outer", [(((8, 1),), (8, 1)), (((1, 8),), (2, 4)),
                                            (((4, 2),), (4, 2))],
                         ids=["rows", "axis-split", "both"])
def test_argmax_every_mode(strategy, outer):
    check_every_mode((8, 16), _argmax_body, lambda: [ops.Argmax()], [strategy], outer)


def test_arg_axis_split_one_allreduce_of_packed_pairs():
    """The reduced axis split 8 ways: each device's best (value, global index) pair,
    packed in an 8-byte key, and one AllReduce(max) of the keys -- not an AllGather of
    the input; every index is global and equals numpy's, ties across devices (and -0.0
    against 0.0) go to the first index, NaN wins as in numpy; float16 and int inputs
    too. float64 values cannot be packed: the axis is gathered."""
    rng = np.random.default_rng(6)
    x = rng.normal(size=(4, 32)).astype(np.float32)
    x[1, :] = 2.0                                    # a row of ties: index 0
    x[2, 5], x[2, 21] = 9.0, 9.0                     # ties on devices 1 and 5: index 5
    x[3, 3], x[3, 30] = -0.0, 0.0                    # -0.0 and 0.0 are equal
    x[3] = np.where(x[3] > 0, -1.0, x[3])            # so they are the row's maxima
    with devices(8, full_batch=True):
        with CommReport() as rep:
            i, v = ops.ArgMaxWithValue(axis=1).shard(((1, 8),))(Tensor(x))
        np.testing.assert_array_equal(i.asnumpy(), x.argmax(1))
        np.testing.assert_array_equal(v.asnumpy(), x.max(1))
        recs = [r for r in rep.records if r.op == "ArgMaxWithValue"]
        assert [r.kind for r in recs] == ["AllReduce"] and recs[0].buffer_bytes == 4 * 8
        for name in ("ArgMinWithValue", "Argmax", "Argmin"):
            pick = np.argmin if "min" in name.lower() else np.argmax
            for data in (x, -x, x.astype(np.float16), (10 * x).astype(np.int32),
                         (10 * x).astype(np.int8)):
                out = getattr(ops, name)(axis=1).shard(((2, 4),))(Tensor(data))
                got = out[0] if name.endswith("WithValue") else out
                np.testing.assert_array_equal(got.asnumpy(), pick(data, 1), err_msg=name)
                if name.endswith("WithValue"):
                    want = np.take_along_axis(data, pick(data, 1)[:, None], 1)[:, 0]
                    assert out[1].dtype == data.dtype
                    np.testing.assert_array_equal(out[1].asnumpy(), want)
        nan = x.copy()
        nan[0, 17], nan[0, 25] = np.nan, np.nan
        for name, pick in (("ArgMaxWithValue", np.argmax), ("ArgMinWithValue", np.argmin)):
            i, v = getattr(ops, name)(axis=1).shard(((1, 8),))(Tensor(nan))
            np.testing.assert_array_equal(i.asnumpy(), pick(nan, 1))
            assert np.isnan(v.asnumpy()[0])
        with CommReport() as rep64:
            i = ops.Argmax(axis=1).shard(((1, 8),))(Tensor(x.astype(np.float64)))
        np.testing.assert_array_equal(i.asnumpy(), x.argmax(1))
    assert {r.kind for r in rep64.records if r.op == "Argmax"} == {"AllGather"}


# ---------------------------------------------------------------------------
# Assign / AssignAdd / AssignSub
# ---------------------------------------------------------------------------
def test_assign_ops_update_the_parameter_in_place():
    p = Parameter(Tensor(np.ones((2, 3), np.float32)), name="p")
    out = ops.AssignAdd()(p, Tensor(np.array([1, 2, 3], np.float32)))      # broadcasts
    assert out is p
    np.testing.assert_array_equal(p.asnumpy(), [[2, 3, 4], [2, 3, 4]])
    ops.AssignSub()(p, 0.5)
    np.testing.assert_array_equal(p.asnumpy(), [[1.5, 2.5, 3.5]] * 2)
    ops.Assign()(p, Tensor(np.arange(6, dtype=np.float64).reshape(2, 3)))
    assert p.dtype == dm.float32
    np.testing.assert_array_equal(p.asnumpy(), np.arange(6).reshape(2, 3))


def test_assign_errors():
    p = Parameter(Tensor(np.ones((2, 3), np.float32)), name="p")
    with pytest.raises(TypeError, match=r"AssignAdd: variable must be a Parameter .* got "
                                        r"Tensor"):
        ops.AssignAdd()(Tensor(np.ones((2, 3), np.float32)), 1.0)
    with pytest.raises(ValueError, match=r"Assign: value has shape \(3,\) but variable 'p' "
                                         r"has shape \(2, 3\); expected the same shape"):
        ops.Assign()(p, Tensor(np.ones(3, np.float32)))
    with pytest.raises(ValueError, match=r"AssignSub: value has shape \(2, 2\) but variable "
                                         r"'p' has shape \(2, 3\); expected one that "
                                         r"broadcasts to it"):
        ops.AssignSub()(p, Tensor(np.ones((2, 2), np.float32)))
    np.testing.assert_array_equal(p.asnumpy(), np.ones((2, 3)))        # nothing changed


class _Acc(nn.Cell):
    """y = tanh(x * w); `kind`(acc, y); the loss is sum(y * acc) (reads acc before)."""

    def __init__(self, kind, strategy=None, mul_strategy=None):
        super().__init__()
        rng = np.random.default_rng(9)
        self.w = Parameter(Tensor(rng.uniform(0.5, 1.5, (8, 4)).astype(np.float32)), name="w")
        self.acc = Parameter(Tensor(rng.normal(size=(8, 4)).astype(np.float32)), name="acc")
        self.mul = ops.Mul()
        if mul_strategy is not None:
            self.mul.shard(mul_strategy)
        self.op = getattr(ops, kind)()
        if strategy is not None:
            self.op.shard(strategy)

    def construct(self, x):
        y = ops.tanh(self.mul(x, self.w))
        loss = ops.reduce_sum(y * self.acc)
        self.op(self.acc, y)
        return loss


def _acc_run(kind, mode, strategy=None, mul_strategy=None, steps=3):
    x = np.random.default_rng(10).normal(size=(8, 4)).astype(np.float32)
    ctx = devices(None) if mode == "single" else devices(8, full_batch=True)
    with ctx:
        net = _Acc(kind, strategy if mode != "single" else None,
                   mul_strategy if mode != "single" else None)
        f = net
        if mode == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)
        elif mode == "ops.shard":
            f = ops.shard(lambda a: net(a), in_strategy=((2, 4),))
        elif mode == "Cell.shard":
            net.shard(in_strategy=((4, 2),))
        losses = [float(f(Tensor(x)).asnumpy()) for _ in range(steps)]
        return losses, net.acc.asnumpy(), net.acc._layout


@pytest.mark.parametrize("kind", ["Assign", "AssignAdd", "AssignSub"])
@pytest.mark.parametrize("mode,strategy,mul_strategy", [
    ("pynative", ((2, 4), (2, 4)), None),
    ("pynative", None, ((4, 2), (4, 2))),
    ("graph", ((2, 4), (2, 4)), None),
    ("graph", None, ((8, 1), (8, 1))),
    ("ops.shard", None, None),
    ("Cell.shard", None, None),
], ids=["pynative-strategy", "pynative-mul", "graph-strategy", "graph-mul", "ops.shard",
        "Cell.shard"])
def test_assign_every_mode_equals_stand_alone(kind, mode, strategy, mul_strategy):
    """Three runs: each updates the parameter (in GRAPH_MODE too: the compiled graph
    writes it at every run), and the next run reads the new value."""
    ref_losses, ref_acc, _ = _acc_run(kind, "single")
    x = np.random.default_rng(10).normal(size=(8, 4)).astype(np.float32)
    w = np.random.default_rng(9).uniform(0.5, 1.5, (8, 4)).astype(np.float32)
    y = np.tanh(x * w)
    acc0 = np.random.default_rng(9)
    acc0.uniform(0.5, 1.5, (8, 4))
    acc = acc0.normal(size=(8, 4)).astype(np.float32)
    want = []
    for _ in range(3):
        want.append(float((y * acc).sum()))
        acc = {"Assign": y, "AssignAdd": acc + y, "AssignSub": acc - y}[kind]
    np.testing.assert_allclose(ref_losses, want, rtol=RTOL)
    np.testing.assert_allclose(ref_acc, acc, rtol=RTOL, atol=ATOL)
    losses, got_acc, lay = _acc_run(kind, mode, strategy, mul_strategy)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    np.testing.assert_allclose(got_acc, ref_acc, rtol=RTOL, atol=ATOL)
    if mode == "pynative" and strategy is not None:
        # the strategy placed the parameter; the writes keep that layout
        assert lay is not None and lay.local_shape == (4, 1)


@pytest.mark.parametrize("mode", ["pynative", "graph", "ops.shard"])
def test_a_read_after_the_write_sees_the_new_value(mode):
    """As in MindSpore, the variable read after AssignAdd in the same call is the new
    value, also inside a compiled graph (which writes the parameter at every run)."""
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.p = Parameter(Tensor(np.ones((8, 4), np.float32)), name="p")
            self.add = ops.AssignAdd().shard(((2, 4), (2, 4)))

        def construct(self, x):
            self.add(self.p, x)
            return self.p * 2.0

    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    with devices(8, full_batch=True):
        net = Net()
        f = net
        if mode == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)
        elif mode == "ops.shard":
            f = ops.shard(lambda a: net(a), in_strategy=((8, 1),))
        outs = [f(Tensor(x)).asnumpy() for _ in range(3)]
        for k, out in enumerate(outs, 1):
            np.testing.assert_array_equal(out, 2 * (1 + k * x))
        np.testing.assert_array_equal(net.p.asnumpy(), 1 + 3 * x)


# ---------------------------------------------------------------------------
# OneHot: the strategy over the output's dims, as MindSpore writes it
# ---------------------------------------------------------------------------
_IDX = np.random.default_rng(11).integers(0, 8, 16).astype(np.int32)


def _onehot_body(axis):
    def body(p, h):                       # h (16, 8); the indices: each row's argmax
        hot = p[0](ops.argmax(h, -1), 8, 1.0, 0.0)
        t = ops.tanh(h) if axis == -1 else ops.transpose(ops.tanh(h), (1, 0))
        return _sq(ops.mul(hot, t))
    return body


@pytest.mark.parametrize("axis,strategy,outer", [
    (-1, ((1, 8), (), ()), (1, 8)),        # model-parallel one-hot: the classes split
    (-1, ((2, 4), (), ()), (2, 4)),
    (-1, ((8, 1), (), ()), (8, 1)),        # the output form, batch only
    (-1, ((4,), (), ()), (4, 1)),          # one entry per indices dim (unchanged)
    (-1, ((4,),), (4, 1)),
    (0, ((4, 2), (), ()), (2, 4)),         # axis 0: the depth is the output's dim 0
], ids=["classes8", "rows2-classes4", "rows8", "indices-form", "indices-only", "axis0"])
def test_onehot_output_form_every_mode(axis, strategy, outer):
    check_every_mode((16, 8), _onehot_body(axis), lambda: [ops.OneHot(axis)], [strategy],
                     outer)


def test_onehot_output_form_values_and_layout():
    """((1, 8), (), ()) for 16 indices: the output (16, 8) split along the classes, each
    device holding one class column, equal to numpy's one-hot; 2-d indices too."""
    with devices(8, full_batch=True):
        with CommReport() as rep:          # whole indices: each device cuts its classes
            out = ops.OneHot().shard(((1, 8), (), ()))(Tensor(_IDX), 8, 1.0, 0.0)
        assert not rep.records
        np.testing.assert_array_equal(out.asnumpy(), np.eye(8, dtype=np.float32)[_IDX])
        assert out._layout.local_shape == (16, 1)
        idx2 = _IDX.reshape(4, 4)
        with CommReport() as rep:          # the indices on the strategy's matrix: local
            out = ops.OneHot().shard(((2, 1, 4), (), ()))(Tensor(idx2), 8, 2.0, -1.0)
        assert not rep.records
        want = np.where(np.eye(8, dtype=bool)[idx2], 2.0, -1.0).astype(np.float32)
        np.testing.assert_array_equal(out.asnumpy(), want)
        assert out._layout.local_shape == (2, 4, 2)
        with pytest.raises(ValueError, match=r"OneHot: in_strategy\[0\]\[1\]=8 splits the "
                                             r"depth dim \(dim 1 of the output\) but does not "
                                             r"divide depth=12"):
            ops.OneHot().shard(((1, 8), (), ()))(Tensor(_IDX), 12, 1.0, 0.0)
        # 15 indices in 2 pieces (8, 7: unequal pieces), the classes in 4
        out = ops.OneHot().shard(((2, 4), (), ()))(Tensor(_IDX[:15]), 8, 1.0, 0.0)
        np.testing.assert_array_equal(out.asnumpy(),
                                      np.eye(8, dtype=np.float32)[_IDX[:15]])
        with pytest.raises(ValueError, match=r"OneHot: in_strategy\[0\]\[0\]=2 exceeds dim 0 "
                                             r"\(size 1\) of the indices: some devices would "
                                             r"hold an empty piece"):
            ops.OneHot().shard(((2, 4), (), ()))(Tensor(_IDX[:1]), 8, 1.0, 0.0)
        with pytest.raises(ValueError, match=r"OneHot: in_strategy\[0\]=\(16, 1\) needs 16 "
                                             r"devices \(its product\) but device_num is 8"):
            ops.OneHot().shard(((16, 1), (), ()))(Tensor(_IDX), 8, 1.0, 0.0)
        with pytest.raises(ValueError, match=r"OneHot: in_strategy\[0\]=\(1, 2, 4\) has 3 "
                                             r"entries but input 0 has rank 1"):
            ops.OneHot().shard(((1, 2, 4), (), ()))(Tensor(_IDX), 8, 1.0, 0.0)


# ---------------------------------------------------------------------------
# a batch smaller than the device count under dataset_strategy="data_parallel"
# ---------------------------------------------------------------------------
class _Lookup(nn.Cell):
    """MindSpore's Gather test network: an embedding table looked up by a batch of
    indices, then a sum."""

    def __init__(self, strategy=None):
        super().__init__()
        rng = np.random.default_rng(12)
        self.table = Parameter(Tensor(rng.normal(size=(16, 8)).astype(np.float32)),
                               name="table")
        self.gather = ops.Gather()
        if strategy is not None:
            self.gather.shard(strategy)

    def construct(self, idx):
        return ops.reduce_sum(self.gather(self.table, idx, 0))


def test_batch_smaller_than_the_device_count_names_what_to_change():
    """A batch of 2 on 8 devices cannot be split in 8: the error names the batch size,
    the device count and the three ways out; each of them then runs and equals the
    stand-alone result."""
    idx = np.array([[1, 5, 7], [2, 2, 15]], np.int32)              # batch 2
    with devices(None):
        want = float(_Lookup()(Tensor(idx)).asnumpy())
    with devices(8):
        with pytest.raises(ValueError, match=r"dataset_strategy='data_parallel': input 0 has "
                                             r"batch size 2 \(shape \(2, 3\)\), fewer rows "
                                             r"than the 8 devices \(some would get none\); use "
                                             r"a batch size of at least 8 .*full_batch=True.*"
                                             r"fewer devices \(device_num=2 divides it\)"):
            _Lookup(((1, 1), (1, 1)))(Tensor(idx))
    with devices(8, full_batch=True):
        got = _Lookup(((1, 1), (1, 1)))(Tensor(idx))
        np.testing.assert_allclose(float(got.asnumpy()), want, rtol=RTOL)
    with devices(2):
        got = _Lookup(((1, 1), (2, 1)))(Tensor(idx))
        np.testing.assert_allclose(float(got.asnumpy()), want, rtol=RTOL)
    with devices(8):                                                # a batch of 8: fine
        idx8 = np.tile(idx, (4, 1))
        got = _Lookup(((1, 1), (8, 1)))(Tensor(idx8))
        np.testing.assert_allclose(float(got.asnumpy()), 4 * want, rtol=RTOL)


def test_tile_rule_splits_the_copies_of_a_split_tiled_dim():
    """A Tile without a strategy on rows split 4 ways: multiples (4, 1) -- the rows are
    gathered and each device makes one of the 4 copies (the output stays split 4 ways);
    multiples (2, 1) -- 2 copies do not split 4 ways: the output's rows are whole."""
    x = np.random.default_rng(13).normal(size=(8, 4)).astype(np.float32)
    with devices(8, full_batch=True):
        t = ops.Tile().shard(((4, 1),))(Tensor(x), (1, 1))        # rows split 4 ways
        assert t._layout.local_shape == (2, 4)
        with CommReport() as rep:
            y = ops.tile(t, (4, 1))
        np.testing.assert_array_equal(y.asnumpy(), np.tile(x, (4, 1)))
        assert y._layout.local_shape == (8, 4)
        assert {r.kind for r in rep.records} == {"AllGather"}
        z = ops.tile(t, (2, 3))
        np.testing.assert_array_equal(z.asnumpy(), np.tile(x, (2, 3)))
        assert z._layout is None or z._layout.local_shape == (16, 12)


class _OneHotXent(nn.Cell):
    """MindSpore's semi-auto OneHot test network: logits = MatMul(x, w); labels one-hot
    with on/off values as 0-d Tensors and the strategy over the output ((1, 8), (), ());
    the loss is SoftmaxCrossEntropyWithLogits' mean."""

    def __init__(self, sharded):
        super().__init__()
        rng = np.random.default_rng(14)
        self.w = Parameter(Tensor(rng.normal(size=(12, 8)).astype(np.float32)), name="w")
        self.matmul = ops.MatMul()
        self.onehot = ops.OneHot()
        self.xent = ops.SoftmaxCrossEntropyWithLogits()
        self.on, self.off = Tensor(np.float32(1.0)), Tensor(np.float32(0.0))
        if sharded:
            self.matmul.shard(((2, 4), (4, 1)))
            self.onehot.shard(((1, 8), (), ()))
            self.xent.shard(((8, 1), (8, 1)))

    def construct(self, x, labels):
        hot = self.onehot(labels, 8, self.on, self.off)
        return ops.reduce_mean(self.xent(self.matmul(x, self.w), hot)[0])


@pytest.mark.parametrize("mode", [dm.PYNATIVE_MODE, dm.GRAPH_MODE], ids=["eager", "graph"])
def test_onehot_mindspore_network_with_tensor_on_off_values(mode):
    rng = np.random.default_rng(15)
    x = rng.normal(size=(16, 12)).astype(np.float32)
    labels = rng.integers(0, 8, 16).astype(np.int32)
    with devices(None):
        net = _OneHotXent(False)
        ref = dm.value_and_grad(net, 0, [net.w])(Tensor(x), Tensor(labels))
    with devices(8, full_batch=True):
        dm.set_context(mode=mode)
        net = _OneHotXent(True)
        got = dm.value_and_grad(net, 0, [net.w])(Tensor(x), Tensor(labels))
    np.testing.assert_allclose(got[0].asnumpy(), ref[0].asnumpy(), rtol=RTOL)
    np.testing.assert_allclose(got[1][0].asnumpy(), ref[1][0].asnumpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[1][1][0].asnumpy(), ref[1][1][0].asnumpy(), rtol=RTOL,
                               atol=ATOL)


# ---------------------------------------------------------------------------
# under backend "mpi": 4 real processes, one device each
# ---------------------------------------------------------------------------
def test_array_ops_under_mpi_equal_numpy(tmp_path):
    """ArgMaxWithValue / Argmin over an axis split across ranks (the packed AllReduce
    between processes), the value's gradient, Tile, OneHot's output form and AssignAdd
    on a sharded Parameter, on 4 MPI ranks against numpy (tests/mpi_scripts/
    array_ops_more.py)."""
    pytest.importorskip("mpi4py", reason="backend 'mpi' needs mpi4py")
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "tests", "mpi_scripts", "array_ops_more.py")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                else "")
    proc = subprocess.run(["mpiexec", "-n", "4", sys.executable, script], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "array ops ok: 7 checks" in proc.stdout
