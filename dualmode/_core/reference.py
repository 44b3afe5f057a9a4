"""Plain numpy references for the Cython kernels (tests compare against these)."""
import numpy as np


def sparse_softmax_xent(logits, labels):
    """Reference for `_kernels.sparse_softmax_xent`: (loss per row, softmax)."""
    logits = np.asarray(logits)
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    s = e.sum(axis=1, keepdims=True)
    probs = e / s
    loss = (np.log(s) + m)[:, 0] - logits[np.arange(len(labels)), labels]
    return loss.astype(logits.dtype), probs.astype(logits.dtype)


def sub_scaled(w, g, a):
    """Reference for `_kernels.sub_scaled`: ``w -= a * g`` in place (numpy's rounding)."""
    w -= a * g
    return True


def relu_grad(y, dy):
    """Reference for `_kernels.relu_grad`: ReLU's gradient from its output."""
    return dy * (y > 0)


def tanh_grad(y, dy):
    """Reference for `_kernels.tanh_grad`: Tanh's gradient from its output."""
    return dy * (1 - y * y)


def sigmoid_grad(y, dy):
    """Reference for `_kernels.sigmoid_grad`: Sigmoid's gradient from its output."""
    return dy * y * (1 - y)


def sparse_xent_grad(probs, labels, g):
    """Reference for `_kernels.sparse_xent_grad`: the gradient of per-row softmax
    cross-entropy (softmax `probs`, integer `labels`, loss gradient `g`)."""
    d = probs * g[:, None]
    d[np.arange(labels.shape[0]), labels] -= g
    return d
