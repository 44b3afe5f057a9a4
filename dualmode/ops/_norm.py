"""Normalisation ops: LayerNorm (x, gamma, beta -> y, mean, variance) and L2Normalize.

Both kernels are written over a *stack* (a leading device axis ``D`` in front of the
op's dims; one device: ``D = 1``), so the sharding rules in
:mod:`dualmode.parallel.rules.norm` and :mod:`dualmode.parallel.rules.along_axis` run
every device's part in one numpy call. Statistics are accumulated in float64 and given
in x's dtype, so a device holding some rows computes them exactly as one device does.
Backward rules are written with ops, so sharded gradients reduce as any sum does; the
common LayerNorm backward (gamma over the normalised dims, only y's gradient) is one op,
LayerNormGrad, whose rule keeps dgamma and dbeta as pending sums over the row devices.
"""
from __future__ import annotations

import math

import numpy as np

from .._core import _kernels
from . import _array as A
from . import _math as M
from ._nn import unused_grad
from ._registry import (apply, check_float, check_same_dtype, checked_once, const, norm_axes,
                        norm_axis, register)

__all__ = ["LAYER_NORM", "LAYER_NORM_GRAD", "L2_NORMALIZE", "layer_norm", "layer_norm_op",
           "layer_norm_stack", "layer_norm_grad_stack",
           "layer_norm_axes", "l2_normalize", "l2_normalize_axes", "l2_normalize_stack"]


# ---------------------------------------------------------------------------
# LayerNorm
# ---------------------------------------------------------------------------
LN_NAME = "LayerNorm"
#: (shapes, dtypes, attrs) of LayerNorm already validated -> output meta
_LN_SEEN: dict = {}


def layer_norm_axes(opname, begin_norm_axis, begin_params_axis, ndim):
    """(begin_norm_axis, begin_params_axis) as non-negative axes of an input of rank
    `ndim` (each in [-ndim, ndim)), or a named error."""
    if ndim == 0:
        raise ValueError(f"{opname}: input_x is 0-d; expected rank >= 1")
    return (norm_axis(opname, begin_norm_axis, ndim, "begin_norm_axis"),
            norm_axis(opname, begin_params_axis, ndim, "begin_params_axis"))


def _infer_layer_norm(attrs, x, gamma, beta):
    key = (x.shape, gamma.shape, beta.shape, x.dtype, gamma.dtype, beta.dtype,
           attrs["begin_norm_axis"], attrs["begin_params_axis"])
    return checked_once(_LN_SEEN, key, _check_layer_norm, attrs, x, gamma, beta)


def _check_layer_norm(attrs, x, gamma, beta):
    check_float(LN_NAME, x)
    check_same_dtype(LN_NAME, (x, gamma, beta))
    bna, bpa = attrs["begin_norm_axis"], attrs["begin_params_axis"]
    shape = tuple(x.shape)
    if not 0 <= bna < len(shape) or not 0 <= bpa < len(shape):
        raise ValueError(f"{LN_NAME}: begin_norm_axis={bna} and begin_params_axis={bpa} must "
                         f"be axes of input_x of shape {shape}")
    for key, p in (("gamma", gamma), ("beta", beta)):
        if tuple(p.shape) != shape[bpa:]:
            raise ValueError(f"{LN_NAME}: {key} has shape {tuple(p.shape)}; expected "
                             f"{shape[bpa:]}, the dims of input_x {shape} from "
                             f"begin_params_axis={bpa}")
    stats = shape[:bna] + (1,) * (len(shape) - bna)
    return ((shape, x.dtype), (stats, x.dtype), (stats, x.dtype))


def _per_device(stack, rank):
    """A stack (D, *dims) of trailing dims viewed as (D, 1, ..., *dims) of `rank` dims
    after the device axis (numpy broadcasting then aligns it with x from the right)."""
    return stack.reshape((stack.shape[0],) + (1,) * (rank - (stack.ndim - 1)) + stack.shape[1:])


def _rows(stack, begin):
    """A stack (D, *dims) as (D, rows, n): the dims before `begin` (of dims) made one
    axis of rows, those from it one axis of n."""
    return stack.reshape(stack.shape[0], math.prod(stack.shape[1:begin + 1]),
                         math.prod(stack.shape[begin + 1:]))


