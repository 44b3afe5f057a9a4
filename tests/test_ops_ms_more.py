"""MindSpore ops its parallel scripts use: Atan2, DivNoNan, MulNoNan, TruncateMod, Xdivy,
Xlogy, ops.div's rounding modes, BitwiseAnd / BitwiseOr / BitwiseXor, MaskedFill, Diag,
FillV2 and SquareSumAll. Forward values against numpy (MindSpore's documented examples
where it gives them, the guarded zeros), gradients against finite differences, named
errors, and each op with a strategy on 8 simulated devices -- the primitive's ``.shard``
in PyNative mode, ``ops.shard`` of the function, and a Cell in GRAPH_MODE -- against the
stand-alone run (loss and input gradients)."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, ops
from dualmode.ops import operations as P

from _devices import devices
from _opcheck import check_op
from test_ops_elementwise_more import _away, _check_modes, _f32

RTOL = 1e-5


def np_xdivy(x, y):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x == 0, 0, x / y).astype(np.result_type(x, y))


def np_xlogy(x, y):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x == 0, 0, x * np.log(y)).astype(np.result_type(x, y))


def np_div_no_nan(x, y):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(y == 0, 0, x / y).astype(np.result_type(x, y))


def np_mul_no_nan(x, y):
    with np.errstate(invalid="ignore"):
        return np.where(y == 0, 0, x * y).astype(np.result_type(x, y))


# ---------------------------------------------------------------------------
# one device: MindSpore's examples, the guarded zeros, dtypes, errors
# ---------------------------------------------------------------------------
def test_mindspore_examples():
    f32 = lambda v: Tensor(np.array(v, np.float32))  # noqa: E731
    np.testing.assert_allclose(
        P.DivNoNan()(f32([-1.0, 0.0, 1.0, 5.0, 6.0]), f32([0.0, 0.0, 0.0, 2.0, 3.0])).asnumpy(),
        [0.0, 0.0, 0.0, 2.5, 2.0], rtol=RTOL)
    np.testing.assert_allclose(P.Xlogy()(f32([-5, 0, 4]), f32([2, 2, 2])).asnumpy(),
                               [-3.465736, 0.0, 2.7725887], rtol=RTOL)
    np.testing.assert_allclose(P.Xdivy()(f32([2, 4, -1]), f32([2, 2, 2])).asnumpy(),
                               [1.0, 2.0, -0.5], rtol=RTOL)
    np.testing.assert_allclose(P.Atan2()(f32([0, 1]), f32([1, 1])).asnumpy(),
                               [0.0, 0.7853981], rtol=RTOL)
    out = P.TruncateMod()(Tensor(np.array([2, 4, -1], np.int32)),
                          Tensor(np.array([3, 3, 3], np.int32)))
    assert out.dtype == dm.int32
    np.testing.assert_array_equal(out.asnumpy(), [2, 1, -1])
    np.testing.assert_allclose(ops.truncate_mod(f32([2.0, 4.0, -1.0]), 3.0).asnumpy(),
                               [2.0, 1.0, -1.0])


def test_guarded_zeros():
    """0 where the guard holds, even where the unguarded result is inf or NaN."""
    x = np.array([0.0, 0.0, 3.0, -2.0, np.inf, np.nan], np.float32)
    y = np.array([0.0, 2.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    np.testing.assert_array_equal(ops.div_no_nan(Tensor(x), Tensor(y)).asnumpy(),
                                  [0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(ops.mul_no_nan(Tensor(x), Tensor(y)).asnumpy(),
                                  [0, 0, 0, 0, 0, 0])
    xs = np.array([0.0, 0.0, 1.0, -1.0], np.float32)
    ys = np.array([0.0, -3.0, 0.0, 0.0], np.float32)
    np.testing.assert_array_equal(ops.xdivy(Tensor(xs), Tensor(ys)).asnumpy(),
                                  [0, 0, np.inf, -np.inf])
    np.testing.assert_array_equal(ops.xlogy(Tensor(xs), Tensor(ys)).asnumpy()[:2], [0, 0])
    assert np.isneginf(ops.xlogy(Tensor(xs), Tensor(ys)).asnumpy()[2])
    # elsewhere the IEEE results
    assert ops.mul_no_nan(Tensor(np.float32(np.inf)), 2.0).asnumpy() == np.inf
    assert ops.div_no_nan(Tensor(np.float32(1.0)), 1e-45).asnumpy() == np.inf


def test_dtypes_and_promotion():
    i = Tensor(np.array([7, -7, 3], np.int32))
    j = Tensor(np.array([2, 2, 0], np.int32))
    out = ops.div_no_nan(i, j)                   # integers are divided in float32
    assert out.dtype == dm.float32
    np.testing.assert_array_equal(out.asnumpy(), [3.5, -3.5, 0.0])
    out = ops.mul_no_nan(i, j)
    assert out.dtype == dm.int32
    np.testing.assert_array_equal(out.asnumpy(), [14, -14, 0])
    for fn in (ops.atan2, ops.xdivy, ops.xlogy):
        assert fn(i, j).dtype == dm.float32
    h = Tensor(np.array([1.0, 2.0], np.float16))
    for fn in (ops.atan2, ops.div_no_nan, ops.mul_no_nan, ops.truncate_mod, ops.xdivy,
               ops.xlogy):
        assert fn(h, 2.0).dtype == dm.float16, fn
        assert fn(h, Tensor(np.array([1.0, 3.0]))).dtype == dm.float64, fn


def test_errors_name_the_op():
    b = Tensor(np.array([True, False]))
    with pytest.raises(TypeError, match=r"MulNoNan: input 0 has dtype bool; supported "
                                        r"dtypes: integer and floating"):
        ops.mul_no_nan(b, b)
    with pytest.raises(TypeError, match=r"TruncateMod: input 0 has dtype bool"):
        P.TruncateMod()(b, b)
    x = Tensor(np.ones((3, 4), np.float32))
    for name in ("Atan2", "DivNoNan", "MulNoNan", "TruncateMod", "Xdivy", "Xlogy"):
        with pytest.raises(ValueError, match=rf"{name}: input 0 has shape \(3, 4\) but input 1 "
                                             rf"has shape \(3,\); they cannot be broadcast"):
            getattr(P, name)()(x, Tensor(np.ones(3, np.float32)))


# forward and gradient (float64 finite differences), with broadcasting
def _binary_inputs(name, shapes, seed, jumps_far=True):
    if name == "TruncateMod" and jumps_far:    # x / y away from an integer (the jumps)
        for s in range(seed, seed + 400, 2):
            a = (_away(shapes[0], s) * 5.0).astype(np.float32)
            b = _away(shapes[1], s + 1, 0.7)
            q = a / b
            if not (np.abs(q - np.round(q)) < 0.05).any():
                return a, b
        raise AssertionError("no inputs away from the jumps")
    if name == "Xlogy":
        return _f32(shapes[0], -2.0, 2.0, seed), _f32(shapes[1], 0.3, 2.0, seed + 1)
    if name == "Atan2":                # away from the origin
        return _away(shapes[0], seed), _away(shapes[1], seed + 1)
    scale = 5.0 if name == "TruncateMod" else 1.0
    return _f32(shapes[0], -2.0 * scale, 2.0 * scale, seed), _away(shapes[1], seed + 1, 0.3)


REFS = {"Atan2": np.arctan2, "DivNoNan": np_div_no_nan, "MulNoNan": np_mul_no_nan,
        "TruncateMod": np.fmod, "Xdivy": np_xdivy, "Xlogy": np_xlogy}
FUNCS = {"Atan2": ops.atan2, "DivNoNan": ops.div_no_nan, "MulNoNan": ops.mul_no_nan,
         "TruncateMod": ops.truncate_mod, "Xdivy": ops.xdivy, "Xlogy": ops.xlogy}


@pytest.mark.parametrize("form", ["primitive", "functional"])
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 4)),
                                    ((), (3,))], ids=str)
@pytest.mark.parametrize("name", sorted(REFS))
def test_forward_and_gradient(name, shapes, form):
    a, b = _binary_inputs(name, shapes, 3)
    fn = getattr(P, name)() if form == "primitive" else FUNCS[name]
    check_op(fn, REFS[name], [a, b], expect_ops=[name])


def test_gradients_at_the_guarded_points():
    """Where the guard holds the output is the constant 0: DivNoNan's gradients are 0
    where y == 0, MulNoNan's x-gradient is 0 where y == 0 (its y-gradient is x), and
    Xdivy's and Xlogy's gradients are 0 where x == 0, even where y == 0 (as MindSpore's)."""
    def grads(fn, x, y):
        x, y = Tensor(np.array(x, np.float32)), Tensor(np.array(y, np.float32))
        gx, gy = dm.grad(lambda a, b: ops.reduce_sum(fn(a, b)), (0, 1))(x, y)
        return gx.asnumpy(), gy.asnumpy()
    gx, gy = grads(ops.div_no_nan, [1.5, 0.0, -2.0], [0.0, 2.0, 4.0])
    np.testing.assert_allclose(gx, [0.0, 0.5, 0.25])
    np.testing.assert_allclose(gy, [0.0, 0.0, 2.0 / 16])
    gx, gy = grads(ops.mul_no_nan, [1.5, 0.0, -2.0], [0.0, 2.0, 4.0])
    np.testing.assert_allclose(gx, [0.0, 2.0, 4.0])
    np.testing.assert_allclose(gy, [1.5, 0.0, -2.0])
    gx, gy = grads(ops.xdivy, [0.0, 2.0, -1.0], [0.0, 4.0, 2.0])
    np.testing.assert_allclose(gx, [0.0, 0.25, 0.5])
    np.testing.assert_allclose(gy, [0.0, -0.125, 0.25])
    gx, gy = grads(ops.xlogy, [0.0, 2.0, -1.0], [0.0, 4.0, 2.0])
    np.testing.assert_allclose(gx, [0.0, np.log(4.0), np.log(2.0)], rtol=RTOL)
    np.testing.assert_allclose(gy, [0.0, 0.5, -0.5])


# ---------------------------------------------------------------------------
# sharded, every mode, against the stand-alone run
# ---------------------------------------------------------------------------
def _sharded_inputs(name, shapes, seed, zeros=False):
    # (sharded and stand-alone runs compute the same remainders: no need to keep x / y
    # away from the jumps here)
    a, b = _binary_inputs(name, shapes, seed, jumps_far=False)
    if zeros:                          # the guarded points, in several devices' blocks
        guarded = b if name in ("DivNoNan", "MulNoNan") else a
        guarded.reshape(-1)[::5] = 0.0
    return a, b


@pytest.mark.parametrize("shapes,strategy", [
    (((16, 8), (16, 8)), ((2, 4), (2, 4))),
    (((16, 8), (8,)), ((8, 1), (1,))),
    (((16, 1, 8), (4, 8)), ((2, 1, 2), (4, 2))),
    (((16, 8), (1, 8)), ((4, 2), (1, 2))),
    (((16, 8), (16, 8)), ((1, 2), (1, 2))),
], ids=str)
@pytest.mark.parametrize("name", sorted(REFS))
def test_binary_sharded_every_mode(name, shapes, strategy):
    a, b = _sharded_inputs(name, shapes, 11, zeros=name != "TruncateMod")
    _check_modes(lambda prims, x, y: prims[0](x, y), lambda: [getattr(P, name)()],
                 strategy, [a, b], (0, 1))


@pytest.mark.parametrize("name", sorted(REFS))
def test_strategy_must_split_shared_dims_alike(name):
    with devices(8):
        x = Tensor(np.ones((16, 8), np.float32))
        with pytest.raises(ValueError, match=rf"{name}: in_strategy\[0\]\[0\]=1 and "
                                             rf"in_strategy\[1\]\[0\]=4 split the broadcast "
                                             rf"dim differently"):
            getattr(P, name)().shard(((1, 8), (4, 2)))(x, x)


@pytest.mark.parametrize("name", ["DivNoNan", "MulNoNan"])
def test_linear_in_x_keeps_pending_sums(name):
    """DivNoNan and MulNoNan are linear in x for a fixed y: a pending partial product
    stays pending through them, finished by one AllReduce where a non-linear op needs
    it; Xdivy is not (x / 0 of a term is infinite), so its input sum is finished first."""
    from dualmode.parallel import CommReport
    a, b = _f32((8, 16), seed=26), _f32((16, 4), seed=27)
    y = _f32((8, 4), seed=28)
    y[0, :2] = 0.0
    with devices(8):
        mm = ops.MatMul().shard(((1, 8), (8, 1)))
        with CommReport() as rep:
            p = getattr(P, name)()(mm(Tensor(a), Tensor(b)), Tensor(y))
            assert p.layout.partial
            q = ops.relu(p)
        got = q.asnumpy()
    ref = REFS[name](a @ b, y)
    np.testing.assert_allclose(got, np.maximum(ref, 0), rtol=1e-5, atol=1e-5)
    ar = [r for r in rep.records if r.kind == "AllReduce"]
    assert len(ar) == 1 and ar[0].resolved_by == "ReLU", rep.records
    with devices(8):
        mm = ops.MatMul().shard(((1, 8), (8, 1)))
        with CommReport() as rep:
            p = ops.Xdivy()(mm(Tensor(a), Tensor(b)), Tensor(y))
        assert p.layout is None or not p.layout.partial
        np.testing.assert_allclose(p.asnumpy(), np_xdivy(a @ b, y), rtol=1e-5, atol=1e-5)
    ar = [r for r in rep.records if r.kind == "AllReduce"]
    assert len(ar) == 1 and ar[0].resolved_by == "Xdivy", rep.records


# ---------------------------------------------------------------------------
# ops.div(x, y, rounding_mode=None | "floor" | "trunc")
# ---------------------------------------------------------------------------
def test_div_rounding_modes_against_numpy():
    a = np.array([[-7.5, -5.0, 5.0, 7.5], [3.0, -3.0, 0.5, -0.5]], np.float32)
    b = np.array([2.0, -3.0, 3.0, -2.0], np.float32)
    out = ops.div(Tensor(a), Tensor(b))
    np.testing.assert_allclose(out.asnumpy(), a / b, rtol=RTOL)
    out = ops.div(Tensor(a), Tensor(b), rounding_mode=None)
    np.testing.assert_allclose(out.asnumpy(), a / b, rtol=RTOL)
    out = ops.div(Tensor(a), Tensor(b), rounding_mode="floor")
    assert out.dtype == dm.float32
    np.testing.assert_array_equal(out.asnumpy(), np.floor_divide(a, b))
    out = ops.div(Tensor(a), Tensor(b), rounding_mode="trunc")
    assert out.dtype == dm.float32
    np.testing.assert_array_equal(out.asnumpy(), np.trunc(a / b))
    i = np.array([-7, -5, 5, 7], np.int32)
    j = np.array([2, -3, 3, -2], np.int32)
    assert ops.div(Tensor(i), Tensor(j)).dtype == dm.float32          # true division
    for mode, ref in (("floor", np.floor_divide(i, j)), ("trunc", np.fix(i / j))):
        out = ops.div(Tensor(i), Tensor(j), rounding_mode=mode)
        assert out.dtype == dm.int32, mode
        np.testing.assert_array_equal(out.asnumpy(), ref.astype(np.int32))
    # a Python number on either side
    np.testing.assert_array_equal(ops.div(7.0, Tensor(b), rounding_mode="trunc").asnumpy(),
                                  np.trunc(7.0 / b))
    np.testing.assert_array_equal(ops.div(Tensor(a), 2, rounding_mode="floor").asnumpy(),
                                  np.floor_divide(a, 2))


def test_div_rounding_mode_errors_and_gradient():
    x = Tensor(np.array([1.5, -2.5], np.float32))
    for bad in ("round", "FLOOR", 1):
        with pytest.raises(ValueError, match=rf"div: rounding_mode={bad!r} is not valid; "
                                             rf"expected None, 'floor' or 'trunc'"):
            ops.div(x, 2.0, rounding_mode=bad)
    with pytest.raises(TypeError):
        ops.div(x, 2.0, "floor")               # keyword-only, as MindSpore's
    # the rounded quotient is a step: no gradient flows through it; the true quotient's
    # gradient is 1 / y
    for mode in ("floor", "trunc"):
        g = dm.grad(lambda t: ops.reduce_sum(ops.div(t, 2.0, rounding_mode=mode) + t * 3.0))(x)
        np.testing.assert_array_equal(g.asnumpy(), [3.0, 3.0])
    g = dm.grad(lambda t: ops.reduce_sum(ops.div(t, 2.0)))(x)
    np.testing.assert_array_equal(g.asnumpy(), [0.5, 0.5])


class _DivPrim(ops.Primitive):
    """A primitive running ``ops.div`` with a rounding mode (MindSpore has no Div
    attribute for it: scripts call the function inside a Cell)."""
    name = "Div"

    def __init__(self, rounding_mode):
        super().__init__()
        self.rounding_mode = rounding_mode

    def construct(self, x, y):
        return ops.div(x, y, rounding_mode=self.rounding_mode)


@pytest.mark.parametrize("strategy", [((4, 2), (4, 2)), ((8, 1), (1,))], ids=str)
@pytest.mark.parametrize("mode", [None, "floor", "trunc"])
def test_div_rounding_mode_sharded_every_mode(mode, strategy):
    """The quotient's values (through the loss) and the gradient of the other term equal
    the stand-alone run's."""
    a = _f32((16, 8), -6.0, 6.0, 13)
    b = _away((16, 8) if len(strategy[1]) == 2 else (8,), 14, 0.7)
    _check_modes(lambda prims, x, y: prims[0](x, y) + x * y, lambda: [_DivPrim(mode)],
                 strategy, [a, b], (0, 1))


# ---------------------------------------------------------------------------
# BitwiseAnd / BitwiseOr / BitwiseXor (integer and bool tensors, no gradient)
# ---------------------------------------------------------------------------
BITWISE = {"BitwiseAnd": (ops.bitwise_and, np.bitwise_and),
           "BitwiseOr": (ops.bitwise_or, np.bitwise_or),
           "BitwiseXor": (ops.bitwise_xor, np.bitwise_xor)}


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.bool_],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", sorted(BITWISE))
def test_bitwise_against_numpy(name, dtype):
    fn, ref = BITWISE[name]
    rng = np.random.default_rng(5)
    hi = 2 if dtype == np.bool_ else 100
    a = rng.integers(0, hi, (3, 1, 4)).astype(dtype)
    b = rng.integers(0, hi, (2, 4)).astype(dtype)
    if np.dtype(dtype).kind == "i":
        a[0, 0, :2] = -a[0, 0, :2] - 1        # negative values: two's complement bits
    for out in (getattr(P, name)()(Tensor(a), Tensor(b)), fn(Tensor(a), Tensor(b))):
        assert out.dtype == dtype and out.shape == (3, 2, 4)
        np.testing.assert_array_equal(out.asnumpy(), ref(a, b))


