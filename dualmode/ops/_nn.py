"""Neural-network ops: Softmax, LogSoftmax, fused softmax cross-entropy, Dropout."""
from __future__ import annotations

import numpy as np

from .._core import _kernels
from .._core._tensor import TensorBase
from ..context import rng
from . import _array as A
from . import _math as M
from ._registry import (apply, check_float, check_int_dtype, check_same_dtype, checked_once,
                        const, norm_axis, register, wrap)


# ---------------------------------------------------------------------------
# Softmax / LogSoftmax
# ---------------------------------------------------------------------------
def _softmax_kernel(attrs, x):
    axis = attrs["axis"]
    e = x - np.max(x, axis=axis, keepdims=True)
    np.exp(e, out=e)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


def _log_softmax_kernel(attrs, x):
    axis = attrs["axis"]
    s = x - np.max(x, axis=axis, keepdims=True)
    s -= np.log(np.sum(np.exp(s), axis=axis, keepdims=True))
    return s


def _make_infer(name):
    def infer(attrs, x):
        check_float(name, x)
        if x.ndim == 0:
            raise ValueError(f"{name}: input 0 is 0-d; expected rank >= 1")
        return ((tuple(x.shape), x.dtype),)
    return infer


def _bw_softmax(node, g):
    y = node.outputs[0]
    axis = node.attrs["axis"]
    gy = M.mul(g, y)
    return (M.sub(gy, M.mul(y, M.reduce_sum(gy, axis, True))),)


def _bw_log_softmax(node, g):
    y = node.outputs[0]
    axis = node.attrs["axis"]
    return (M.sub(g, M.mul(M.exp(y), M.reduce_sum(g, axis, True))),)


SOFTMAX = register("Softmax", family=("along_axis",), infer=_make_infer("Softmax"), kernel=_softmax_kernel,
                   backward=_bw_softmax, save_outputs=True)
LOG_SOFTMAX = register("LogSoftmax", family=("along_axis",),
                       infer=_make_infer("LogSoftmax"),
                       kernel=_log_softmax_kernel, backward=_bw_log_softmax, save_outputs=True)


def softmax(x, axis=-1):
    """exp(x) / sum(exp(x)) along `axis` (computed stably)."""
    x = const(x, "Softmax")
    return apply(SOFTMAX, {"axis": norm_axis("Softmax", axis, x.ndim)}, (x,))


def log_softmax(x, axis=-1):
    """log(softmax(x)) along `axis` (computed stably)."""
    x = const(x, "LogSoftmax")
    return apply(LOG_SOFTMAX, {"axis": norm_axis("LogSoftmax", axis, x.ndim)}, (x,))


# ---------------------------------------------------------------------------
# fused sparse softmax cross-entropy: per-sample loss, probabilities kept for backward
# ---------------------------------------------------------------------------
#: (shapes, dtypes) of SparseSoftmaxCrossEntropyWithLogits already validated -> output meta
_XENT_SEEN: dict = {}


def _infer_sparse_xent(attrs, logits, labels):
    key = (logits.shape, labels.shape, logits.dtype, labels.dtype)
    return checked_once(_XENT_SEEN, key, _check_sparse_xent, logits, labels)


def _check_sparse_xent(logits, labels):
    name = "SparseSoftmaxCrossEntropyWithLogits"
    check_float(name, logits)
    check_int_dtype(name, labels, 1, "labels")
    if logits.ndim != 2 or labels.ndim != 1 or labels.shape[0] != logits.shape[0]:
        raise ValueError(f"{name}: logits have shape {tuple(logits.shape)} and labels shape "
                         f"{tuple(labels.shape)}; expected logits (N, C) and labels (N,)")
    n, c = logits.shape
    return (((n,), logits.dtype), ((n, c), logits.dtype))


def _sparse_xent_kernel(attrs, logits, labels):
    if logits.dtype == np.float16:
        loss, probs = _kernels.sparse_softmax_xent(logits.astype(np.float32), labels)
        return loss.astype(np.float16), probs.astype(np.float16)
    return _kernels.sparse_softmax_xent(logits, labels)


