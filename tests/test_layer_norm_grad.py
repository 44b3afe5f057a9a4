"""LayerNorm's fused backward, the ``LayerNormGrad`` op (x, dy, variance, mean, gamma ->
dx, dgamma, dbeta), and the Cython kernels of LayerNorm's forward and backward.

The kernels against their numpy references (float32 and float64, odd row lengths,
strided and broadcast inputs); the op against finite differences and a float64
formula; sharded runs (rows split, a pending-sum gradient from a column-parallel
product, rows that do not divide) against the stand-alone run in every mode; the op
taken exactly when only LayerNorm's first output is used (its statistics' gradients
take the ops written backward); bad inputs refused by name."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode._core import _kernels as K
from dualmode._core import _tensor as core
from dualmode._core import reference as R
from dualmode.ops import _norm as N

from _devices import devices
from _steps import assert_same_steps, sgd_steps


def _rand(shape, seed, dtype=np.float32, lo=-2.0, hi=2.0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(dtype)


# ---------------------------------------------------------------------------
# the kernels against their references
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 3, 1), (2, 5, 3), (3, 4, 8), (2, 7, 513)])
def test_layer_norm_kernel_equals_reference(shape, dtype):
    x = _rand(shape, 0, dtype) * 3 + 5              # a mean far from 0
    g, b = _rand(shape[::2], 1, dtype), _rand(shape[::2], 2, dtype)
    got = K.layer_norm(x, g, b, 1e-5)
    want = R.layer_norm(x, g, b, 1e-5)
    rtol = 1e-6 if dtype == np.float32 else 1e-12
    for name, a, w in zip(("y", "mean", "variance"), got, want):
        assert a.dtype == dtype and a.shape == w.shape, name
        np.testing.assert_allclose(a, w, rtol=rtol, atol=rtol, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 3, 1), (2, 5, 3), (3, 4, 8), (2, 7, 513)])
def test_layer_norm_grad_kernel_equals_reference(shape, dtype):
    x = _rand(shape, 0, dtype) * 3 + 5
    dy, g = _rand(shape, 3, dtype), _rand(shape[::2], 1, dtype)
    _, mean, var = K.layer_norm(x, g, g, 1e-5)
    got = K.layer_norm_grad(x, dy, mean, var, g, 1e-5)
    want = R.layer_norm_grad(x, dy, mean, var, g, 1e-5)
    rtol = 2e-6 if dtype == np.float32 else 1e-11
    for name, a, w in zip(("dx", "dgamma", "dbeta"), got, want):
        assert a.dtype == dtype and a.shape == w.shape, name
        np.testing.assert_allclose(a, w, rtol=rtol, atol=rtol * np.abs(w).max(),
                                   err_msg=name)


def test_layer_norm_kernels_take_strided_and_broadcast_inputs():
    """A transposed stack and a gamma stored once for every device (stride 0) give the
    numbers of their contiguous copies, and the numpy reference's."""
    x = np.ascontiguousarray(_rand((5, 2, 6), 0).transpose(1, 0, 2))
    xt = _rand((5, 2, 6), 0).transpose(1, 0, 2)
    g = np.broadcast_to(_rand((6,), 1), (2, 6))
    b = np.broadcast_to(_rand((6,), 2), (2, 6))
    got = K.layer_norm(xt, g, b, 1e-5)
    for a, w in zip(got, K.layer_norm(x, g.copy(), b.copy(), 1e-5)):
        np.testing.assert_array_equal(a, w)
    for a, w in zip(got, R.layer_norm(x, g.copy(), b.copy(), 1e-5)):
        np.testing.assert_allclose(a, w, rtol=1e-6, atol=1e-6)
    dy = _rand((2, 5, 6), 3)
    _, mean, var = K.layer_norm(x, g.copy(), b.copy(), 1e-5)
    got = K.layer_norm_grad(xt, dy, mean, var, g, 1e-5)
    for a, w in zip(got, K.layer_norm_grad(x, dy, mean, var, g.copy(), 1e-5)):
        np.testing.assert_array_equal(a, w)
    for a, w in zip(got, R.layer_norm_grad(x, dy, mean, var, g.copy(), 1e-5)):
        np.testing.assert_allclose(a, w, rtol=2e-6, atol=2e-6 * np.abs(w).max())


