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
