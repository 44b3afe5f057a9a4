"""Adam: MindSpore's ApplyAdam update (bias correction folded into the step size)."""
from __future__ import annotations

import math

import numpy as np

from .._checks import check_bool, check_float
from .optimizer import Optimizer, _storage

__all__ = ["Adam"]


class Adam(Optimizer):
    """Adam (MindSpore's ``nn.Adam``).

    With ``g = grad / loss_scale + weight_decay * p`` (L2, not AdamW), ``t`` the
    1-based step and states ``moment1`` (m) and ``moment2`` (v)::

        lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p -= lr_t * m / (sqrt(v) + eps)                                   (default)
        p -= lr_t * (beta1 * m + (1 - beta1) * g) / (sqrt(v) + eps)       (use_nesterov)

    Parameters
    ----------
    params : list of Parameters or of group dicts (see ``Optimizer``)
    learning_rate : float, list or callable (default 1e-3)
    beta1, beta2 : float in (0, 1)
    eps : float > 0
    use_locking : bool
        Accepted for MindSpore compatibility (updates are never concurrent here).
    use_nesterov : bool
    weight_decay : float >= 0
    loss_scale : float > 0
    """

    def __init__(self, params, learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                 use_locking=False, use_nesterov=False, weight_decay=0.0, loss_scale=1.0):
        super().__init__(learning_rate, params, weight_decay, loss_scale)
        self.beta1 = check_float("Adam", "beta1", beta1, 0.0, 1.0, True, True)
        self.beta2 = check_float("Adam", "beta2", beta2, 0.0, 1.0, True, True)
        self.eps = check_float("Adam", "eps", eps, 0.0, lo_open=True)
        self.use_locking = check_bool("Adam", "use_locking", use_locking)
        self.use_nesterov = check_bool("Adam", "use_nesterov", use_nesterov)
        self.moment1 = self._states("moment1")
        self.moment2 = self._states("moment2")

    def _update(self, i, w, g, lr):
        b1, b2 = self.beta1, self.beta2
        t = self.global_step + 1
        lr_t = lr * math.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)
        m = _storage(self.moment1[i], w)
        v = _storage(self.moment2[i], w)
        m *= b1
        m += (1.0 - b1) * g
        v *= b2
        v += (1.0 - b2) * np.square(g)
        denom = np.sqrt(v)
        denom += self.eps
        num = b1 * m + (1.0 - b1) * g if self.use_nesterov else m
        np.divide(num, denom, out=denom)
        denom *= lr_t
        w -= denom
