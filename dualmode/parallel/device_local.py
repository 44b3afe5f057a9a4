"""Device-local values: what hybrid parallel's ``layerwise_parallel`` parameters hold.

In MindSpore's hybrid parallel mode a ``Parameter(..., layerwise_parallel=True)`` is
stored as each device's own slice; the framework inserts no communication for it and
the user writes ``ops.AllReduce()`` (& co.) where the math needs it. Such a value has
**no global view**: device ``d`` holds its own tensor and nothing says how the tensors
form one array. dualmode represents it as a Tensor whose ``_layout`` is a
:class:`DeviceLocalLayout` and whose ``_data`` is the stack ``(n, *shape)`` of the
``n`` devices' values:

* ``t.shape`` is the per-device shape (what the device-local code sees);
* ``t.asnumpy()`` is the stack of the per-device values, shape ``(n, *shape)`` (there
  is no single global value to return);
* ``dm.parallel.local_shape(t)`` is the per-device shape.

Giving each device its own slice
--------------------------------
A ``Parameter(..., layerwise_parallel=True)`` initialised normally holds the same value
on every device (as MindSpore ranks seeded alike). :func:`set_layerwise_slices` gives
each device its own::

    net = HybridParallelNet()                        # weight: Parameter (512, 64), layerwise
    dm.parallel.set_layerwise_slices(net.weight, W, dim=1)       # W (512, 128): device d
    dm.parallel.set_layerwise_slices(net.weight, stack)          # or a stack (n, 512, 64)

A layerwise parameter given a value (created, or ``set_data``) while several devices
run the program (a hybrid-parallel context, or ``stand_alone`` after ``init()`` on
several devices) is per-device at once: under "mpi" each rank holds
the value it passed (its own slice), under "sim" every device the same value. One made
before that context is a plain value until it first meets a device-local value in an
op. Either way it is then stored as ``n`` per-device copies, which its per-device
gradients may make diverge, as in MindSpore: the gradient of device ``d``'s copy is
that device's own, never a sum over the devices.
:func:`device_local_tensor` wraps a stack ``(n, *shape)`` as a device-local Tensor.

Running ops
-----------
An op with a device-local input runs here (:func:`device_local_apply`, reached from
``dtensor.dist_apply``): every device applies the op to its own value, in ONE numpy
call on the stacks (never a loop over devices). Plain (replicated) inputs and constants
are the same on every device and broadcast against the stacks; inputs that are
distributed by data parallelism (batch-split, pending partial sums) are first made
plain (an AllGather / AllReduce, reported as "forward"). Supported: every elementwise
op, Cast, MatMul, BatchMatMul, BiasAdd, ReduceSum/Mean/Max/Min, Reshape, BroadcastTo,
Softmax, LogSoftmax, Transpose, Concat, Split, GetItem/IndexAdd with basic indices
(ints, slices, None, Ellipsis), Gather of a device-local table by plain indices
(and GatherGrad), and the collectives ``ops.AllReduce`` & co.; any other op raises a
RuntimeError naming it. Outputs are device-local (collectives may return plain values).

Gradients
---------
Device-local values differentiate like any other: the gradient of a device-local input
is device-local. A plain value feeding a device-local op is used by every device, so
its gradient is the sum of the devices' contributions: it is returned as a pending
partial sum (``TensorLayout`` with ``partial=(0,)``), which ``asnumpy()`` sums, later
ops resolve with an AllReduce when they need to, and the optimizer's data-parallel
gradient AllReduce (reason "gradient") reduces for replicated parameters. Layerwise
parameters get device-local gradients, which no gradient AllReduce touches.
"""
from __future__ import annotations

import functools
import numbers

import numpy as np

from .._core import _tensor as _core
from .._core._tensor import KIND_GENERIC, OpDef, TensorBase
from .. import context
from ..tensor import Parameter, register_layerwise_hook
from . import dtensor
from .moves import gather_global
from .devices import device_num, live_backend, parallel_active, world_stack
from .tensor_layout import TensorLayout
from .sharding import RULES

__all__ = ["DeviceLocalLayout", "set_layerwise_slices", "layerwise_slice_dim",
           "device_local_tensor",
           "device_local_apply", "to_device_local", "shards_as_device_local",
           "is_device_local"]


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