def test_layer_norm_kernels_decline_what_they_do_not_handle():
    x = _rand((2, 3, 4), 0)
    g = _rand((2, 4), 1)
    assert K.layer_norm(x.astype(np.float16), g.astype(np.float16), g.astype(np.float16),
                        1e-5) is None
    assert K.layer_norm(x, g.astype(np.float64), g, 1e-5) is None        # mixed dtypes
    assert K.layer_norm(x, g[:, :3], g, 1e-5) is None                     # gamma too short
    assert K.layer_norm(x[0], g[0], g[0], 1e-5) is None                   # not a stack
    _, m, v = K.layer_norm(x, g, g, 1e-5)
    assert K.layer_norm_grad(x, x[:, :2], m, v, g, 1e-5) is None          # dy's shape
    assert K.layer_norm_grad(x, x, m[:, :2], v, g, 1e-5) is None          # mean's rows


def test_a_row_gives_the_same_numbers_whatever_rows_come_with_it():
    """What a device computes for a row does not depend on the other rows it holds: the
    sharded run's bits are the stand-alone run's."""
    x, dy = _rand((1, 8, 37), 0) * 4 + 3, _rand((1, 8, 37), 1)
    g, b = _rand((1, 37), 2), _rand((1, 37), 3)
    whole = K.layer_norm(x, g, b, 1e-5)
    halves = [K.layer_norm(x[:, i:i + 4], g, b, 1e-5) for i in (0, 4)]
    for k in range(3):
        np.testing.assert_array_equal(np.concatenate([h[k] for h in halves], axis=1),
                                      whole[k])
    dwhole = K.layer_norm_grad(x, dy, whole[1], whole[2], g, 1e-5)
    dhalves = [K.layer_norm_grad(x[:, i:i + 4], dy[:, i:i + 4], whole[1][:, i:i + 4],
                                 whole[2][:, i:i + 4], g, 1e-5) for i in (0, 4)]
    np.testing.assert_array_equal(np.concatenate([h[0] for h in dhalves], axis=1), dwhole[0])


# ---------------------------------------------------------------------------
# the op, one device
# ---------------------------------------------------------------------------
def _y_only_loss(bna, w):
    prim = ops.LayerNorm(bna, bna, 1e-5)

    def loss(x, g, b):
        return ops.reduce_sum(ops.mul(prim(x, g, b)[0], w))
    return loss


