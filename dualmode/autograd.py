"""Reverse-mode autodiff: ``grad`` and ``value_and_grad``.

Calling the returned function runs `fn` once while a tape records every op whose
inputs descend from a watched leaf (the inputs at `grad_position` and the
`weights`), then walks the tape backwards from the output(s). Backward rules are
written with dualmode ops, so they run through the same dispatcher as the forward.
"""
from __future__ import annotations

import functools

import numpy as np

from ._core import _tensor as _core
from ._core._tensor import TensorBase
from .ops import _array, _math
from .ops._registry import remember
from .tensor import Parameter

__all__ = ["grad", "value_and_grad", "vjp"]


def _check_position(grad_position):
    if grad_position is None:
        return None
    if isinstance(grad_position, bool):
        raise TypeError(f"grad: grad_position must be an int, a tuple of ints or None, got "
                        f"{grad_position!r}")
    if isinstance(grad_position, int):
        if grad_position < 0:
            raise ValueError(f"grad: grad_position={grad_position} must be >= 0")
        return grad_position
    if isinstance(grad_position, tuple) and grad_position:
        for p in grad_position:
            if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                raise ValueError(f"grad: grad_position={grad_position!r} must hold ints >= 0")
        if len(set(grad_position)) != len(grad_position):
            raise ValueError(f"grad: grad_position={grad_position!r} repeats a position")
        return grad_position
    raise TypeError(f"grad: grad_position must be an int, a non-empty tuple of ints or None, "
                    f"got {grad_position!r}")


def _check_weights(weights):
    if weights is None:
        return None, False
    if isinstance(weights, Parameter):
        return (weights,), True
    if isinstance(weights, (list, tuple)):
        for i, w in enumerate(weights):
            if not isinstance(w, Parameter):
                raise TypeError(f"grad: weights[{i}] is a {type(w).__name__}; weights must be "
                                f"Parameters (e.g. net.trainable_params())")
        return tuple(weights), False
    raise TypeError(f"grad: weights must be a Parameter, a list/tuple of Parameters or None, "
                    f"got {type(weights).__name__}")


#: (shape, dtype) -> read-only zeros of that shape taking no memory (stride 0)
_ZEROS: dict = {}


def _zeros_like_meta(shape, dtype):
    """The gradient of an output nothing used (of a multi-output op): zeros read by
    the op's backward rule, made once per shape and dtype (a read-only stride-0 view)."""
    key = (shape, dtype)
    z = _ZEROS.get(key)
    if z is None:
        z = remember(_ZEROS, key, np.broadcast_to(np.zeros((), dtype), shape))
    return _core.wrap_dist(z, None)


def _detach(x):
    if isinstance(x, TensorBase):
        # a distributed value keeps its stack as it is (one not written yet stays so)
        return _core.wrap_dist(x._value(), None) if x._layout is None else \
            _core.detached(x)
    if isinstance(x, tuple):
        return tuple(_detach(v) for v in x)
    if isinstance(x, list):
        return [_detach(v) for v in x]
    return x