def test_bitwise_mindspore_example_scalars_and_promotion():
    x = Tensor(np.array([0, 0, 1, -1, 1, 1, 1], np.int16))
    y = Tensor(np.array([0, 1, 1, -1, -1, 2, 3], np.int16))
    np.testing.assert_array_equal(P.BitwiseAnd()(x, y).asnumpy(), [0, 0, 1, -1, 1, 0, 1])
    np.testing.assert_array_equal(P.BitwiseOr()(x, y).asnumpy(), [0, 1, 1, -1, -1, 3, 3])
    np.testing.assert_array_equal(P.BitwiseXor()(x, y).asnumpy(), [0, 1, 0, 0, -2, 3, 2])
    out = ops.bitwise_and(x, 6)                 # a Python int takes the tensor's dtype
    assert out.dtype == dm.int16
    np.testing.assert_array_equal(out.asnumpy(), np.bitwise_and(x.asnumpy(), 6))
    np.testing.assert_array_equal(ops.bitwise_xor(5, x).asnumpy(),
                                  np.bitwise_xor(5, x.asnumpy()))
    wide = ops.bitwise_or(x, Tensor(np.array([1 << 20], np.int64)))   # promoted to int64
    assert wide.dtype == dm.int64
    np.testing.assert_array_equal(wide.asnumpy(), np.bitwise_or(x.asnumpy().astype(np.int64),
                                                                1 << 20))