def _np_grads(x, g, b, w, bna):
    """d sum(w * LayerNorm(x)) / d (x, gamma, beta) in float64 by the textbook formula."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    axes = tuple(range(bna, x.ndim))
    mean = x64.mean(axes, keepdims=True)
    rstd = 1 / np.sqrt(x64.var(axes, keepdims=True) + 1e-5)
    xhat = (x64 - mean) * rstd
    d = w64 * g
    dx = rstd * (d - d.mean(axes, keepdims=True)
                 - xhat * (d * xhat).mean(axes, keepdims=True))
    lead = tuple(range(bna))
    return dx, (w64 * xhat).sum(lead), w64.sum(lead)


@pytest.mark.parametrize("shape,bna", [((4, 6), 1), ((3, 4, 5), 2), ((3, 4, 5), 1),
                                       ((2, 3, 4), 0), ((5, 1), 1)])
def test_layer_norm_grad_equals_the_formula(shape, bna, monkeypatch):
    calls = []
    real = N.layer_norm_grad_stack
    monkeypatch.setattr(N, "layer_norm_grad_stack",
                        lambda *a: calls.append(1) or real(*a))
    x = _rand(shape, 0) * 2 + 1
    g, b = _rand(shape[bna:], 1, lo=0.5, hi=1.5), _rand(shape[bna:], 2)
    w = _rand(shape, 3)
    grads = dm.grad(_y_only_loss(bna, Tensor(w)), (0, 1, 2))(Tensor(x), Tensor(g), Tensor(b))
    for name, got, want in zip(("dx", "dgamma", "dbeta"), grads, _np_grads(x, g, b, w, bna)):
        np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert calls, "the fused LayerNormGrad did not run"


def test_layer_norm_grad_equals_finite_differences():
    shape, bna = (3, 7), 1
    x = _rand(shape, 0).astype(np.float64)
    g, b, w = _rand((7,), 1, np.float64), _rand((7,), 2, np.float64), _rand(shape, 3,
                                                                           np.float64)
    loss = _y_only_loss(bna, Tensor(w))
    gx = dm.grad(loss, 0)(Tensor(x), Tensor(g), Tensor(b)).asnumpy()
    eps, num = 1e-6, np.zeros(shape)
    for i in np.ndindex(*shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        num[i] = (float(loss(Tensor(xp), Tensor(g), Tensor(b)).asnumpy())
                  - float(loss(Tensor(xm), Tensor(g), Tensor(b)).asnumpy())) / (2 * eps)
    np.testing.assert_allclose(gx, num, rtol=1e-6, atol=1e-8)


def test_statistics_gradients_and_other_param_axes_take_the_written_backward(monkeypatch):
    """Used statistics, or gamma not over the normalised dims: no LayerNormGrad."""
    calls = []
    monkeypatch.setattr(N, "layer_norm_grad_stack", lambda *a: calls.append(1))
    x = Tensor(_rand((3, 4, 5), 0))
    prim = ops.LayerNorm(1, 1, 1e-5)
    g, b = Tensor(_rand((4, 5), 1)), Tensor(_rand((4, 5), 2))

    def both(t):
        y, mean, _ = prim(t, g, b)
        return ops.reduce_sum(mean) + ops.reduce_sum(y)
    dm.grad(both)(x)
    other = ops.LayerNorm(2, 1, 1e-5)
    dm.grad(lambda t: ops.reduce_sum(other(t, g, b)[0]))(x)
    assert not calls


def test_layer_norm_grad_float16_and_float64():
    for dt in (np.float16, np.float64):
        x, w = _rand((4, 6), 0, dt), _rand((4, 6), 3, dt)
        g, b = _rand((6,), 1, dt, 0.5, 1.5), _rand((6,), 2, dt)
        grads = dm.grad(_y_only_loss(1, Tensor(w)), (0, 1, 2))(Tensor(x), Tensor(g),
                                                                Tensor(b))
        for got, want in zip(grads, _np_grads(x, g, b, w, 1)):
            assert got.dtype == dt
            tol = 5e-3 if dt == np.float16 else 1e-12
            np.testing.assert_allclose(got.asnumpy().astype(np.float64), want, rtol=tol,
                                       atol=tol)


def test_layer_norm_grad_bad_inputs_are_named():
    op = N.LAYER_NORM_GRAD
    at = {"begin_norm_axis": 1, "begin_params_axis": 1, "epsilon": 1e-5}
    x, s, g = _rand((2, 3), 0), _rand((2, 1), 1), _rand((3,), 2)
    with pytest.raises(ValueError, match=r"LayerNormGrad: dy has shape \(3, 2\); expected "
                                         r"\(2, 3\)"):
        core.apply(op, at, (Tensor(x), Tensor(x.T.copy()), Tensor(s), Tensor(s), Tensor(g)))
    with pytest.raises(ValueError, match=r"LayerNormGrad: gamma has shape \(2,\); expected "
                                         r"\(3,\)"):
        core.apply(op, at, (Tensor(x), Tensor(x), Tensor(s), Tensor(s), Tensor(g[:2])))
    with pytest.raises(ValueError, match=r"LayerNormGrad: begin_norm_axis=1 and "
                                         r"begin_params_axis=0 must be one axis"):
        core.apply(op, dict(at, begin_params_axis=0),
                   (Tensor(x), Tensor(x), Tensor(s), Tensor(s), Tensor(g)))
    with pytest.raises(TypeError, match=r"LayerNormGrad"):
        core.apply(op, at, (Tensor(x), Tensor(x.astype(np.float64)), Tensor(s), Tensor(s),
                            Tensor(g)))


# ---------------------------------------------------------------------------
# sharded, every mode, against the stand-alone run
# ---------------------------------------------------------------------------
class _Block(nn.Cell):
    """x -> LayerNorm (only y used) -> MatMul with `mm` (column-parallel when it splits
    the weight's columns: the gradient reaching y is then a pending sum)."""

    def __init__(self, hidden, ln=None, mm=None, eps=1e-5):
        super().__init__()
        rng = np.random.default_rng(5)
        self.ln = ops.LayerNorm(1, 1, eps)
        self.mm = ops.MatMul()
        if ln is not None:
            self.ln.shard(ln)
        if mm is not None:
            self.mm.shard(mm)
        self.gamma = Parameter(Tensor(rng.uniform(0.5, 1.5, (hidden,)).astype(np.float32)),
                               name="gamma")
        self.beta = Parameter(Tensor(rng.uniform(-1, 1, (hidden,)).astype(np.float32)),
                              name="beta")
        self.w = Parameter(Tensor(rng.normal(0, 0.3, (hidden, 8)).astype(np.float32)),
                           name="w")

    def construct(self, x):
        y = self.ln(x, self.gamma, self.beta)[0]
        return ops.reduce_mean(ops.square(self.mm(y, self.w)))


def _run(n, mode, rows, ln=None, mm=None, outer=None, hidden=6, eps=1e-5):
    x = _rand((rows, hidden), 1) * 2 + 0.5
    with devices(n, full_batch=True):
        if mode == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)
        net = _Block(hidden, ln, mm, eps)
        f = net
        if n and mode == "ops.shard":
            f = ops.shard(lambda t: net(t), in_strategy=(outer,))
        return sgd_steps(f, net, x, 2)


