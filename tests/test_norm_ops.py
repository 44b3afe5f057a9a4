"""The normalisation ops as MindSpore's primitives, each one op with one sharding rule:
``ops.LayerNorm`` (x, gamma, beta -> y, mean, variance; the rows split, the normalised
dims whole) and ``ops.L2Normalize`` (the normalised axes whole), with ``nn.LayerNorm``
built on the primitive (``cell.layer_norm.shard(...)`` as in MindSpore). Values and
gradients against numpy; sharded runs (PyNative primitive strategies, GRAPH_MODE,
ops.shard, Cell.shard) against the stand-alone run; strategies splitting a normalised
dim are refused by name, as MindSpore refuses them."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel import CommReport

from _devices import devices
from _steps import assert_same_steps, sgd_steps
from _opcheck import check_op

RTOL = 1e-5          # one op
TRAIN_RTOL = 1e-4    # over training steps / a loss and its gradients


def np_layer_norm(x, gamma, beta, bna, bpa, eps=1e-7):
    x64 = x.astype(np.float64)
    axes = tuple(range(bna, x.ndim))
    mean = x64.mean(axes, keepdims=True)
    var = x64.var(axes, keepdims=True)
    y = (x64 - mean) / np.sqrt(var + eps) * gamma + beta
    return y, mean, var


def np_l2_normalize(x, axis, eps=1e-4):
    x64 = x.astype(np.float64)
    s = np.square(x64).sum(axis, keepdims=True)
    return x64 / np.sqrt(np.maximum(s, eps))


def _rand(*shape, seed=0, lo=-2.0, hi=2.0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


# ---------------------------------------------------------------------------
# LayerNorm, one device
# ---------------------------------------------------------------------------
def test_layer_norm_mindspore_example():
    x = Tensor(np.array([[1, 2, 3], [1, 2, 3]], np.float32))
    g = Tensor(np.ones(3, np.float32))
    b = Tensor(np.ones(3, np.float32))
    y, mean, var = ops.LayerNorm()(x, g, b)
    np.testing.assert_allclose(y.asnumpy(), [[-0.2247448, 1.0, 2.2247448]] * 2, rtol=RTOL)
    assert mean.shape == (2, 1) and var.shape == (2, 1)
    np.testing.assert_allclose(mean.asnumpy(), [[2.0], [2.0]], rtol=RTOL)
    np.testing.assert_allclose(var.asnumpy(), [[2 / 3], [2 / 3]], rtol=RTOL)


@pytest.mark.parametrize("shape,bna,bpa", [((4, 6), 1, 1), ((3, 4, 5), 1, 1),
                                           ((3, 4, 5), 2, 1), ((3, 4, 5), 1, 2),
                                           ((3, 4, 5), -1, -1), ((2, 3, 4), 0, 0)])
def test_layer_norm_values_and_gradients_equal_numpy(shape, bna, bpa):
    """Every output against numpy; the gradients of a weighted sum of all three outputs
    (so the statistics' gradients too) to x, gamma and beta against finite differences."""
    nd = len(shape)
    pshape = shape[bpa % nd:]
    prim = ops.LayerNorm(bna, bpa, 1e-5)

    def ref(x, g, b):
        return tuple(o.astype(x.dtype) for o in
                     np_layer_norm(x, g, b, bna % nd, bpa % nd, 1e-5))

    check_op(prim, ref, [shape, pshape, pshape], rtol=1e-5, atol=1e-6, grad_rtol=1e-5,
             grad_atol=1e-6, expect_ops=["LayerNorm"])


def test_layer_norm_dtypes_and_errors():
    x = _rand(4, 6)
    g, b = np.ones(6, np.float16), np.zeros(6, np.float16)
    y, m, v = ops.LayerNorm()(Tensor(x.astype(np.float16)), Tensor(g), Tensor(b))
    assert y.dtype == m.dtype == v.dtype == dm.float16
    np.testing.assert_allclose(y.asnumpy(), np_layer_norm(x, 1, 0, 1, 1)[0], rtol=3e-3,
                               atol=3e-3)
    prim = ops.LayerNorm()
    with pytest.raises(ValueError, match=r"LayerNorm: gamma has shape \(5,\); expected \(6,\), "
                                         r"the dims of input_x \(4, 6\) from "
                                         r"begin_params_axis=1"):
        prim(Tensor(x), Tensor(np.ones(5, np.float32)), Tensor(np.zeros(6, np.float32)))
    with pytest.raises(TypeError, match=r"LayerNorm: input 0 has dtype float32 but input 1 "
                                        r"has dtype float16"):
        prim(Tensor(x), Tensor(g), Tensor(b))
    with pytest.raises(ValueError, match=r"LayerNorm: begin_norm_axis=2 is out of range for "
                                         r"an input of rank 2"):
        ops.LayerNorm(2)(Tensor(x), Tensor(np.ones(6, np.float32)),
                         Tensor(np.zeros(6, np.float32)))
    with pytest.raises(TypeError, match=r"LayerNorm: begin_norm_axis must be an int, got 1.0"):
        ops.LayerNorm(1.0)
    with pytest.raises(TypeError, match=r"LayerNorm: input 0 has dtype int32"):
        prim(Tensor(x.astype(np.int32)), Tensor(np.ones(6, np.int32)),
             Tensor(np.zeros(6, np.int32)))


def test_functional_layer_norm_as_mindspore():
    x = np.array([[1, 2, 3], [1, 2, 3]], np.float32)
    out = ops.layer_norm(Tensor(x), (3,), Tensor(np.ones(3, np.float32)),
                         Tensor(np.zeros(3, np.float32)), 1e-7)
    np.testing.assert_allclose(out.asnumpy(), [[-1.2247448, 0.0, 1.2247448]] * 2, rtol=RTOL,
                               atol=1e-7)
    x = _rand(2, 3, 4)
    np.testing.assert_allclose(ops.layer_norm(Tensor(x), (3, 4)).asnumpy(),
                               np_layer_norm(x, 1, 0, 1, 1, 1e-5)[0], rtol=RTOL, atol=1e-6)
    with pytest.raises(ValueError, match=r"LayerNorm: normalized_shape=\(5,\) must be the "
                                         r"trailing dims of input of shape \(2, 3, 4\)"):
        ops.layer_norm(Tensor(x), (5,))


def test_nn_layer_norm_holds_the_primitive():
    ln = nn.LayerNorm((4, 6), begin_norm_axis=1, begin_params_axis=1, epsilon=1e-6)
    assert isinstance(ln.layer_norm, ops.LayerNorm)
    assert (ln.layer_norm.begin_norm_axis, ln.layer_norm.begin_params_axis,
            ln.layer_norm.epsilon) == (1, 1, 1e-6)
    assert [n for n, _ in ln.parameters_and_names()] == ["gamma", "beta"]
    x = _rand(3, 4, 6)
    np.testing.assert_allclose(ln(Tensor(x)).asnumpy(), np_layer_norm(x, 1, 0, 1, 1, 1e-6)[0],
                               rtol=RTOL, atol=1e-6)
    # float16 input, float32 parameters: computed in float16 as MindSpore's cell does
    y = ln(Tensor(x.astype(np.float16)))
    assert y.dtype == dm.float16


# ---------------------------------------------------------------------------
# LayerNorm sharded, every mode, against the stand-alone run
# ---------------------------------------------------------------------------
class _LNNet(nn.Cell):
    """x -> LayerNorm primitive (its strategy) -> a loss reaching y, mean and variance."""

    def __init__(self, shape, bna, bpa, strategy=None):
        super().__init__()
        rng = np.random.default_rng(3)
        pshape = shape[bpa:]
        self.ln = ops.LayerNorm(bna, bpa, 1e-5)
        if strategy is not None:
            self.ln.shard(strategy)
        self.gamma = Parameter(Tensor(rng.uniform(0.5, 1.5, pshape).astype(np.float32)),
                               name="gamma")
        self.beta = Parameter(Tensor(rng.uniform(-1, 1, pshape).astype(np.float32)),
                              name="beta")
        stats = shape[:bna] + (1,) * (len(shape) - bna)
        self.w = Tensor(rng.normal(size=shape).astype(np.float32))
        self.a = Tensor(rng.normal(size=stats).astype(np.float32))

    def construct(self, x):
        y, mean, var = self.ln(x, self.gamma, self.beta)
        return ops.reduce_mean(ops.mul(ops.square(y), self.w)) + \
            ops.reduce_sum(ops.mul(mean, self.a)) + ops.reduce_sum(ops.mul(var, self.a))


def _run_ln(n, mode, shape, bna, bpa, strategy=None, outer=None, steps=2):
    """Losses, dx and the parameters after `steps` SGD steps; `mode` one of eager,
    graph, ops.shard, Cell.shard."""
    x = _rand(*shape, seed=1)
    with devices(n, full_batch=True):
        if mode == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)
        net = _LNNet(shape, bna, bpa, strategy)
        f = net
        if n and mode == "ops.shard":
            f = ops.shard(lambda t: net(t), in_strategy=(outer,))
        elif n and mode == "Cell.shard":
            net.shard(in_strategy=(outer,))
        return sgd_steps(f, net, x, steps)