def test_bitwise_errors_name_the_op():
    f = Tensor(np.ones((2, 3), np.float32))
    i = Tensor(np.ones((2, 3), np.int32))
    for name, (fn, _) in BITWISE.items():
        with pytest.raises(TypeError, match=rf"{name}: input 0 has dtype float32; supported "
                                            rf"dtypes: int8, .* and bool"):
            fn(f, f)
        with pytest.raises(TypeError, match=rf"{name}: input \d has dtype float32"):
            getattr(P, name)()(i, 1.5)          # a float operand promotes to float
        with pytest.raises(ValueError, match=rf"{name}: input 0 has shape \(2, 3\) but input 1 "
                                             rf"has shape \(2,\)"):
            fn(i, Tensor(np.ones(2, np.int32)))
    from dualmode._core import _tensor as core
    with pytest.raises(TypeError, match=r"BitwiseAnd: input 0 has dtype int32 but input 1 has "
                                        r"dtype int64"):
        core.apply(ops.REGISTRY["BitwiseAnd"], None,
                   (np.ones(2, np.int32), np.ones(2, np.int64)))


def test_bitwise_has_no_gradient():
    """Nothing flows back through a bitwise op (integer outputs); the other term's
    gradient is kept."""
    x = Tensor(np.array([1.5, -2.5, 0.5], np.float32))

    def f(t):
        m = ops.bitwise_and(ops.cast(ops.greater(t, 0.0), dm.int32) * 3, 1)
        return ops.reduce_sum(t * ops.cast(m, dm.float32) + t)
    np.testing.assert_array_equal(dm.grad(f)(x).asnumpy(), [2.0, 1.0, 2.0])


