"""Type stub for the parameter-server kernels (`_ps_kernels.pyx`); numpy reference:
`dualmode.ps.optim.fused_update_reference`."""
from typing import Optional, Sequence

import numpy as np

def sgd_update(out: np.ndarray, w: np.ndarray, grads: Sequence[np.ndarray], lr: float,
               mean: bool, v: Optional[np.ndarray] = None, momentum: float = 0.0) -> bool:
    """``out = w - lr * s`` (plain SGD) or, with Momentum's state `v`,
    ``v = v * momentum + s; out = w - lr * v``, where ``s`` is the sum of `grads` in
    order (divided by their count when `mean`); one pass, GIL released. `out` may be
    `w` or ``grads[0]``. False, doing nothing, unless every array is C-contiguous with
    the float32/float64 dtype and shape of `w` (`out`, `v` writable)."""
    ...