def layer_norm_stack(attrs, xs, gammas, betas):
    """LayerNorm on a stack: xs (D, *shape), gammas and betas (D, *shape[begin_params_axis:]);
    returns the (y, mean, variance) stacks, the statistics over the dims from
    begin_norm_axis (kept as 1s), accumulated in float64. With gamma over the
    normalised dims (begin_params_axis = begin_norm_axis) in float32/float64, one
    Cython pass per row (:func:`dualmode._core._kernels.layer_norm`)."""
    nd = xs.ndim - 1
    bna = attrs["begin_norm_axis"]
    stats_shape = xs.shape[:bna + 1] + (1,) * (nd - bna)
    if attrs["begin_params_axis"] == bna:
        out = _kernels.layer_norm(_rows(xs, bna), _rows(gammas, 0)[:, 0],
                                  _rows(betas, 0)[:, 0], attrs["epsilon"])
        if out is not None:
            y, mean, var = out
            return y.reshape(xs.shape), mean.reshape(stats_shape), var.reshape(stats_shape)
    axes = tuple(range(bna + 1, nd + 1))
    x64 = xs.astype(np.float64)
    mean = x64.mean(axis=axes, keepdims=True)
    centred = x64 - mean
    var = np.square(centred).mean(axis=axes, keepdims=True)
    centred *= 1.0 / np.sqrt(var + attrs["epsilon"])
    centred *= _per_device(gammas, nd)
    centred += _per_device(betas, nd)
    dt = xs.dtype
    return centred.astype(dt), mean.astype(dt), var.astype(dt)


def _layer_norm_kernel(attrs, x, gamma, beta):
    return tuple(o[0] for o in layer_norm_stack(attrs, x[None], gamma[None], beta[None]))


def _bw_layer_norm(node, gy, g_mean, g_var):
    """xhat = (x - mean) * rstd, rstd = 1 / sqrt(variance + epsilon), N the count of the
    normalised dims: dx = rstd * (d - mean_N(d) - xhat * mean_N(d * xhat)) with d = gy *
    gamma, plus g_mean / N and g_var * 2 (x - mean) / N from the statistics' outputs;
    dgamma = sum(gy * xhat), dbeta = sum(gy) over the dims before begin_params_axis."""
    x, gamma = node.inputs[0], node.inputs[1]
    _, mean, var = node.outputs
    attrs = node.attrs
    nd = len(x.shape)
    bna, bpa = attrs["begin_norm_axis"], attrs["begin_params_axis"]
    need = [node.needs_grad(i) for i in range(3)]
    if bna == bpa and unused_grad(g_mean) and unused_grad(g_var) and not unused_grad(gy):
        # the common case, one fused op: LayerNormGrad
        grads = apply(LAYER_NORM_GRAD, attrs, (x, gy, var, mean, gamma))
        return tuple(g if n else None for g, n in zip(grads, need))
    norm = tuple(range(bna, nd))
    lead = tuple(range(bpa))
    count = int(np.prod(x.shape[bna:]))
    rstd = M.div(A.ones_like(var), M.sqrt(M.add(var, float(attrs["epsilon"]))))
    centred = M.sub(x, mean)
    xhat = M.mul(centred, rstd)
    grads = [None, None, None]
    if need[0]:
        d = M.mul(gy, gamma)
        inner = M.sub(d, M.reduce_mean(d, norm, True))
        inner = M.sub(inner, M.mul(xhat, M.reduce_mean(M.mul(d, xhat), norm, True)))
        gx = M.mul(inner, rstd)
        if not unused_grad(g_mean):
            gx = M.add(gx, M.mul(g_mean, 1.0 / count))
        if not unused_grad(g_var):
            gx = M.add(gx, M.mul(centred, M.mul(g_var, 2.0 / count)))
        grads[0] = gx
    if need[1]:
        gg = M.mul(gy, xhat)
        grads[1] = M.reduce_sum(gg, lead, False) if lead else gg
    if need[2]:
        grads[2] = M.reduce_sum(gy, lead, False) if lead else gy
    return tuple(grads)


LAYER_NORM = register(LN_NAME, infer=_infer_layer_norm, kernel=_layer_norm_kernel,
                      backward=_bw_layer_norm, save_outputs=True, multi_output=True)