def _bitwise_body(prims, x, y):
    a = ops.cast(ops.greater(x, 0.0), dm.int32) * 3          # {0, 3}
    b = ops.cast(ops.greater(y, 0.0), dm.int32) + 1          # {1, 2}
    return x * ops.cast(prims[0](a, b), dm.float32) + y


@pytest.mark.parametrize("shapes,strategy", [
    (((16, 8), (16, 8)), ((2, 4), (2, 4))),
    (((16, 1), (1, 8)), ((8, 1), (1, 1))),
    (((16, 8), (8,)), ((4, 2), (2,))),
], ids=str)
@pytest.mark.parametrize("name", sorted(BITWISE))
def test_bitwise_sharded_every_mode(name, shapes, strategy):
    _check_modes(_bitwise_body, lambda: [getattr(P, name)()], strategy,
                 [_f32(shapes[0], seed=31), _f32(shapes[1], seed=32)], (0, 1))


@pytest.mark.parametrize("graph", [False, True], ids=["pynative", "graph"])
@pytest.mark.parametrize("name", sorted(BITWISE))
def test_bitwise_int_broadcast_sharded_equals_numpy(name, graph):
    """Integer inputs broadcast (16, 1) with (1, 16), split (2, 1) and (1, 4): the output
    is in slices and equal to numpy's."""
    rng = np.random.default_rng(6)
    a = rng.integers(-8, 8, (16, 1)).astype(np.int32)
    b = rng.integers(-8, 8, (1, 16)).astype(np.int32)
    with devices(8, full_batch=True):
        if graph:
            dm.set_context(mode=dm.GRAPH_MODE)
        prim = getattr(P, name)().shard(((2, 1), (1, 4)))
        out = _BitwiseCell(prim)(Tensor(a), Tensor(b))
        assert max(out.layout.dim_parts) > 1
        got = out.asnumpy()
    np.testing.assert_array_equal(got, BITWISE[name][1](a, b))


