"""The optimizer a server runs, described by the worker that owns it.

A worker's optimizer is sent to the servers as a small JSON spec per parameter (class
name, hyper-parameters, learning rate, weight decay, loss scale); a server builds the
same dualmode optimizer class over its shard of that parameter. The classes are looked
up in a registry that :class:`dualmode.nn.Optimizer` fills as its subclasses are
defined (the nn layer sits above this package). State (momentum, Adam moments, step
counter) lives on the server.

Plain SGD and Momentum (no weight decay, loss scale 1, no Nesterov) run **fused** on a
server (:func:`fused_step`): the workers' gradients are summed, averaged and applied in
one pass (:func:`dualmode._core._ps_kernels.sgd_update`), and the new weight is written
into the first worker's received gradient buffer instead of over the old weight, which
may still be on its way to a worker (sent without a copy). The numbers are exactly the
optimizer's own (:func:`fused_update_reference` is its sequence of numpy operations).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._core import _ps_kernels
from ..tensor import Parameter

__all__ = ["register_optimizer_class", "optimizer_spec", "build_optimizer", "state_arrays",
           "optimizer_meta", "restore_optimizer", "row_local", "fusable", "fused_step",
           "fused_update_reference"]

#: optimizer class name -> class (registered by dualmode.nn.Optimizer.__init_subclass__)
_CLASSES: Dict[str, type] = {}
#: the constructor arguments a server needs, per class (besides learning rate, weight
#: decay and loss scale)
_HYPER: Dict[str, Tuple[str, ...]] = {
    "SGD": ("momentum", "dampening", "nesterov"),
    "Momentum": ("momentum", "use_nesterov"),
    "Adam": ("beta1", "beta2", "eps", "use_nesterov"),
}


def register_optimizer_class(cls: type) -> None:
    """Make `cls` buildable on a server under its class name."""
    _CLASSES[cls.__name__] = cls


def _lr_spec(owner: str, name: str, schedule) -> Any:
    if schedule.value is not None:
        return schedule.value
    if schedule.values is not None:
        return list(schedule.values)
    raise ValueError(f"{owner}: parameter {name!r} is held by the parameter servers and its "
                     "learning rate is a callable, which cannot be sent to them; give a "
                     "float or a list with one value per step")


def optimizer_spec(opt, index: int) -> Dict[str, Any]:
    """The JSON spec of `opt` for its parameter `index`."""
    owner = type(opt).__name__
    if owner not in _HYPER or _CLASSES.get(owner) is not type(opt):
        raise ValueError(f"{owner}: parameter {opt.parameters[index].name!r} is held by the "
                         f"parameter servers, which run SGD, Momentum or Adam; {owner} cannot "
                         "run there (keep its weights on the workers, or use one of those)")
    group = next(g for g in opt._groups if g.start <= index < g.stop)
    hyper = {k: getattr(opt, k) for k in _HYPER[owner]}
    return {"cls": owner, "hyper": hyper, "loss_scale": opt.loss_scale,
            "lr": _lr_spec(owner, opt.parameters[index].name, group.lr),
            "weight_decay": opt._decay[index]}


def build_optimizer(spec: Dict[str, Any], params: Sequence[Parameter]):
    """The optimizer `spec` describes, over server-held `params` (shards that share the
    spec: one optimizer call updates them all)."""
    cls = _CLASSES.get(spec.get("cls"))
    if cls is None:
        raise ValueError(f"optimizer class {spec.get('cls')!r} is not known on this server; "
                         "expected one of " + ", ".join(sorted(_HYPER)))
    group = {"params": list(params), "lr": spec["lr"], "weight_decay": spec["weight_decay"]}
    return cls([group], learning_rate=spec["lr"], loss_scale=spec["loss_scale"],
               **spec["hyper"])


def state_arrays(opt, index: int) -> Dict[str, np.ndarray]:
    """The state arrays (momentum, moments) of `opt`'s parameter `index`, by state
    name."""
    out = {}
    for name in opt.__dict__.get("_state_names", ()):
        out[name] = getattr(opt, name)[index]._data
    return out


def optimizer_meta(opt, index: int) -> Dict[str, Any]:
    """What besides its state arrays a restarted server needs for `opt`'s parameter
    `index`: the step counter and SGD's first-step flag."""
    fresh = opt.__dict__.get("_fresh")
    return {"global_step": opt.global_step, "fresh": [] if fresh is None else [fresh[index]]}