LN_CASES = {
    # shape, begin_norm_axis, begin_params_axis, strategy
    "rows8": ((16, 8), 1, 1, ((8, 1), (1,), (1,))),
    "rows4": ((16, 8), 1, 1, ((4, 1), (1,), (1,))),
    "3d-rows2x4": ((4, 8, 6), 2, 2, ((2, 4, 1), (1,), (1,))),
    "3d-batch8-norm2": ((8, 4, 6), 1, 1, ((8, 1, 1), (1, 1), (1, 1))),
    # gamma covers a row dim (begin_params_axis < begin_norm_axis): it follows x's split
    "gamma-split": ((4, 8, 6), 2, 1, ((2, 4, 1), (4, 1), (4, 1))),
}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("case", list(LN_CASES))
def test_layer_norm_strategy_equals_single_device(case, mode):
    shape, bna, bpa, strategy = LN_CASES[case]
    ref = _run_ln(None, "eager", shape, bna, bpa)
    got = _run_ln(8, mode, shape, bna, bpa, strategy)
    assert_same_steps(got, ref)
    # the rows split: each device normalises its own rows, the op communicates nothing
    fwd = [r for r in got[3].records if r.op == "LayerNorm" and r.reason == "forward"]
    assert not fwd, fwd


@pytest.mark.parametrize("mode", ["ops.shard", "Cell.shard"])
@pytest.mark.parametrize("outer", [(8, 1), (2, 4)], ids=["rows", "rows-and-cols"])
def test_layer_norm_compiled_blocks_equal_single_device(mode, outer):
    """No strategy on the op: the input arrives split (also on the normalised dim) and
    propagation / the rule place the op."""
    ref = _run_ln(None, "eager", (16, 8), 1, 1)
    assert_same_steps(_run_ln(8, mode, (16, 8), 1, 1, outer=outer), ref)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_nn_layer_norm_strategy_as_mindspore(mode):
    """MindSpore scripts write ``net.norm.layer_norm.shard(((8, 1, 1), (1, 1), (1, 1)))``."""
    class Net(nn.Cell):
        def __init__(self, strategy=None):
            super().__init__()
            self.dense = nn.Dense(6, 6)
            self.norm = nn.LayerNorm((4, 6), begin_norm_axis=1, begin_params_axis=1)
            if strategy is not None:
                self.norm.layer_norm.shard(strategy)

        def construct(self, x):
            return ops.reduce_sum(ops.square(self.norm(self.dense(x)) - 0.5))

    x = _rand(8, 4, 6, seed=4)

    def run(n, strategy):
        with devices(n, full_batch=True):
            if mode == "graph":
                dm.set_context(mode=dm.GRAPH_MODE)
            dm.set_seed(0)
            net = Net(strategy)
            opt = nn.SGD(net.trainable_params(), 0.05)
            g = dm.value_and_grad(net, None, opt.parameters)
            losses = []
            for _ in range(2):
                loss, grads = g(Tensor(x))
                opt(grads)
                losses.append(float(loss.asnumpy()))
            return losses, [p.asnumpy() for p in net.trainable_params()]

    ref = run(None, None)
    got = run(8, ((8, 1, 1), (1, 1), (1, 1)))
    np.testing.assert_allclose(got[0], ref[0], rtol=TRAIN_RTOL)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=TRAIN_RTOL, atol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_layer_norm_strategy_splitting_a_normalised_dim_is_refused(mode):
    """MindSpore refuses a LayerNorm strategy that splits a dim from begin_norm_axis on."""
    x = Tensor(_rand(16, 8))
    g, b = Tensor(np.ones(8, np.float32)), Tensor(np.zeros(8, np.float32))
    with devices(8, full_batch=True):
        if mode == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)

        class Head(nn.Cell):
            def __init__(self, prim):
                super().__init__()
                self.prim = prim

            def construct(self, t):
                return self.prim(t, g, b)[0]

        with pytest.raises(ValueError, match=r"LayerNorm: in_strategy\[0\]\[1\]=2 splits dim 1 "
                                             r"of input 0, a normalised dim "
                                             r"\(begin_norm_axis=1\); it must be 1 \(keep dim 1 "
                                             r"whole, e.g. in_strategy\[0\]=\(4, 1\)\)"):
            Head(ops.LayerNorm().shard(((4, 2), (2,), (2,))))(x)
        with pytest.raises(ValueError, match=r"LayerNorm: in_strategy\[0\]\[2\]=2 splits dim 2"):
            ops.LayerNorm(1, 2).shard(((1, 1, 2), (2,), (2,)))(
                Tensor(_rand(2, 4, 8)), g, b)
        with pytest.raises(ValueError, match=r"LayerNorm: in_strategy\[0\]\[1\]=4 and "
                                             r"in_strategy\[1\]\[0\]=1 split the dim 1 "
                                             r"differently"):
            ops.LayerNorm(2, 1).shard(((2, 4, 1), (1, 1), (1, 1)))(
                Tensor(_rand(4, 8, 6)), Tensor(np.ones((8, 6), np.float32)),
                Tensor(np.zeros((8, 6), np.float32)))
    # stand-alone ignores strategies, as MindSpore: the same call runs
    y = ops.LayerNorm().shard(((4, 2), (2,), (2,)))(x, g, b)[0]
    np.testing.assert_allclose(y.asnumpy(), np_layer_norm(x.asnumpy(), 1, 0, 1, 1)[0],
                               rtol=RTOL, atol=1e-6)


