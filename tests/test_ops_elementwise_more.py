"""GeLU, FastGeLU (and nn.GELU), Erf, Rsqrt, Reciprocal, Select, Mod, FloorMod,
FloorDiv, TruncateDiv, SquaredDifference, LogicalAnd / LogicalOr / LogicalNot, AddN and
PReLU: forward values and gradients against numpy (MindSpore's documented examples
where it gives them), and every op with a strategy on 8 simulated devices -- the
primitive's ``.shard`` in PyNative mode, ``ops.shard`` of the function, and a Cell in
GRAPH_MODE -- against the stand-alone run (loss, outputs and input gradients)."""
import math

import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, nn, ops

from _devices import devices
from _opcheck import check_op

RTOL = 1e-5
_ERF = np.vectorize(math.erf)


def np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def np_gelu_tanh(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def np_gelu_erf(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1 + _ERF(x / math.sqrt(2)))


def np_fast_gelu(x):
    x = x.astype(np.float64)
    return x / (1 + np.exp(-1.702 * np.abs(x))) * np.exp(0.851 * (x - np.abs(x)))


def _f32(shape, lo=-2.0, hi=2.0, seed=0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


# ---------------------------------------------------------------------------
# one device: MindSpore's examples, numpy values, gradients (finite differences)
# ---------------------------------------------------------------------------
def test_gelu_matches_mindspore_examples():
    x = Tensor(np.array([1.0, 2.0, 3.0], np.float32))
    # ops.GeLU() computes the tanh form (MindSpore's printed example)
    np.testing.assert_allclose(ops.GeLU()(x).asnumpy(), [0.841192, 1.9545976, 2.9963627],
                               rtol=RTOL)
    np.testing.assert_allclose(ops.gelu(x, approximate="tanh").asnumpy(),
                               [0.841192, 1.9545976, 2.9963627], rtol=RTOL)
    # ops.gelu's default is the erf form
    np.testing.assert_allclose(ops.gelu(x).asnumpy(), [0.8413447, 1.9544997, 2.9959505],
                               rtol=RTOL)
    m = Tensor(np.array([[-1.0, 4.0, -8.0], [2.0, -5.0, 9.0]], np.float32))
    np.testing.assert_allclose(nn.GELU()(m).asnumpy(),
                               [[-1.5880802e-01, 3.9999299e+00, -3.1077917e-21],
                                [1.9545976e+00, -2.2918017e-07, 9.0000000e+00]], rtol=1e-5)
    np.testing.assert_allclose(nn.GELU(approximate=False)(m).asnumpy(),
                               [[-1.5865526e-01, 3.9998732e+00, 0.0],
                                [1.9544997e+00, -1.4901161e-06, 9.0000000e+00]],
                               rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(ops.FastGeLU()(m).asnumpy(), np_fast_gelu(m.asnumpy()),
                               rtol=RTOL, atol=1e-12)
    assert isinstance(nn.get_activation("gelu"), nn.GELU)
    assert isinstance(nn.get_activation("fast_gelu"), nn.FastGelu)


def test_erf_against_math_erf():
    x = np.concatenate([np.linspace(-6, 6, 2001), [0.0, 0.46875, -0.46875, 4.0, -4.0, 30.0,
                                                    -30.0]])
    got = ops.erf(Tensor(x)).asnumpy()
    np.testing.assert_allclose(got, _ERF(x), rtol=1e-14, atol=1e-300)
    got32 = ops.Erf()(Tensor(x.astype(np.float32)))
    assert got32.dtype == dm.float32
    np.testing.assert_allclose(got32.asnumpy(), _ERF(x.astype(np.float32)), rtol=1e-6,
                               atol=1e-7)
    nan = ops.erf(Tensor(np.array([np.nan, np.inf, -np.inf]))).asnumpy()
    assert np.isnan(nan[0]) and nan[1] == 1.0 and nan[2] == -1.0


UNARY_CASES = [
    ("GeLU", lambda x: ops.GeLU()(x), np_gelu_tanh, (3, 4), {}),
    ("gelu-tanh", lambda x: ops.gelu(x, "tanh"), np_gelu_tanh, (3, 4), {}),
    ("gelu-none", lambda x: ops.gelu(x), np_gelu_erf, (3, 4), {}),
    ("nn.GELU", lambda x: nn.GELU()(x), np_gelu_tanh, (2, 3), {}),
    ("nn.GELU-erf", lambda x: nn.GELU(False)(x), np_gelu_erf, (2, 3), {}),
    ("FastGeLU", lambda x: ops.FastGeLU()(x), np_fast_gelu, (3, 4), {}),
    ("fast_gelu", ops.fast_gelu, np_fast_gelu, (2, 3, 2), {}),
    ("nn.FastGelu", lambda x: nn.FastGelu()(x), np_fast_gelu, (3,), {}),
    ("Erf", lambda x: ops.Erf()(x), _ERF, (3, 4), {}),
    ("erf", ops.erf, _ERF, (), {}),
    ("Rsqrt", lambda x: ops.Rsqrt()(x), lambda x: 1 / np.sqrt(x), (3, 4), {"low": 0.3}),
    ("rsqrt", ops.rsqrt, lambda x: 1 / np.sqrt(x), (2, 3, 2), {"low": 0.3}),
    ("rsqrt-0d", ops.rsqrt, lambda x: 1 / np.sqrt(x), (), {"low": 0.3}),
    ("gelu-0d", lambda x: ops.gelu(x, "tanh"), np_gelu_tanh, (), {}),
    ("fast_gelu-0d", ops.fast_gelu, np_fast_gelu, (), {}),
    ("Reciprocal", lambda x: ops.Reciprocal()(x), lambda x: 1 / x, (3, 4), {"low": 0.3}),
    ("reciprocal", ops.reciprocal, lambda x: 1 / x, (), {"low": 0.3}),
]


@pytest.mark.parametrize("name,fn,ref,shape,kw", UNARY_CASES, ids=[c[0] for c in UNARY_CASES])
def test_unary_forward_and_gradient(name, fn, ref, shape, kw):
    check_op(fn, lambda x: np.asarray(ref(x)).astype(np.float32), [shape], **kw)


def _away(shape, seed, lo=0.3):
    x = _f32(shape, lo, 2.0, seed)
    sign = np.where(np.random.default_rng(seed + 50).random(shape) < 0.5, -1, 1)
    return (x * sign).astype(np.float32)


BINARY_CASES = [
    ("Mod", ops.Mod(), np.fmod, 5.0),
    ("fmod", ops.fmod, np.fmod, 5.0),
    ("FloorMod", ops.FloorMod(), np.mod, 5.0),
    ("floor_mod", ops.floor_mod, np.mod, 5.0),
    ("SquaredDifference", ops.SquaredDifference(), lambda a, b: (a - b) ** 2, 2.0),
    ("squared_difference", ops.squared_difference, lambda a, b: (a - b) ** 2, 2.0),
]


@pytest.mark.parametrize("name,fn,ref,scale", BINARY_CASES, ids=[c[0] for c in BINARY_CASES])
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 4))],
                         ids=str)