def _sparse_xent_grad_kernel(attrs, probs, labels, g):
    d = _kernels.sparse_xent_grad(probs, labels, g)      # one pass, when it applies
    if d is not None:
        return d
    d = probs * g[:, None]
    d[np.arange(labels.shape[0]), labels] -= g
    return d


def _infer_sparse_xent_grad(attrs, probs, labels, g):
    name = "SparseSoftmaxCrossEntropyGrad"
    check_float(name, probs)
    check_int_dtype(name, labels, 1, "labels")
    return ((tuple(probs.shape), probs.dtype),)


def _bw_sparse_xent_grad(node, gg):
    """d = g * (probs - onehot(labels)): to the probabilities gg * g per row, to the row
    weights g the row sums of gg * (probs - onehot)."""
    probs, labels, g = node.inputs
    d_probs = d_g = None
    if node.needs_grad(0):
        d_probs = M.mul(gg, A.expand_dims(g, -1))
    if node.needs_grad(2):
        ones = A.ones_like(g)
        d_g = M.reduce_sum(M.mul(gg, apply(SPARSE_XENT_GRAD, None, (probs, labels, ones))),
                           -1, False)
    return d_probs, None, d_g


SPARSE_XENT_GRAD = register("SparseSoftmaxCrossEntropyGrad", infer=_infer_sparse_xent_grad,
                            kernel=_sparse_xent_grad_kernel, backward=_bw_sparse_xent_grad,
                            family=("rowwise",))


def _bw_sparse_xent(node, g_loss, g_probs):
    """Through the per-sample loss: the fused gradient op; through the probabilities:
    the softmax's Jacobian (skipped when they are unused)."""
    logits, labels = node.inputs
    probs = node.outputs[1]
    d = apply(SPARSE_XENT_GRAD, None, (probs, labels, g_loss))
    if not unused_grad(g_probs):
        gp = M.mul(g_probs, probs)
        d = M.add(d, M.sub(gp, M.mul(probs, M.reduce_sum(gp, -1, True))))
    return d, None


SPARSE_XENT = register("SparseSoftmaxCrossEntropyWithLogits", infer=_infer_sparse_xent,
                       kernel=_sparse_xent_kernel, backward=_bw_sparse_xent,
                       save_outputs=True, multi_output=True, family=("rowwise",))


def _sparse_xent_pair(logits, labels):
    return apply(SPARSE_XENT, None, (const(logits, SPARSE_XENT.name),
                                     const(labels, SPARSE_XENT.name)))


def sparse_softmax_cross_entropy(logits, labels):
    """Per-sample -log softmax(logits)[label] for logits (N, C) and int labels (N,)."""
    return _sparse_xent_pair(logits, labels)[0]


def sparse_softmax_cross_entropy_mean(logits, labels):
    """The mean over the batch of -log softmax(logits)[label] (a scalar), as MindSpore's
    ``SparseSoftmaxCrossEntropyWithLogits()`` primitive returns it. With the rows split
    over devices each holds a part of the sum: one AllReduce finishes it where needed."""
    return M.reduce_mean(sparse_softmax_cross_entropy(logits, labels))


def sparse_softmax_cross_entropy_grad(logits, labels):
    """(softmax(logits) - onehot(labels)) / N, the gradient of the batch's mean loss with
    respect to the logits, as ``SparseSoftmaxCrossEntropyWithLogits(is_grad=True)``
    returns it (differentiable in turn: the softmax's Jacobian / N)."""
    logits = const(logits, SPARSE_XENT.name)
    labels = const(labels, SPARSE_XENT.name)
    _, probs = _sparse_xent_pair(logits, labels)
    n = probs.shape[0]
    weights = const(np.full((n,), 1.0 / max(n, 1), probs.dtype), SPARSE_XENT.name)
    return apply(SPARSE_XENT_GRAD, None, (probs, labels, weights))