# ---------------------------------------------------------------------------
# L2Normalize
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape,axis", [((2, 3, 4), 0), ((4, 6), 1), ((4, 6), -1),
                                        ((2, 3, 4), (1, 2)), ((2, 3, 4), [0, -1])])
def test_l2_normalize_values_and_gradients_equal_numpy(shape, axis):
    prim = ops.L2Normalize(axis)
    ax = tuple(axis) if isinstance(axis, list) else axis
    check_op(prim, lambda x: np_l2_normalize(x, ax).astype(x.dtype), [shape],
             expect_ops=["L2Normalize"])


def test_l2_normalize_epsilon_floor_and_default_axis():
    """The sum of squares below epsilon: x / sqrt(epsilon), and the gradient is 1 /
    sqrt(epsilon) (the floor does not depend on x)."""
    x = np.array([[1e-3, 2e-3], [3.0, 4.0]], np.float32)
    got = ops.L2Normalize(axis=1, epsilon=1e-4)(Tensor(x))
    np.testing.assert_allclose(got.asnumpy(), [[0.1, 0.2], [0.6, 0.8]], rtol=RTOL)
    g = dm.grad(lambda t: ops.reduce_sum(ops.L2Normalize(1, 1e-4)(t)))(Tensor(x))
    y = x[1] / 5.0
    np.testing.assert_allclose(g.asnumpy()[0], [100.0, 100.0], rtol=RTOL)
    np.testing.assert_allclose(g.asnumpy()[1], (1 - y * y.sum()) / 5.0, rtol=RTOL, atol=1e-7)
    x = _rand(2, 3, 4)          # the default axis 0, as MindSpore's example
    np.testing.assert_allclose(ops.L2Normalize()(Tensor(x)).asnumpy(), np_l2_normalize(x, 0),
                               rtol=RTOL)
    np.testing.assert_allclose(ops.l2_normalize(Tensor(x), -1, 1e-4).asnumpy(),
                               np_l2_normalize(x, -1), rtol=RTOL)