def test_binary_forward_and_gradient(name, fn, ref, scale, shapes):
    # values away from the remainders' jumps (x / y not near an integer)
    for seed in range(1, 200, 2):      # the first seeds with every x / y off an integer
        a = (_away(shapes[0], seed) * scale).astype(np.float32)
        b = _away(shapes[1], seed + 1, 0.7)
        q = a / b
        if not (np.abs(q - np.round(q)) < 0.05).any():
            break
    check_op(fn, ref, [a, b])


def test_mod_floor_mod_floor_div_on_integers_and_signs():
    a = np.array([-7, -5, 5, 7, 0], np.int32)
    b = np.array([3, -3, 3, -2, 4], np.int32)
    got = {n: getattr(ops, n)()(Tensor(a), Tensor(b)).asnumpy() for n in
           ("Mod", "FloorMod", "FloorDiv", "TruncateDiv")}
    np.testing.assert_array_equal(got["Mod"], np.fmod(a, b))          # sign of x
    np.testing.assert_array_equal(got["FloorMod"], np.mod(a, b))      # sign of y
    np.testing.assert_array_equal(got["FloorDiv"], np.floor_divide(a, b))
    np.testing.assert_array_equal(got["TruncateDiv"], np.trunc(a / b).astype(np.int32))
    for v in got.values():
        assert v.dtype == np.int32
    f = np.array([-7.5, 7.5], np.float32)
    np.testing.assert_array_equal(ops.floor_div(Tensor(f), 2.0).asnumpy(), [-4.0, 3.0])
    np.testing.assert_array_equal(ops.truncate_div(Tensor(f), 2.0).asnumpy(), [-3.0, 3.0])


