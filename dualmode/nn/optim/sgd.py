"""SGD with optional momentum, dampening, Nesterov momentum and weight decay."""
from __future__ import annotations

import numpy as np

from .._checks import check_bool, check_float
from .optimizer import Optimizer, _storage, _sub_scaled

__all__ = ["SGD"]


class SGD(Optimizer):
    """Stochastic gradient descent (MindSpore's ``nn.SGD``, PyTorch's formula).

    With ``g = grad / loss_scale + weight_decay * p``::

        momentum == 0:  p -= lr * g
        otherwise:      v = g on the first step, else momentum * v + (1 - dampening) * g
                        p -= lr * (g + momentum * v)  if nesterov  else  lr * v

    Parameters
    ----------
    params : list of Parameters or of group dicts (see ``Optimizer``)
    learning_rate : float, list or callable (default 0.1)
    momentum : float >= 0
    dampening : float
    weight_decay : float >= 0
    nesterov : bool
        Needs ``momentum > 0`` and ``dampening == 0``.
    loss_scale : float > 0
    """

    def __init__(self, params, learning_rate=0.1, momentum=0.0, dampening=0.0,
                 weight_decay=0.0, nesterov=False, loss_scale=1.0):
        super().__init__(learning_rate, params, weight_decay, loss_scale)
        self.momentum = check_float("SGD", "momentum", momentum, 0.0)
        self.dampening = check_float("SGD", "dampening", dampening)
        self.nesterov = check_bool("SGD", "nesterov", nesterov)
        if self.nesterov and (self.momentum <= 0.0 or self.dampening != 0.0):
            raise ValueError(f"SGD: nesterov=True needs momentum > 0 and dampening == 0, got "
                             f"momentum={self.momentum}, dampening={self.dampening}")
        if self.momentum > 0.0:
            self.accum = self._states("accum")
            self._fresh = [True] * len(self.parameters)

    def _update(self, i, w, g, lr):
        if self.momentum == 0.0:
            _sub_scaled(w, g, lr)
            return
        v = _storage(self.accum[i], w)
        if self._fresh[i]:
            np.copyto(v, g)
            self._fresh[i] = False
        else:
            v *= self.momentum
            if self.dampening:
                v += (1.0 - self.dampening) * g
            else:
                v += g
        if self.nesterov:
            w -= lr * (g + self.momentum * v)
        else:
            _sub_scaled(w, v, lr)
