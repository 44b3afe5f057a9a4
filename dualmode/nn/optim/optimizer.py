"""Optimizer: the base of SGD, Momentum and Adam (MindSpore's ``nn.Optimizer``).

An optimizer holds a tuple of Parameters (``.parameters``), in parameter groups
that may each set their own learning rate and weight decay, and is called with the
gradients aligned with ``.parameters``: ``optimizer(grads)``. Updates are made in
place on each parameter's numpy storage; subclasses write ``_update`` for one
parameter with as few numpy passes as they can.
"""
from __future__ import annotations

import numbers

import numpy as np

from ..._core import _kernels
from ..._core._tensor import TensorBase
from ...parallel.grad_reduce import fuse_gradient_moves, reduce_gradients
from ...parallel.graph.trace import current_trace
from ...parallel.tensor_layout import TensorLayout
from ...parallel.moves import redistribute_grid, redistribute_tensor
from ...parallel import optimizer_shard
from ...parallel.replicas import replica_blocks, store_blocks
from ...parallel.strategy import is_sharded_layout
from ...ps.optim import register_optimizer_class
from ...ps.worker import active_worker
from ...tensor import Parameter
from .._checks import check_float
from ..cell import Cell

__all__ = ["Optimizer"]

_GROUP_KEYS = ("params", "lr", "weight_decay")


class _Schedule:
    """A learning rate: a constant, a per-step list (the last value repeats), or a
    callable ``step -> float``."""

    __slots__ = ("value", "values", "fn")

    def __init__(self, owner, what, lr):
        self.value, self.values, self.fn = None, None, None
        if isinstance(lr, TensorBase):
            lr = np.asarray(lr)
        if isinstance(lr, np.ndarray) and lr.ndim == 0:
            lr = lr.item()
        if isinstance(lr, numbers.Real) and not isinstance(lr, bool):
            if not np.isfinite(lr):
                raise ValueError(f"{owner}: {what}={lr} must be a finite float >= 0")
            self.value = check_float(owner, what, lr, 0.0)
        elif isinstance(lr, (list, tuple, np.ndarray)):
            arr = np.asarray(lr)
            if arr.ndim != 1 or not arr.size or arr.dtype.kind not in "fiu":
                raise ValueError(f"{owner}: {what} as a schedule must be a non-empty 1-D list "
                                 f"of numbers (one per step), got {lr!r}")
            if not np.isfinite(arr).all():
                raise ValueError(f"{owner}: {what} schedule has a non-finite value; learning "
                                 f"rates must be finite floats >= 0")
            if (arr < 0).any():
                raise ValueError(f"{owner}: {what} schedule has a negative value "
                                 f"{arr.min()}; learning rates must be >= 0")
            self.values = [float(v) for v in arr]
        elif callable(lr):
            self.fn = lr
        else:
            raise TypeError(f"{owner}: {what} must be a float, a list/ndarray with one value "
                            f"per step, or a callable(step) -> float; got "
                            f"{type(lr).__name__}")

    def __call__(self, step: int) -> float:
        if self.value is not None:
            return self.value
        if self.values is not None:
            return self.values[min(step, len(self.values) - 1)]
        return float(self.fn(step))

    @property
    def dynamic(self) -> bool:
        return self.value is None


def _as_params(owner, params, where):
    if isinstance(params, (TensorBase, dict)) or not hasattr(params, "__iter__"):
        raise TypeError(f"{owner}: {where} must be a list of Parameters (e.g. "
                        f"net.trainable_params()), got {type(params).__name__}")
    params = list(params)
    for i, p in enumerate(params):
        if not isinstance(p, Parameter):
            raise TypeError(f"{owner}: {where}[{i}] is a {type(p).__name__}; expected a "
                            f"Parameter")
    return params