def test_floor_div_is_not_differentiable():
    """FloorDiv and TruncateDiv are steps: nothing flows back through them (as through
    the comparisons), while the other term's gradient is kept."""
    x = Tensor(np.array([1.5, -2.5], np.float32))
    for fn in (ops.floor_div, ops.truncate_div):
        g = dm.grad(lambda t: ops.reduce_sum(fn(t, 2.0) + t * 3.0))(x)
        np.testing.assert_array_equal(g.asnumpy(), [3.0, 3.0])


def test_logical_ops():
    a = np.array([[True, False, True, False]])
    b = np.array([[True], [False]])
    np.testing.assert_array_equal(ops.LogicalAnd()(Tensor(a), Tensor(b)).asnumpy(), a & b)
    np.testing.assert_array_equal(ops.LogicalOr()(Tensor(a), Tensor(b)).asnumpy(), a | b)
    np.testing.assert_array_equal(ops.LogicalNot()(Tensor(a)).asnumpy(), ~a)
    np.testing.assert_array_equal(ops.logical_and(Tensor(a), True).asnumpy(), a)
    np.testing.assert_array_equal(ops.logical_or(Tensor(a), False).asnumpy(), a)
    out = ops.logical_not(Tensor(a))
    assert out.dtype == dm.bool_ and out.shape == (1, 4)
    with pytest.raises(TypeError, match=r"LogicalAnd: input 1 has dtype float32; expected "
                                        r"bool"):
        ops.LogicalAnd()(Tensor(a), Tensor(np.ones((1, 4), np.float32)))
    with pytest.raises(TypeError, match=r"LogicalNot: input 0 has dtype int32; expected bool"):
        ops.logical_not(Tensor(np.array([1, 0], np.int32)))
    with pytest.raises(ValueError, match=r"LogicalOr: input 0 has shape \(1, 4\) but input 1 "
                                         r"has shape \(3,\)"):
        ops.logical_or(Tensor(a), Tensor(np.array([True, False, True])))


def test_select_forward_gradient_and_errors():
    rng = np.random.default_rng(3)
    c = rng.random((3, 4)) < 0.5
    for shapes in [((3, 4), (3, 4)), ((3, 4), (4,)), ((1, 4), (3, 1))]:
        check_op(lambda x, y: ops.Select()(Tensor(c), x, y),
                 lambda x, y: np.where(c, x, y), list(shapes))
    # broadcasting cond, a Python number for one branch (it takes the other's dtype)
    check_op(lambda x: ops.select(Tensor(c[:1]), x, 0.5),
             lambda x: np.where(c[:1], x, np.float32(0.5)), [(3, 4)])
    check_op(lambda y: ops.select(Tensor(c), 2, y), lambda y: np.where(c, np.float32(2), y),
             [(4,)])
    with pytest.raises(TypeError, match=r"Select: cond \(input 0\) has dtype float32; "
                                        r"expected bool"):
        ops.Select()(Tensor(np.ones(2, np.float32)), Tensor(np.ones(2, np.float32)),
                     Tensor(np.ones(2, np.float32)))
    with pytest.raises(TypeError, match=r"Select: x \(input 1\) has dtype float32 but y "
                                        r"\(input 2\) has dtype float64"):
        ops.select(Tensor(c), Tensor(np.ones((3, 4), np.float32)), Tensor(np.ones((3, 4))))
    with pytest.raises(ValueError, match=r"Select: cond has shape \(3, 4\), x \(3, 4\) and y "
                                         r"\(5,\); they cannot be broadcast together"):
        ops.select(Tensor(c), Tensor(np.ones((3, 4), np.float32)),
                   Tensor(np.ones(5, np.float32)))