# LayerNormGrad (x, dy, variance, mean, gamma) -> (dx, dgamma, dbeta): LayerNorm's
# backward as one op when gamma spans the normalised dims and only y's gradient flows
LNG_NAME = "LayerNormGrad"
_LNG_SEEN: dict = {}


def _infer_layer_norm_grad(attrs, x, dy, var, mean, gamma):
    key = (x.shape, dy.shape, var.shape, mean.shape, gamma.shape, x.dtype, dy.dtype,
           var.dtype, mean.dtype, gamma.dtype, attrs["begin_norm_axis"],
           attrs["begin_params_axis"])
    return checked_once(_LNG_SEEN, key, _check_layer_norm_grad, attrs, x, dy, var, mean,
                        gamma)


def _check_layer_norm_grad(attrs, x, dy, var, mean, gamma):
    check_float(LNG_NAME, x)
    check_same_dtype(LNG_NAME, (x, dy, var, mean, gamma))
    bna, bpa = attrs["begin_norm_axis"], attrs["begin_params_axis"]
    shape = tuple(x.shape)
    if bna != bpa or not 0 <= bna < len(shape):
        raise ValueError(f"{LNG_NAME}: begin_norm_axis={bna} and begin_params_axis={bpa} "
                         f"must be one axis of x of shape {shape}")
    stats = shape[:bna] + (1,) * (len(shape) - bna)
    for key, t, want in (("dy", dy, shape), ("variance", var, stats), ("mean", mean, stats),
                         ("gamma", gamma, shape[bpa:])):
        if tuple(t.shape) != want:
            raise ValueError(f"{LNG_NAME}: {key} has shape {tuple(t.shape)}; expected "
                             f"{want} for x of shape {shape}")
    params = (shape[bpa:], x.dtype)
    return ((shape, x.dtype), params, params)


def layer_norm_grad_stack(attrs, xs, dys, variances, means, gammas):
    """LayerNormGrad on stacks (a leading device axis): ``(dx, dgamma, dbeta)``, dgamma
    and dbeta each device's sums over its own rows. One Cython pass per row
    (:func:`dualmode._core._kernels.layer_norm_grad`); float16 through float32."""
    bna = attrs["begin_norm_axis"]
    args = [_rows(xs, bna), _rows(dys, bna), _rows(means, bna)[..., 0],
            _rows(variances, bna)[..., 0], _rows(gammas, 0)[:, 0]]
    if xs.dtype == np.float16:
        args = [a.astype(np.float32) for a in args]
    dx, dg, db = (o.astype(xs.dtype, copy=False)
                  for o in _kernels.layer_norm_grad(*args, attrs["epsilon"]))
    return dx.reshape(xs.shape), dg.reshape(gammas.shape), db.reshape(gammas.shape)


def _layer_norm_grad_kernel(attrs, x, dy, var, mean, gamma):
    return tuple(o[0] for o in layer_norm_grad_stack(attrs, x[None], dy[None], var[None],
                                                     mean[None], gamma[None]))


LAYER_NORM_GRAD = register(LNG_NAME, infer=_infer_layer_norm_grad,
                           kernel=_layer_norm_grad_kernel, multi_output=True, linear=(1,))
# zero rows of x and dy (the pads of a batch that does not divide) give zero rows of dx
# and add nothing to dgamma and dbeta: the kernel runs once on padded global values
LAYER_NORM_GRAD.extras["pads_exact"] = True