def restore_optimizer(opt, index: int, meta: Dict[str, Any],
                      states: Dict[str, np.ndarray]) -> None:
    """Put the checkpointed state of `opt`'s parameter `index` back."""
    opt.global_step = int(meta["global_step"])
    if "_fresh" in opt.__dict__ and meta["fresh"]:
        opt._fresh[index] = bool(meta["fresh"][0])
    for name, arr in states.items():
        getattr(opt, name)[index]._data = np.array(arr)


def swap_rows(opt, index: int, rows: np.ndarray) -> List[Tuple[Any, np.ndarray]]:
    """Point `opt`'s parameter `index` and its states at copies of their `rows` (a
    sparse update runs on those rows only); returns what :func:`unswap_rows` writes
    back."""
    saved = []
    states = opt.__dict__.get("_state_names", ())
    for t in [opt.parameters[index]] + [getattr(opt, name)[index] for name in states]:
        saved.append((t, t._data))
        t._data = t._data[rows]
        t._shape = t._data.shape
    return saved


def unswap_rows(saved, rows: np.ndarray) -> None:
    """Write the updated rows back and restore the full arrays."""
    for t, full in saved:
        full[rows] = t._data
        t._data = full
        t._shape = full.shape


def row_local(opt) -> bool:
    """Whether `opt`'s step leaves every row whose gradient is zero as it was, so that a
    sparse table's step may run on the rows a step used alone: plain SGD (no momentum)
    without weight decay. Momentum and Adam move a row through their state, and weight
    decay moves every row."""
    return type(opt).__name__ == "SGD" and _CLASSES.get("SGD") is type(opt) and \
        opt.momentum == 0.0 and not any(opt._decay)


def fusable(opt) -> bool:
    """Whether a server runs `opt`'s step fused (:func:`fused_step`): plain SGD (no
    momentum) or Momentum without Nesterov, with loss scale 1 and no weight decay."""
    if opt._inv_scale != 1.0 or any(opt._decay) or len(opt._groups) != 1:
        return False
    name = type(opt).__name__
    if name == "SGD" and _CLASSES.get(name) is type(opt):
        return opt.momentum == 0.0
    if name == "Momentum" and _CLASSES.get(name) is type(opt):
        return not opt.use_nesterov
    return False


def fused_update_reference(out: np.ndarray, w: np.ndarray, grads: Sequence[np.ndarray],
                           lr: float, mean: bool, v: Optional[np.ndarray] = None,
                           momentum: float = 0.0) -> None:
    """The numpy form of :func:`dualmode._core._ps_kernels.sgd_update` (what the server
    did before the fused kernel, and the reference the kernel is tested against): the
    gradients summed in order into a copy of the first, divided by their count when
    `mean`; with `v` (Momentum's state): ``v *= momentum; v += s``; then
    ``out = w - lr * v`` (or ``- lr * s``)."""
    s = np.array(grads[0], copy=True)
    for g in grads[1:]:
        np.add(s, g, out=s)
    if mean and len(grads) > 1:
        np.divide(s, len(grads), out=s)
    if v is not None:
        v *= momentum
        v += s
        s = v
    out[...] = w - lr * s


def fused_step(opt, keys: Sequence[Tuple[Parameter, int, List[np.ndarray]]],
               mean: bool) -> None:
    """One step of the fusable optimizer `opt` (:func:`fusable`) on its shards: `keys`
    lists each shard's parameter, its index in ``opt.parameters`` and the workers'
    gradients for it (in worker order; the sum is used, or the mean with `mean`). Each
    new weight is written into the first gradient's buffer when it is writable (a
    received frame), else into a new array, and becomes the parameter's storage: the
    old weight array is never written again."""
    lr = opt._groups[0].lr(opt.global_step)
    momentum = opt.__dict__.get("moments")
    for param, slot, grads in keys:
        w = param._data
        first = grads[0]
        out = first if first.flags.writeable and first.dtype == w.dtype and \
            first.shape == w.shape and first.flags.c_contiguous else np.empty_like(w)
        v = None if momentum is None else momentum[slot]._value()
        m = opt.momentum if momentum is not None else 0.0
        if not _ps_kernels.sgd_update(out, w, grads, lr, mean, v, m):
            fused_update_reference(out, w, grads, lr, mean, v, m)
        param._data = out
    opt.global_step += 1