def test_addn_forward_gradient_and_errors():
    check_op(lambda a, b, c: ops.AddN()((a, b, c)), lambda a, b, c: a + b + c,
             [(3, 4), (3, 4), (3, 4)])
    check_op(lambda a, b: ops.addn([a, b]), lambda a, b: a + b, [(2, 3, 2), (2, 3, 2)])
    check_op(lambda a: ops.addn([a]), lambda a: a, [(3,)])
    check_op(lambda a: ops.addn((a, a)), lambda a: 2 * a, [(3,)])
    ints = ops.addn([Tensor(np.arange(3)), Tensor(np.arange(3))])
    np.testing.assert_array_equal(ints.asnumpy(), 2 * np.arange(3))
    x = Tensor(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"AddN: input 0 has shape \(2, 3\) but input 1 has "
                                         r"shape \(3,\); all inputs must have the same shape"):
        ops.AddN()((x, Tensor(np.ones(3, np.float32))))
    with pytest.raises(TypeError, match=r"AddN: input 0 has dtype float32 but input 1 has "
                                        r"dtype float64"):
        ops.addn([x, Tensor(np.ones((2, 3)))])
    with pytest.raises(TypeError, match=r"AddN: takes a tuple or list of tensors, got Tensor"):
        ops.addn(x)
    with pytest.raises(ValueError, match=r"AddN: takes a non-empty tuple or list"):
        ops.addn([])


def np_prelu(x, w):
    return np.where(x > 0, x, x * w.reshape(w.shape + (1,) * (x.ndim - 2)))


def test_prelu_mindspore_example_gradient_and_errors():
    x = np.arange(-6, 6).reshape((2, 3, 2)).astype(np.float32)
    w = np.array([0.1, 0.6, -0.3], np.float32)
    np.testing.assert_allclose(ops.PReLU()(Tensor(x), Tensor(w)).asnumpy(),
                               [[[-0.60, -0.50], [-2.40, -1.80], [0.60, 0.30]],
                                [[0.00, 1.00], [2.00, 3.00], [4.0, 5.00]]], rtol=RTOL)
    for xs, ws in [((2, 3, 2), (3,)), ((4, 3), (3,)), ((2, 3, 2, 2), (1,))]:
        check_op(ops.prelu, np_prelu, [_away(xs, 4), _f32(ws, -1.0, 1.0, 5)])
    with pytest.raises(ValueError, match=r"PReLU: input 0 has shape \(2, 3, 2\) but weight has "
                                         r"shape \(2,\); the weight must be 1-D of size 1 or 3"):
        ops.PReLU()(Tensor(x), Tensor(np.ones(2, np.float32)))
    with pytest.raises(ValueError, match=r"PReLU: input 0 has rank 1 \(shape \(3,\)\); expected "
                                         r"rank >= 2"):
        ops.prelu(Tensor(w), Tensor(w))
    with pytest.raises(TypeError, match=r"PReLU: input 0 has dtype int64"):
        ops.prelu(Tensor(np.ones((2, 3), np.int64)), Tensor(np.ones(3, np.int64)))


