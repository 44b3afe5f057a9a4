"""Type stub for the Philox4x32-10 kernels (`_random.pyx`); reference in
`random_reference.py`."""
import numpy as np

UNIFORM: int
NORMAL: int

def fill_index(key: int, index: np.ndarray, out: np.ndarray, dist: int = ...,
               a: float = ..., b: float = ...) -> None:
    """Fill `out` (float32/float64, 1-D) with the values of the flat elements `index`
    (int64, 1-D) of the tensor of 64-bit `key`: U(a, b) (dist=UNIFORM) or N(a, b^2)
    (dist=NORMAL)."""
    ...

def fill_blocks(key: int, strides: np.ndarray, starts: np.ndarray, steps: np.ndarray,
                bshape: np.ndarray, out: np.ndarray, dist: int = ..., a: float = ...,
                b: float = ...) -> None:
    """Fill `out` (flat, C order) with the equally shaped blocks of the tensor of `key`
    starting at the rows of `starts` (int64 (nb, ndim)), `bshape` elements `steps` apart;
    `strides` are the tensor's element strides (C order)."""
    ...

def philox4x32_10(c01: int, c23: int, key: int) -> tuple[int, int, int, int]:
    """The four output words of Philox4x32-10 (known-answer tests)."""
    ...