# ---------------------------------------------------------------------------
# dense softmax cross-entropy: (loss, dlogits) as MindSpore's primitive, one fused op
# ---------------------------------------------------------------------------
XENT_NAME = "SoftmaxCrossEntropyWithLogits"
#: (shapes, dtypes) of SoftmaxCrossEntropyWithLogits already validated -> output meta
_DENSE_XENT_SEEN: dict = {}


def _infer_xent(attrs, logits, labels):
    key = (logits.shape, labels.shape, logits.dtype, labels.dtype)
    return checked_once(_DENSE_XENT_SEEN, key, _check_xent, logits, labels)


def _check_xent(logits, labels):
    check_float(XENT_NAME, logits)
    check_float(XENT_NAME, labels, 1)
    if tuple(logits.shape) != tuple(labels.shape):
        raise ValueError(f"{XENT_NAME}: logits have shape {tuple(logits.shape)} but labels "
                         f"have shape {tuple(labels.shape)}; dense labels must match the "
                         f"logits")
    if logits.ndim == 0:
        raise ValueError(f"{XENT_NAME}: logits are 0-d; expected (N, C) (the classes on "
                         f"the last dim)")
    check_same_dtype(XENT_NAME, (logits, labels))
    shape = tuple(logits.shape)
    return ((shape[:-1], logits.dtype), (shape, logits.dtype))


def _xent_kernel(attrs, logits, labels):
    """(loss, dlogits): -sum(labels * log_softmax(logits)) over the last dim, and
    softmax(logits) - labels (float16 computed in float32)."""
    dt = logits.dtype
    if dt == np.float16:
        logits, labels = logits.astype(np.float32), labels.astype(np.float32)
    s = logits - np.max(logits, axis=-1, keepdims=True)
    e = np.exp(s)
    z = np.sum(e, axis=-1, keepdims=True)
    s -= np.log(z)
    loss = -np.sum(labels * s, axis=-1)
    e /= z
    e -= labels
    return loss.astype(dt, copy=False), e.astype(dt, copy=False)


def _infer_xent_grad(attrs, dlogits, labels, g):
    name = "SoftmaxCrossEntropyGrad"
    check_float(name, dlogits)
    check_same_dtype(name, (dlogits, labels, g))
    if tuple(labels.shape) != tuple(dlogits.shape) or \
            tuple(g.shape) != tuple(dlogits.shape[:-1]):
        raise ValueError(f"{name}: dlogits {tuple(dlogits.shape)}, labels "
                         f"{tuple(labels.shape)} and the loss gradient {tuple(g.shape)} do "
                         f"not fit; expected (..., C), (..., C) and (...)")
    return ((tuple(dlogits.shape), dlogits.dtype),)


def _xent_grad_kernel(attrs, dlogits, labels, g):
    """d(sum(g * loss))/d(logits) = g * (softmax * sum(labels) - labels), from the saved
    dlogits = softmax - labels: g * (dlogits * S + labels * (S - 1)), S = sum(labels)
    (exactly g * dlogits for labels that sum to 1)."""
    dt = dlogits.dtype
    if dt == np.float16:
        dlogits, labels, g = (a.astype(np.float32) for a in (dlogits, labels, g))
    total = np.sum(labels, axis=-1, keepdims=True)
    d = dlogits * total
    d += labels * (total - 1)
    d *= g[..., None]
    return d.astype(dt, copy=False)


XENT_GRAD = register("SoftmaxCrossEntropyGrad", infer=_infer_xent_grad,
                     kernel=_xent_grad_kernel, family=("rowwise",))


def unused_grad(g):
    """Is `g` the gradient autograd gives an output nothing used (zeros stored once,
    stride 0)? Its contribution is then skipped."""
    if not isinstance(g, TensorBase) or g._layout is not None:
        return False
    a = g._arr
    return isinstance(a, np.ndarray) and a.size > 0 and not any(a.strides) and not a.flat[0]