def test_gelu_errors():
    with pytest.raises(ValueError, match=r"gelu: approximate='exact' is not valid; expected "
                                         r"'none' or 'tanh'"):
        ops.gelu(Tensor(np.ones(2, np.float32)), approximate="exact")
    with pytest.raises(TypeError, match=r"GELU: approximate must be a bool, got 'tanh'"):
        nn.GELU(approximate="tanh")
    with pytest.raises(TypeError, match=r"GeLU: input 0 has dtype int32; supported dtypes"):
        ops.GeLU()(Tensor(np.ones(2, np.int32)))
    with pytest.raises(TypeError, match=r"Rsqrt: input 0 has dtype int32"):
        ops.rsqrt(Tensor(np.ones(2, np.int32)))


# ---------------------------------------------------------------------------
# sharded, every mode, against the stand-alone run
# ---------------------------------------------------------------------------
def _weights(outs):
    return [np.random.default_rng(100 + k).standard_normal(o.shape).astype(np.float32)
            for k, o in enumerate(outs)]


def _loss(outs, ws):
    total = None
    for o, w in zip(outs, ws):
        if o.dtype.kind != "f":
            o = ops.cast(o, dm.float32)
        term = ops.reduce_sum(ops.mul(o, Tensor(w)))
        total = term if total is None else total + term
    return total


class _Program(nn.Cell):
    """``outs = body(prims, *xs)``; the loss ``sum_k reduce_sum(out_k * w_k)``."""

    def __init__(self, body, make, strategy, ws):
        super().__init__()
        self.prims = make()
        if strategy is not None:
            self.prims[0].shard(strategy)
        self.body, self.ws = body, ws

    def construct(self, *xs):
        out = self.body(self.prims, *xs)
        return _loss(out if isinstance(out, tuple) else (out,), self.ws)


def _run(mode, body, make, strategy, inputs, grad_pos):
    """(loss, input gradients) of the program in `mode`."""
    out = body(make(), *[Tensor(x) for x in inputs])
    ws = _weights(out if isinstance(out, tuple) else (out,))
    args = [Tensor(x) for x in inputs]
    if mode == "single":
        with devices(None):
            net = _Program(body, make, None, ws)
            return dm.value_and_grad(net, grad_pos)(*args)
    with devices(8, full_batch=True):
        if mode == "eager":
            net = _Program(body, make, strategy, ws)
            return dm.value_and_grad(net, grad_pos)(*args)
        if mode == "ops.shard":
            net = _Program(body, make, None, ws)
            f = ops.shard(lambda *a: net(*a), in_strategy=strategy)
            return dm.value_and_grad(f, grad_pos)(*args)
        dm.set_context(mode=dm.GRAPH_MODE)
        net = _Program(body, make, strategy, ws)
        return dm.value_and_grad(net, grad_pos)(*args)


MODES = ["eager", "ops.shard", "graph"]


def _check_modes(body, make, strategy, inputs, grad_pos, modes=MODES):
    ref_loss, ref_g = _run("single", body, make, None, inputs, grad_pos)
    ref_g = ref_g if isinstance(ref_g, tuple) else (ref_g,)
    for mode in modes:
        loss, g = _run(mode, body, make, strategy, inputs, grad_pos)
        g = g if isinstance(g, tuple) else (g,)
        np.testing.assert_allclose(loss.asnumpy(), ref_loss.asnumpy(), rtol=RTOL, atol=1e-5,
                                   err_msg=f"loss, {mode}")
        for k, (a, b) in enumerate(zip(g, ref_g)):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=f"gradient {k}, {mode}")


def _unary_body(prims, x):
    return prims[0](x)


UNARY_PRIMS = {
    "GeLU": (ops.GeLU, (-3.0, 3.0)), "FastGeLU": (ops.FastGeLU, (-3.0, 3.0)),
    "Erf": (ops.Erf, (-2.0, 2.0)), "Rsqrt": (ops.Rsqrt, (0.3, 2.0)),
    "Reciprocal": (ops.Reciprocal, (0.3, 2.0)), "Sqrt": (ops.Sqrt, (0.3, 2.0)),
    "Square": (ops.Square, (-2.0, 2.0)),
}


