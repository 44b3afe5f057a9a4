"""LARS: layer-wise adaptive rate scaling around another optimizer (MindSpore's
``nn.LARS``)."""
from __future__ import annotations

import numpy as np

from ... import ops
from ..._core import _tensor as _core
from ..._core._tensor import TensorBase
from ...parallel.grad_reduce import fuse_gradient_moves, reduce_gradients
from ...parallel.moves import redistribute_tensor
from ...parallel.strategy import is_sharded_layout
from ...tensor import Tensor
from .._checks import check_bool
from .optimizer import Optimizer

__all__ = ["LARS"]


def _default_filter(p):
    return "LayerNorm" not in p.name and "bias" not in p.name


def _float(owner, name, value):
    if isinstance(value, bool) or not isinstance(value, float):
        raise TypeError(f"{owner}: {name} must be a float, got {value!r}")
    return value


class LARS(Optimizer):
    """Wrap `optimizer` so each parameter's gradient is rescaled layer by layer before
    the wrapped update (MindSpore's ``nn.LARS``). For a parameter chosen by
    `lars_filter`, with ``g`` its gradient divided by the loss scale and ``d`` its
    weight decay (0 where the wrapped optimizer would not decay it)::

        ratio = coefficient * |w| / (|g| + d * |w| + epsilon)   (1 when |w| or |g| is 0)
        ratio = min(ratio / learning_rate, 1)                   (use_clip=True)
        g     = ratio * (g + d * w)

    The other parameters keep their gradient (divided by the loss scale) and get no
    weight decay; the wrapped optimizer then runs with no weight decay and no loss
    scale of its own. The norms are those of the whole parameter: for a sharded weight
    each device sums its shard and one AllReduce of a scalar totals them.

    Parameters
    ----------
    optimizer : Optimizer
        The optimizer to wrap (e.g. ``nn.Momentum``); its weight decay and loss scale
        move to LARS.
    epsilon : float
        Added to the denominator (default 1e-5).
    coefficient : float
        The trust coefficient (default 0.001).
    use_clip : bool
        Clip the ratio at the learning rate (default False).
    lars_filter : callable(Parameter) -> bool
        Which parameters LARS rescales (default: names without "LayerNorm" or "bias").
    """

    def __init__(self, optimizer, epsilon=1e-05, coefficient=0.001, use_clip=False,
                 lars_filter=_default_filter):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"LARS: optimizer must be an Optimizer (e.g. nn.Momentum), got "
                            f"{type(optimizer).__name__}")
        if isinstance(optimizer, LARS):
            raise TypeError("LARS: optimizer is already a LARS; wrap the inner optimizer "
                            "once")
        if not callable(lars_filter):
            raise TypeError(f"LARS: lars_filter must be a function of a Parameter, got "
                            f"{type(lars_filter).__name__}")
        super().__init__(optimizer.learning_rate, list(optimizer.parameters))
        self.epsilon = _float("LARS", "epsilon", epsilon)
        self.coefficient = _float("LARS", "coefficient", coefficient)
        self.use_clip = check_bool("LARS", "use_clip", use_clip)
        self.opt = optimizer
        self.is_group = optimizer.is_group
        self.lars_flag = tuple(bool(lars_filter(p)) for p in self.parameters)
        # the wrapped optimizer's weight decay and loss scale move here
        self._lars_decay = tuple(optimizer._decay)
        self._lars_scale = 1.0 / optimizer.loss_scale
        self.weight_decay = optimizer.weight_decay
        optimizer._decay = tuple(0.0 for _ in optimizer._decay)
        optimizer.weight_decay = 0.0
        optimizer._inv_scale = 1.0
        self._decay = optimizer._decay
        self._inv_scale = 1.0
        self._lr_of = [None] * len(self.parameters)
        for group in optimizer._groups:
            for i in range(group.start, group.stop):
                self._lr_of[i] = group.lr

    def get_lr(self):
        return self.opt.get_lr()

    def construct(self, gradients):
        """Rescale `gradients` (aligned with ``.parameters``) and run the wrapped
        optimizer on them."""
        params = self.parameters
        distributed = self._recorded_or_checked(gradients)
        if distributed is None:              # recorded into the graph being traced
            return True
        if distributed:
            # the gradient communication the wrapped optimizer would make (sharded
            # weights' gradients moved into their layouts, data-parallel AllReduces),
            # before the norms are taken
            gradients = reduce_gradients(fuse_gradient_moves(gradients, params), params)
        step = self.opt.global_step
        out = []
        for i, (p, g) in enumerate(zip(params, gradients)):
            if not p.requires_grad:
                out.append(g)
                continue
            if not isinstance(g, TensorBase):
                g = Tensor(np.asarray(g))
            elif p._layout is not None and is_sharded_layout(p._layout) and \
                    g._layout != p._layout:
                # a sharded weight's gradient moved into its layout (its ReduceScatter /
                # AllReduce, as the wrapped optimizer would move it): the norms and the
                # rescaled gradient are then computed on the local shards
                g = _core.wrap_dist(redistribute_tensor(g, p._layout, p.name,
                                                        reason="gradient"), p._layout)
            if self._lars_scale != 1.0:
                g = ops.mul(g, self._lars_scale)
            if self.lars_flag[i]:
                g = self._rescaled(p, g, self._lars_decay[i], self._lr_of[i](step))
            out.append(g)
        done = self.opt(tuple(out))
        self.global_step = self.opt.global_step
        return done

    def _rescaled(self, w, g, decay, lr):
        """``ratio * (g + decay * w)`` with the layer's trust ratio."""
        w_norm = float(np.sqrt(float(ops.reduce_sum(ops.square(w)).asnumpy())))
        g_norm = float(np.sqrt(float(ops.reduce_sum(ops.square(g)).asnumpy())))
        ratio = 1.0
        if w_norm > 0 and g_norm > 0:
            ratio = self.coefficient * w_norm / (g_norm + decay * w_norm + self.epsilon)
        if self.use_clip:
            ratio = min(ratio / lr, 1.0)
        if decay:
            g = ops.add(g, ops.mul(w, decay))
        return ops.mul(g, ratio)

    def extend_repr(self):
        return (f"optimizer={type(self.opt).__name__}, epsilon={self.epsilon}, "
                f"coefficient={self.coefficient}, use_clip={self.use_clip}")
