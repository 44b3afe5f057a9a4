"""MindSpore's ``ops.composite`` names: :class:`GradOperation`.

``GradOperation(get_all, get_by_list, sens_param)(net[, weights])`` is the older form of
:func:`dualmode.grad`, as MindSpore's parallel tests and scripts write it::

    from dualmode.ops import composite as C
    grad_all = C.GradOperation(get_all=True)
    dx, dy = grad_all(net)(x, y)
    grad_w = C.GradOperation(get_by_list=True)
    dws = grad_w(net, dm.ParameterTuple(net.trainable_params()))(x, y)
"""
from __future__ import annotations

import numpy as np

from .._core import _tensor as _core
from .._core._tensor import TensorBase
from ..autograd import _check_weights, _differentiate

__all__ = ["GradOperation"]


def _flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"GradOperation: {name} must be a bool, got {value!r}")
    return bool(value)


class GradOperation:
    """A higher-order function making the gradient function of a network.

    Parameters
    ----------
    get_all : bool
        Gradients of every positional input (a tuple) instead of the first one only.
        Inputs that are not floating Tensors get zeros of their shape and dtype.
    get_by_list : bool
        Gradients of the `weights` given with the network (a tuple); with `get_all`
        too, ``(input gradients, weight gradients)``.
    sens_param : bool
        The last positional argument is the sensitivity: the gradient of the network's
        output (a Tensor, or a tuple for a network with several outputs) instead of ones.
    """

    def __init__(self, get_all=False, get_by_list=False, sens_param=False):
        self.get_all = _flag("get_all", get_all)
        self.get_by_list = _flag("get_by_list", get_by_list)
        self.sens_param = _flag("sens_param", sens_param)

    def __call__(self, fn, weights=None):
        if not callable(fn):
            raise TypeError(f"GradOperation: the network must be callable, got "
                            f"{type(fn).__name__}")
        if self.get_by_list:
            if weights is None:
                raise TypeError("GradOperation: get_by_list=True needs the weights: "
                                "grad_op(net, ParameterTuple(net.trainable_params()))")
            ws, _ = _check_weights(weights)
        elif weights is not None:
            raise ValueError("GradOperation: weights were given but get_by_list=False; "
                             "set get_by_list=True to differentiate with respect to them")
        else:
            ws = ()
        op = self

        def gradient(*args, **kwargs):
            sens = None
            if op.sens_param:
                if not args:
                    raise TypeError("GradOperation: sens_param=True needs the sensitivity "
                                    "as the last positional argument")
                args, sens = args[:-1], args[-1]
                sens = tuple(sens) if isinstance(sens, (tuple, list)) else (sens,)
            if op.get_all:
                positions = tuple(i for i, a in enumerate(args) if _differentiable(a))
            elif op.get_by_list:
                positions = ()
            else:
                if not args:
                    raise TypeError("GradOperation: the network got no positional input "
                                    "to differentiate")
                positions = 0
            pos = positions if positions != () else None
            if pos is None and not ws:         # get_all over inputs that have none
                return tuple(_zeros_like(a) for a in args)
            _, grads = _differentiate(fn, pos, ws, False, False, args, kwargs, sens=sens)
            if not op.get_all:
                return grads                   # the first input's, or the weights'
            got = grads if not ws else (grads[0] if pos is not None else ())
            got = dict(zip(positions, got))
            inputs = tuple(got[i] if i in got else _zeros_like(a) for i, a in enumerate(args))
            if not ws:
                return inputs
            return inputs, (grads[1] if pos is not None else grads)

        return gradient


def _differentiable(a):
    return isinstance(a, TensorBase) and a.dtype.kind == "f"


def _zeros_like(a):
    """The gradient MindSpore gives an input that has none (an integer Tensor)."""
    if isinstance(a, TensorBase):
        return _core.wrap(np.zeros(a.shape, a.dtype))
    return 0
