"""Image ops (NCHW): Conv2D and its two backward ops, MaxPool/AvgPool and their backward
ops, and BatchNorm (one op: per-channel sums, their folding into mean and variance, the
scale-and-shift; its backward written with ops).

Every kernel here is written over a *stack*: a leading device axis ``D`` in front of the
NCHW dims (one device: ``D = 1``), so the sharding rules in
:mod:`dualmode.parallel.rules.conv` run each op's local computation with the same
functions, in one numpy call over every device. Convolution is im2col + one GEMM per
stack in a channels-last layout: the images are copied once, zero-bordered, into (B, Hp,
Wp, C), whose windows are runs of whole channels; the Cython kernels of
:mod:`dualmode._core._conv` (GIL released) copy them into columns, add gradient columns
back (col2im) and bring results back to NCHW, with numpy references here for float16
and the tests. Max pooling and its gradient are Cython kernels over the (H, W) planes too;
average pooling's loops run over the kernel's offsets (``kh * kw`` numpy calls), never
over pixels or devices.

Padding is resolved at call time into explicit ``pads = (top, bottom, left, right)``
(MindSpore's rules: "same" gives ``ceil(H / stride)`` outputs and puts the odd pixel of
padding at the bottom/right), so kernels and sharding rules read one form.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .._core import _conv as _K
from . import interpreter
from . import _array as A
from . import _math as M
from ._nn import unused_grad
from ._registry import apply, check_float, check_same_dtype, checked_once, const, register

__all__ = ["conv2d", "max_pool", "avg_pool",
           "batch_norm", "batch_norm_op", "assign_parameters", "batch_norm_stack",
           "fold_sums", "running_update", "bn_count", "conv_out_size", "pool_op", "pair",
           "check_pad", "check_pad_mode", "resolve_pads", "conv_stack", "conv_input_grad_stack",
           "conv_filter_grad_stack", "pool_stack", "pool_grad_stack", "window_view",
           "bn_sums_stack", "bn_affine_stack",
           "CONV2D", "CONV2D_INPUT_GRAD", "CONV2D_FILTER_GRAD", "MAX_POOL", "MAX_POOL_GRAD",
           "AVG_POOL", "AVG_POOL_GRAD", "BATCH_NORM"]


# ---------------------------------------------------------------------------
# attribute checks and sizes
# ---------------------------------------------------------------------------
def pair(opname, key, v, lo=1):
    """An int or a pair of ints (each >= lo) -> a 2-tuple (MindSpore also accepts 4-tuples
    ``(1, 1, h, w)`` for stride and dilation)."""
    given = v
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        v = (int(v), int(v))
    elif isinstance(v, (tuple, list)) and len(v) == 4 and tuple(v[:2]) == (1, 1):
        v = tuple(v[2:])
    if not isinstance(v, (tuple, list)) or len(v) != 2 or any(
            isinstance(e, bool) or not isinstance(e, (int, np.integer)) or e < lo for e in v):
        raise ValueError(f"{opname}: {key}={given!r} is not valid; expected an int >= {lo} or a "
                         f"pair of them")
    return int(v[0]), int(v[1])


def check_pad_mode(opname, pad_mode, allowed=("valid", "same", "pad")):
    if not isinstance(pad_mode, str) or pad_mode.lower() not in allowed:
        raise ValueError(f"{opname}: pad_mode={pad_mode!r} is not valid; expected one of "
                         + ", ".join(repr(a) for a in allowed))
    return pad_mode.lower()


def check_pad(opname, pad, pad_mode):
    """``pad`` (int or (top, bottom, left, right)) -> 4-tuple; nonzero only with "pad"."""
    if isinstance(pad, (int, np.integer)) and not isinstance(pad, bool):
        pad = (int(pad),) * 4
    if not isinstance(pad, (tuple, list)) or len(pad) != 4 or any(
            isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 0 for p in pad):
        raise ValueError(f"{opname}: pad={pad!r} is not valid; expected an int >= 0 or a "
                         f"4-tuple (top, bottom, left, right) of them")
    pad = tuple(int(p) for p in pad)
    if pad_mode != "pad" and any(pad):
        raise ValueError(f"{opname}: pad={pad} needs pad_mode='pad', got "
                         f"pad_mode={pad_mode!r}")
    return pad


def conv_out_size(size, k, stride, dilation, lo, hi):
    """Output length of a window of k taps (dilated) over size + lo + hi."""
    return (size + lo + hi - (k - 1) * dilation - 1) // stride + 1


def resolve_pads(pad_mode, pad, hw, kernel, stride, dilation):
    """Explicit (top, bottom, left, right) padding for input spatial size `hw`."""
    if pad_mode == "pad":
        return tuple(pad)
    if pad_mode == "valid":
        return (0, 0, 0, 0)
    out = []
    for size, k, s, d in zip(hw, kernel, stride, dilation):
        n_out = -(-size // s)
        total = max((n_out - 1) * s + (k - 1) * d + 1 - size, 0)
        out += [total // 2, total - total // 2]
    return tuple(out)


def _out_hw(opname, hw, kernel, stride, dilation, pads):
    oh = conv_out_size(hw[0], kernel[0], stride[0], dilation[0], pads[0], pads[1])
    ow = conv_out_size(hw[1], kernel[1], stride[1], dilation[1], pads[2], pads[3])
    if oh < 1 or ow < 1:
        raise ValueError(f"{opname}: the input's spatial size {tuple(hw)} with padding "
                         f"{pads} is smaller than the kernel {tuple(kernel)} "
                         f"(dilation {tuple(dilation)}); the output would be empty")
    return oh, ow


def _check_4d(opname, x, i, what):
    if x.ndim != 4:
        raise ValueError(f"{opname}: {what} (input {i}) has shape {tuple(x.shape)}; "
                         f"expected 4-D NCHW")


# ---------------------------------------------------------------------------
# stack kernels (leading device axis)
# ---------------------------------------------------------------------------
def _pad_stack(x, pads, value=0.0):
    if not any(pads):
        return x
    t, b, l, r = pads
    return np.pad(x, ((0, 0),) * (x.ndim - 2) + ((t, b), (l, r)), constant_values=value)


def window_view(xp, kernel, stride, dilation, out_hw):
    """Strided view (..., Ho, Wo, kh, kw) of the windows of the padded `xp` (..., H, W)."""
    sh, sw = xp.strides[-2:]
    shape = xp.shape[:-2] + tuple(out_hw) + tuple(kernel)
    strides = xp.strides[:-2] + (sh * stride[0], sw * stride[1], sh * dilation[0],
                                 sw * dilation[1])
    return as_strided(xp, shape, strides, writeable=False)


# channels-last data movement: Cython kernels for float32/float64 (dualmode/_core/_conv.pyx),
# these numpy references for float16 and for the tests to compare the kernels against
def to_channels_last_numpy(x, pads=(0, 0, 0, 0)):
    """Reference of ``_core._conv.to_channels_last``: (B, C, H, W) -> (B, Hp, Wp, C) with
    a zero border of pads = (top, bottom, left, right)."""
    t, b, l, r = pads
    n, c, h, w = x.shape
    out = np.zeros((n, h + t + b, w + l + r, c), x.dtype)
    out[:, t:t + h, l:l + w, :] = x.transpose(0, 2, 3, 1)
    return out


def to_channels_first_numpy(xh, origin=(0, 0), hw=None):
    """Reference of ``_core._conv.to_channels_first``: the (H, W) block of xh (B, Hp, Wp,
    C) at origin (top, left) -> (B, C, H, W)."""
    t, l = origin
    h, w = (xh.shape[1] - t, xh.shape[2] - l) if hw is None else hw
    return np.ascontiguousarray(xh[:, t:t + h, l:l + w, :].transpose(0, 3, 1, 2))


def _window_columns_view(xh, kernel, stride, dilation, out_hw, group):
    """Strided view (B, Ho, Wo, group, kh, kw, C/group) of the windows of xh (B, Hp, Wp,
    C)."""
    b, _, _, c = xh.shape
    s0, s1, s2, s3 = xh.strides
    cg = c // group
    shape = (b,) + tuple(out_hw) + (group,) + tuple(kernel) + (cg,)
    strides = (s0, s1 * stride[0], s2 * stride[1], s3 * cg, s1 * dilation[0],
               s2 * dilation[1], s3)
    return as_strided(xh, shape, strides, writeable=False)


def im2col_numpy(xh, kernel, stride, dilation, out_hw, group=1):
    """Reference of ``_core._conv.im2col``: the windows of xh (B, Hp, Wp, C) as rows
    (B * Ho * Wo, kh * kw * C) ordered (group, kh, kw, C / group)."""
    win = _window_columns_view(xh, kernel, stride, dilation, out_hw, group)
    return np.ascontiguousarray(win).reshape(win.shape[0] * out_hw[0] * out_hw[1], -1)


def col2im_numpy(cols, batch, grid_hw, kernel, stride, dilation, out_hw, group=1):
    """Reference of ``_core._conv.col2im``: window columns (B * Ho * Wo, kh * kw * C)
    added back onto a zero grid (B, Hp, Wp, C), one numpy call per kernel tap."""
    kh, kw = kernel
    ho, wo = out_hw
    c = cols.shape[1] // (kh * kw)
    v = cols.reshape(batch, ho, wo, group, kh, kw, c // group)
    out = np.zeros((batch,) + tuple(grid_hw) + (c,), cols.dtype)
    o = out.reshape(out.shape[:3] + (group, c // group))
    for i in range(kh):
        r0 = i * dilation[0]
        for j in range(kw):
            c0 = j * dilation[1]
            o[:, r0:r0 + (ho - 1) * stride[0] + 1:stride[0],
              c0:c0 + (wo - 1) * stride[1] + 1:stride[1]] += v[:, :, :, :, i, j]
    return out


def _fast(a):
    return a.dtype in _K.DTYPES


def _channels_last(x, pads=(0, 0, 0, 0)):
    return (_K.to_channels_last if _fast(x) else to_channels_last_numpy)(x, pads)


def _channels_first(xh, origin=(0, 0), hw=None):
    return (_K.to_channels_first if _fast(xh) else to_channels_first_numpy)(xh, origin, hw)


def _im2col(xh, kernel, stride, dilation, out_hw, group):
    return (_K.im2col if _fast(xh) else im2col_numpy)(xh, kernel, stride, dilation, out_hw,
                                                     group)


def _col2im(cols, batch, grid_hw, kernel, stride, dilation, out_hw, group):
    return (_K.col2im if _fast(cols) else col2im_numpy)(cols, batch, grid_hw, kernel, stride,
                                                       dilation, out_hw, group)


def _images(stack):
    """(D, N, C, H, W) -> (D * N, C, H, W) (a copy only when the stack is not contiguous)."""
    return np.ascontiguousarray(stack).reshape((-1,) + stack.shape[2:])


def _mm(a, b):
    """np.matmul; float16 operands are multiplied with float32 accumulation (as float16
    hardware does) and the product rounded back to float16 (numpy has no float16 BLAS)."""
    if a.dtype == np.float16:
        return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return np.matmul(a, b)


def _same_on_every_device(w):
    """One weight for the whole stack (one device, or a stride-0 replicated stack): the
    devices' rows go through one GEMM."""
    return w.shape[0] == 1 or w.strides[0] == 0