def test_l2_normalize_errors():
    x = Tensor(_rand(2, 3))
    with pytest.raises(ValueError, match=r"L2Normalize: axis=2 is out of range for an input of "
                                         r"rank 2"):
        ops.L2Normalize(2)(x)
    with pytest.raises(TypeError, match=r"L2Normalize: axis must be an int or a tuple/list of "
                                        r"ints, got 1.5"):
        ops.L2Normalize(1.5)
    with pytest.raises(TypeError, match=r"L2Normalize: epsilon must be a float, got '1'"):
        ops.L2Normalize(0, "1")
    with pytest.raises(TypeError, match=r"L2Normalize: input 0 has dtype int32"):
        ops.L2Normalize()(Tensor(np.ones((2, 3), np.int32)))
    with pytest.raises(ValueError, match=r"L2Normalize: x is 0-d; expected rank >= 1"):
        ops.L2Normalize()(Tensor(np.float32(1.0)))


class _L2Net(nn.Cell):
    """Dense(8, 8) then L2Normalize (its strategy) then a weighted sum."""

    def __init__(self, axis, strategy=None):
        super().__init__()
        self.fc = nn.Dense(8, 8)
        self.l2 = ops.L2Normalize(axis)
        if strategy is not None:
            self.l2.shard(strategy)
        self.w = Tensor(np.random.default_rng(5).normal(size=(16, 8)).astype(np.float32))

    def construct(self, x):
        return ops.reduce_sum(ops.mul(self.l2(self.fc(x)), self.w))