def layer_norm_op(x, gamma, beta, begin_norm_axis=1, begin_params_axis=1, epsilon=1e-7):
    """``(y, mean, variance)`` of the LayerNorm op: x normalised over its dims from
    `begin_norm_axis` with their mean and biased variance, scaled by `gamma` and shifted
    by `beta` (both of x's shape from `begin_params_axis`); the statistics keep the
    normalised dims as 1s."""
    x = const(x, LN_NAME)
    bna, bpa = layer_norm_axes(LN_NAME, begin_norm_axis, begin_params_axis, x.ndim)
    attrs = {"begin_norm_axis": bna, "begin_params_axis": bpa, "epsilon": float(epsilon)}
    return apply(LAYER_NORM, attrs, (x, const(gamma, LN_NAME), const(beta, LN_NAME)))


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):  # noqa: A002
    """Layer normalisation over the trailing dims `normalized_shape` of `input` (as
    ``mindspore.ops.layer_norm``): ``(x - mean) / sqrt(var + eps) * weight + bias``;
    weight defaults to ones and bias to zeros. Returns the normalised tensor."""
    x = const(input, LN_NAME)
    if isinstance(normalized_shape, (int, np.integer)) and not isinstance(normalized_shape,
                                                                          bool):
        normalized_shape = (int(normalized_shape),)
    if not isinstance(normalized_shape, (tuple, list)) or not normalized_shape or \
            tuple(x.shape[x.ndim - len(normalized_shape):]) != tuple(normalized_shape) or \
            len(normalized_shape) > x.ndim:
        raise ValueError(f"{LN_NAME}: normalized_shape={normalized_shape!r} must be the "
                         f"trailing dims of input of shape {tuple(x.shape)}")
    axis = x.ndim - len(normalized_shape)
    shape = tuple(normalized_shape)
    if weight is None:
        weight = np.ones(shape, x.dtype)
    if bias is None:
        bias = np.zeros(shape, x.dtype)
    return layer_norm_op(x, weight, bias, axis, axis, eps)[0]


# ---------------------------------------------------------------------------
# L2Normalize: x / sqrt(max(sum(x^2, axis), epsilon))
# ---------------------------------------------------------------------------
L2_NAME = "L2Normalize"


def l2_normalize_axes(axis, ndim):
    """L2Normalize's axis (an int, or a tuple/list of ints) as a sorted tuple."""
    if isinstance(axis, (list, tuple)) and not axis:
        raise ValueError(f"{L2_NAME}: axis=() names no axis; give an int or a non-empty "
                         f"tuple of ints")
    if axis is None:
        raise TypeError(f"{L2_NAME}: axis must be an int or a tuple/list of ints, got None")
    if ndim == 0:
        raise ValueError(f"{L2_NAME}: x is 0-d; expected rank >= 1")
    return norm_axes(L2_NAME, axis, ndim)


def _infer_l2_normalize(attrs, x):
    check_float(L2_NAME, x)
    if x.ndim == 0:
        raise ValueError(f"{L2_NAME}: x is 0-d; expected rank >= 1")
    return ((tuple(x.shape), x.dtype),)


def l2_normalize_stack(attrs, xs):
    """``x / sqrt(max(sum(x^2 over attrs["axis"]), epsilon))`` for a stack or one tensor
    (the axes given for the array passed), the sum in float64."""
    sq = np.square(xs, dtype=np.float64).sum(axis=attrs["axis"], keepdims=True)
    return (xs / np.sqrt(np.maximum(sq, attrs["epsilon"]))).astype(xs.dtype)


def _bw_l2_normalize(node, g):
    """y = x * r, r = 1 / sqrt(max(s, epsilon)), s = sum(x^2): dx = r * (g - y * sum(g * y))
    where s > epsilon, r * g where the floor holds s."""
    x = node.inputs[0]
    y = node.outputs[0]
    axis, eps = node.attrs["axis"], float(node.attrs["epsilon"])
    s = M.reduce_sum(M.mul(x, x), axis, True)
    r = M.div(A.ones_like(s), M.sqrt(M.maximum(s, eps)))
    above = M.cast(M.greater(s, eps), x.dtype)
    proj = M.mul(M.mul(y, M.reduce_sum(M.mul(g, y), axis, True)), above)
    return (M.mul(M.sub(g, proj), r),)


L2_NORMALIZE = register(L2_NAME, family=("along_axis",), infer=_infer_l2_normalize,
                        kernel=l2_normalize_stack, backward=_bw_l2_normalize,
                        save_outputs=True)


def l2_normalize(x, axis=0, epsilon=1e-4):
    """``x / sqrt(max(sum(x^2, axis), epsilon))`` (MindSpore's L2Normalize): `axis` an
    int or a tuple/list of ints."""
    x = const(x, L2_NAME)
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
        raise TypeError(f"{L2_NAME}: epsilon must be a float, got {epsilon!r}")
    axes = l2_normalize_axes(axis, x.ndim)
    return apply(L2_NORMALIZE, {"axis": axes, "epsilon": float(epsilon)}, (x,))
