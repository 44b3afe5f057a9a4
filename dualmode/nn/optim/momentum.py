"""Momentum: MindSpore's ApplyMomentum update."""
from __future__ import annotations

from .._checks import check_bool, check_float
from .optimizer import Optimizer, _storage, _sub_scaled

__all__ = ["Momentum"]


class Momentum(Optimizer):
    """Gradient descent with momentum (MindSpore's ``nn.Momentum``).

    With ``g = grad / loss_scale + weight_decay * p`` and ``v`` the state
    ``moments`` (zeros at the start)::

        v = momentum * v + g
        p -= lr * v                       (use_nesterov=False)
        p -= lr * (g + momentum * v)      (use_nesterov=True)

    Parameters
    ----------
    params : list of Parameters or of group dicts (see ``Optimizer``)
    learning_rate : float, list or callable
    momentum : float >= 0
    weight_decay : float >= 0
    loss_scale : float > 0
    use_nesterov : bool
    """

    def __init__(self, params, learning_rate, momentum, weight_decay=0.0, loss_scale=1.0,
                 use_nesterov=False):
        super().__init__(learning_rate, params, weight_decay, loss_scale)
        self.momentum = check_float("Momentum", "momentum", momentum, 0.0)
        self.use_nesterov = check_bool("Momentum", "use_nesterov", use_nesterov)
        self.moments = self._states("moments")

    def _update(self, i, w, g, lr):
        v = _storage(self.moments[i], w)
        v *= self.momentum
        v += g
        if self.use_nesterov:
            w -= lr * (g + self.momentum * v)
        else:
            _sub_scaled(w, v, lr)