def _run_l2(n, mode, axis, strategy=None, outer=None, steps=2):
    x = _rand(16, 8, seed=2)
    with devices(n, full_batch=True):
        if mode == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)
        dm.set_seed(0)
        net = _L2Net(axis, strategy)
        f = net
        if n and mode == "ops.shard":
            f = ops.shard(lambda t: net(t), in_strategy=(outer,))
        elif n and mode == "Cell.shard":
            net.shard(in_strategy=(outer,))
        return sgd_steps(f, net, x, steps)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("axis,strategy", [(1, ((8, 1),)), (-1, ((4, 1),)), (0, ((1, 8),)),
                                           (0, ((1, 2),))],
                         ids=["axis1-rows8", "axis-1-rows4", "axis0-cols8", "axis0-cols2"])
def test_l2_normalize_strategy_equals_single_device(axis, strategy, mode):
    ref = _run_l2(None, "eager", axis)
    got = _run_l2(8, mode, axis, strategy)
    assert_same_steps(got, ref)
    assert not [r for r in got[3].records if r.op == "L2Normalize" and r.reason == "forward"]


@pytest.mark.parametrize("mode", ["ops.shard", "Cell.shard"])
@pytest.mark.parametrize("axis", [0, 1])
def test_l2_normalize_compiled_blocks_equal_single_device(mode, axis):
    ref = _run_l2(None, "eager", axis)
    assert_same_steps(_run_l2(8, mode, axis, outer=(4, 2)), ref)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_l2_normalize_strategy_splitting_the_axis_is_refused(mode):
    x = Tensor(_rand(16, 8))
    with devices(8, full_batch=True):
        if mode == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)

        class Head(nn.Cell):
            def __init__(self, prim):
                super().__init__()
                self.prim = prim

            def construct(self, t):
                return self.prim(t)

        with pytest.raises(ValueError, match=r"L2Normalize: in_strategy\[0\]\[0\]=2 splits dim 0 "
                                             r"of input 0, a normalised dim \(axis=0\); it must "
                                             r"be 1 \(keep dim 0 whole, e.g. "
                                             r"in_strategy\[0\]=\(1, 4\)\)"):
            Head(ops.L2Normalize(0).shard(((2, 4),)))(x)
        with pytest.raises(ValueError, match=r"L2Normalize: in_strategy\[0\]\[1\]=8 splits dim 1"):
            Head(ops.L2Normalize((0, 1)).shard(((1, 8),)))(x)