SHARDED = {
    # rows, LayerNorm's strategy, MatMul's strategy
    "rows8": (16, ((8, 1), (1,), (1,)), ((8, 1), (1, 1))),
    # the column-parallel product: y's gradient a pending sum over the 2 devices
    "rows4-column-parallel": (16, ((4, 1), (1,), (1,)), ((4, 1), (1, 2))),
    "column-parallel": (16, ((1, 1), (1,), (1,)), ((1, 1), (1, 8))),
    # 14 rows over 4 devices: pieces of 4 and 3
    "uneven-rows": (14, ((4, 1), (1,), (1,)), ((4, 1), (1, 2))),
}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("case", list(SHARDED))
def test_sharded_layer_norm_grad_equals_single_device(case, mode, monkeypatch):
    rows, ln, mm = SHARDED[case]
    ref = _run(None, "eager", rows)
    calls = []
    real = N.layer_norm_grad_stack
    monkeypatch.setattr(N, "layer_norm_grad_stack", lambda *a: calls.append(1) or real(*a))
    got = _run(8, mode, rows, ln, mm)
    assert_same_steps(got, ref)
    assert calls, "the fused LayerNormGrad did not run"


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_epsilon_zero_with_rows_that_do_not_divide(mode):
    """The zero rows padding the short pieces have nothing to normalise (their variance
    and epsilon 0): they pass no gradient (before, NaN reached dgamma and dbeta)."""
    ref = _run(None, "eager", 14, eps=0.0)
    got = _run(8, mode, 14, ((4, 1), (1,), (1,)), ((4, 1), (1, 2)), eps=0.0)
    assert_same_steps(got, ref)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_epsilon_zero_with_rows_that_do_not_divide_statistics_used(mode):
    """The same through the backward written with ops (the statistics' gradients used):
    each op's pads are zeroed after it, so the pads' NaN never reaches a sum."""
    def run(n, strategy=None):
        x = _rand((14, 6), 1) * 2 + 0.5
        with devices(n, full_batch=True):
            if mode == "graph" and n:
                dm.set_context(mode=dm.GRAPH_MODE)
            net = _Stats(strategy)
            return sgd_steps(net, net, x, 2)
    assert_same_steps(run(8, ((4, 1), (1,), (1,))), run(None))


class _Stats(nn.Cell):
    def __init__(self, strategy):
        super().__init__()
        rng = np.random.default_rng(6)
        self.ln = ops.LayerNorm(1, 1, 0.0)
        if strategy is not None:
            self.ln.shard(strategy)
        self.gamma = Parameter(Tensor(rng.uniform(0.5, 1.5, (6,)).astype(np.float32)),
                               name="gamma")
        self.beta = Parameter(Tensor(rng.uniform(-1, 1, (6,)).astype(np.float32)),
                              name="beta")

    def construct(self, x):
        y, mean, var = self.ln(x, self.gamma, self.beta)
        return ops.reduce_mean(ops.square(y)) + ops.reduce_mean(ops.mul(mean, var))


def test_layer_norm_grad_kernel_zero_row_with_epsilon_zero():
    x = np.zeros((1, 2, 4), np.float32)
    x[0, 1] = [1, 2, 3, 4]
    g = np.ones((1, 4), np.float32)
    dy = (x != 0).astype(np.float32)            # the zero row: a pad, no gradient
    _, mean, var = K.layer_norm(x, g, g, 0.0)
    dx, dg, db = K.layer_norm_grad(x, dy, mean, var, g, 0.0)
    assert np.isfinite(dx).all() and np.isfinite(dg).all()
    np.testing.assert_array_equal(dx[0, 0], 0)
    want = R.layer_norm_grad(x[:, 1:], dy[:, 1:], mean[:, 1:], var[:, 1:], g, 0.0)
    np.testing.assert_allclose(dg, want[1], rtol=1e-6)
    np.testing.assert_allclose(db, want[2], rtol=1e-6)


@pytest.mark.parametrize("outer", [(8, 1), (2, 4)], ids=["rows", "rows-and-cols"])
def test_layer_norm_grad_in_a_compiled_block_equals_single_device(outer):
    ref = _run(None, "eager", 16, hidden=8)
    assert_same_steps(_run(8, "ops.shard", 16, outer=outer, hidden=8), ref)


def test_data_parallel_layer_norm_grad_equals_single_device():
    x = _rand((16, 6), 1) * 2 + 0.5
    ref = _run(None, "eager", 16)
    with devices(8, "data_parallel", gradients_mean=True):
        net = _Block(6)
        got = sgd_steps(net, net, x, 2)
    assert_same_steps(got, ref)