def _sharded_pair(g, p, once=True):
    """(gradient, weight) of a sharded parameter for an in-place update. When this
    process holds every device both are viewed over ``device_matrix + local_shape``,
    the gradient with size 1 along axes that split nothing: replicated blocks are
    updated by broadcasting, without writing the gradient once per replica. A weight
    whose replicas are stored once (``parallel.replicas``) is that grid of distinct
    blocks, each updated once (unless not `once`: the weight's stack is then written)."""
    layout = p._layout
    w = replica_blocks(p) if once else None
    if w is None:
        w = _view_as(p._data, layout.device_matrix + layout.local_shape)
        if w is not None and isinstance(g, TensorBase) and g._layout == layout \
                and g._lazy is None:
            return g._data.reshape(w.shape), w     # already in place (e.g. a fused move)
    grid = redistribute_grid(g, layout, p.name, reason="gradient") if w is not None else None
    if grid is None:
        return _gradient_stack(g, layout, p.name), p._data
    if grid.shape != w.shape:
        # a grid of distinct blocks: the gradient's replicas hold equal blocks, the first
        # stands for all
        grid = grid[tuple(slice(0, 1) if n == 1 else slice(None) for n in w.shape)]
    return grid, w


def _view_as(a, shape):
    """`a` viewed with `shape` (None when that needs a copy: updates must write `a`)."""
    try:
        return np.reshape(a, shape, copy=False)
    except ValueError:
        return None


def _gradient_stack(g, layout, name):
    """The local stack of gradient `g` in `layout`, its pending sums resolved (the
    gradient's ReduceScatter/AllReduce, reported as "gradient"). Updates only read it,
    so it may be a read-only view."""
    if isinstance(g, TensorBase) and g._layout == layout:
        return g._data
    return redistribute_tensor(g, layout, name, reason="gradient")


class _Group:
    __slots__ = ("start", "stop", "lr", "weight_decay")

    def __init__(self, start, stop, lr, weight_decay):
        self.start, self.stop, self.lr, self.weight_decay = start, stop, lr, weight_decay