def test_layout_strategies_are_checked_too():
    from dualmode.parallel.shard import Layout
    x = Tensor(_rand(16, 8))
    g, b = Tensor(np.ones(8, np.float32)), Tensor(np.zeros(8, np.float32))
    with devices(8, full_batch=True):
        lay = Layout((2, 4), ("dp", "mp"))
        with pytest.raises(ValueError, match=r"LayerNorm: in_strategy\[0\]\[1\]=4 splits dim 1 of "
                                             r"input 0, a normalised dim \(begin_norm_axis=1\); "
                                             r"it must be 1 \(keep dim 1 whole, 'None' for it in "
                                             r"the layout\)"):
            ops.LayerNorm().shard((lay("dp", "mp"), lay("mp"), lay("mp")))(x, g, b)
        y = ops.LayerNorm().shard((lay(("dp", "mp"), "None"), lay("None"), lay("None")))(
            x, g, b)[0]
        assert y._layout.tensor_map == ((0, 1), ())
        np.testing.assert_allclose(y.asnumpy(), np_layer_norm(x.asnumpy(), 1, 0, 1, 1)[0],
                                   rtol=RTOL, atol=1e-6)


# ---------------------------------------------------------------------------
# nn.BatchNorm1d / nn.BatchNorm2d on the BatchNorm op: bn_train / bn_infer
# ---------------------------------------------------------------------------
def np_bn_train(x, gamma, beta, eps=1e-5):
    axes = (0,) + tuple(range(2, x.ndim))
    b = (1, -1) + (1,) * (x.ndim - 2)
    x64 = x.astype(np.float64)
    m, v = x64.mean(axes), x64.var(axes)
    return (x64 - m.reshape(b)) / np.sqrt(v.reshape(b) + eps) * gamma.reshape(b) + \
        beta.reshape(b), m, v


