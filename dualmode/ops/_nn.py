"""Neural-network ops: Softmax, LogSoftmax, fused softmax cross-entropy, Dropout."""
from __future__ import annotations

import numpy as np

from .._core import _kernels
from ..context import rng
from . import _math as M
from ._registry import (apply, check_float, check_int_dtype, checked_once, const, norm_axis,
                        register, wrap)


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


SPARSE_XENT_GRAD = register("SparseSoftmaxCrossEntropyGrad", infer=_infer_sparse_xent_grad,
                            kernel=_sparse_xent_grad_kernel, family=("rowwise",))


def _bw_sparse_xent(node, g_loss, g_probs):
    logits, labels = node.inputs
    probs = node.outputs[1]
    d = apply(SPARSE_XENT_GRAD, None, (probs, labels, g_loss))
    return d, None


SPARSE_XENT = register("SparseSoftmaxCrossEntropyWithLogits", infer=_infer_sparse_xent,
                       kernel=_sparse_xent_kernel, backward=_bw_sparse_xent,
                       save_outputs=True, multi_output=True, family=("rowwise",))


def sparse_softmax_cross_entropy(logits, labels):
    """Per-sample -log softmax(logits)[label] for logits (N, C) and int labels (N,)."""
    loss, _ = apply(SPARSE_XENT, None, (const(logits, SPARSE_XENT.name),
                                        const(labels, SPARSE_XENT.name)))
    return loss


def softmax_cross_entropy(logits, labels, axis=-1):
    """Per-sample -sum(labels * log_softmax(logits)) for dense (probability) labels."""
    logits = const(logits, "SoftmaxCrossEntropyWithLogits")
    labels = const(labels, "SoftmaxCrossEntropyWithLogits")
    if tuple(logits.shape) != tuple(labels.shape):
        raise ValueError(f"SoftmaxCrossEntropyWithLogits: logits have shape "
                         f"{tuple(logits.shape)} but labels have shape {tuple(labels.shape)}; "
                         f"dense labels must match the logits")
    return M.neg(M.reduce_sum(M.mul(labels, log_softmax(logits, axis)), axis, False))


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
