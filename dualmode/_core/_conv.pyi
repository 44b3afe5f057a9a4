"""Type stub for the convolution data-movement kernels (`_conv.pyx`); numpy references
(``*_numpy``) in `dualmode/ops/_conv.py`.

Dtypes: float32 and float64 (float16 arrays take the numpy references). Inputs of any
strides are copied to C order first; outputs are new C-contiguous arrays. Errors name
the kernel, the parameter and what is valid.
"""
from typing import Sequence

import numpy as np

DTYPES: tuple[np.dtype, ...]

def to_channels_last(x: np.ndarray, pads: Sequence[int] = (0, 0, 0, 0)) -> np.ndarray:
    """(B, C, H, W) -> (B, H + top + bottom, W + left + right, C) with a zero border;
    pads = (top, bottom, left, right)."""
    ...

def to_channels_first(xh: np.ndarray, origin: Sequence[int] = (0, 0),
                      hw: Sequence[int] | None = None) -> np.ndarray:
    """The (H, W) block of xh (B, Hp, Wp, C) at origin (top, left) -> (B, C, H, W)."""
    ...

def im2col(xh: np.ndarray, kernel: Sequence[int], stride: Sequence[int],
           dilation: Sequence[int], out_hw: Sequence[int], group: int = 1) -> np.ndarray:
    """The Ho x Wo windows of xh (B, Hp, Wp, C) as rows (B * Ho * Wo, kh * kw * C),
    ordered (group, kh, kw, C / group). Raises ValueError if a window leaves the grid."""
    ...

def col2im(cols: np.ndarray, batch: int, grid_hw: Sequence[int], kernel: Sequence[int],
           stride: Sequence[int], dilation: Sequence[int], out_hw: Sequence[int],
           group: int = 1) -> np.ndarray:
    """The adjoint of im2col: window rows `cols` added onto a zero grid (batch, Hp, Wp,
    C)."""
    ...

def max_pool(x: np.ndarray, kernel: Sequence[int], stride: Sequence[int],
             pads: Sequence[int] = (0, 0, 0, 0)) -> np.ndarray:
    """Max over the windows of the planes x (B, H, W) -> (B, Ho, Wo); padding (top,
    bottom, left, right) never wins, NaN propagates."""
    ...

def max_pool_grad(x: np.ndarray, dy: np.ndarray, kernel: Sequence[int],
                  stride: Sequence[int], pads: Sequence[int] = (0, 0, 0, 0)) -> np.ndarray:
    """dy (B, Ho, Wo) added into a zero (B, H, W) at each window's first maximum
    (numpy's argmax order; NaN wins)."""
    ...

def channel_sums(x: np.ndarray) -> np.ndarray:
    """Per device d and channel c of x (D, B, C, L): float64 sum and sum of squares over B
    and L -> (D, 2, C)."""
    ...

def channel_affine(x: np.ndarray, shift: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """shift[d, c] + scale[d, c] * x[d, b, c, l] for x (D, B, C, L) and shift, scale (D, C)
    of x's dtype."""
    ...