@pytest.mark.parametrize("strategy", [((8, 1),), ((2, 4),), ((1, 2),)], ids=str)
@pytest.mark.parametrize("name", sorted(UNARY_PRIMS))
def test_unary_sharded_every_mode(name, strategy):
    cls, (lo, hi) = UNARY_PRIMS[name]
    _check_modes(_unary_body, lambda: [cls()], strategy, [_f32((16, 8), lo, hi, 7)], 0)


def test_nn_gelu_cell_strategy_every_mode():
    """MindSpore code shards the cell's inner primitive: ``cell.gelu.shard(...)``."""
    def make():
        cell = nn.GELU()
        return [cell.gelu, cell]
    _check_modes(lambda prims, x: prims[1](x), make, ((4, 2),),
                 [_f32((16, 8), -3, 3, 9)], 0)


BINARY_PRIMS = {"Mod": ops.Mod, "FloorMod": ops.FloorMod,
                "SquaredDifference": ops.SquaredDifference}


@pytest.mark.parametrize("shapes,strategy", [
    (((16, 8), (16, 8)), ((2, 4), (2, 4))),
    (((16, 8), (8,)), ((8, 1), (1,))),
    (((16, 1, 8), (4, 8)), ((2, 1, 2), (4, 2))),
], ids=str)
@pytest.mark.parametrize("name", sorted(BINARY_PRIMS))
def test_binary_sharded_every_mode(name, shapes, strategy):
    # (sharded and stand-alone runs compute the same remainders: no need to keep x / y
    # away from the jumps here)
    a = _f32(shapes[0], -4.0, 4.0, 11)
    b = _away(shapes[1], 12, 0.7)
    _check_modes(lambda prims, x, y: prims[0](x, y), lambda: [BINARY_PRIMS[name]()],
                 strategy, [a, b], (0, 1))


@pytest.mark.parametrize("name", ["FloorDiv", "TruncateDiv"])
def test_floor_div_sharded_every_mode(name):
    """No gradient through the division; the output's values (through the loss) and the
    gradient of the other term match."""
    a = _f32((16, 8), -6.0, 6.0, 13)
    b = _away((16, 8), 14, 0.7)
    _check_modes(lambda prims, x, y: prims[0](x, y) + x * y, lambda: [getattr(ops, name)()],
                 ((4, 2), (4, 2)), [a, b], (0, 1))


def _logical_body(prims, x, y):
    land, lor, lnot = prims
    m = land(ops.greater(x, 0.0), ops.less(y, 0.5))
    return ops.select(lor(m, lnot(ops.greater(y, -0.5))), x, y)


@pytest.mark.parametrize("first", ["LogicalAnd", "LogicalOr"])
def test_logical_sharded_every_mode(first):
    """The logical op first in `prims` carries the strategy, on bool inputs."""
    names = ["LogicalAnd", "LogicalOr", "LogicalNot"]
    names.remove(first)
    order = [first] + names

    def make():
        return [getattr(ops, n)() for n in order]

    def body(prims, x, y):
        by = dict(zip(order, prims))
        return _logical_body([by["LogicalAnd"], by["LogicalOr"], by["LogicalNot"]], x, y)
    if first == "LogicalAnd":
        # the strategy covers LogicalAnd's two bool inputs; ops.shard's covers x, y
        _check_modes(body, make, ((2, 4), (2, 4)), [_f32((16, 8), seed=15),
                                                    _f32((16, 8), seed=16)], (0, 1))
    else:
        _check_modes(body, make, ((8, 1), (8, 1)), [_f32((16, 8), seed=17),
                                                    _f32((16, 8), seed=18)], (0, 1))


def test_logical_not_sharded_every_mode():
    def body(prims, x):
        return ops.select(prims[0](ops.greater(x, 0.0)), x * 2.0, x)
    _check_modes(body, lambda: [ops.LogicalNot()], ((4, 2),), [_f32((16, 8), seed=19)], 0)


