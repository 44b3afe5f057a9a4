"""Conv2D, MaxPool, AvgPool and BatchNorm against direct numpy references written here
(loops over output pixels: slow and obvious), forward and gradients (finite differences
in float64 through tests/_opcheck.py), every pad mode, stride 2, dilation and groups;
bad attributes and shapes raise named errors."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, ops
from dualmode._core import _conv as _K
from dualmode.ops import _conv

from _opcheck import check_op


# ---------------------------------------------------------------------------
# direct references
# ---------------------------------------------------------------------------
def ref_pads(mode, pad, hw, k, s, d):
    if mode == "valid":
        return (0, 0, 0, 0)
    if mode == "pad":
        return (pad,) * 4 if isinstance(pad, int) else tuple(pad)
    out = []
    for size, kk, ss, dd in zip(hw, k, s, d):
        n = -(-size // ss)
        tot = max((n - 1) * ss + (kk - 1) * dd + 1 - size, 0)
        out += [tot // 2, tot - tot // 2]
    return tuple(out)


def ref_conv(x, w, mode="valid", pad=0, stride=1, dilation=1, group=1):
    s = (stride, stride) if isinstance(stride, int) else stride
    d = (dilation, dilation) if isinstance(dilation, int) else dilation
    n, c, h, wd = x.shape
    co, cg, kh, kw = w.shape
    t, b, l, r = ref_pads(mode, pad, (h, wd), (kh, kw), s, d)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (t, b), (l, r)))
    ho = (h + t + b - (kh - 1) * d[0] - 1) // s[0] + 1
    wo = (wd + l + r - (kw - 1) * d[1] - 1) // s[1] + 1
    out = np.zeros((n, co, ho, wo))
    cog = co // group
    for o in range(co):
        g = o // cog
        for i in range(ho):
            for j in range(wo):
                patch = xp[:, g * cg:(g + 1) * cg,
                           i * s[0]:i * s[0] + (kh - 1) * d[0] + 1:d[0],
                           j * s[1]:j * s[1] + (kw - 1) * d[1] + 1:d[1]]
                out[:, o, i, j] = (patch * w[o]).sum(axis=(1, 2, 3))
    return out.astype(x.dtype)


def ref_pool(x, mode, k, s, pad_mode):
    n, c, h, w = x.shape
    t, b, l, r = ref_pads(pad_mode, 0, (h, w), (k, k), (s, s), (1, 1))
    ho = (h + t + b - k) // s + 1
    wo = (w + l + r - k) // s + 1
    out = np.zeros((n, c, ho, wo), x.dtype)
    for i in range(ho):
        for j in range(wo):
            r0, c0 = max(i * s - t, 0), max(j * s - l, 0)
            r1, c1 = min(i * s - t + k, h), min(j * s - l + k, w)
            win = x[:, :, r0:r1, c0:c1]
            out[:, :, i, j] = win.max(axis=(2, 3)) if mode == "max" else \
                win.mean(axis=(2, 3))
    return out


def ref_bn(x, gamma, beta, eps):
    mean = x.mean(axis=(0, 2, 3), dtype=np.float64)
    var = x.astype(np.float64).var(axis=(0, 2, 3))
    y = (x - mean[None, :, None, None]) / np.sqrt(var[None, :, None, None] + eps)
    return (y * gamma[None, :, None, None] + beta[None, :, None, None]).astype(x.dtype)


# ---------------------------------------------------------------------------
# Conv2D
# ---------------------------------------------------------------------------
CONV_CASES = [
    dict(mode="valid"),
    dict(mode="same"),
    dict(mode="same", stride=2),
    dict(mode="pad", pad=1),
    dict(mode="pad", pad=(1, 0, 2, 1), stride=2),
    dict(mode="valid", stride=2, dilation=2),
    dict(mode="same", group=2),
    dict(mode="same", stride=2, group=4),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in
                                                                     c.items()))
def test_conv2d_matches_direct_reference_and_gradients(case):
    group = case.get("group", 1)
    x = (2, 4, 7, 6)
    w = (4, 4 // group, 3, 3)
    kw = dict(pad_mode=case["mode"], pad=case.get("pad", 0), stride=case.get("stride", 1),
              dilation=case.get("dilation", 1), group=group)
    check_op(lambda a, b: ops.conv2d(a, b, **kw),
             lambda a, b: ref_conv(a, b, case["mode"], case.get("pad", 0),
                                   case.get("stride", 1), case.get("dilation", 1), group),
             [x, w], rtol=1e-5, atol=1e-5, grad_rtol=1e-5, grad_atol=1e-6,
             expect_ops=["Conv2D"])


def test_conv2d_primitive_and_second_order_ops():
    # the backward ops are differentiable too (their own gradients are checked)
    prim = ops.Conv2D(5, (3, 2), pad_mode="same", stride=(2, 1))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 6, 5)).astype(np.float32)
    w = rng.normal(size=(5, 3, 3, 2)).astype(np.float32)
    np.testing.assert_allclose(prim(Tensor(x), Tensor(w)).asnumpy(),
                               ref_conv(x, w, "same", 0, (2, 1)), rtol=1e-5, atol=1e-5)
    at = {"out_channel": 4, "kernel_size": (3, 3), "stride": (2, 2), "dilation": (1, 1),
          "group": 1, "pads": (1, 1, 1, 1), "in_hw": (7, 6)}
    check_op(lambda dy, w: _conv.apply(_conv.CONV2D_INPUT_GRAD, at, (dy, w)),
             lambda dy, w: _conv.conv_input_grad_stack(dy[None], w[None], (7, 6), (2, 2),
                                                       (1, 1), (1, 1, 1, 1), 1)[0],
             [(2, 4, 4, 3), (4, 3, 3, 3)], grad_rtol=1e-5, grad_atol=1e-6)
    at2 = {k: v for k, v in at.items() if k != "in_hw"}
    check_op(lambda dy, x: _conv.apply(_conv.CONV2D_FILTER_GRAD, at2, (dy, x)),
             lambda dy, x: _conv.conv_filter_grad_stack(dy[None], x[None], (3, 3), (2, 2),
                                                        (1, 1), (1, 1, 1, 1), 1)[0],
             [(2, 4, 4, 3), (2, 3, 7, 6)], grad_rtol=1e-5, grad_atol=1e-6)


def test_conv2d_float16_runs_in_float16():
    x = np.random.default_rng(1).normal(size=(2, 3, 5, 5)).astype(np.float16)
    w = np.random.default_rng(2).normal(size=(4, 3, 3, 3)).astype(np.float16)
    y = ops.conv2d(Tensor(x), Tensor(w), "same")
    assert y.dtype == dm.float16
    np.testing.assert_allclose(y.asnumpy(), ref_conv(x.astype(np.float32),
                                                     w.astype(np.float32), "same"),
                               rtol=2e-2, atol=2e-2)   # float16 products: 11-bit mantissa


@pytest.mark.parametrize("make, match", [
    (lambda: ops.Conv2D(0, 3), r"Conv2D: out_channel=0 is not valid; expected an int >= 1"),
    (lambda: ops.Conv2D(4, 3, pad_mode="full"),
     r"Conv2D: pad_mode='full' is not valid; expected one of 'valid', 'same', 'pad'"),
    (lambda: ops.Conv2D(4, 3, pad=1), r"Conv2D: pad=\(1, 1, 1, 1\) needs pad_mode='pad'"),
    (lambda: ops.Conv2D(4, 3, stride=0), r"Conv2D: stride=0 is not valid"),
    (lambda: ops.Conv2D(4, (3, 3, 3)), r"Conv2D: kernel_size=\(3, 3, 3\) is not valid"),
    (lambda: ops.Conv2D(4, 3, group=0), r"Conv2D: group=0 is not valid"),
    (lambda: ops.Conv2D(4, 3, data_format="NHWC"), r"Conv2D: .*'NHWC' are not supported"),
    (lambda: ops.MaxPool(2, 2, "pad"), r"MaxPool: pad_mode='pad' is not valid; expected "
                                       r"one of 'valid', 'same'"),
    (lambda: ops.BatchNorm(momentum=2.0), r"BatchNorm: momentum=2.0 must be a float"),
])
def test_bad_attributes_are_named(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


@pytest.mark.parametrize("x, w, prim, match", [
    ((2, 3, 5, 5), (4, 2, 3, 3), ops.Conv2D(4, 3),
     r"Conv2D: x has 3 input channels but the weight \(4, 2, 3, 3\) with group=1 expects 2"),
    ((2, 3, 5), (4, 3, 3, 3), ops.Conv2D(4, 3), r"Conv2D: x \(input 0\) has shape \(2, 3, 5\)"),
    ((2, 3, 5, 5), (4, 3, 3, 3), ops.Conv2D(8, 3),
     r"Conv2D: weight shape \(4, 3, 3, 3\) does not match out_channel=8"),
    ((2, 3, 2, 2), (4, 3, 3, 3), ops.Conv2D(4, 3),
     r"Conv2D: the input's spatial size \(2, 2\) .* is smaller than the kernel"),
    ((2, 4, 5, 5), (3, 2, 3, 3), ops.Conv2D(3, 3, group=2),
     r"Conv2D: out_channel=3 is not divisible by group=2"),
])
def test_bad_shapes_are_named(x, w, prim, match):
    with pytest.raises(ValueError, match=match):
        prim(Tensor(np.zeros(x, np.float32)), Tensor(np.zeros(w, np.float32)))


# ---------------------------------------------------------------------------
# channels-last kernels (dualmode/_core/_conv.pyx) against their numpy references
# ---------------------------------------------------------------------------
GEOMETRIES = [   # (C, H, W, kernel, stride, dilation, pads, group)
    (3, 7, 6, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1),
    (4, 7, 6, (3, 2), (2, 1), (1, 1), (1, 0, 2, 1), 1),
    (4, 9, 8, (3, 3), (2, 2), (2, 2), (0, 0, 0, 0), 1),
    (6, 6, 7, (3, 3), (1, 2), (1, 2), (1, 1, 0, 2), 2),
    (8, 5, 5, (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 4),
]


def _geometry_out(h, w, kernel, stride, dilation, pads):
    return (_conv.conv_out_size(h, kernel[0], stride[0], dilation[0], pads[0], pads[1]),
            _conv.conv_out_size(w, kernel[1], stride[1], dilation[1], pads[2], pads[3]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geom", GEOMETRIES, ids=str)
def test_conv_kernels_match_numpy_references(dtype, geom):
    c, h, w, kernel, stride, dilation, pads, group = geom
    rng = np.random.default_rng(7)
    x = rng.normal(size=(3, c, h, w)).astype(dtype)
    xh = _K.to_channels_last(x, pads)
    np.testing.assert_array_equal(xh, _conv.to_channels_last_numpy(x, pads))
    assert xh.dtype == dtype and xh.flags.c_contiguous
    np.testing.assert_array_equal(_K.to_channels_first(xh, (pads[0], pads[2]), (h, w)), x)
    np.testing.assert_array_equal(_K.to_channels_first(xh, (1, 0)),
                                  _conv.to_channels_first_numpy(xh, (1, 0)))
    out_hw = _geometry_out(h, w, kernel, stride, dilation, pads)
    cols = _K.im2col(xh, kernel, stride, dilation, out_hw, group)
    np.testing.assert_array_equal(cols, _conv.im2col_numpy(xh, kernel, stride, dilation,
                                                           out_hw, group))
    # integer values: the sums are exact whatever order the kernel adds in
    dcols = rng.integers(-8, 8, size=cols.shape).astype(dtype)
    grid = xh.shape[1:3]
    got = _K.col2im(dcols, 3, grid, kernel, stride, dilation, out_hw, group)
    np.testing.assert_array_equal(got, _conv.col2im_numpy(dcols, 3, grid, kernel, stride,
                                                          dilation, out_hw, group))
    # col2im is im2col's adjoint: <im2col(x), d> == <x, col2im(d)>
    np.testing.assert_allclose((cols.astype(np.float64) * dcols).sum(),
                               (xh.astype(np.float64) * got).sum(), rtol=1e-5)


def test_conv_kernels_take_strided_inputs_and_float16_takes_the_references():
    x = np.random.default_rng(8).normal(size=(2, 3, 5, 4, 2))[..., 0]     # not contiguous
    np.testing.assert_array_equal(_K.to_channels_last(x, (1, 2, 0, 1)),
                                  _conv.to_channels_last_numpy(x, (1, 2, 0, 1)))
    xh = _conv._channels_last(x.astype(np.float16), (1, 1, 1, 1))
    assert xh.dtype == np.float16
    np.testing.assert_array_equal(xh, _K.to_channels_last(x, (1, 1, 1, 1)).astype(np.float16))


POOL_GEOMETRIES = [   # (H, W, kernel, stride, pads)
    (7, 6, (3, 3), (2, 2), (1, 1, 1, 1)),
    (7, 6, (3, 3), (1, 1), (1, 1, 1, 1)),
    (8, 8, (2, 2), (2, 2), (0, 0, 0, 0)),
    (7, 5, (3, 2), (2, 1), (1, 0, 0, 1)),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geom", POOL_GEOMETRIES, ids=str)
def test_max_pool_kernels_match_numpy_references(dtype, geom):
    h, w, kernel, stride, pads = geom
    rng = np.random.default_rng(9)
    # small integers: many ties, where the first maximum of each window must win
    x = rng.integers(-3, 3, size=(2, 3, h, w)).astype(dtype)
    x[0, 0, 0, :2] = -np.inf         # -inf pixels beside -inf padding
    x[1, 2, 3, 1] = np.nan           # NaN propagates and takes the gradient
    y = _K.max_pool(x.reshape(-1, h, w), kernel, stride, pads)
    want = _conv.max_pool_numpy(x, kernel, stride, pads)
    np.testing.assert_array_equal(y.reshape(want.shape), want)
    dy = rng.integers(-4, 4, size=want.shape).astype(dtype)
    got = _K.max_pool_grad(x.reshape(-1, h, w), dy.reshape(-1, *want.shape[2:]), kernel,
                           stride, pads)
    np.testing.assert_array_equal(got.reshape(x.shape),
                                  _conv.max_pool_grad_numpy(x, dy, kernel, stride, pads))
    # windows of dy past the padded grid meet more padding
    big = rng.integers(-4, 4, size=(6,) + tuple(n + 1 for n in want.shape[2:])).astype(dtype)
    np.testing.assert_array_equal(
        _K.max_pool_grad(x.reshape(-1, h, w), big, kernel, stride, pads).reshape(x.shape),
        _conv.max_pool_grad_numpy(x, big.reshape(x.shape[:2] + big.shape[1:]), kernel,
                                  stride, pads))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(2, 3, 4, 25), (1, 5, 1, 1), (3, 2, 2, 0)], ids=str)
def test_channel_kernels_match_numpy_references(dtype, shape):
    rng = np.random.default_rng(10)
    x = rng.normal(3.0, 2.0, size=shape).astype(dtype)
    np.testing.assert_allclose(_K.channel_sums(x), _conv.channel_sums_numpy(x),
                               rtol=1e-13, atol=1e-13)
    assert _K.channel_sums(x).dtype == np.float64
    shift = rng.normal(size=(shape[0], shape[2])).astype(dtype)
    scale = rng.normal(size=(shape[0], shape[2])).astype(dtype)
    got = _K.channel_affine(x, shift, scale)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, _conv.channel_affine_numpy(x, shift, scale))


@pytest.mark.parametrize("call, err, match", [
    (lambda: _K.to_channels_last(np.zeros((1, 2, 3, 3), np.float16)), TypeError,
     r"conv to_channels_last: x has dtype float16; expected float32 or float64"),
    (lambda: _K.to_channels_last(np.zeros((2, 3, 3), np.float32)), ValueError,
     r"conv to_channels_last: x has shape \(2, 3, 3\); expected 4 dims"),
    (lambda: _K.to_channels_last(np.zeros((1, 2, 3, 3), np.float32), (1, -1, 0, 0)),
     ValueError, r"conv to_channels_last: pads=\(1, -1, 0, 0\) is not valid"),
    (lambda: _K.im2col(np.zeros((1, 4, 4, 2), np.float32), (3, 3), (1, 1), (1, 1), (3, 2)),
     ValueError, r"conv im2col: 3 windows of kernel 3 \(stride 1, dilation 1\) reach 5 "
                 r"pixels along spatial dim 0; the grid has 4"),
    (lambda: _K.im2col(np.zeros((1, 4, 4, 3), np.float32), (3, 3), (1, 1), (1, 1), (2, 2),
                       2),
     ValueError, r"conv im2col: group=2 does not divide the 3 channels"),
    (lambda: _K.col2im(np.zeros((5, 18), np.float32), 1, (4, 4), (3, 3), (1, 1), (1, 1),
                       (2, 2)),
     ValueError, r"conv col2im: cols has shape \(5, 18\); expected \(4, a multiple of 9\)"),
    (lambda: _K.to_channels_first(np.zeros((1, 4, 4, 2), np.float32), (2, 0), (3, 4)),
     ValueError, r"conv to_channels_first: the block of hw=\(3, 4\) at origin=\(2, 0\) "
                 r"does not fit the grid \(4, 4\)"),
    (lambda: _K.im2col([[1.0]], (1, 1), (1, 1), (1, 1), (1, 1)), TypeError,
     r"conv im2col: xh is a list; expected a numpy array"),
    (lambda: _K.channel_affine(np.zeros((1, 2, 3, 4), np.float32), np.zeros((1, 3),
                                                                           np.float32),
                               np.zeros((1, 3), np.float64)),
     ValueError, r"conv channel_affine: shift \(1, 3\) float32 and scale \(1, 3\) float64 "
                 r"must both be \(1, 3\) float32 for x \(1, 2, 3, 4\)"),
    (lambda: _K.max_pool(np.zeros((1, 2, 2), np.float32), (3, 3), (1, 1)), ValueError,
     r"conv max_pool: the grid \(2, 2\) with pads \(0, 0, 0, 0\) is smaller than the "
     r"kernel \(3, 3\)"),
    (lambda: _K.max_pool_grad(np.zeros((1, 4, 4), np.float32), np.zeros((1, 2, 2)),
                              (2, 2), (2, 2)),
     ValueError, r"conv max_pool_grad: dy has shape \(1, 2, 2\) and dtype float64; "
                 r"expected batch 1 and float32 \(x's\)"),
])
def test_conv_kernels_refuse_bad_input_by_name(call, err, match):
    with pytest.raises(err, match=match):
        call()


# ---------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("k, s, pad_mode", [(2, 2, "valid"), (3, 2, "same"), (3, 1, "same"),
                                            (3, 2, "valid")])
def test_pool_matches_direct_reference_and_gradients(mode, k, s, pad_mode):
    fn = ops.max_pool if mode == "max" else ops.avg_pool
    # distinct values: a max tie would make the finite difference ill-defined
    x = np.random.default_rng(3).permutation(2 * 3 * 7 * 6).reshape(2, 3, 7, 6)
    x = (x / 50.0).astype(np.float32)
    check_op(lambda a: fn(a, k, s, pad_mode), lambda a: ref_pool(a, mode, k, s, pad_mode),
             [x], grad_rtol=1e-5, grad_atol=1e-7,
             expect_ops=["MaxPool" if mode == "max" else "AvgPool"])


def test_pool_grads_are_differentiable():
    x = np.random.default_rng(4).permutation(2 * 2 * 6 * 6).reshape(2, 2, 6, 6)
    x = (x / 30.0).astype(np.float64)

    def second(a):
        g = dm.grad(lambda t: ops.reduce_sum(ops.mul(ops.max_pool(t, 3, 2, "same"),
                                                      ops.max_pool(t, 3, 2, "same"))))(a)
        return g
    # d/dx of sum(pool(x)^2) = 2 * pool(x) scattered to the argmaxes
    got = second(Tensor(x)).asnumpy()
    y = ref_pool(x, "max", 3, 2, "same")
    assert got.sum() == pytest.approx(2 * y.sum())


# ---------------------------------------------------------------------------
# BatchNorm
# ---------------------------------------------------------------------------
def test_batch_norm_training_matches_reference_and_gradients():
    gamma = np.linspace(0.5, 1.5, 3).astype(np.float32)
    beta = np.linspace(-1, 1, 3).astype(np.float32)
    check_op(lambda x, g, b: ops.BatchNorm(True, 1e-5)(x, g, b, Parameter(Tensor(np.zeros(3, np.float32)), name="m", requires_grad=False),
                                                       Parameter(Tensor(np.ones(3, np.float32)), name="v", requires_grad=False))[0],
             lambda x, g, b: ref_bn(x, g, b, 1e-5), [(4, 3, 5, 4), gamma, beta],
             rtol=1e-4, atol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)


def test_batch_norm_running_statistics_and_inference():
    rng = np.random.default_rng(5)
    x = rng.normal(2.0, 3.0, size=(4, 3, 5, 4)).astype(np.float32)
    mean = Parameter(Tensor(np.zeros(3, np.float32)), name="mean", requires_grad=False)
    var = Parameter(Tensor(np.ones(3, np.float32)), name="var", requires_grad=False)
    g, b = Tensor(np.ones(3, np.float32)), Tensor(np.zeros(3, np.float32))
    y, bm, bv, _, _ = ops.BatchNorm(True, 1e-5, 0.1)(Tensor(x), g, b, mean, var)
    np.testing.assert_allclose(bm.asnumpy(), x.mean(axis=(0, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(bv.asnumpy(), x.var(axis=(0, 2, 3)), rtol=1e-4)
    n = 4 * 5 * 4
    np.testing.assert_allclose(mean.asnumpy(), 0.1 * x.mean(axis=(0, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(var.asnumpy(), 0.9 + 0.1 * x.var(axis=(0, 2, 3)) * n / (n - 1),
                               rtol=1e-5)
    y2 = ops.BatchNorm(False, 1e-5)(Tensor(x), g, b, mean, var)[0]
    want = (x - mean.asnumpy()[None, :, None, None]) / np.sqrt(
        var.asnumpy()[None, :, None, None] + 1e-5)
    np.testing.assert_allclose(y2.asnumpy(), want, rtol=1e-5, atol=1e-5)


def test_batch_norm_bad_parameter_shape_is_named():
    x = Tensor(np.zeros((2, 3, 4, 4), np.float32))
    p = Parameter(Tensor(np.zeros(4, np.float32)), name="m", requires_grad=False)
    q = Parameter(Tensor(np.zeros(3, np.float32)), name="v", requires_grad=False)
    with pytest.raises(ValueError, match=r"BatchNorm: running_mean has shape \(4,\); "
                                         r"expected \(3,\)"):
        ops.batch_norm(x, p, q, q, q, training=True)
    np.testing.assert_array_equal(q.asnumpy(), 0)     # nothing changed