# ============================================================================ layout

class DeviceLocalLayout:
    """Layout of a value that differs per device with no global view.

    Each of ``device_num`` devices holds its own tensor of ``shape`` (the per-device
    shape). The tensor's ``_data`` is the stack ``(device_num, *shape)``, and
    :meth:`assemble` returns that stack itself (no copy: optimizers update layerwise
    parameters in place through ``Parameter._value()``), so ``t.asnumpy()`` of a
    device-local tensor is the stacked per-device values, shape
    ``(device_num, *shape)``, while ``t.shape`` is ``shape``.

    The attributes read by the data-parallel layers mirror ``TensorLayout``'s:
    ``device_matrix=(n,)``, ``tensor_map=((),) * ndim``, ``partial=()``,
    ``local_shape=shape``, ``split_axes=()``.
    """

    __slots__ = ("_n", "_shape", "_hash")

    def __init__(self, device_num, shape):
        if not _is_int(device_num) or device_num < 1:
            raise ValueError(f"DeviceLocalLayout: device_num={device_num!r} is not valid; "
                             f"expected an int >= 1")
        try:
            shape = tuple(shape)
        except TypeError:
            raise TypeError(f"DeviceLocalLayout: shape={shape!r} must be a tuple of ints") \
                from None
        if not all(_is_int(s) and s >= 0 for s in shape):
            raise ValueError(f"DeviceLocalLayout: shape={shape!r} must be a tuple of ints >= 0")
        object.__setattr__(self, "_n", int(device_num))
        object.__setattr__(self, "_shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "_hash", hash((DeviceLocalLayout, self._n, self._shape)))

    def __setattr__(self, name, value):
        raise AttributeError(f"DeviceLocalLayout is immutable; cannot set {name!r}")

    def __reduce__(self):
        return (DeviceLocalLayout, (self._n, self._shape))

    # ---- TensorLayout-compatible attributes
    @property
    def device_num(self) -> int:
        return self._n

    @property
    def shape(self):
        """The per-device shape."""
        return self._shape

    @property
    def local_shape(self):
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def device_matrix(self):
        return (self._n,)

    @property
    def tensor_map(self):
        return ((),) * len(self._shape)

    @property
    def partial(self):
        return ()

    @property
    def split_axes(self):
        return ()

    @property
    def replicated_axes(self):
        return ()

    @property
    def dim_parts(self):
        return (1,) * len(self._shape)

    @property
    def is_partial(self) -> bool:
        return False

    @property
    def is_replicated(self) -> bool:
        return False

    def without_partial(self):
        return self

    def assemble(self, stack):
        """The stack itself: a device-local value has no single global value. Under
        "mpi" (a stack of this rank's row only) every rank's row, gathered unrecorded."""
        want = (self._n,) + self._shape
        if np.ndim(stack) == len(want) and tuple(np.shape(stack)[1:]) == self._shape \
                and np.shape(stack)[0] == local_row_count(self._n) < self._n:
            stack = world_stack(stack, self)
        if tuple(np.shape(stack)) != want:
            raise ValueError(f"{self!r}: assemble got a stack of shape {np.shape(stack)}, "
                             f"expected {want} (device_num, *shape)")
        return stack

    def device_slices(self):
        raise ValueError(f"{self!r}: a device-local (layerwise_parallel) value is not a slice "
                         f"of a global tensor; each device holds its own value of shape "
                         f"{self._shape}")

    def table(self, max_rows=None) -> str:
        return (f"{self!r}: each of the {self._n} devices holds its own value of shape "
                f"{self._shape} (no global view)")

    def __str__(self):
        return self.table()

    def __eq__(self, other):
        if not isinstance(other, DeviceLocalLayout):
            return NotImplemented
        return self._n == other._n and self._shape == other._shape

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"DeviceLocalLayout(device_num={self._n}, shape={self._shape})"


def is_device_local(x) -> bool:
    """True for a Tensor holding per-device values (a DeviceLocalLayout)."""
    return isinstance(x, TensorBase) and isinstance(x._layout, DeviceLocalLayout)


# ============================================================================ context

def local_row_count(n: int) -> int:
    """Rows of this process's stack of an ``n``-device value: ``n`` under "sim", one
    per local device under "mpi"."""
    b = live_backend()
    if b is not None and b.world_size == n and len(b.local_ranks) < n:
        return len(b.local_ranks)
    return n


def local_ranks(n: int) -> np.ndarray:
    """The devices whose rows this process's stack of an ``n``-device value holds."""
    b = live_backend()
    if b is not None and b.world_size == n and len(b.local_ranks) < n:
        return np.asarray(b.local_ranks, dtype=np.int64)
    return np.arange(n, dtype=np.int64)


def all_rows(stack: np.ndarray, n: int) -> np.ndarray:
    """Every device's row ``(n, ...)`` from this process's stack (an unrecorded
    AllGather under "mpi"; the stack itself under "sim")."""
    if stack.shape[0] == n:
        return stack
    return world_stack(np.ascontiguousarray(stack), DeviceLocalLayout(n, stack.shape[1:]))


def own_rows(full: np.ndarray, n: int) -> np.ndarray:
    """This process's rows of an every-device stack ``(n, ...)``."""
    rows = local_row_count(n)
    return full if rows == n else full[local_ranks(n)]


def context_devices() -> int:
    """Devices of the live parallel context; under ``parallel_mode="stand_alone"`` the
    devices that each run the whole program, among which the user's collectives
    communicate (and per-device values live): every MPI rank, or the simulated devices
    of ``init()`` while ``device_num`` asks for them (simulated devices left from an
    earlier setting that ``device_num`` no longer names are not used); 1 with
    ``device_num=1`` (one device on purpose) or without a backend."""
    if parallel_active():
        return device_num()
    b = live_backend()
    want = context._STATE.auto_parallel.device_num
    if b is None or want == 1:
        return 1
    if want is None and len(b.local_ranks) == b.world_size:
        return 1
    return b.world_size


def _require_devices(func: str) -> int:
    if live_backend() is None:
        raise RuntimeError(f"{func}: needs an initialised parallel context; call "
                           f"dm.set_auto_parallel_context(parallel_mode='hybrid_parallel', "
                           f"device_num=N) and dm.communication.init() first")
    return context_devices()


# ============================================================================ user entry

def set_layerwise_slices(param, values, dim=None):
    """Give each device its own slice of a ``layerwise_parallel`` Parameter.

    A ``Parameter(..., layerwise_parallel=True)`` initialised normally holds the same
    value on every device (as MindSpore ranks seeded alike); this gives device ``d`` its
    own value instead::

        w = Parameter(Tensor(np.zeros((512, 64), np.float32)), layerwise_parallel=True)
        set_layerwise_slices(w, W, dim=1)     # W (512, 128) on 2 devices: W[:, 64d:64(d+1)]
        set_layerwise_slices(w, stack)        # stack (2, 512, 64): device d gets stack[d]

    Parameters
    ----------
    param : Parameter
        Created with ``layerwise_parallel=True`` and the per-device (slice) shape.
    values : Tensor or numpy array
        Either the stack ``(n, *param.shape)`` of the ``n`` devices' slices (device
        ``d`` gets ``values[d]``), or, with ``dim``, the full weight, split evenly along
        ``dim`` into the ``n`` device slices (device ``d`` gets part ``d``).
    dim : int, optional
        The dim of the full weight to split.

    Afterwards ``param`` is device-local: ``param.shape`` is the slice shape and
    ``param.asnumpy()`` the stack ``(n, *param.shape)``. Given ``dim``, the full weight
    is recorded as the devices' slices joined along ``dim``: the stand-alone run of
    :func:`dualmode.parallel.check_equivalence` uses it (the slices' current values). Needs an initialised backend
    (``dm.communication.init()``); ``n`` is its device count (1 outside a parallel
    context, where the single slice simply becomes the value). Returns ``param``.

    Raises
    ------
    TypeError
        ``param`` is not a Parameter.
    ValueError
        ``param`` is not ``layerwise_parallel``; the shapes do not match (the message
        names the parameter, the shapes and what would be valid).
    RuntimeError
        No initialised backend.
    """
    func = "set_layerwise_slices"
    if not isinstance(param, Parameter):
        raise TypeError(f"{func}: param must be a Parameter created with "
                        f"layerwise_parallel=True, got {type(param).__name__}")
    name = param.name
    if not param.layerwise_parallel:
        raise ValueError(f"{func}: Parameter {name!r} is not layerwise_parallel; create it "
                         f"with Parameter(..., layerwise_parallel=True) to give each device "
                         f"its own slice")
    n = _require_devices(func)
    if isinstance(values, TensorBase):
        arr = values._data if values._layout is not None and \
            isinstance(values._layout, DeviceLocalLayout) else values._value()
    else:
        arr = np.asarray(values)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{func}: values for Parameter {name!r} have dtype {arr.dtype}; "
                        f"expected a numeric array")
    shape = tuple(param.shape)
    if dim is None:
        want = (n,) + shape
        if tuple(arr.shape) != want:
            raise ValueError(f"{func}: values for Parameter {name!r} have shape "
                             f"{tuple(arr.shape)}; expected the stack of the {n} devices' "
                             f"slices, shape {want} (or pass the full weight with dim=...)")
        stack = arr
    else:
        if not _is_int(dim) or arr.ndim == 0 or not -arr.ndim <= dim < arr.ndim:
            raise ValueError(f"{func}: dim={dim!r} is out of range for the full weight of "
                             f"shape {tuple(arr.shape)} given for Parameter {name!r}; expected "
                             f"an int in [{-arr.ndim}, {arr.ndim})")
        d = int(dim) % arr.ndim
        full = tuple(arr.shape)
        if full[d] % n:
            raise ValueError(f"{func}: dim {d} (size {full[d]}) of the full weight of shape "
                             f"{full} given for Parameter {name!r} does not split evenly over "
                             f"{n} devices")
        part = full[:d] + (full[d] // n,) + full[d + 1:]
        if part != shape:
            raise ValueError(f"{func}: Parameter {name!r} has shape {shape} but splitting the "
                             f"full weight of shape {full} on dim {d} over {n} devices gives "
                             f"slices of shape {part}; expected a full weight of shape "
                             f"{shape[:d] + (shape[d] * n,) + shape[d + 1:]}")
        stack = np.moveaxis(arr.reshape(full[:d] + (n, full[d] // n) + full[d + 1:]), d, 0)
    dtype = param.dtype
    param.__dict__.pop("_layerwise_cut", None)
    if n == 1:
        param._layout = None
        param.set_data(np.asarray(stack[0]).astype(dtype))
        return param
    stack = own_rows(stack, n)             # under "mpi": this rank's slice only
    param._data = np.array(stack, dtype=dtype, order="C", copy=True)   # owned, writable
    param._layout = DeviceLocalLayout(n, shape)
    param._init = None
    if dim is not None:                    # the full weight: its slices joined along d
        param.__dict__["_layerwise_cut"] = (d, param._layout)
    return param


def layerwise_slice_dim(param) -> "int | None":
    """The dim of the full weight that :func:`set_layerwise_slices` cut `param`'s slices
    from (device ``d`` holds part ``d``), while `param` still holds those slices' layout;
    None when its slices were given as a stack (or it holds none)."""
    cut = param.__dict__.get("_layerwise_cut")
    if cut is None or param._layout != cut[1]:
        return None
    return cut[0]


def device_local_tensor(values):
    """A device-local Tensor from the stack ``values`` ``(n, *shape)`` of the ``n``
    devices' values (device ``d`` holds ``values[d]``); ``n`` must be the device count
    of the parallel context. No copy of a numpy stack."""
    func = "device_local_tensor"
    n = _require_devices(func)
    arr = values._value() if isinstance(values, TensorBase) else np.asarray(values)
    if isinstance(values, (list, tuple)) and arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    if arr.ndim == 0 or arr.shape[0] != n:
        raise ValueError(f"{func}: values have shape {tuple(arr.shape)}; expected a stack "
                         f"(n, *shape) with n = {n}, the devices of the parallel context")
    return _core.wrap_dist(own_rows(arr, n), DeviceLocalLayout(n, arr.shape[1:]))


def _localize_parameter(p, n):
    """A plain layerwise Parameter becomes n per-device copies of its value (in place)."""
    v = p._value()
    p._data = np.array(np.broadcast_to(v, (local_row_count(n),) + v.shape), order="C")
    p._layout = DeviceLocalLayout(n, v.shape)


def _own_value(p):
    """A ``layerwise_parallel`` Parameter given a value (created or ``set_data``) while
    several devices run the program (a hybrid-parallel context, or ``stand_alone`` after
    ``init()`` on several devices) holds it per device: under "mpi" the value this rank
    passed, under "sim" the same value on every device. Each device then has its own
    copy and its own gradient, whatever op first uses it."""
    if context._STATE.auto_parallel.parallel_mode not in ("hybrid_parallel", "stand_alone"):
        return
    try:
        n = context_devices()
    except ValueError:           # device_num not set yet: the first op says so
        return
    if n > 1:
        _localize_parameter(p, n)


register_layerwise_hook(_own_value)


# ============================================================================ conversions

def _partial_layout(shape, n):
    return TensorLayout((n,), ((),) * len(shape), tuple(shape), partial=(0,))


def _plain_array(x, op_name):
    """The global value of a plain or data-parallel-distributed Tensor (gathering or
    resolving as dtensor does)."""
    if x._layout is None:
        return x._value()
    return gather_global(x, op_name)


def _bw_to_local(node, g):
    x = node.inputs[0]
    n = node.attrs["n"]
    if is_device_local(g):
        # every device used x: its gradient is the sum of the devices' contributions
        return (_core.wrap_dist(g._data, _partial_layout(tuple(x.shape), n)),)
    gv = _plain_array(g, "ToDeviceLocal")
    return (_core.wrap_dist(np.multiply(gv, n, dtype=gv.dtype), None),)


_TO_LOCAL = OpDef("ToDeviceLocal", kind=KIND_GENERIC,
                  infer=lambda at, x: ((tuple(x.shape), x.dtype),),
                  kernel=lambda at, x: x, backward=_bw_to_local)


def to_device_local(x, n, op_name):
    """`x` (a plain or data-parallel-distributed Tensor) as a device-local value in which
    every device holds x's global value: a zero-copy broadcast view, recorded on the tape
    when x is on it (its gradient is then the partial sum of the devices' gradients)."""
    arr = _plain_array(x, op_name)
    stack = np.broadcast_to(arr, (local_row_count(n),) + arr.shape)
    rec = _core.recording() and x._node is not None
    return _core.finish(_TO_LOCAL, {"n": n}, (x,), stack, rec,
                        (DeviceLocalLayout(n, arr.shape),))


def _bw_shards(node, g):
    lay = node.inputs[0]._layout
    if is_device_local(g):
        stack = g._data
    else:
        gv = _plain_array(g, "ShardsAsDeviceLocal")
        stack = np.broadcast_to(gv, (node.inputs[0]._data.shape[0],) + tuple(gv.shape))
    return (_core.wrap_dist(stack, lay),)


_SHARDS = OpDef("ShardsAsDeviceLocal", kind=KIND_GENERIC,
                infer=lambda at, x: ((tuple(x.shape), x.dtype),),
                kernel=lambda at, x: x, backward=_bw_shards)


def shards_as_device_local(x):
    """A batch-split (data-parallel) Tensor seen per device: device d holds its shard
    (no copy; recorded on the tape when x is on it)."""
    stack = x._data
    n = x._layout.device_num
    rec = _core.recording() and x._node is not None
    return _core.finish(_SHARDS, None, (x,), stack, rec,
                        (DeviceLocalLayout(n, stack.shape[1:]),))


# ============================================================================ dispatch

def _unsupported(op_name, why):
    return RuntimeError(
        f"{op_name}: not supported on layerwise_parallel (device-local) values: {why}; "
        f"supported: every op whose sharding rule is a per-device map with its inputs "
        f"whole (elementwise ops, MatMul, reductions, Reshape, Softmax, Gather, basic "
        f"indexing, cross-entropy, ...) and the collectives AllReduce, AllGather, "
        f"ReduceScatter, Broadcast, AlltoAll")


def device_local_apply(op, attrs, inputs, rec):
    """Run `op` when some input is device-local (see the module docstring)."""
    name = op.name
    n = None
    for i, x in enumerate(inputs):
        if is_device_local(x):
            m = x._layout.device_num
            if n is None:
                n = m
            elif m != n:
                raise RuntimeError(f"{name}: input {i} holds the values of {m} devices but an "
                                   f"earlier input those of {n}; device-local inputs of one op "
                                   f"must come from the same parallel context")
    ctx = context_devices()
    if ctx != n:
        raise RuntimeError(f"{name}: an input holds per-device (layerwise_parallel) values of "
                           f"{n} devices but the current parallel context has {ctx} device(s); "
                           f"set the per-device values again (set_layerwise_slices) after "
                           f"changing the context")
    special = op.extras.get("device_local")
    if special is not None:
        return special(op, attrs, inputs, n)
    recording = _core.recording()
    xs, arrays, local = [], [], []
    for x in inputs:
        if isinstance(x, TensorBase):
            lay = x._layout
            if lay is None and isinstance(x, Parameter) and x.layerwise_parallel:
                _localize_parameter(x, n)
            elif not isinstance(lay, DeviceLocalLayout):
                if recording and x._node is not None:
                    x = to_device_local(x, n, name)
                elif lay is not None:
                    x = _core.wrap_dist(_plain_array(x, name), None)
            xs.append(x)
            if isinstance(x._layout, DeviceLocalLayout):
                arrays.append(x._data)
                local.append(True)
            else:
                arrays.append(x._value())
                local.append(False)
        else:
            xs.append(x)
            arrays.append(np.asarray(x))
            local.append(False)
    stand_ins = [np.broadcast_to(np.zeros((), a.dtype), a.shape[1:]) if loc else a
                 for a, loc in zip(arrays, local)]
    meta = _core.infer(op, attrs, *stand_ins)
    out = _per_device(op, attrs, arrays, local, n)
    outs = out if op.multi_output else (out,)
    results, layouts = [], []
    for o, (shape, _dt) in zip(outs, meta):
        o = np.asarray(o)
        want = (local_row_count(n),) + tuple(shape)
        if o.shape != want:      # a rule bug: never return a wrong result
            raise RuntimeError(f"{name}: internal error: per-device result of shape "
                               f"{o.shape[1:]}, expected {tuple(shape)}")
        results.append(o)
        layouts.append(DeviceLocalLayout(n, shape))
    rec = any(isinstance(x, TensorBase) and x._node is not None for x in xs)
    return _core.finish(op, attrs, tuple(xs), tuple(results) if op.multi_output else results[0],
                        rec, tuple(layouts))


# ============================================================================ per device

def _per_device(op, attrs, arrays, local, n):
    """Every device applies `op` to its own values (stacks (n, *s) where `local[i]`, else
    plain values every device shares), in one call: the local computation of the op's
    sharding rule (parallel/rules/) with every input whole on every device, which
    is exactly a per-device map."""
    lays, stacks = [], []
    for a, loc in zip(arrays, local):
        shape = a.shape[1:] if loc else a.shape
        if not loc and a.ndim == 0:
            lays.append(None)
            stacks.append(a)
            continue
        lays.append(_whole(tuple(shape), n))
        stacks.append(a if loc else np.broadcast_to(a, (local_row_count(n),) + a.shape))
    if op.extras.get("random"):
        raise _unsupported(op.name, "it draws random numbers, which have no per-device "
                                    "meaning here")
    rule = RULES.get(op.name)
    if rule is None:
        raise _unsupported(op.name, "it has no sharding rule")
    plan = rule(attrs, lays, [a.dtype for a in arrays])
    if plan is None or plan.post or any(
            need is not None and (need != have) for need, have in zip(plan.inputs, lays)) \
            or any(lay.partial or any(lay.tensor_map) for lay in plan.outputs):
        raise _unsupported(op.name, "its sharding rule needs communication for these "
                                    "inputs (e.g. indexing with integer or bool arrays)")
    return plan.local(attrs, stacks)


@functools.lru_cache(maxsize=4096)
def _whole(shape, n):
    """Every dim whole on each of n devices."""
    return TensorLayout.replicated(shape, n)


dtensor.register_layout_kind(DeviceLocalLayout, device_local_apply)