def _weight_matrix(w, group):
    """w (D, Co, C/g, kh, kw) -> (D', g, Co/g, kh * kw * C/g) in the columns' order (D' =
    1 for one weight on every device)."""
    if _same_on_every_device(w):
        w = w[:1]
    d, co, cg, kh, kw = w.shape
    wm = np.ascontiguousarray(w.transpose(0, 1, 3, 4, 2))
    return wm.reshape(d, group, co // group, kh * kw * cg)


def _grid_hw(in_hw, kernel, stride, dilation, pads, out_hw):
    """The padded grid col2im adds onto: the padded input, or as far as the windows reach
    (a cropped block's windows may run past it into rows nobody reads)."""
    return tuple(max(in_hw[a] + pads[2 * a] + pads[2 * a + 1],
                     (out_hw[a] - 1) * stride[a] + (kernel[a] - 1) * dilation[a] + 1)
                 for a in range(2))


def conv_stack(x, w, stride, dilation, pads, group):
    """Per-device 2-D convolution: x (D, N, C, H, W), w (D, Co, C/g, kh, kw) -> (D, N, Co,
    Ho, Wo), as channels-last im2col + one GEMM (one per device and group when the
    devices hold different weights or group > 1)."""
    d, n = x.shape[:2]
    co, kernel = w.shape[1], w.shape[3:]
    out_hw = (conv_out_size(x.shape[3], kernel[0], stride[0], dilation[0], pads[0], pads[1]),
              conv_out_size(x.shape[4], kernel[1], stride[1], dilation[1], pads[2], pads[3]))
    cols = _im2col(_channels_last(_images(x), pads), kernel, stride, dilation, out_hw,
                   group)                                           # D*P, g*K
    wm = _weight_matrix(w, group)                                   # D' g Cog K
    if wm.shape[0] == 1 and group == 1:
        out = _mm(cols, wm[0, 0].T)                                 # D*P, Co
    else:
        p = cols.shape[0] // d
        cols = cols.reshape(d, p, group, -1).transpose(0, 2, 1, 3)  # D g P K
        out = _mm(cols, np.swapaxes(wm, -1, -2))                    # D g P Cog
        out = np.ascontiguousarray(out.transpose(0, 2, 1, 3))       # D P g Cog
    y = _channels_first(out.reshape((d * n,) + out_hw + (co,)))
    return y.reshape((d, n, co) + out_hw)


def conv_input_grad_stack(dy, w, in_hw, stride, dilation, pads, group):
    """Gradient of conv_stack with respect to x: dy (D, N, Co, Ho, Wo), w (D, Co, C/g, kh,
    kw) -> (D, N, C, H, W) (one GEMM, then col2im onto the padded channels-last grid)."""
    d, n, co, ho, wo = dy.shape
    cg, kernel = w.shape[2], tuple(w.shape[3:])
    dyh = _channels_last(_images(dy))                               # D*N Ho Wo Co
    wm = _weight_matrix(w, group)                                   # D' g Cog K
    if wm.shape[0] == 1 and group == 1:
        dcols = _mm(dyh.reshape(-1, co), wm[0, 0])                  # D*P, K
    else:
        dyg = dyh.reshape(d, n * ho * wo, group, co // group).transpose(0, 2, 1, 3)
        dcols = _mm(dyg, wm)                                        # D g P K
        dcols = np.ascontiguousarray(dcols.transpose(0, 2, 1, 3)).reshape(d * n * ho * wo,
                                                                          -1)
    grid = _grid_hw(in_hw, kernel, stride, dilation, pads, (ho, wo))
    dxh = _col2im(dcols, d * n, grid, kernel, stride, dilation, (ho, wo), group)
    dx = _channels_first(dxh, (pads[0], pads[2]), tuple(in_hw))
    return dx.reshape((d, n, cg * group) + tuple(in_hw))


def conv_filter_grad_stack(dy, x, kernel, stride, dilation, pads, group):
    """Per-device gradient of conv_stack with respect to w: dy (D, N, Co, Ho, Wo), x (D, N,
    C, H, W) -> (D, Co, C/g, kh, kw): channels-last im2col of x, one GEMM with dy."""
    d, n, co, ho, wo = dy.shape
    c = x.shape[2]
    kernel = tuple(kernel)
    cols = _im2col(_channels_last(_images(x), pads), kernel, stride, dilation, (ho, wo),
                   group)                                           # D*P, g*K
    dyh = _channels_last(_images(dy)).reshape(d, n * ho * wo, group, co // group)
    if d == 1 and group == 1:
        dw = _mm(dyh[0, :, 0].T, cols)[None, None]                  # one GEMM
    else:
        cols = cols.reshape(d, n * ho * wo, group, -1).transpose(0, 2, 1, 3)   # D g P K
        dw = _mm(dyh.transpose(0, 2, 3, 1), cols)                   # D g Cog K
    dw = dw.reshape((d, co) + kernel + (c // group,))
    return np.ascontiguousarray(dw.transpose(0, 1, 4, 2, 3))


def _scatter_windows(dwin, in_hw, kernel, stride, dilation, pads, dtype):
    """col2im of pooling: add the window values dwin (..., Ho, Wo, kh, kw) back onto the
    padded input grid and crop the padding -> (..., H, W)."""
    lead = dwin.shape[:-4]
    ho, wo = dwin.shape[-4:-2]
    hp, wp = _grid_hw(in_hw, kernel, stride, dilation, pads, (ho, wo))
    out = np.zeros(lead + (hp, wp), dtype)
    for i in range(kernel[0]):
        r0 = i * dilation[0]
        for j in range(kernel[1]):
            c0 = j * dilation[1]
            out[..., r0:r0 + (ho - 1) * stride[0] + 1:stride[0],
                c0:c0 + (wo - 1) * stride[1] + 1:stride[1]] += dwin[..., i, j]
    return out[..., pads[0]:pads[0] + in_hw[0], pads[2]:pads[2] + in_hw[1]]


def _pool_out_hw(hw, kernel, stride, pads):
    return (conv_out_size(hw[0], kernel[0], stride[0], 1, pads[0], pads[1]),
            conv_out_size(hw[1], kernel[1], stride[1], 1, pads[2], pads[3]))


def max_pool_numpy(x, kernel, stride, pads):
    """Reference of ``_core._conv.max_pool``: the max over each window of x (..., H, W)
    padded with -inf."""
    out_hw = _pool_out_hw(x.shape[-2:], kernel, stride, pads)
    xp = _pad_stack(x, pads, -np.inf)
    return window_view(xp, kernel, stride, (1, 1), out_hw).max(axis=(-2, -1))


def max_pool_grad_numpy(x, dy, kernel, stride, pads):
    """Reference of ``_core._conv.max_pool_grad``: dy (..., Ho, Wo) scattered to each
    window's first maximum (numpy's argmax over the -inf padded window; windows reaching
    past the padded grid meet more padding)."""
    hw = x.shape[-2:]
    grid = _grid_hw(hw, kernel, stride, (1, 1), pads, dy.shape[-2:])
    xp = _pad_stack(x, pads[:1] + (grid[0] - hw[0] - pads[0],) + pads[2:3]
                    + (grid[1] - hw[1] - pads[2],), -np.inf)
    win = window_view(xp, kernel, stride, (1, 1), dy.shape[-2:])
    arg = win.reshape(win.shape[:-2] + (-1,)).argmax(axis=-1)
    taps = np.arange(kernel[0] * kernel[1]).reshape(kernel)
    dwin = np.where(arg[..., None, None] == taps, dy[..., None, None], 0).astype(dy.dtype)
    return _scatter_windows(dwin, x.shape[-2:], kernel, stride, (1, 1), pads, dy.dtype)


def _planes(x):
    """(..., H, W) -> (B, H, W)."""
    return np.reshape(x, (-1,) + x.shape[-2:])


def pool_stack(x, mode, kernel, stride, pads):
    """Per-device pooling of (..., H, W): "max" (padding never wins) or "avg" (the mean
    over the window's pixels inside the input: padding is not counted)."""
    hw = x.shape[-2:]
    out_hw = _pool_out_hw(hw, kernel, stride, pads)
    if mode == "max":
        if _fast(x):
            return _K.max_pool(_planes(x), kernel, stride, pads).reshape(x.shape[:-2]
                                                                          + out_hw)
        return max_pool_numpy(x, kernel, stride, pads)
    xp = _pad_stack(x, pads)
    s = window_view(xp, kernel, stride, (1, 1), out_hw).sum(axis=(-2, -1))
    return s / _avg_counts(hw, kernel, stride, pads, out_hw).astype(x.dtype)


def _avg_counts(hw, kernel, stride, pads, out_hw):
    """Pixels of the input under each window (H and W counts multiply)."""
    def axis(size, k, s, lo, n):
        start = np.arange(n) * s - lo
        return np.minimum(start + k, size) - np.maximum(start, 0)
    return np.outer(axis(hw[0], kernel[0], stride[0], pads[0], out_hw[0]),
                    axis(hw[1], kernel[1], stride[1], pads[2], out_hw[1]))


def pool_grad_stack(x, dy, mode, kernel, stride, pads):
    """Gradient of pool_stack: to the first maximum of each window ("max"), or shared
    evenly over the window's input pixels ("avg"); x (..., H, W), dy (..., Ho, Wo)."""
    hw = x.shape[-2:]
    out_hw = dy.shape[-2:]
    if mode == "max":
        if _fast(x) and dy.dtype == x.dtype:
            return _K.max_pool_grad(_planes(x), _planes(dy), kernel, stride,
                                    pads).reshape(x.shape)
        return max_pool_grad_numpy(x, dy, kernel, stride, pads)
    g = dy / _avg_counts(hw, kernel, stride, pads, out_hw).astype(dy.dtype)
    dwin = np.broadcast_to(g[..., None, None], g.shape + tuple(kernel))
    return _scatter_windows(dwin, hw, kernel, stride, (1, 1), pads, dy.dtype)


# ---------------------------------------------------------------------------
# Conv2D
# ---------------------------------------------------------------------------
def _geometry(attrs):
    return attrs["stride"], attrs["dilation"], attrs["pads"], attrs["group"]


def _infer_conv(attrs, x, w):
    name = "Conv2D"
    check_float(name, x)
    check_same_dtype(name, (x, w))
    _check_4d(name, x, 0, "x")
    _check_4d(name, w, 1, "weight")
    g = attrs["group"]
    co, cg, kh, kw = w.shape
    if x.shape[1] != cg * g:
        raise ValueError(f"Conv2D: x has {x.shape[1]} input channels but the weight "
                         f"{tuple(w.shape)} with group={g} expects {cg * g} "
                         f"(weight dim 1 = in_channels / group)")
    if co != attrs["out_channel"] or (kh, kw) != attrs["kernel_size"]:
        raise ValueError(f"Conv2D: weight shape {tuple(w.shape)} does not match "
                         f"out_channel={attrs['out_channel']} and "
                         f"kernel_size={attrs['kernel_size']}")
    if co % g:
        raise ValueError(f"Conv2D: out_channel={co} is not divisible by group={g}")
    stride, dilation, pads, _ = _geometry(attrs)
    oh, ow = _out_hw(name, x.shape[2:], (kh, kw), stride, dilation, pads)
    return (((x.shape[0], co, oh, ow), x.dtype),)


def _conv_kernel(attrs, x, w):
    stride, dilation, pads, g = _geometry(attrs)
    return conv_stack(x[None], w[None], stride, dilation, pads, g)[0]


def _bw_conv(node, g):
    x, w = node.inputs
    at = dict(node.attrs)
    gx = gw = None
    if node.needs_grad(0):
        gx = apply(CONV2D_INPUT_GRAD, dict(at, in_hw=tuple(x.shape[2:])), (g, w))
    if node.needs_grad(1):
        gw = apply(CONV2D_FILTER_GRAD, at, (g, x))
    return gx, gw


def _infer_conv_input_grad(attrs, dy, w):
    check_float("Conv2DBackpropInput", dy)
    check_same_dtype("Conv2DBackpropInput", (dy, w))
    return (((dy.shape[0], w.shape[1] * attrs["group"]) + tuple(attrs["in_hw"]), dy.dtype),)


def _conv_input_grad_kernel(attrs, dy, w):
    stride, dilation, pads, g = _geometry(attrs)
    return conv_input_grad_stack(dy[None], w[None], attrs["in_hw"], stride, dilation, pads,
                                 g)[0]


def _bw_conv_input_grad(node, gg):
    """d/d(dy) of dx is the convolution of gg with w; d/dw is the filter gradient of dy
    over gg (both linear)."""
    dy, w = node.inputs
    at = {k: v for k, v in node.attrs.items() if k != "in_hw"}
    gdy = apply(CONV2D, at, (gg, w)) if node.needs_grad(0) else None
    gw = apply(CONV2D_FILTER_GRAD, at, (dy, gg)) if node.needs_grad(1) else None
    return gdy, gw


def _infer_conv_filter_grad(attrs, dy, x):
    check_float("Conv2DBackpropFilter", dy)
    check_same_dtype("Conv2DBackpropFilter", (dy, x))
    g = attrs["group"]
    return (((attrs["out_channel"], x.shape[1] // g) + tuple(attrs["kernel_size"]),
             dy.dtype),)


def _conv_filter_grad_kernel(attrs, dy, x):
    stride, dilation, pads, g = _geometry(attrs)
    return conv_filter_grad_stack(dy[None], x[None], attrs["kernel_size"], stride, dilation,
                                  pads, g)[0]


def _bw_conv_filter_grad(node, gg):
    dy, x = node.inputs
    at = dict(node.attrs)
    gdy = apply(CONV2D, at, (x, gg)) if node.needs_grad(0) else None
    gx = (apply(CONV2D_INPUT_GRAD, dict(at, in_hw=tuple(x.shape[2:])), (dy, gg))
          if node.needs_grad(1) else None)
    return gdy, gx


CONV2D = register("Conv2D", infer=_infer_conv, kernel=_conv_kernel, backward=_bw_conv)
CONV2D_INPUT_GRAD = register("Conv2DBackpropInput", infer=_infer_conv_input_grad,
                             kernel=_conv_input_grad_kernel, backward=_bw_conv_input_grad)
CONV2D_FILTER_GRAD = register("Conv2DBackpropFilter", infer=_infer_conv_filter_grad,
                              kernel=_conv_filter_grad_kernel, backward=_bw_conv_filter_grad)


def conv2d(x, weight, pad_mode="valid", pad=0, stride=1, dilation=1, group=1, *,
           out_channel=None, kernel_size=None):
    """2-D convolution (cross-correlation, as MindSpore) of x (N, C, H, W) with weight
    (C_out, C / group, kh, kw); pad_mode "valid", "same" or "pad" (with `pad`).
    `out_channel` and `kernel_size`, when given (the primitive's attributes), must match
    the weight."""
    name = "Conv2D"
    x, weight = const(x, name), const(weight, name)
    _check_4d(name, x, 0, "x")
    _check_4d(name, weight, 1, "weight")
    pad_mode = check_pad_mode(name, pad_mode)
    pad = check_pad(name, pad, pad_mode)
    stride = pair(name, "stride", stride)
    dilation = pair(name, "dilation", dilation)
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ValueError(f"Conv2D: group={group!r} is not valid; expected an int >= 1")
    kernel = tuple(int(k) for k in weight.shape[2:])
    attrs = {"out_channel": int(weight.shape[0] if out_channel is None else out_channel),
             "kernel_size": kernel if kernel_size is None else tuple(kernel_size),
             "stride": stride,
             "dilation": dilation, "group": int(group),
             "pads": resolve_pads(pad_mode, pad, tuple(x.shape[2:]), kernel, stride,
                                  dilation)}
    return apply(CONV2D, attrs, (x, weight))


# ---------------------------------------------------------------------------
# MaxPool / AvgPool
# ---------------------------------------------------------------------------
def _make_pool(name, mode):
    def infer(attrs, x):
        check_float(name, x)
        _check_4d(name, x, 0, "x")
        oh, ow = _out_hw(name, x.shape[2:], attrs["kernel_size"], attrs["strides"], (1, 1),
                         attrs["pads"])
        return ((tuple(x.shape[:2]) + (oh, ow), x.dtype),)

    def kernel(attrs, x):
        return pool_stack(x, mode, attrs["kernel_size"], attrs["strides"], attrs["pads"])

    def infer_grad(attrs, x, dy):
        check_float(name + "Grad", dy)
        return ((tuple(x.shape), dy.dtype),)

    def kernel_grad(attrs, x, dy):
        return pool_grad_stack(x, dy, mode, attrs["kernel_size"], attrs["strides"],
                               attrs["pads"])

    def bw_grad(node, gg):
        # MaxPoolGrad is linear in dy with x fixed (the argmax); AvgPoolGrad is linear
        # in dy: its adjoint is the pool itself (max: gg picked at the argmax taps)
        x, dy = node.inputs
        if not node.needs_grad(1):
            return None, None
        if mode == "avg":
            return None, apply(fwd, node.attrs, (gg,))
        return None, apply(SELECT, node.attrs, (x, gg))

    grad = register(name + "Grad", infer=infer_grad, kernel=kernel_grad, backward=bw_grad)

    def bw(node, g):
        return (apply(grad, node.attrs, (node.inputs[0], g)),)

    fwd = register(name, infer=infer, kernel=kernel, backward=bw)
    return fwd, grad


def _infer_select(attrs, x, gg):
    check_float("MaxPoolSelect", gg)
    return ((tuple(gg.shape[:2]) + _out_hw("MaxPoolSelect", x.shape[2:],
                                           attrs["kernel_size"], attrs["strides"], (1, 1),
                                           attrs["pads"]), gg.dtype),)


def _select_kernel(attrs, x, gg):
    """gg (..., H, W) read at the first maximum of each window of x -> (..., Ho, Wo)."""
    kernel, stride, pads = attrs["kernel_size"], attrs["strides"], attrs["pads"]
    hw = x.shape[-2:]
    out_hw = (conv_out_size(hw[0], kernel[0], stride[0], 1, pads[0], pads[1]),
              conv_out_size(hw[1], kernel[1], stride[1], 1, pads[2], pads[3]))
    win = window_view(_pad_stack(x, pads, -np.inf), kernel, stride, (1, 1), out_hw)
    arg = win.reshape(win.shape[:-2] + (-1,)).argmax(axis=-1)[..., None]
    gwin = window_view(_pad_stack(gg, pads), kernel, stride, (1, 1), out_hw)
    return np.take_along_axis(gwin.reshape(gwin.shape[:-2] + (-1,)), arg, -1)[..., 0]


SELECT = register("MaxPoolSelect", infer=_infer_select, kernel=_select_kernel)
MAX_POOL, MAX_POOL_GRAD = _make_pool("MaxPool", "max")
AVG_POOL, AVG_POOL_GRAD = _make_pool("AvgPool", "avg")


def pool_op(op, x, kernel_size, strides, pad_mode):
    name = op.name
    x = const(x, name)
    _check_4d(name, x, 0, "x")
    kernel = pair(name, "kernel_size", kernel_size)
    strides = pair(name, "strides", strides)
    pad_mode = check_pad_mode(name, pad_mode, ("valid", "same"))
    attrs = {"kernel_size": kernel, "strides": strides,
             "pads": resolve_pads(pad_mode, (0,) * 4, tuple(x.shape[2:]), kernel, strides,
                                  (1, 1))}
    return apply(op, attrs, (x,))


def max_pool(x, kernel_size=1, strides=1, pad_mode="valid"):
    """Max over kernel_size windows of x (N, C, H, W); pad_mode "valid" or "same"."""
    return pool_op(MAX_POOL, x, kernel_size, strides, pad_mode)


def avg_pool(x, kernel_size=1, strides=1, pad_mode="valid"):
    """Mean over kernel_size windows of x (N, C, H, W); with pad_mode "same" a border
    window averages only the pixels inside the input."""
    return pool_op(AVG_POOL, x, kernel_size, strides, pad_mode)


# ---------------------------------------------------------------------------
# BatchNorm kernels over stacks: per-channel (sum, sum of squares), their folding into
# mean and variance, and the per-channel scale-and-shift
# ---------------------------------------------------------------------------
def channel_sums_numpy(x):
    """Reference of ``_core._conv.channel_sums``: x (D, B, C, L) -> (D, 2, C) float64 sums
    and sums of squares over B and L."""
    x64 = x.astype(np.float64)
    return np.stack([x64.sum(axis=(1, 3)), np.square(x64).sum(axis=(1, 3))], axis=1)


def channel_affine_numpy(x, shift, scale):
    """Reference of ``_core._conv.channel_affine``: shift + scale * x per device and
    channel, for x (D, B, C, L) and shift, scale (D, C)."""
    return shift[:, None, :, None] + scale[:, None, :, None] * x


def _channel_rows(stack):
    """A stack (D, N, C, ...) as (D, N, C, L)."""
    return np.reshape(stack, stack.shape[:3] + (math.prod(stack.shape[3:]),))


def bn_sums_stack(xs):
    """Per device of the stack xs (D, N, C, ...): the (2, C) float64 sum and sum of
    squares of every channel -> (D, 2, C)."""
    rows = _channel_rows(xs)
    return (_K.channel_sums if _fast(rows) else channel_sums_numpy)(rows)


def bn_affine_stack(xs, shift, scale):
    """``shift[c] + scale[c] * x`` per device of the stack xs (D, N, C, ...), with shift and
    scale (D, C) in x's dtype: BatchNorm's per-channel map in one pass."""
    rows = _channel_rows(xs)
    out = (_K.channel_affine if _fast(rows) else channel_affine_numpy)(rows, shift, scale)
    return out.reshape(xs.shape)


def fold_sums(total, total_sq, count):
    """(mean, biased variance) of `count` values from their sum and sum of squares (in
    the sums' dtype, float64)."""
    mean = total / count
    return mean, np.maximum(total_sq / count - mean * mean, 0)


def bn_count(shape):
    """How many values each channel's statistics cover."""
    return math.prod(shape[:1] + tuple(shape[2:]))


def _channel_shape(c, ndim):
    return (1, c) + (1,) * (ndim - 2)


def _check_bn_args(x, params):
    c = x.shape[1] if x.ndim >= 2 else None
    for name, p in params.items():
        if tuple(p.shape) != (c,):
            raise ValueError(f"BatchNorm: {name} has shape {tuple(p.shape)}; expected "
                             f"({c},), one value per channel of x {tuple(x.shape)}")


def batch_norm(x, running_mean, running_var, weight, bias, training=False, momentum=0.1,
               eps=1e-5):
    """Batch normalisation (as ``mindspore.ops.batch_norm``), the BatchNorm op: with
    ``training`` the batch's statistics normalise x and the running ones become ``(1 -
    momentum) * running + momentum * batch`` (running_var takes the unbiased batch
    variance), set in place; otherwise the running statistics normalise x."""
    x = const(x, "BatchNorm")
    if x.ndim < 2:
        raise ValueError(f"BatchNorm: x has shape {tuple(x.shape)}; expected (N, C, ...)")
    _check_bn_args(x, {"running_mean": running_mean, "running_var": running_var,
                       "weight": weight, "bias": bias})
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or \
            not 0.0 <= momentum <= 1.0:
        raise ValueError(f"BatchNorm: momentum={momentum!r} must be a float in [0, 1]")
    y, mean, var = batch_norm_op(x, weight, bias, running_mean, running_var, training, eps)
    if training:
        new_mean, new_var = running_update(running_mean, running_var, mean, var,
                                           bn_count(tuple(x.shape)), 1.0 - momentum)
        assign_parameters("BatchNorm.update", (running_mean, running_var), new_mean, new_var)
    return y


def assign_parameters(label, params, *values):
    """Set each Parameter of `params` to its value in `values`. Inside a graph being
    traced (an interpreter that records opaque calls) this is recorded as one opaque
    call named `label`, which sets them each time the graph runs."""
    record = getattr(interpreter.current(), "call_opaque", None)
    if record is not None:
        record(functools.partial(assign_parameters, label, params), label, values)
        return
    for p, v in zip(params, values):
        p.set_data(np.asarray(v))


# ---------------------------------------------------------------------------
# BatchNorm as one op (the primitive): (x, scale, bias, mean, variance) -> (y, mean,
# variance); a strategy applies to the op as a whole
# ---------------------------------------------------------------------------
BN_NAME = "BatchNorm"
BN_PARAMS = ("scale", "bias", "mean", "variance")
#: (shapes, dtypes) of BatchNorm already validated -> output meta
_BN_SEEN: dict = {}


def _infer_batch_norm(attrs, x, *params):
    key = (x.shape, x.dtype) + tuple((p.shape, p.dtype) for p in params)
    return checked_once(_BN_SEEN, key, _check_batch_norm, x, params)


def _check_batch_norm(x, params):
    check_float(BN_NAME, x)
    if x.ndim < 2:
        raise ValueError(f"{BN_NAME}: x has shape {tuple(x.shape)}; expected (N, C, ...)")
    c = x.shape[1]
    for i, (key, p) in enumerate(zip(BN_PARAMS, params), 1):
        check_float(BN_NAME, p, i)
        if tuple(p.shape) != (c,):
            raise ValueError(f"{BN_NAME}: {key} has shape {tuple(p.shape)}; expected "
                             f"({c},), one value per channel of x {tuple(x.shape)}")
    stats = _stats_dtype(params)
    return ((tuple(x.shape), x.dtype), ((c,), stats), ((c,), stats))


def _stats_dtype(params):
    """The statistics' dtype: the widest of scale, bias, mean and variance."""
    return np.result_type(*[p.dtype for p in params])


def batch_norm_stack(attrs, xs, scale, bias, mean, var, all_reduce=None):
    """The BatchNorm op on a stack: xs (D, N, C, ...), the others (D, C); returns (y,
    mean, variance) stacks. Training: the statistics of ``attrs["count"]`` values per
    channel from float64 sums and sums of squares, which `all_reduce` (when given)
    totals over the devices that split the batch first; inference: `mean`, `var`."""
    eps = attrs["epsilon"]
    if attrs["is_training"]:
        sums = bn_sums_stack(xs)                     # (D, 2, C) float64
        if all_reduce is not None:
            sums = all_reduce(sums)
        m, v = fold_sums(sums[:, 0], sums[:, 1], attrs["count"])
    else:
        m, v = mean.astype(np.float64), var.astype(np.float64)
    stats = _stats_dtype((scale, bias, mean, var))
    out_m, out_v = m.astype(stats), v.astype(stats)
    k = scale / np.sqrt(v + eps)                     # float64 per channel
    shift = bias - m * k
    y = bn_affine_stack(xs, shift.astype(xs.dtype), k.astype(xs.dtype))
    return y, out_m, out_v


def _batch_norm_kernel(attrs, x, *params):
    outs = batch_norm_stack(attrs, x[None], *[p[None] for p in params])
    return tuple(o[0] for o in outs)


def _bw_batch_norm(node, gy, g_mean, g_var):
    """Written with ops, so sharded inputs reduce per channel as any sum does (a split
    batch: pending sums, one AllReduce each). Training: the statistics are the batch's
    (outputs 1, 2), dx = k * (gy - mean(gy) - xhat * mean(gy * xhat)) plus what
    reaches the statistics' outputs; inference: dx = k * gy, and the running
    statistics get theirs. k = scale / sqrt(variance + epsilon)."""
    x, scale = node.inputs[0], node.inputs[1]
    attrs = node.attrs
    training = attrs["is_training"]
    mean, var = (node.outputs[1], node.outputs[2]) if training else \
        (node.inputs[3], node.inputs[4])
    nd = len(x.shape)
    cshape = _channel_shape(x.shape[1], nd)
    axes = (0,) + tuple(range(2, nd))
    use_mean, use_var = not unused_grad(g_mean), not unused_grad(g_var)
    need = [node.needs_grad(i) for i in range(5)]
    rstd = M.div(A.ones_like(var), M.sqrt(M.add(var, float(attrs["epsilon"]))))
    k = M.mul(scale, rstd)
    centred = M.sub(x, A.reshape(mean, cshape))
    xhat = M.mul(centred, A.reshape(rstd, cshape))
    # the per-channel sums (each an AllReduce when the batch is split): only those needed
    sum_gy = M.reduce_sum(gy, axes, False) if need[2] or need[3] or \
        (training and need[0]) else None
    sum_gy_xhat = M.reduce_sum(M.mul(gy, xhat), axes, False) if need[1] or need[4] or \
        (training and need[0]) else None
    grads = [None] * 5
    if training:
        if need[0]:
            inv = 1.0 / attrs["count"]
            inner = M.sub(gy, A.reshape(M.mul(sum_gy, inv), cshape))
            inner = M.sub(inner, M.mul(xhat, A.reshape(M.mul(sum_gy_xhat, inv), cshape)))
            gx = M.mul(inner, A.reshape(k, cshape))
            if use_mean:
                gx = M.add(gx, A.reshape(M.mul(g_mean, inv), cshape))
            if use_var:
                gx = M.add(gx, M.mul(centred, A.reshape(M.mul(g_var, 2.0 * inv), cshape)))
            grads[0] = gx
    else:
        if need[0]:
            grads[0] = M.mul(gy, A.reshape(k, cshape))
        if need[3]:
            gm = M.neg(M.mul(sum_gy, k))
            grads[3] = M.add(gm, g_mean) if use_mean else gm
        if need[4]:
            gv = M.mul(M.mul(M.mul(sum_gy_xhat, k), rstd), -0.5)
            grads[4] = M.add(gv, g_var) if use_var else gv
    if need[1]:
        grads[1] = sum_gy_xhat
    if need[2]:
        grads[2] = sum_gy
    return tuple(g if g is None or g.dtype == inp.dtype else M.cast(g, inp.dtype)
                 for g, inp in zip(grads, node.inputs))


BATCH_NORM = register(BN_NAME, infer=_infer_batch_norm, kernel=_batch_norm_kernel,
                      backward=_bw_batch_norm, save_outputs=True, multi_output=True)


def batch_norm_op(x, scale, bias, mean, variance, is_training, epsilon):
    """``(y, mean, variance)`` of the BatchNorm op: training normalises x (N, C, ...) with
    its batch's per-channel mean and biased variance (those of the global batch when
    the batch is split over devices) and returns them; inference uses and returns
    `mean` and `variance`."""
    x = const(x, BN_NAME)
    ins = (x,) + tuple(const(p, BN_NAME) for p in (scale, bias, mean, variance))
    attrs = {"is_training": bool(is_training), "epsilon": float(epsilon),
             "count": bn_count(tuple(x.shape)) if x.ndim >= 2 else 1}
    return apply(BATCH_NORM, attrs, ins)


def running_update(moving_mean, moving_var, mean, var, count, keep):
    """``keep * moving + (1 - keep) * batch`` for mean and (unbiased) variance (values
    that feed no loss: no gradient reaches them)."""
    unbias = count / max(count - 1, 1)
    new_mean = M.add(M.mul(moving_mean, keep), M.mul(mean, 1.0 - keep))
    new_var = M.add(M.mul(moving_var, keep), M.mul(var, (1.0 - keep) * unbias))
    return new_mean, new_var