@pytest.mark.parametrize("shapes,strategy", [
    (((16, 8), (16, 8), (16, 8)), ((2, 4), (2, 4), (2, 4))),
    (((16, 8), (16, 8), (8,)), ((8, 1), (8, 1), (1,))),
    (((16, 8), (1, 8), (16, 1)), ((4, 2), (1, 2), (4, 1))),
], ids=str)
def test_select_sharded_every_mode(shapes, strategy):
    c = np.random.default_rng(20).random(shapes[0]) < 0.5

    def body(prims, x, y):
        return prims[0](Tensor(c), x, y)
    # the strategy has an entry for cond (a constant Tensor here) in eager/graph; ops.shard
    # takes the function's inputs x and y
    st_fn = strategy[1:]
    for mode in MODES:
        st = st_fn if mode == "ops.shard" else strategy
        _check_modes(body, lambda: [ops.Select()], st,
                     [_f32(shapes[1], seed=21), _f32(shapes[2], seed=22)], (0, 1),
                     modes=[mode])


def test_select_strategy_must_split_shared_dims_alike():
    with devices(8):
        c = Tensor(np.ones((16, 8), bool))
        x = Tensor(np.ones((16, 8), np.float32))
        with pytest.raises(ValueError, match=r"Select: in_strategy\[0\]\[0\]=2 and "
                                             r"in_strategy\[1\]\[0\]=4 split the broadcast dim "
                                             r"differently"):
            ops.Select().shard(((2, 4), (4, 2), (2, 4)))(c, x, x)


@pytest.mark.parametrize("strategy", [((2, 4), (2, 4), (2, 4)), ((8, 1), (8, 1), (8, 1)),
                                      ((1, 2), (1, 2), (1, 2))], ids=str)
def test_addn_sharded_every_mode(strategy):
    def body(prims, a, b, c):
        return prims[0]((a, b * c, c))
    _check_modes(body, lambda: [ops.AddN()], strategy,
                 [_f32((16, 8), seed=s) for s in (23, 24, 25)], (0, 1, 2))


def test_addn_keeps_pending_sums():
    """AddN is linear in all its inputs jointly: the sum of two pending partial products
    stays pending, finished by one AllReduce where a non-linear op needs it (not one per
    term)."""
    from dualmode.parallel import CommReport
    a, b = _f32((8, 16), seed=26), _f32((16, 4), seed=27)
    with devices(8):
        mm1 = ops.MatMul().shard(((1, 8), (8, 1)))
        mm2 = ops.MatMul().shard(((1, 8), (8, 1)))
        with CommReport() as rep:
            p = ops.AddN()((mm1(Tensor(a), Tensor(b)), mm2(Tensor(a), Tensor(2 * b))))
            assert p.layout.partial
            q = ops.relu(p)
        got = q.asnumpy()
    np.testing.assert_allclose(got, np.maximum(3 * (a @ b), 0), rtol=1e-5, atol=1e-5)
    ar = [r for r in rep.records if r.kind == "AllReduce"]
    assert len(ar) == 1 and ar[0].resolved_by == "ReLU", rep.records


@pytest.mark.parametrize("xshape,wshape,strategy", [
    ((16, 8, 4), (8,), ((2, 4, 1), (4,))),
    ((16, 8, 2, 2), (8,), ((8, 1, 1, 1), (1,))),
    ((16, 8), (8,), ((1, 8), (8,))),
    ((16, 8, 4), (1,), ((2, 2, 2), (1,))),
], ids=str)
def test_prelu_sharded_every_mode(xshape, wshape, strategy):
    _check_modes(lambda prims, x, w: prims[0](x, w), lambda: [ops.PReLU()], strategy,
                 [_away(xshape, 28), _f32(wshape, -1.0, 1.0, 29)], (0, 1))


def test_prelu_channel_split_must_match():
    """MindSpore's rule: the weight is split as x's channel dim."""
    with devices(8):
        x = Tensor(np.ones((16, 8, 4), np.float32))
        w = Tensor(np.ones(8, np.float32))
        with pytest.raises(ValueError, match=r"PReLU: in_strategy\[0\]\[1\]=4 and "
                                             r"in_strategy\[1\]\[0\]=2 split the channel dim "
                                             r"differently"):
            ops.PReLU().shard(((2, 4, 1), (2,)))(x, w)