class _BitwiseCell(dm.nn.Cell):
    def __init__(self, prim):
        super().__init__()
        self.prim = prim

    def construct(self, x, y):
        return self.prim(x, y)


# ---------------------------------------------------------------------------
# MaskedFill(input_x, mask, value)
# ---------------------------------------------------------------------------
def test_masked_fill_mindspore_example_and_forms():
    x = Tensor(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    mask = Tensor(np.array([True, True, False, True]))
    np.testing.assert_array_equal(P.MaskedFill()(x, mask, 0.5).asnumpy(), [0.5, 0.5, 3.0, 0.5])
    np.testing.assert_array_equal(ops.masked_fill(x, mask, Tensor(np.float32(-1))).asnumpy(),
                                  [-1.0, -1.0, 3.0, -1.0])
    # broadcasting: the output has the broadcast shape
    a = np.arange(6, dtype=np.float32).reshape(6, 1)
    m = np.array([[True, False, True]])
    out = ops.masked_fill(Tensor(a), Tensor(m), 9.0)
    assert out.shape == (6, 3) and out.dtype == dm.float32
    np.testing.assert_array_equal(out.asnumpy(), np.where(m, np.float32(9.0), a))
    # an int input: a Python number takes its dtype
    i = np.array([[1, 2], [3, 4]], np.int32)
    out = ops.masked_fill(Tensor(i), Tensor(np.array([False, True])), 7)
    assert out.dtype == dm.int32
    np.testing.assert_array_equal(out.asnumpy(), [[1, 7], [3, 7]])
    h = ops.masked_fill(Tensor(np.ones(3, np.float16)), Tensor(np.array([True, False, True])),
                        0.25)
    assert h.dtype == dm.float16
    np.testing.assert_array_equal(h.asnumpy(), np.array([0.25, 1.0, 0.25], np.float16))


def test_masked_fill_errors():
    x = Tensor(np.ones((2, 3), np.float32))
    m = Tensor(np.ones((2, 3), bool))
    with pytest.raises(TypeError, match=r"MaskedFill: mask \(input 1\) has dtype float32; "
                                        r"expected bool"):
        ops.masked_fill(x, x, 0.0)
    with pytest.raises(ValueError, match=r"MaskedFill: value \(input 2\) has shape \(1,\); "
                                         r"expected a 0-d tensor or a Python number"):
        P.MaskedFill()(x, m, Tensor(np.ones(1, np.float32)))
    with pytest.raises(TypeError, match=r"MaskedFill: value \(input 2\) has dtype float64 but "
                                        r"input 0 has dtype float32"):
        ops.masked_fill(x, m, Tensor(np.float64(1.0)))
    with pytest.raises(TypeError, match=r"MaskedFill: value must be a Python number or a 0-d "
                                        r"Tensor, got str"):
        ops.masked_fill(x, m, "1")
    with pytest.raises(ValueError, match=r"MaskedFill: input 0 has shape \(2, 3\) but mask has "
                                         r"shape \(2,\); they cannot be broadcast together"):
        ops.masked_fill(x, Tensor(np.ones(2, bool)), 1.0)


def _mask(shape, seed):
    return np.random.default_rng(seed).random(shape) < 0.4


@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 1), (1, 4)), ((2, 3, 4), (4,)),
                                    ((4,), (3, 4))], ids=str)