def _differentiate(fn, positions, weights, single_weight, has_aux, args, kwargs, sens=None):
    """Run fn on args, return (outputs, position grads, weight grads). `sens`: one
    cotangent per output (None: not differentiated) instead of ones."""
    pos = (positions,) if isinstance(positions, int) else (positions or ())
    for p in pos:
        if p >= len(args):
            raise ValueError(f"grad: grad_position={positions!r} but the function got "
                             f"{len(args)} positional argument(s)")
        if not isinstance(args[p], TensorBase):
            raise TypeError(f"grad: argument {p} (at grad_position) is a "
                            f"{type(args[p]).__name__}; it must be a Tensor")
        if args[p].dtype.kind != "f":
            raise TypeError(f"grad: argument {p} (at grad_position) has dtype "
                            f"{args[p].dtype}; only floating tensors have gradients")
    weights = weights or ()
    tape = _core.begin_tape()
    saved_nodes = [w._node for w in weights]
    try:
        args = list(args)
        for slot, p in enumerate(pos):
            a = args[p]
            leaf = _core.wrap_dist(a._value() if a._layout is None else a._data, a._layout)
            leaf._node = _core.make_leaf(slot, tape)
            args[p] = leaf
        slot_of = {}
        for k, w in enumerate(weights):
            if id(w) not in slot_of:
                slot_of[id(w)] = len(pos) + k
                w._node = _core.make_leaf(len(pos) + k, tape)
        out = fn(*args, **kwargs)
    except BaseException:
        _core.end_tape()
        for w, n in zip(weights, saved_nodes):
            w._node = n
        raise
    _core.end_tape()
    try:
        if has_aux:
            if not isinstance(out, tuple) or len(out) < 2:
                raise ValueError("grad: has_aux=True needs the function to return more than "
                                 "one output: a tuple (output, aux...)")
            roots = (out[0],)
        else:
            roots = out if isinstance(out, tuple) else (out,)
        if sens is not None:
            if len(sens) != len(roots):
                raise ValueError(f"grad: {len(sens)} cotangents for {len(roots)} outputs")
            roots = tuple(r for r, s in zip(roots, sens) if s is not None)
        for i, r in enumerate(roots):
            if not isinstance(r, TensorBase):
                raise TypeError(f"grad: output {i} of the function is a {type(r).__name__}; "
                                f"differentiated outputs must be Tensors")
            if r.dtype.kind != "f":
                raise TypeError(f"grad: output {i} of the function has dtype {r.dtype}; "
                                f"differentiated outputs must be floating tensors")
        seeds = tuple(_core.wrap_dist(np.ones(r.shape, r.dtype), None) for r in roots) \
            if sens is None else tuple(s for s in sens if s is not None)
        nslots = len(pos) + len(weights)
        grads = _core.run_backward(tuple(roots), seeds, tape, nslots, _math.ADD,
                                   _zeros_like_meta)
    finally:
        for w, n in zip(weights, saved_nodes):
            w._node = n
    inputs = [args[p] for p in pos] + [weights[k] for k in range(len(weights))]
    for k, w in enumerate(weights):
        first = slot_of[id(w)]
        if first != len(pos) + k:
            grads[len(pos) + k] = grads[first]
    full = []
    for g, x in zip(grads, inputs):
        if g is None:
            g = _array.zeros(x.shape, x.dtype)
            if x._layout is not None and not getattr(x._layout, "abstract", False):
                # a distributed input gets a zero of its layout (an abstract one, while
                # a graph is traced, names the input's own value: a plain zero then)
                g = _core.wrap_dist(np.zeros(x._data.shape, x.dtype), x._layout)
        elif g.dtype != x.dtype:
            g = _math.cast(g, x.dtype)
        full.append(_core.wrap_dist(g._value(), None) if g._layout is None
                    else _core.detached(g))
    pos_grads = full[:len(pos)]
    w_grads = tuple(full[len(pos):])
    if isinstance(positions, int):
        pos_out = pos_grads[0]
    else:
        pos_out = tuple(pos_grads)
    if single_weight:
        w_grads = w_grads[0]
    if positions is None:
        result = w_grads
    elif weights:
        result = (pos_out, w_grads)
    else:
        result = pos_out
    return _detach(out), result


def _make(fn, grad_position, weights, has_aux, return_value):
    if not callable(fn):
        raise TypeError(f"grad: fn must be callable, got {type(fn).__name__}")
    positions = _check_position(grad_position)
    ws, single = _check_weights(weights)
    if positions is None and not ws:
        raise ValueError("grad: grad_position and weights are both None; nothing to "
                         "differentiate with respect to")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out, grads = _differentiate(fn, positions, ws, single, has_aux, args, kwargs)
        if return_value:
            return out, grads
        if has_aux:
            return grads, out[1:] if len(out) > 2 else out[1]
        return grads

    return wrapper


def value_and_grad(fn, grad_position=0, weights=None, has_aux=False):
    """A function returning ``(fn(*args), gradients)``.

    Parameters
    ----------
    fn : callable returning a Tensor, or a tuple of Tensors
    grad_position : int, tuple of ints, or None
        Which positional inputs to differentiate with respect to.
    weights : Parameter, list/tuple of Parameters, or None
        Parameters to differentiate with respect to (e.g. ``optimizer.parameters``).
    has_aux : bool
        Only the first output is differentiated; the others are returned as they are.

    The gradients are: the input gradients (one Tensor for an int position, a tuple
    for a tuple), the weight gradients (a tuple), or ``(inputs, weights)`` when both
    are asked for. Inputs never reached get zero gradients.
    """
    return _make(fn, grad_position, weights, has_aux, True)


def grad(fn, grad_position=0, weights=None, has_aux=False):
    """Like :func:`value_and_grad` but returns only the gradients (and aux outputs
    as ``(gradients, aux)`` when `has_aux`)."""
    return _make(fn, grad_position, weights, has_aux, False)




def vjp(fn, grad_position=None, weights=None):
    """A function ``(args, cotangents) -> (fn(*args), gradients)``: the gradients of
    ``sum(output_i * cotangent_i)``, i.e. the vector-Jacobian product; `fn` returns a
    tuple of Tensors and a cotangent None leaves its output out. The gradients are
    shaped as :func:`value_and_grad` gives them for the same `grad_position`/`weights`.
    (Graph mode derives a compiled block's backward pass with it.)"""
    positions = _check_position(grad_position)
    ws, single = _check_weights(weights)
    if positions is None and not ws:
        raise ValueError("vjp: grad_position and weights are both None; nothing to "
                         "differentiate with respect to")

    def wrapper(args, cotangents):
        return _differentiate(fn, positions, ws, single, False, tuple(args), {},
                              sens=tuple(cotangents))
    return wrapper