class Optimizer(Cell):
    """Base class of optimizers.

    Parameters
    ----------
    learning_rate : float, list/ndarray (one value per step; the last one repeats), or
        callable(step) -> float
    parameters : list of Parameters, or list of group dicts
        ``[{"params": [...], "lr": 0.1, "weight_decay": 0.01}, {"params": [...]}]``;
        a group's missing "lr" / "weight_decay" default to the arguments.
    weight_decay : float
        L2 penalty added to the gradient (``g + weight_decay * p``). Without groups it
        skips parameters whose name contains "beta" or "gamma" (MindSpore's rule).
    loss_scale : float
        Gradients are divided by it before the update.

    Attributes
    ----------
    parameters : tuple of Parameter
    learning_rate : the `learning_rate` argument
    global_step : int
        The number of updates made; the learning rate of a schedule is read at it.
    """

    _eager_only = True      # GRAPH_MODE never compiles an update step alone

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_optimizer_class(cls)      # a parameter server can build it by name

    def __init__(self, learning_rate, parameters, weight_decay=0.0, loss_scale=1.0):
        super().__init__(auto_prefix=False)
        owner = type(self).__name__
        self.loss_scale = check_float(owner, "loss_scale", loss_scale, 0.0, lo_open=True)
        weight_decay = check_float(owner, "weight_decay", weight_decay, 0.0)
        schedule = _Schedule(owner, "learning_rate", learning_rate)
        if isinstance(parameters, (list, tuple)) and parameters and \
                all(isinstance(g, dict) for g in parameters):
            params, groups = self._parse_groups(owner, parameters, schedule, weight_decay)
            decay = [g.weight_decay for g in groups for _ in range(g.start, g.stop)]
            self.is_group = True
        else:
            params = _as_params(owner, parameters, "parameters")
            groups = [_Group(0, len(params), schedule, weight_decay)]
            decay = [weight_decay if _decays(p) else 0.0 for p in params]
            self.is_group = False
        if not params:
            raise ValueError(f"{owner}: parameters is empty; pass the parameters to optimize "
                             f"(e.g. net.trainable_params())")
        seen = {}
        for i, p in enumerate(params):
            if id(p) in seen:
                raise ValueError(f"{owner}: parameter {p.name!r} is given twice (positions "
                                 f"{seen[id(p)]} and {i}); each parameter may appear once")
            seen[id(p)] = i
        self.parameters = tuple(params)
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.global_step = 0
        self._groups = tuple(groups)
        self._decay = tuple(decay)
        self._inv_scale = 1.0 / self.loss_scale
        self.dynamic_lr = any(g.lr.dynamic for g in groups)

    @staticmethod
    def _parse_groups(owner, groups, schedule, weight_decay):
        params, out = [], []
        for k, group in enumerate(groups):
            unknown = sorted(set(group) - set(_GROUP_KEYS))
            if unknown:
                raise ValueError(f"{owner}: parameter group {k} has unknown key(s) {unknown}; "
                                 f"valid keys: {', '.join(_GROUP_KEYS)}")
            if "params" not in group:
                raise ValueError(f"{owner}: parameter group {k} has no 'params' entry")
            ps = _as_params(owner, group["params"], f"group {k} 'params'")
            lr = _Schedule(owner, f"group {k} 'lr'", group["lr"]) if "lr" in group \
                else schedule
            wd = check_float(owner, f"group {k} 'weight_decay'", group["weight_decay"], 0.0) \
                if "weight_decay" in group else weight_decay
            out.append(_Group(len(params), len(params) + len(ps), lr, wd))
            params.extend(ps)
        return params, out

    # ---- learning rate -------------------------------------------------------------
    def get_lr(self):
        """The learning rate of the next update (a tuple, one per group, with groups)."""
        lrs = tuple(g.lr(self.global_step) for g in self._groups)
        return lrs if self.is_group else lrs[0]

    # ---- one update ----------------------------------------------------------------
    def _recorded_or_checked(self, gradients):
        """The start of an update. While a graph is traced, the update is recorded as
        one opaque node (run eagerly on the gradients): None. Otherwise every gradient
        is checked (type, shape, dtype) before anything changes: whether any of them is
        distributed."""
        params = self.parameters
        owner = type(self).__name__
        tr = current_trace()
        if tr is not None and isinstance(gradients, (tuple, list)):
            tr.call_opaque(lambda *g: type(self).construct(self, g), f"{owner}.update",
                           tuple(gradients),
                           params=params if len(gradients) == len(params) else None)
            return None
        if not isinstance(gradients, (tuple, list)):
            raise TypeError(f"{owner}: gradients must be a tuple of Tensors aligned with "
                            f"optimizer.parameters, got {type(gradients).__name__}")
        if len(gradients) != len(params):
            raise ValueError(f"{owner}: got {len(gradients)} gradients for {len(params)} "
                             f"parameters; they must be aligned with optimizer.parameters")
        return _check_gradients(owner, gradients, params)

    def construct(self, gradients):
        """Apply one update with `gradients` (aligned with ``.parameters``)."""
        params = self.parameters
        distributed = self._recorded_or_checked(gradients)
        if distributed is None:
            return True
        worker = active_worker()
        # the parallel optimizer: the weights whose states and update are split over
        # their replicas (None: none is); their gradients moved into the slices (their
        # ReduceScatters; a whole gradient, e.g. one LARS reduced, is cut locally)
        # pipeline parallelism under "mpi": the other stages' weights are their
        # processes' to update (this rank's copies keep their values)
        skip = optimizer_shard.other_stages(params) if worker is None else frozenset()
        shards = optimizer_shard.plan(self, skip) if worker is None else None
        if shards is not None:
            gradients = shards.scatter(gradients)
        if distributed:
            targets = params if shards is None else shards.targets
            mine = [i for i in range(len(params)) if i not in skip]
            grads = [gradients[i] for i in mine]
            tgts = [targets[i] for i in mine]
            if worker is None:
                # the sharded weights' gradient ReduceScatters and AllReduces, in fused
                # buckets per comm_fusion (as a compiled step fuses them); the others
                # move one by one below
                grads = fuse_gradient_moves(grads, tgts)
            grads = reduce_gradients(grads, tgts)              # data-parallel AllReduce
            gradients = list(gradients)
            for i, g in zip(mine, grads):
                gradients[i] = g
        # parameter server mode: the servers update the weights they hold (push the
        # gradients, pull the new values); this optimizer updates the others
        on_servers = worker.step(self, gradients) if worker is not None else ()
        step = self.global_step
        scale = self._inv_scale
        decay = self._decay
        updated = {}                    # the parallel optimizer's updated slices
        for group in self._groups:
            lr = group.lr(step)
            for i in range(group.start, group.stop):
                p = params[i]
                if not p.requires_grad or i in on_servers or i in skip:
                    continue
                g = gradients[i]
                if shards is not None and shards.sharded(i):
                    # the parallel optimizer: this device's slice of the weight and of
                    # its states, updated with the ReduceScattered gradient
                    shards.match_states(self, i)
                    w, g = shards.weight_slice(i), g._data
                    if scale != 1.0:
                        g = g * scale
                    if decay[i]:
                        g = g + decay[i] * w
                    self._update(i, w, g, lr)
                    updated[i] = w
                    continue
                if p._layout is not None and is_sharded_layout(p._layout):
                    # a sharded weight: its gradient moves into the weight's layout (the
                    # gradient communication) and the update runs on the local shards
                    names = self.__dict__.get("_state_names")
                    if names:
                        self._match_states(i, p, None)
                    # a weight whose replicas are stored once is updated on its grid of
                    # distinct blocks when its states are stored so as well
                    once = not names or all(replica_blocks(getattr(self, n)[i]) is not None
                                            for n in names)
                    g, w = _sharded_pair(g, p, once)
                    if scale != 1.0:
                        g = g * scale
                    if decay[i]:
                        g = g + decay[i] * w
                    self._update(i, w, g, lr)
                    continue
                else:
                    # a per-device (layerwise) weight updates this process's rows in place
                    # (under "mpi" its value would be every rank's rows, gathered)
                    local = p._layout is not None and not isinstance(p._layout, TensorLayout)
                    if local and isinstance(g, TensorBase) and g._layout == p._layout:
                        g = g._data
                    else:
                        g = g._value() if isinstance(g, TensorBase) else np.asarray(g)
                    w = p._data if local else p._value()
                if p._layout is not None:
                    self._match_states(i, p, w)
                    if g.shape != w.shape:          # a plain gradient of a per-device weight
                        g = np.broadcast_to(g, w.shape)
                if g.shape != w.shape:
                    raise ValueError(f"{type(self).__name__}: the gradient for parameter "
                                     f"{p.name!r} has shape {g.shape}; the parameter has "
                                     f"shape {w.shape}")
                if scale != 1.0:
                    g = g * scale
                if decay[i]:
                    g = g + decay[i] * w
                self._update(i, w, g, lr)
        if updated:
            shards.gather(updated)      # the updated slices AllGathered into the weights
        self.global_step = step + 1
        return True

    def _update(self, i, w, g, lr):
        """Update parameter `i` in place: `w` its numpy value, `g` its gradient."""
        raise NotImplementedError(f"{type(self).__name__}: optimizers define _update")

    def _states(self, prefix):
        """A zero-filled clone of every parameter, named ``prefix.<name>``."""
        self.__dict__.setdefault("_state_names", []).append(prefix)
        return tuple(p.clone(prefix=prefix, init="zeros") for p in self.parameters)

    def _match_states(self, i, p, w):
        """Give parameter i's optimizer states the layout of the parameter when it
        became sharded or per-device after the optimizer was built. A state holding a
        global value (e.g. restored from a checkpoint before the weight was sharded)
        keeps it, cut into the parameter's local shards; otherwise it starts at zero.
        The states of a weight whose replicas are stored once (``parallel.replicas``)
        are stored so too; `w` is the weight's local array (None: read it if needed)."""
        for name in self.__dict__.get("_state_names", ()):
            st = getattr(self, name)[i]
            if st._layout != p._layout:
                restored = st._layout is None and st._data is not None and \
                    isinstance(p._layout, TensorLayout) and st.shape == p.shape
                value = st._value() if restored else None
                if replica_blocks(p) is not None:
                    once = store_blocks(st, p._layout, value if restored else
                                        np.zeros(p.shape, p.dtype))
                else:
                    once = False
                if once:
                    pass                                # stored as its weight is
                elif restored:
                    st._data = np.array(redistribute_tensor(st, p._layout, st.name))
                else:
                    if w is None:
                        w = p._data
                    st._data = np.zeros(w.shape, w.dtype)
                st._init = None
                st._layout = p._layout

    def extend_repr(self):
        return f"learning_rate={self.learning_rate}, parameters={len(self.parameters)}"