def test_masked_fill_forward_and_gradient(shapes):
    """Gradients (finite differences): to input_x where the mask is False (summed over
    broadcast dims) and to a tensor value, summed where it is True."""
    m = _mask(shapes[1], 3)
    check_op(lambda x, v: ops.masked_fill(x, Tensor(m), v),
             lambda x, v: np.where(m, v, x), [shapes[0], np.array(0.7, np.float32)],
             expect_ops=["MaskedFill"])
    check_op(lambda x: P.MaskedFill()(x, Tensor(m), -1.5),
             lambda x: np.where(m, np.float32(-1.5), x), [shapes[0]])


@pytest.mark.parametrize("value", ["tensor", 0.5])
@pytest.mark.parametrize("shapes,strategy", [
    (((16, 8), (16, 8)), ((2, 4), (2, 4))),
    (((16, 1), (1, 8)), ((4, 1), (1, 2))),
    (((16, 8), (8,)), ((8, 1), (1,))),
], ids=str)
@pytest.mark.parametrize("value_entry", [False, True], ids=["no-value-entry", "value-entry"])
def test_masked_fill_sharded_every_mode(shapes, strategy, value, value_entry):
    """The value is a Python float or a 0-d Tensor computed in the program (its gradient
    checked); the primitive's strategy has an entry () for it or none."""
    mask = _mask(shapes[1], 40)
    x = _f32(shapes[0], seed=41)
    if value == "tensor":
        def body(prims, x, m, v):
            return prims[0](x * x, m, v * 2.0)
        inputs, grad_pos = [x, mask, np.array(0.3, np.float32)], (0, 2)
    else:
        def body(prims, x, m):
            return prims[0](x * x, m, value)
        inputs, grad_pos = [x, mask], 0
    st = strategy + ((),) if value_entry else strategy
    for mode in ("eager", "ops.shard", "graph"):
        # ops.shard's in_strategy covers the function's inputs (x, mask and the value)
        outer = strategy + ((),) * (len(inputs) - 2) if mode == "ops.shard" else st
        _check_modes(body, lambda: [P.MaskedFill()], outer, inputs, grad_pos, modes=[mode])


# ---------------------------------------------------------------------------
# Diag and FillV2
# ---------------------------------------------------------------------------
def np_diag(x):
    return np.diag(x.reshape(-1)).reshape(x.shape * 2)


def test_diag_mindspore_example_and_ranks():
    out = P.Diag()(Tensor(np.array([1, 2, 3, 4], np.int32)))
    assert out.dtype == dm.int32
    np.testing.assert_array_equal(out.asnumpy(), np.diag([1, 2, 3, 4]))
    x = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    out = ops.diag(Tensor(x))
    assert out.shape == (2, 3, 2, 3)
    got = out.asnumpy()
    for i in range(2):
        for j in range(3):
            assert got[i, j, i, j] == x[i, j]
    assert np.count_nonzero(got) == 6
    np.testing.assert_array_equal(got, np_diag(x))


def test_diag_gradient_and_errors():
    for shape in [(4,), (2, 3)]:
        check_op(ops.diag, np_diag, [shape], expect_ops=["Diag"])
    with pytest.raises(ValueError, match=r"Diag: input 0 is 0-d; expected a tensor of rank "
                                         r">= 1"):
        ops.diag(Tensor(np.float32(1.0)))
    with pytest.raises(ValueError, match=r"Diag: shard\(in_strategy=\(\(2,\),\)\) is not "
                                         r"supported: Diag has no sharding rule"):
        P.Diag().shard(((2,),))