class _PReLUNet(nn.Cell):
    def __init__(self, strategy):
        super().__init__()
        self.act = nn.PReLU(8, Tensor(np.linspace(-0.5, 0.5, 8).astype(np.float32)))
        if strategy is not None:
            self.act.prelu.shard(strategy)
        self.w = Tensor(_f32((16, 8, 4), seed=31))

    def construct(self, x):
        return ops.reduce_sum(ops.mul(self.act(x), self.w))


@pytest.mark.parametrize("mode", ["single", "eager", "graph"])
def test_nn_prelu_cell_trains_like_numpy(mode):
    """nn.PReLU(channel, w): the slopes are a Parameter; its gradient (and x's) equal
    numpy's, stand-alone and with the cell's primitive sharded (channels over 4 devices,
    batch over 2) in PyNative and GRAPH_MODE."""
    x = _away((16, 8, 4), 30)
    net_w = np.linspace(-0.5, 0.5, 8).astype(np.float32)
    w_out = _f32((16, 8, 4), seed=31)
    with devices(None if mode == "single" else 8):
        if mode == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)
        net = _PReLUNet(None if mode == "single" else ((2, 4, 1), (4,)))
        assert [tuple(p.shape) for p in net.trainable_params()] == [(8,)]
        loss, (gx, (gw,)) = dm.value_and_grad(net, 0, net.trainable_params())(Tensor(x))
    wide = net_w[:, None]
    np.testing.assert_allclose(loss.asnumpy(), np.sum(np.where(x > 0, x, x * wide) * w_out),
                               rtol=1e-5)
    np.testing.assert_allclose(gx.asnumpy(), np.where(x > 0, 1, wide) * w_out, rtol=1e-5)
    np.testing.assert_allclose(gw.asnumpy(), np.sum(np.where(x > 0, 0, x) * w_out,
                                                    axis=(0, 2)), rtol=1e-4, atol=1e-5)


def test_nn_prelu_errors():
    with pytest.raises(ValueError, match=r"PReLU: channel=0 must be an int >= 1"):
        nn.PReLU(0)
    with pytest.raises(ValueError, match=r"PReLU: w has shape \(2,\); expected \(3,\)"):
        nn.PReLU(3, Tensor(np.ones(2, np.float32)))
    with pytest.raises(TypeError, match=r"PReLU: w must be a float or a Tensor"):
        nn.PReLU(3, "0.25")


def test_tensor_floor_division_and_remainder_operators():
    """``//`` and ``%`` as Python's (and MindSpore's Tensor): FloorDiv and FloorMod."""
    a = np.array([-7.5, -5.0, 5.0, 7.5], np.float32)
    b = np.array([2.0, -3.0, 3.0, -2.0], np.float32)
    np.testing.assert_array_equal((Tensor(a) // Tensor(b)).asnumpy(), a // b)
    np.testing.assert_array_equal((Tensor(a) % Tensor(b)).asnumpy(), a % b)
    np.testing.assert_array_equal((Tensor(a) % 2.0).asnumpy(), a % np.float32(2))
    np.testing.assert_array_equal((10.0 // Tensor(b)).asnumpy(), np.float32(10) // b)
    np.testing.assert_array_equal((10.0 % Tensor(b)).asnumpy(), np.float32(10) % b)
    i = Tensor(np.array([-7, 7], np.int32))
    out = i // 2
    assert out.dtype == dm.int32
    np.testing.assert_array_equal(out.asnumpy(), [-4, 3])
    np.testing.assert_array_equal((i % 3).asnumpy(), [2, 1])
    g = dm.grad(lambda t: ops.reduce_sum(t % 2.0))(Tensor(a))        # d(x mod c)/dx = 1
    np.testing.assert_array_equal(g.asnumpy(), np.ones(4, np.float32))