def _check_gradients(owner, gradients, params):
    """Every gradient is an array of its parameter's shape: checked for all of them
    before any parameter, state or step counter changes (a bad gradient in the middle of
    the list leaves everything as it was). Returns whether some gradient is a
    distributed Tensor (none is: there is nothing to fuse, reduce or gather)."""
    distributed = False
    for p, g in zip(params, gradients):
        is_tensor = isinstance(g, TensorBase)
        if is_tensor and g._layout is not None:
            distributed = True
        if not p.requires_grad:
            continue
        if is_tensor:                           # the usual case: no stack is read
            shape, dtype = g.shape, g.dtype
        elif not isinstance(g, (np.ndarray, numbers.Number)) or \
                isinstance(g, (bool, np.bool_)):
            raise TypeError(f"{owner}: the gradient for parameter {p.name!r} is a "
                            f"{type(g).__name__}; expected a Tensor of shape {tuple(p.shape)}")
        else:
            shape, dtype = np.shape(g), np.asarray(g).dtype
        if tuple(shape) != tuple(p.shape):
            raise ValueError(f"{owner}: the gradient for parameter {p.name!r} has shape "
                             f"{shape}; the parameter has shape {tuple(p.shape)}")
        if np.dtype(dtype).kind not in "fiu":
            raise TypeError(f"{owner}: the gradient for parameter {p.name!r} has dtype "
                            f"{np.dtype(dtype)}; expected a numeric dtype")
    return distributed


def _decays(p):
    name = p.name or ""
    return "beta" not in name and "gamma" not in name


def _sub_scaled(w, g, a):
    """``w -= a * g`` in place: one pass, no temporary (the Cython kernel) when `w` and
    `g` are contiguous arrays of one shape and dtype, else numpy (e.g. a gradient that
    broadcasts over a sharded weight's replicas)."""
    if not _kernels.sub_scaled(w, g, a):
        w -= a * g


def _storage(t, like=None):
    """The array an optimizer updates in place: the local shards of a distributed
    state or parameter, the value of a plain one; viewed with the shape of the weight
    array `like` when given (a sharded weight is updated over its device grid; a state
    whose replicas are stored once, as its weight's, is that grid)."""
    grid = replica_blocks(t)
    if grid is not None and (like is None or grid.shape == like.shape):
        return grid
    a = t._data if t._layout is not None else t._value()
    if like is not None and a.shape != like.shape:
        view = _view_as(a, like.shape)
        if view is None:                       # not one strided block: make it one
            t._data = a = np.ascontiguousarray(a)
            view = a.reshape(like.shape)
        a = view
    return a