def _bw_xent(node, g_loss, g_dlogits):
    """Through the loss: the fused gradient op; through dlogits = softmax - labels: the
    softmax's Jacobian for the logits, minus the incoming gradient for the labels. The
    labels' gradient through the loss is -g * log_softmax(logits)."""
    logits, labels = node.inputs
    need_x, need_y = node.needs_grad(0), node.needs_grad(1)
    gx = gy = None
    if need_x:
        gx = apply(XENT_GRAD, None, (node.outputs[1], labels, g_loss))
    if need_y:
        g_col = A.expand_dims(g_loss, -1)
        gy = M.neg(M.mul(g_col, log_softmax(logits, -1)))
    if not unused_grad(g_dlogits):
        if need_x:
            p = softmax(logits, -1)
            gp = M.mul(g_dlogits, p)
            gx = M.add(gx, M.sub(gp, M.mul(p, M.reduce_sum(gp, -1, True))))
        if need_y:
            gy = M.sub(gy, g_dlogits)
    return gx, gy


XENT = register(XENT_NAME, infer=_infer_xent, kernel=_xent_kernel, backward=_bw_xent,
                save_outputs=True, multi_output=True, family=("rowwise",))


def softmax_cross_entropy_pair(logits, labels):
    """``(loss, dlogits)`` of logits (..., C) against dense labels of the same shape:
    the per-sample loss -sum(labels * log_softmax(logits)) and softmax(logits) - labels
    (the gradient of the summed loss for labels that sum to 1), as MindSpore's
    ``SoftmaxCrossEntropyWithLogits`` primitive returns them."""
    return apply(XENT, None, (const(logits, XENT_NAME), const(labels, XENT_NAME)))


def softmax_cross_entropy(logits, labels, axis=-1):
    """Per-sample -sum(labels * log_softmax(logits)) along `axis` for dense (probability)
    labels of the logits' shape."""
    logits = const(logits, XENT_NAME)
    labels = const(labels, XENT_NAME)
    if tuple(logits.shape) != tuple(labels.shape):
        raise ValueError(f"{XENT_NAME}: logits have shape {tuple(logits.shape)} but labels "
                         f"have shape {tuple(labels.shape)}; dense labels must match the "
                         f"logits")
    nd = logits.ndim
    if nd and norm_axis(XENT_NAME, axis, nd) != nd - 1:
        ax = norm_axis(XENT_NAME, axis, nd)
        perm = tuple(d for d in range(nd) if d != ax) + (ax,)
        logits, labels = A.transpose(logits, perm), A.transpose(labels, perm)
    return softmax_cross_entropy_pair(logits, labels)[0]


# ---------------------------------------------------------------------------
# Dropout: (output, mask); the mask is drawn from the context's generator
# ---------------------------------------------------------------------------
def _infer_dropout(attrs, x):
    check_float("Dropout", x)
    return ((tuple(x.shape), x.dtype), (tuple(x.shape), x.dtype))


def _dropout_kernel(attrs, x):
    """(x * mask / keep_prob, mask) with a 0/1 mask in x's dtype (MindSpore CPU/GPU)."""
    keep = attrs["keep_prob"]
    mask = (rng().random(x.shape) < keep).astype(x.dtype)
    out = x * mask
    out *= x.dtype.type(1.0 / keep)
    return out, mask


def _bw_dropout(node, g, g_mask):
    return (M.mul(M.mul(g, node.outputs[1]), 1.0 / node.attrs["keep_prob"]),)


DROPOUT = register("Dropout", infer=_infer_dropout, kernel=_dropout_kernel,
                   backward=_bw_dropout, save_outputs=True, multi_output=True)
DROPOUT.extras["random"] = True     # draws from the context's generator: not a pure map


def dropout(x, p=0.5, training=True):
    """Zero each element with probability `p`, scaling the rest by 1/(1-p)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"Dropout: p={p!r} must be a float in [0, 1)")
    x = const(x, "Dropout")
    if not training or p == 0.0:
        return wrap(x)
    out, _ = apply(DROPOUT, {"keep_prob": 1.0 - float(p)}, (x,))
    return out
