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


def layer_norm(x, gamma, beta, eps):
    """Reference for `_kernels.layer_norm`: a stack x (D, R, N) normalised along its
    rows in float64, gamma and beta (D, N); (y, mean, variance) in x's dtype."""
    x64 = np.asarray(x, np.float64)
    mean = x64.mean(axis=2)
    centred = x64 - mean[..., None]
    var = np.square(centred).mean(axis=2)
    y = centred / np.sqrt(var + eps)[..., None] * gamma[:, None] + beta[:, None]
    return y.astype(x.dtype), mean.astype(x.dtype), var.astype(x.dtype)


def layer_norm_grad(x, dy, mean, var, gamma, eps):
    """Reference for `_kernels.layer_norm_grad`, in float64: (dx, dgamma, dbeta) with
    dgamma and dbeta each device's sums over its rows."""
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    rstd = 1.0 / np.sqrt(np.asarray(var, np.float64) + eps)[..., None]
    xhat = (x64 - np.asarray(mean, np.float64)[..., None]) * rstd
    d = dy64 * np.asarray(gamma, np.float64)[:, None]
    dx = rstd * (d - d.mean(axis=2, keepdims=True)
                 - xhat * (d * xhat).mean(axis=2, keepdims=True))
    return dx, (dy64 * xhat).sum(axis=1), dy64.sum(axis=1)