@pytest.mark.parametrize("strategy", [((8,), (8,)), ((2,), (2,)), ((1,), (1,))], ids=str)
def test_diag_of_a_split_tensor_every_mode(strategy):
    """Diag's input split by the op before it (gathered), its output whole on every
    device, used by a MatMul: loss and gradients equal the stand-alone run's."""
    w = _f32((16, 4), seed=51)

    def body(prims, x, y):
        d = prims[1](prims[0](x, y))                     # (16, 16), x * y on the diagonal
        return ops.matmul(d, Tensor(w))
    _check_modes(body, lambda: [P.Mul(), P.Diag()], strategy,
                 [_f32((16,), seed=52), _f32((16,), seed=53)], (0, 1))


def test_fill_v2_mindspore_examples_and_forms():
    out = P.FillV2()(Tensor(np.array([2, 3], np.int32)), Tensor(np.float32(1)))
    assert out.dtype == dm.float32
    np.testing.assert_array_equal(out.asnumpy(), np.ones((2, 3), np.float32))
    out = P.FillV2()(Tensor(np.array([3, 3], np.int64)), Tensor(np.int32(0)))
    assert out.dtype == dm.int32
    np.testing.assert_array_equal(out.asnumpy(), np.zeros((3, 3), np.int32))
    out = ops.fill_v2((2, 1, 4), 2.5)
    assert out.dtype == dm.float32 and out.shape == (2, 1, 4)
    np.testing.assert_array_equal(out.asnumpy(), np.full((2, 1, 4), 2.5, np.float32))
    assert ops.fill_v2([], Tensor(np.float16(3))).shape == ()
    check_op(lambda v: ops.fill_v2((2, 3), v), lambda v: np.full((2, 3), v),
             [np.array(0.7, np.float32)], expect_ops=["FillV2"])


def test_fill_v2_errors():
    v = Tensor(np.float32(1))
    with pytest.raises(ValueError, match=r"FillV2: value \(input 1\) has shape \(1,\); "
                                         r"expected a 0-d tensor"):
        ops.fill_v2((2, 3), Tensor(np.ones(1, np.float32)))
    with pytest.raises(TypeError, match=r"FillV2: shape is a tensor of shape \(2,\) and dtype "
                                        r"float32; expected a 1-D int32 or int64 tensor"):
        ops.fill_v2(Tensor(np.array([2.0, 3.0], np.float32)), v)
    with pytest.raises(TypeError, match=r"FillV2: shape is a tensor of shape \(1, 2\)"):
        P.FillV2()(Tensor(np.array([[2, 3]], np.int32)), v)
    with pytest.raises(ValueError, match=r"FillV2: shape=\(2, -3\) must be a tuple of ints "
                                         r">= 0"):
        ops.fill_v2((2, -3), v)
    with pytest.raises(TypeError, match=r"FillV2: shape must be a tuple of ints or a 1-D int "
                                        r"Tensor, got int"):
        ops.fill_v2(3, v)
    with pytest.raises(TypeError, match=r"FillV2: value must be a 0-d Tensor or a Python "
                                        r"number, got str"):
        ops.fill_v2((2,), "1")


def test_fill_v2_strategy_errors():
    v = Tensor(np.float32(1))
    with devices(8):
        for st, msg in [
                (((2, 2), (), ()), r"in_strategy=\(\(2, 2\), \(\), \(\)\) must be \(output "
                                   r"entry, \(\)\) or \(output entry,\)"),
                (((2, 2), (1,)), r"in_strategy=\(\(2, 2\), \(1,\)\) must be"),
                (((2, 2, 1), ()), r"in_strategy\[0\]=\(2, 2, 1\) must have one entry per dim "
                                  r"of the output \(shape \(16, 8\)\)"),
                # (a split that does not divide gives unequal pieces; 3 does not fit 8)
                (((3, 1), ()), r"in_strategy\[0\]=\(3, 1\) needs 3 devices \(its product\) "
                               r"but device_num is 8"),
                (((4, 4), ()), r"in_strategy\[0\]=\(4, 4\) needs 16 devices \(its product\) "
                               r"but device_num is 8")]:
            with pytest.raises(ValueError, match="FillV2: " + msg):
                P.FillV2().shard(st)((16, 8), v)


@pytest.mark.parametrize("graph", [False, True], ids=["pynative", "graph"])
@pytest.mark.parametrize("strategy", [((2, 2, 1), ()), ((8, 1, 1),), ((1, 2, 4), ())], ids=str)
def test_fill_v2_strategy_cuts_the_output_locally(strategy, graph):
    """MindSpore's form: one entry per output dim (the value's entry () may be left out);
    each device holds its block of the output, made with no communication."""
    from dualmode.parallel import CommReport

    class Net(dm.nn.Cell):
        def __init__(self):
            super().__init__()
            self.fill = P.FillV2().shard(strategy)

        def construct(self, v):
            return self.fill((16, 8, 4), v * 2.0)

    with devices(8, full_batch=True):
        if graph:
            dm.set_context(mode=dm.GRAPH_MODE)
        with CommReport() as rep:
            out = Net()(Tensor(np.float32(1.5)))
        assert out.layout.dim_parts == strategy[0], out.layout
        assert not rep.records, rep.records
        got = out.asnumpy()
    np.testing.assert_array_equal(got, np.full((16, 8, 4), 3.0, np.float32))