@pytest.mark.parametrize("shape", [(16, 6), (8, 6, 5)], ids=["NC", "NCL"])
def test_batchnorm1d_equals_numpy(shape):
    """Training: batch statistics, moving ones updated (momentum 0.9 keeps 90% of the
    old, the variance unbiased); inference: the moving statistics."""
    x = _rand(*shape, seed=3)
    bn = nn.BatchNorm1d(6, momentum=0.8, gamma_init="normal", beta_init="normal")
    gamma, beta = bn.gamma.asnumpy(), bn.beta.asnumpy()
    bn.set_train()
    y = bn(Tensor(x))
    want, m, v = np_bn_train(x, gamma, beta)
    np.testing.assert_allclose(y.asnumpy(), want, rtol=1e-4, atol=1e-5)
    count = x.size // 6
    np.testing.assert_allclose(bn.moving_mean.asnumpy(), 0.2 * m, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(bn.moving_variance.asnumpy(),
                               0.8 + 0.2 * v * count / (count - 1), rtol=RTOL)
    bn.set_train(False)
    mm, mv = bn.moving_mean.asnumpy(), bn.moving_variance.asnumpy()
    b = (1, -1) + (1,) * (x.ndim - 2)
    np.testing.assert_allclose(bn(Tensor(x)).asnumpy(),
                               (x - mm.reshape(b)) / np.sqrt(mv.reshape(b) + 1e-5) *
                               gamma.reshape(b) + beta.reshape(b), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(bn.moving_mean.asnumpy(), mm)      # not updated


def test_batchnorm_cells_hold_mindspores_ops():
    for cls in (nn.BatchNorm1d, nn.BatchNorm2d):
        bn = cls(4, eps=1e-4, momentum=0.7)
        assert isinstance(bn.bn_train, ops.BatchNorm) and isinstance(bn.bn_infer, ops.BatchNorm)
        assert bn.bn_train.is_training and not bn.bn_infer.is_training
        assert bn.bn_train.epsilon == bn.bn_infer.epsilon == 1e-4
        assert bn.bn_train.momentum == pytest.approx(0.3)      # the batch's weight
        assert [n for n, _ in bn.parameters_and_names()] == [
            "gamma", "beta", "moving_mean", "moving_variance"]
    with pytest.raises(ValueError, match=r"BatchNorm1d: input has shape \(2, 4, 3, 3\); "
                                         r"expected \(N, 4\) or \(N, 4, L\)"):
        nn.BatchNorm1d(4)(Tensor(_rand(2, 4, 3, 3)))
    with pytest.raises(ValueError, match=r"BatchNorm2d: input has shape \(2, 4\); expected "
                                         r"\(N, 4, H, W\)"):
        nn.BatchNorm2d(4)(Tensor(_rand(2, 4)))
    with pytest.raises(ValueError, match=r"BatchNorm1d: input has shape \(2, 3\); expected "
                                         r"\(N, 4\) or \(N, 4, L\)"):
        nn.BatchNorm1d(4)(Tensor(_rand(2, 3)))


class _BNNet(nn.Cell):
    """Dense -> BatchNorm1d (its bn_train / bn_infer strategy) -> ReLU -> square mean,
    or Conv-free NCHW input -> BatchNorm2d."""

    def __init__(self, two_d, strategy=None, infer_strategy=None):
        super().__init__()
        self.two_d = two_d
        self.fc = nn.Dense(8, 8)
        self.bn = nn.BatchNorm2d(8) if two_d else nn.BatchNorm1d(8)
        if strategy is not None:
            self.bn.bn_train.shard(strategy)
        if infer_strategy is not None:
            self.bn.bn_infer.shard(infer_strategy)

    def construct(self, x):
        h = self.fc(x)
        if self.two_d:
            h = ops.reshape(h, (8, 2, 2, 8))
            h = ops.transpose(h, (0, 3, 1, 2))          # (8, 8 channels, 2, 2)
        return ops.reduce_mean(ops.square(ops.relu(self.bn(h)) - 0.3))


def _run_bn(n, mode, two_d, strategy=None, outer=None, infer_strategy=None, steps=2):
    x = _rand(32, 8, seed=6)
    with devices(n, full_batch=True):
        if mode == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)
        dm.set_seed(2)
        net = _BNNet(two_d, strategy, infer_strategy)
        net.set_train()
        f = net
        if n and mode == "ops.shard":
            f = ops.shard(lambda t: net(t), in_strategy=(outer,))
        elif n and mode == "Cell.shard":
            net.shard(in_strategy=(outer,))
        opt = nn.SGD(net.trainable_params(), 0.1)
        g = dm.value_and_grad(f, 0, opt.parameters)
        losses, dxs = [], []
        with CommReport() as rep:
            for _ in range(steps):
                loss, (dx, grads) = g(Tensor(x))
                opt(grads)
                losses.append(float(loss.asnumpy()))
                dxs.append(dx.asnumpy())
            net.set_train(False)                       # inference: bn_infer
            losses.append(float(f(Tensor(x)).asnumpy()))
        return losses, dxs, {p.name: p.asnumpy() for p in net.get_parameters()}, rep


BN_CASES = {
    # cell, bn_train strategy, forward AllReduces of the op per training step
    "1d-batch8": (False, ((8, 1), (1,), (1,), (1,), (1,)), 1),
    "1d-channels8": (False, ((1, 8), (8,), (8,), (8,), (8,)), 0),
    "1d-batch2-channels4": (False, ((2, 4), (4,), (4,), (4,), (4,)), 1),
    "2d-batch8": (True, ((8, 1, 1, 1), (1,), (1,), (1,), (1,)), 1),
    "2d-channels2-HW": (True, ((1, 2, 2, 2), (2,), (2,), (2,), (2,)), 1),
    "2d-channels8": (True, ((1, 8, 1, 1), (8,), (8,), (8,), (8,)), 0),
}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("case", list(BN_CASES))
def test_batchnorm_cell_strategy_as_mindspore(case, mode):
    """``net.bn.bn_train.shard(...)``: trained weights, moving statistics, losses (the
    last one in inference) and dx equal the stand-alone run; the strategy takes effect
    (the batch split: one AllReduce of the statistics per step inside the op; the
    channels split: none)."""
    two_d, strategy, n_ar = BN_CASES[case]
    ref = _run_bn(None, "eager", two_d)
    got = _run_bn(8, mode, two_d, strategy)
    assert_same_steps(got, ref)
    fwd = [r for r in got[3].records if r.op == "BatchNorm" and r.kind == "AllReduce"]
    assert len(fwd) == 2 * n_ar and all(r.reason == "forward" for r in fwd)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_batchnorm_infer_strategy(mode):
    """bn_infer's strategy applies in inference (the parameters placed as bn_train
    placed them: both split the channels in 2)."""
    two_d = False
    ref = _run_bn(None, "eager", two_d)
    got = _run_bn(8, mode, two_d, ((4, 2), (2,), (2,), (2,), (2,)),
                  infer_strategy=((1, 2), (2,), (2,), (2,), (2,)))
    assert_same_steps(got, ref)


@pytest.mark.parametrize("mode", ["ops.shard", "Cell.shard", "data_parallel"])
@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
def test_batchnorm_cells_compiled_and_data_parallel(mode, two_d):
    """No strategy on the op: a compiled block whose input arrives split on the batch,
    and data parallel (each device 4 of the 32 rows): global-batch statistics, as one
    device."""
    ref = _run_bn(None, "eager", two_d)
    if mode == "data_parallel":
        x = _rand(32, 8, seed=6)
        with devices(8, "data_parallel", gradients_mean=True):
            dm.set_seed(2)
            net = _BNNet(two_d)
            net.set_train()
            opt = nn.SGD(net.trainable_params(), 0.1)
            g = dm.value_and_grad(net, None, opt.parameters)
            losses = []
            with CommReport() as rep:
                for _ in range(2):
                    loss, grads = g(Tensor(x))
                    opt(grads)
                    losses.append(float(loss.asnumpy()))
                net.set_train(False)
                losses.append(float(net(Tensor(x)).asnumpy()))
            params = {p.name: p.asnumpy() for p in net.get_parameters()}
        np.testing.assert_allclose(losses, ref[0], rtol=TRAIN_RTOL)
        for name, want in ref[2].items():
            np.testing.assert_allclose(params[name], want, rtol=TRAIN_RTOL, atol=1e-6,
                                       err_msg=name)
        fwd = [r for r in rep.records if r.op == "BatchNorm" and r.kind == "AllReduce"]
        assert len(fwd) == 2 and all(r.reason == "forward" for r in fwd)
        return
    assert_same_steps(_run_bn(8, mode, two_d, outer=(8, 1)), ref)
