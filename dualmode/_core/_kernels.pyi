"""Type stub for the Cython kernels (`_kernels.pyx`); numpy references in `reference.py`."""
import numpy as np

def sparse_softmax_xent(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (loss, softmax) for float32/float64 logits (N, C) and integer labels (N,).

    Raises ValueError naming the first row whose label is outside [0, C)."""
    ...

def sub_scaled(w: np.ndarray, g: np.ndarray, a: float) -> bool:
    """``w -= a * g`` in place without a temporary for C-contiguous float32/float64 arrays
    of one dtype, `g` of `w`'s shape or of its trailing shape (broadcast over `w`'s
    leading axes: replicas); `a` rounded to their dtype first. False, doing nothing, for
    other arrays."""
    ...

def relu_grad(y: np.ndarray, dy: np.ndarray) -> np.ndarray | None:
    """``dy * (y > 0)`` in one pass for float32/float64 arrays of one shape and dtype,
    C-contiguous or stacks of C-contiguous slices along the leading axis (any stride
    there, 0 included); None for other inputs."""
    ...

def tanh_grad(y: np.ndarray, dy: np.ndarray) -> np.ndarray | None:
    """``dy * (1 - y * y)`` in one pass (inputs as :func:`relu_grad`); None otherwise."""
    ...

def sigmoid_grad(y: np.ndarray, dy: np.ndarray) -> np.ndarray | None:
    """``dy * y * (1 - y)`` in one pass (inputs as :func:`relu_grad`); None otherwise."""
    ...

def sparse_xent_grad(probs: np.ndarray, labels: np.ndarray, g: np.ndarray) -> np.ndarray | None:
    """``probs * g[:, None]`` minus `g` at each row's label, in one pass, for C-contiguous
    float32/float64 probs (N, C), g (N,) of that dtype and C-contiguous int32/int64 labels
    in [0, C); None for other inputs."""
    ...

def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray,
               eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """LayerNorm of the rows of a stack x (D, R, N) with gamma, beta (D, N): (y, mean,
    variance), the statistics (D, R) accumulated in float64, all in x's dtype; None
    unless the inputs are float32/float64 arrays of one dtype and those shapes."""
    ...

def layer_norm_grad(x: np.ndarray, dy: np.ndarray, mean: np.ndarray, var: np.ndarray,
                    gamma: np.ndarray,
                    eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """LayerNorm's gradients (dx, dgamma, dbeta) for dy (D, R, N); dgamma and dbeta
    (D, N) each device's sums over its rows, in float64 then x's dtype; None as
    :func:`layer_norm`."""
    ...