@pytest.mark.parametrize("strategy", [((2, 4), ()), ((8, 1),), ((1, 1), ())], ids=str)
def test_fill_v2_sharded_every_mode(strategy):
    """The value computed in the program (its gradient: the sum of the output's) and the
    filled tensor used elementwise: loss and gradients equal the stand-alone run's."""
    def body(prims, x, v):
        return prims[0]((16, 8), v * 2.0) * x
    for mode in ("eager", "ops.shard", "graph"):
        outer = ((2, 4), ()) if mode == "ops.shard" else strategy     # covers (x, v)
        _check_modes(body, lambda: [P.FillV2()], outer,
                     [_f32((16, 8), seed=54), np.array(0.3, np.float32)], (0, 1), modes=[mode])


# ---------------------------------------------------------------------------
# SquareSumAll(x, y) -> (sum(x ** 2), sum(y ** 2))
# ---------------------------------------------------------------------------
def test_square_sum_all_mindspore_example_and_gradient():
    x = Tensor(np.array([0, 0, 2, 0], np.float32))
    y = Tensor(np.array([0, 0, 2, 4], np.float32))
    sx, sy = P.SquareSumAll()(x, y)
    assert sx.shape == () and sy.shape == () and sx.dtype == dm.float32
    assert float(sx.asnumpy()) == 4.0 and float(sy.asnumpy()) == 20.0
    for shape in [(3, 4), (2, 3, 2), ()]:
        check_op(ops.square_sum_all, lambda a, b: (np.sum(a * a), np.sum(b * b)),
                 [shape, shape], expect_ops=["SquareSumAll"])
    h = ops.square_sum_all(Tensor(np.ones(3, np.float16)), Tensor(np.ones(3, np.float16)))
    assert h[0].dtype == dm.float16
    # one output used: the other input gets no gradient
    gx, gy = dm.grad(lambda a, b: ops.square_sum_all(a, b)[1] * 3.0, (0, 1))(x, y)
    np.testing.assert_array_equal(gx.asnumpy(), [0, 0, 0, 0])
    np.testing.assert_array_equal(gy.asnumpy(), 6.0 * y.asnumpy())


def test_square_sum_all_errors():
    x = Tensor(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"SquareSumAll: input 0 has shape \(2, 3\) but input 1 "
                                         r"has shape \(3,\); both inputs must have the same "
                                         r"shape"):
        P.SquareSumAll()(x, Tensor(np.ones(3, np.float32)))
    with pytest.raises(TypeError, match=r"SquareSumAll: input 0 has dtype int32; supported "
                                        r"dtypes: float16, float32, float64"):
        ops.square_sum_all(Tensor(np.ones(3, np.int32)), Tensor(np.ones(3, np.int32)))
    with pytest.raises(TypeError, match=r"SquareSumAll: input 0 has dtype float32 but input 1 "
                                        r"has dtype float64"):
        ops.square_sum_all(x, Tensor(np.ones((2, 3))))


@pytest.mark.parametrize("strategy", [((2, 4), (2, 4)), ((8, 1), (1, 8)), ((1, 2), (4, 1)),
                                      ((1, 1), (1, 1))], ids=str)
def test_square_sum_all_sharded_every_mode(strategy):
    """Each device sums the squares of its block; the sums are finished over the devices
    that split each input: loss and gradients equal the stand-alone run's."""
    def body(prims, x, y):
        sx, sy = prims[0](x, y)
        return sx * 0.5 + sy * sy * 0.01, sx / sy
    _check_modes(body, lambda: [P.SquareSumAll()], strategy,
                 [_f32((16, 8), seed=61), _f32((16, 8), seed=62)], (0, 1))


def test_square_sum_all_sums_pending_over_the_split_axes():
    """A split input's sum of squares is pending over the devices that split it (one
    AllReduce per output when the value is needed), as MindSpore's AllReduce after
    SquareSumAll; the other input's over its own."""
    from dualmode.parallel import CommReport
    a, b = _f32((16, 8), seed=63), _f32((16, 8), seed=64)
    with devices(8):
        with CommReport() as rep:
            sx, sy = P.SquareSumAll().shard(((2, 4), (8, 1)))(Tensor(a), Tensor(b))
            assert sx.layout.partial and sy.layout.partial
            assert not [r for r in rep.records if r.kind == "AllReduce"]
            got = (ops.sqrt(sx).asnumpy(), ops.sqrt(sy).asnumpy())
        assert len([r for r in rep.records if r.kind == "AllReduce"]) == 2, rep.records
    np.testing.assert_allclose(got[0], np.sqrt(np.sum(a * a)), rtol=1e-5)
    np.testing.assert_allclose(got[1], np.sqrt(np.sum(b * b)), rtol=1e-5)
