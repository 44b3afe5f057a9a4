"""check_equivalence: is a parallel strategy correct? The sharded run against the
stand-alone run of the same program, op by op.

    report = dm.parallel.check_equivalence(net, x, device_num=8)
    report.ok                     # outputs and gradients equal within float32 tolerance
    report.max_abs_diff           # over every output and gradient
    report.first_divergent_op     # e.g. "ReLU": the first op whose output differs
    print(report)                 # a table per output and gradient, and the diverging op

How it works
------------
The program runs twice in PyNative mode (or in whatever mode the context is), each time
under ``value_and_grad`` with respect to its floating inputs and its weights (the sum of
its floating outputs is differentiated, as MindSpore's default sensitivity of ones):

1. **sharded**: under the current parallel settings (``parallel_mode``, strategies,
   ``dataset_strategy``...) on ``device_num`` devices; a ``stand_alone`` context is run
   as ``semi_auto_parallel``;
2. **stand-alone**: ``parallel_mode="stand_alone"``, every weight holding the global
   value it held in the sharded run (its initial value: the run changes no weight), and
   the same seed, so Dropout masks and every other draw are the same. A
   ``layerwise_parallel`` weight given its slices by
   ``set_layerwise_slices(param, full_weight, dim)`` holds the full weight: its current
   slices joined along ``dim`` (slices given as a stack need ``layerwise={name: dim}``).

Each run's tape (the ops recorded while the gradient was computed) is walked from the
outputs in post-order, inputs in order, so every op comes after the ops it consumes
and the walk is the same for the same program: that is the *program order* used here.
The two op sequences are aligned by op name (ops found in one run only, such as the
``Redistribute`` moves a strategy inserts, are listed and skipped), and each aligned
pair's outputs are compared as global values. A value the sharded run holds per device
(hybrid parallel's ``layerwise_parallel`` results) has no global view; it matches when
every device holds the stand-alone value, when the devices' values sum to it (pending
partial sums) or when they are its slices along one dim, and those relations are
reported. The *first divergent op* is the first op whose output matches in none of
these ways; when every op matches but an output does not (per-device partial sums
returned without their ``ops.AllReduce``), it is the op that produced that output.

Tolerance: an element passes when ``|sharded - single| <= atol * max(1, max|single|) +
rtol * |single|``, with (rtol, atol) = (1e-4, 1e-5) for float32 (the reordered sums of a
sharded forward and backward pass), (1e-2, 1e-3) for float16, (1e-9, 1e-12) for float64,
exact for integers and bools.

Every op the program calls is compared, the collectives it calls itself
(``ops.AllReduce`` & co.) included: on one device a collective is the identity, so its
sharded output must equal its input's stand-alone value (an AllReduce of a value every
device already holds whole sums copies of it, and is named as the divergent op).
Only ops that are recorded on a tape are compared: ops on values that do not descend
from a floating input or a weight, and ops without a backward rule, are not. A block
compiled by ``ops.shard`` / ``Cell.shard`` is one op of the caller's tape: the ops inside
it are not compared (the report's note says so when the runs differ). In GRAPH_MODE,
where a Cell runs as one compiled op, runs that differ are run a third time, sharded and
eagerly (PYNATIVE_MODE, the same strategies and weights), to name the op. The context,
the random generator, the communication backend (re-initialised when the device count
has to change: groups made by ``create_group`` are then gone) and every weight's storage
are restored afterwards, whatever happens.
"""
from __future__ import annotations

import dataclasses
import difflib
import numbers
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .. import context
from .._core._tensor import KEEPING_INPUTS, TensorBase
from ..autograd import value_and_grad
from ..communication import init as _comm_init
from ..communication import release as _comm_release
from ..ops._registry import REGISTRY
from ..tensor import Parameter, Tensor, live_parameters
from .device_local import DeviceLocalLayout, all_rows, layerwise_slice_dim
from .devices import live_backend
from .graph.compile import Block

__all__ = ["check_equivalence", "EquivalenceReport", "ComparedValue", "ComparedOp",
           "tolerances", "parallel_settings"]

_TOLERANCES = {"f2": (1e-2, 1e-3), "f4": (1e-4, 1e-5), "f8": (1e-9, 1e-12)}


def tolerances(dtype) -> Tuple[float, float]:
    """``(rtol, atol)`` check_equivalence uses for values of `dtype` (0, 0: exact)."""
    dt = np.dtype(dtype)
    if dt.kind != "f":
        return 0.0, 0.0
    return _TOLERANCES.get(f"f{dt.itemsize}", _TOLERANCES["f4"])


# ============================================================================ settings

class parallel_settings:
    """Save the context's parallel settings, run mode, seed and random generator and the
    communication backend's device count; :meth:`restore` puts them back (re-initialising
    the "sim" backend only when its device count changed, releasing one that was not
    initialised before). Used by check_equivalence and the pytest plugin's fixtures."""

    def __init__(self) -> None:
        st = context._STATE
        self.auto_parallel = st.auto_parallel
        self.run = st.run
        self.seed = st.seed
        self.generator = st.generator
        b = live_backend()
        self.backend = b
        self.world_size = None if b is None else b.world_size

    def restore(self) -> None:
        st = context._STATE
        st.auto_parallel = self.auto_parallel
        st.run = self.run
        st.seed = self.seed
        st.generator = self.generator
        b = live_backend()
        if self.backend is None:
            if b is not None:
                _comm_release()
        elif b is not self.backend and (b is None or b.world_size != self.world_size
                                        or b.name != self.backend.name):
            _comm_init()

    def __enter__(self) -> "parallel_settings":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def _use_devices(mode: str, n: int, func: str) -> None:
    """Configure `mode` on `n` devices, (re)initialising the backend when needed."""
    st = context._STATE
    st.auto_parallel = dataclasses.replace(st.auto_parallel, parallel_mode=mode, device_num=n)
    b = live_backend()
    if b is not None and b.world_size == n:
        return
    if b is not None and len(b.local_ranks) == 1 and b.world_size > 1:
        raise ValueError(f"{func}: device_num={n} but this process is one rank of an MPI "
                         f"job of {b.world_size}; under MPI device_num must be the world "
                         f"size ({b.world_size}) or None")
    _comm_init()


def _use_one_device() -> None:
    """Stand-alone: one device; a "sim" backend is re-initialised with one device so
    that ``get_group_size()`` is 1 as in a one-device job (an MPI rank keeps its world
    and runs stand-alone on its own device: ``device_num=1`` makes the user's
    collectives the identity there, as on one device)."""
    st = context._STATE
    st.auto_parallel = dataclasses.replace(st.auto_parallel, parallel_mode="stand_alone",
                                           device_num=1)
    b = live_backend()
    if b is not None and len(b.local_ranks) == b.world_size and b.world_size != 1:
        _comm_init()


# ============================================================================ report

@dataclass
class ComparedValue:
    """One output or gradient: its name, shapes, largest differences and verdict."""

    name: str
    kind: str                    # "output" or "gradient"
    shape: Tuple[int, ...]
    max_abs_diff: float
    max_rel_diff: float
    ok: bool
    note: str = ""


@dataclass
class ComparedOp:
    """One op of the program as run sharded, beside its stand-alone run."""

    index: int                   # position in program order (sharded run)
    name: str                    # the op's class name, e.g. "MatMul"
    relation: str                # "equal", "partial sums", "slices along dim d", "differs", ...
    max_abs_diff: float
    in_layouts: Tuple[Any, ...]
    out_layouts: Tuple[Any, ...]
    inputs_from: Tuple[Optional[str], ...] = ()

    @property
    def strategy(self) -> Tuple[Optional[Tuple[int, ...]], ...]:
        """The parts each input is split into per dim (None for a whole or per-device
        value), as a strategy tuple reads."""
        return tuple(None if lay is None or isinstance(lay, DeviceLocalLayout)
                     else tuple(lay.dim_parts) for lay in self.in_layouts)

    @property
    def ok(self) -> bool:
        return self.relation != "differs"


@dataclass
class EquivalenceReport:
    """What :func:`check_equivalence` found.

    Attributes
    ----------
    ok : bool
        Every output and gradient equal within tolerance.
    max_abs_diff : float
        Largest absolute difference over every output and gradient.
    first_divergent_op : str or None
        Class name of the first op (program order) whose output differs; None when ok
        (and when only the backward pass diverges: see :attr:`note`).
    divergent : ComparedOp or None
        That op: its strategy, input and output layouts and how its output differs.
    values : list of ComparedValue
        One row per output and per gradient.
    ops : list of ComparedOp
        Every aligned op, in program order.
    only_sharded, only_single : list of str
        Ops found in one run only (e.g. the ``Redistribute`` moves of strategies).
    """

    ok: bool
    max_abs_diff: float
    first_divergent_op: Optional[str]
    divergent: Optional[ComparedOp]
    values: List[ComparedValue]
    ops: List[ComparedOp]
    only_sharded: List[str] = field(default_factory=list)
    only_single: List[str] = field(default_factory=list)
    device_num: int = 1
    parallel_mode: str = ""
    note: str = ""

    def __str__(self) -> str:
        verdict = "OK" if self.ok else "DIFFERS"
        lines = [f"check_equivalence: {verdict} ({self.parallel_mode} on {self.device_num} "
                 f"devices vs stand-alone; max |diff| {self.max_abs_diff:.3g}; "
                 f"{len(self.ops)} ops compared)"]
        head = f"  {'':<8} {'name':<28} {'shape':<16} {'max abs diff':>12} " \
               f"{'max rel diff':>12}  result"
        lines += [head, "  " + "-" * (len(head) - 2)]
        for v in self.values:
            lines.append(f"  {v.kind:<8} {v.name[:28]:<28} {str(v.shape)[:16]:<16} "
                         f"{v.max_abs_diff:>12.3g} {v.max_rel_diff:>12.3g}  "
                         f"{'ok' if v.ok else 'DIFFERS'}{'  ' + v.note if v.note else ''}")
        if self.divergent is not None:
            d = self.divergent
            lines.append(f"first divergent op: {d.name} (op #{d.index} in program order): "
                         f"{d.relation}, max |diff| {d.max_abs_diff:.3g}")
            lines.append(f"  strategy: {d.strategy}")
            for i, (lay, src) in enumerate(zip(d.in_layouts, d.inputs_from)):
                frm = f" (from {src})" if src else ""
                lines.append(f"  input {i}{frm}: {lay!r}")
            for i, lay in enumerate(d.out_layouts):
                lines.append(f"  output {i}: {lay!r}")
        if self.note:
            lines.append(self.note)
        if self.only_sharded:
            lines.append("only in the sharded run: " + ", ".join(_counted(self.only_sharded)))
        if self.only_single:
            lines.append("only in the stand-alone run: "
                         + ", ".join(_counted(self.only_single)))
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_pretty_(self, p, cycle):          # IPython / Jupyter
        p.text(str(self))


def _counted(names: Sequence[str]) -> List[str]:
    out, seen = [], {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
    for n, c in seen.items():
        out.append(n if c == 1 else f"{n} x{c}")
    return out


# ============================================================================ running

@dataclass
class _OpRun:
    name: str
    outputs: List[Any]            # global values (device-local: the stack), None if unseen
    out_layouts: List[Any]
    in_layouts: Tuple[Any, ...]
    inputs_from: Tuple[Optional[str], ...]
    inputs_at: Tuple[Optional[int], ...] = ()     # index of each input's producer op
    compiled: bool = False        # a block compiled by GRAPH_MODE / ops.shard / Cell.shard


@dataclass
class _Run:
    outputs: List[Any]            # per program output: (value, layout) or None (not a tensor)
    grads: List[Any]              # (value, layout) per gradient
    ops: List[_OpRun]
    root_ops: List[Optional[int]]  # per output: index into ops of the op that made it


def _global(t) -> Tuple[np.ndarray, Any]:
    return np.asarray(t._value()), t._layout


def _walk(roots) -> Tuple[list, dict]:
    """The recorded nodes reachable from the `roots` tensors in post-order (inputs in
    order), and node id -> {output index: tensor} for the outputs seen."""
    order, index, outs = [], {}, {}

    def note(t):
        node = t._node
        if node is None or node.is_leaf:
            return None
        outs.setdefault(id(node), {})[t._out_index] = t
        return node

    for r in roots:
        start = note(r)
        if start is None or id(start) in index:
            continue
        stack = [(start, 0)]
        index[id(start)] = -1                     # on the path
        while stack:
            node, i = stack[-1]
            if i < len(node.inputs):
                stack[-1] = (node, i + 1)
                x = node.inputs[i]
                if isinstance(x, TensorBase):
                    child = note(x)
                    if child is not None and id(child) not in index:
                        index[id(child)] = -1
                        stack.append((child, 0))
                continue
            stack.pop()
            index[id(node)] = len(order)
            order.append(node)
    return order, outs


def _run(fn, inputs, weights, positions, seed) -> _Run:
    captured = []

    def program(*args):
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        captured.append(outs)
        diff = tuple(o for o in outs if isinstance(o, TensorBase) and o.dtype.kind == "f")
        if not diff:
            raise ValueError("check_equivalence: the program returned no floating Tensor; "
                             "it must return a Tensor (or a tuple holding one) to compare "
                             "and differentiate")
        return diff

    context.set_seed(seed)
    with KEEPING_INPUTS:        # every op's values are read from the tape below
        _, grads = value_and_grad(program, positions or None, list(weights) or None)(*inputs)
    if positions and weights:
        grads = tuple(grads[0]) + tuple(grads[1])
    outs = captured[-1]
    order, seen = _walk([o for o in outs if isinstance(o, TensorBase)])
    pos = {id(n): k for k, n in enumerate(order)}
    ops = []
    for node in order:
        got = seen.get(id(node), {})
        if node.outputs:
            got = {**{k: t for k, t in enumerate(node.outputs)}, **got}
        n_out = len(node.out_meta)
        vals, lays = [None] * n_out, [None] * n_out
        for k, t in got.items():
            if k < n_out:
                vals[k], lays[k] = _global(t)
        ins = tuple(x._layout if isinstance(x, TensorBase) else None for x in node.inputs)
        at = tuple(pos[id(x._node)] if isinstance(x, TensorBase) and x._node is not None
                   and not x._node.is_leaf and id(x._node) in pos else None
                   for x in node.inputs)
        frm = tuple(None if i is None else order[i].op.name for i in at)
        ops.append(_OpRun(node.op.name, vals, lays, ins, frm, at,
                          isinstance(getattr(node.op.backward, "__self__", None), Block)))
    outputs, roots = [], []
    for o in outs:
        if isinstance(o, TensorBase):
            outputs.append(_global(o))
            n = o._node
            roots.append(pos.get(id(n)) if n is not None else None)
        else:
            outputs.append(None)
            roots.append(None)
    return _Run(outputs, [_global(g) for g in grads], ops, roots)


# ============================================================================ comparing

def _close(a: np.ndarray, b: np.ndarray, rtol: Optional[float],
           atol: Optional[float]) -> Tuple[bool, float, float]:
    """(within tolerance, max abs diff, max rel diff) of `a` against the reference `b`."""
    r, t = tolerances(b.dtype)
    r = r if rtol is None else rtol
    t = t if atol is None else atol
    if a.shape != b.shape:
        return False, float("inf"), float("inf")
    if b.size == 0:
        return True, 0.0, 0.0
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    diff = np.abs(a64 - b64)
    both_nan = np.isnan(a64) & np.isnan(b64)
    diff = np.where(both_nan, 0.0, diff)
    mag = np.abs(b64)
    scale = max(1.0, float(np.nanmax(mag)) if np.isfinite(mag).any() else 1.0)
    ok = bool(np.all(diff <= t * scale + r * mag))
    rel = diff / np.where(mag > 0, mag, 1.0)
    return ok, float(np.nanmax(diff)), float(np.nanmax(rel))


def _relation(val, lay, ref, rtol, atol) -> Tuple[str, float]:
    """How a sharded value relates to the stand-alone one (see the module docstring)."""
    if val is None or ref is None:
        return "not seen", 0.0
    if not isinstance(lay, DeviceLocalLayout):
        ok, d, _ = _close(val, ref, rtol, atol)
        return ("equal" if ok else "differs"), d
    n, local = val.shape[0], val.shape[1:]
    if local == ref.shape:
        ok, d, _ = _close(val, np.broadcast_to(ref, val.shape), rtol, atol)
        if ok:
            return "equal on every device", d
        ok, d2, _ = _close(val.sum(axis=0, dtype=val.dtype), ref, rtol, atol)
        if ok:
            return "per-device partial sums", d2
        return "differs", d
    if len(local) == ref.ndim:
        for k in range(ref.ndim):
            if local[k] * n == ref.shape[k] and local[:k] == ref.shape[:k] \
                    and local[k + 1:] == ref.shape[k + 1:]:
                whole = np.concatenate(list(val), axis=k)
                ok, d, _ = _close(whole, ref, rtol, atol)
                return (f"device slices along dim {k}" if ok else "differs"), d
    return "differs", float("inf")


def _compare_value(name, kind, sharded, single, rtol, atol, per_device, slice_dim=None):
    val, lay = sharded
    ref, _ = single
    note = ""
    if isinstance(lay, DeviceLocalLayout):
        if slice_dim is not None:                 # a layerwise weight's gradient: its slices
            whole = np.concatenate(list(val), axis=slice_dim)
            ok, d, r = _close(whole, ref, rtol, atol)
            note = f"per-device slices along dim {slice_dim}"
        else:                                     # what each rank returns must be the value
            ok, d, r = _close(val, np.broadcast_to(ref, val.shape) if val.shape[1:] ==
                              ref.shape else ref, rtol, atol)
            if not ok:
                rel, _ = _relation(val, lay, ref, rtol, atol)
                note = f"devices hold {rel}" if rel != "differs" else "differs per device"
    else:
        ok, d, r = _close(val, ref, rtol, atol)
    return ComparedValue(name, kind, tuple(ref.shape), d, r, ok, note)


# ============================================================================ entry point

def _check_inputs(func, fn, inputs, device_num, weights, rtol, atol, layerwise):
    if not callable(fn):
        raise TypeError(f"{func}: fn_or_cell={fn!r} is not callable; expected a function or "
                        f"a Cell")
    out = []
    for i, x in enumerate(inputs):
        if isinstance(x, np.ndarray):
            x = Tensor(x)
        elif not isinstance(x, (TensorBase, numbers.Number, str, type(None))):
            raise TypeError(f"{func}: inputs[{i}] is a {type(x).__name__}; expected a Tensor, "
                            f"a numpy array or a Python scalar")
        out.append(x)
    if device_num is not None and (isinstance(device_num, bool)
                                   or not isinstance(device_num, numbers.Integral)
                                   or not 1 <= device_num <= 4096):
        raise ValueError(f"{func}: device_num={device_num!r} is not valid; expected an int "
                         f"in [1, 4096] or None")
    for name, v in (("rtol", rtol), ("atol", atol)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)
                              or not v >= 0):
            raise ValueError(f"{func}: {name}={v!r} is not valid; expected a number >= 0 or "
                             f"None (the dtype's default)")
    if weights is None:
        if hasattr(fn, "trainable_params") and hasattr(fn, "construct"):
            weights = list(fn.trainable_params())
        else:
            weights = [p for p in live_parameters() if p.requires_grad]
    else:
        weights = list(weights) if isinstance(weights, (list, tuple)) else [weights]
        for i, w in enumerate(weights):
            if not isinstance(w, Parameter):
                raise TypeError(f"{func}: weights[{i}] is a {type(w).__name__}; expected "
                                f"Parameters")
    if layerwise is not None and not isinstance(layerwise, dict):
        raise TypeError(f"{func}: layerwise must be a dict {{parameter name: dim}}, got "
                        f"{type(layerwise).__name__}")
    given = dict(layerwise or {})
    layerwise = {}
    for p in weights:
        if isinstance(p._layout, DeviceLocalLayout):
            cut = layerwise_slice_dim(p)          # set_layerwise_slices(p, full, dim)
            dim = given.get(p.name, cut)
            if dim is None:
                raise ValueError(
                    f"{func}: Parameter {p.name!r} is layerwise_parallel with per-device "
                    f"slices given as a stack, so the full weight for the stand-alone run "
                    f"is not known; pass layerwise={{{p.name!r}: dim}} naming the dim of "
                    f"the full weight the slices were cut from (or give the slices with "
                    f"set_layerwise_slices(param, full_weight, dim))")
            nd = len(p._layout.shape)
            if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) \
                    or not -nd <= dim < nd:
                raise ValueError(f"{func}: layerwise[{p.name!r}]={dim!r} is not valid; "
                                 f"expected a dim in [{-nd}, {nd})")
            if cut is not None and int(dim) % nd != cut:
                raise ValueError(f"{func}: layerwise[{p.name!r}]={dim!r} but "
                                 f"set_layerwise_slices cut Parameter {p.name!r}'s slices "
                                 f"from its full weight along dim {cut}; leave "
                                 f"{p.name!r} out of layerwise (or pass {cut})")
            layerwise[p.name] = int(dim) % nd
    stray = [k for k in given if k not in layerwise]
    if stray:
        held = sorted(layerwise) or "none"
        raise ValueError(f"{func}: layerwise names {stray[0]!r}, which is not a weight "
                         f"holding per-device slices among the weights compared; "
                         f"layerwise_parallel weights with slices: {held}")
    return out, weights, layerwise


def check_equivalence(fn_or_cell, *inputs, device_num: Optional[int] = None,
                      weights: Optional[Sequence[Parameter]] = None,
                      rtol: Optional[float] = None, atol: Optional[float] = None,
                      layerwise: Optional[dict] = None) -> EquivalenceReport:
    """Run `fn_or_cell` on `inputs` sharded and stand-alone, and compare them op by op.

    Parameters
    ----------
    fn_or_cell : Cell or callable
        The program; it returns a Tensor or a tuple (its floating Tensors are compared
        and their sum differentiated).
    *inputs : Tensor, numpy array or scalar
        Its arguments (global values; a top-level Cell call splits them per
        ``dataset_strategy`` as usual).
    device_num : int, optional
        Devices for the sharded run; default: the context's when a parallel mode is
        set, else 8.
    weights : list of Parameter, optional
        Weights whose gradients are compared and whose values both runs share; default:
        a Cell's ``trainable_params()``, for a function every live trainable Parameter.
    rtol, atol : float, optional
        Tolerances (default per dtype, see :func:`tolerances` and the module docstring).
    layerwise : dict, optional
        ``{parameter name: dim}`` for ``layerwise_parallel`` parameters whose
        per-device slices were given as a stack: the dim of the full weight they were
        cut from (the stand-alone run uses the full weight). Not needed for slices
        given by ``set_layerwise_slices(param, full_weight, dim)``, which records
        ``dim``.

    Returns
    -------
    EquivalenceReport
        ``.ok``, ``.max_abs_diff``, ``.first_divergent_op``, and a printable table.

    Raises
    ------
    TypeError, ValueError
        Bad arguments (named); nothing is run and nothing changes.
    """
    func = "check_equivalence"
    inputs, weights, layerwise = _check_inputs(func, fn_or_cell, inputs, device_num,
                                               weights, rtol, atol, layerwise)
    cur = context.get_auto_parallel_context("parallel_mode")
    mode = "semi_auto_parallel" if cur == "stand_alone" else cur
    if device_num is None:
        configured = context._STATE.auto_parallel.device_num
        b = live_backend()
        device_num = configured if cur != "stand_alone" and configured else \
            (b.world_size if b is not None and b.world_size > 1 and cur != "stand_alone"
             else 8)
    positions = tuple(i for i, x in enumerate(inputs)
                      if isinstance(x, TensorBase) and x.dtype.kind == "f")
    if not positions and not weights:
        raise ValueError(f"{func}: nothing to differentiate: the program has no floating "
                         f"Tensor input and no trainable Parameter; pass weights=[...] or "
                         f"a floating input")
    seed = context.get_seed() or 0
    stored = [(p, p._data, p._layout, p._init, p._shape) for p in weights]
    saved = parallel_settings()
    try:
        _use_devices(mode, device_num, func)
        sharded = _run(fn_or_cell, inputs, weights, positions, seed)
        globals_ = []
        for p in weights:
            if p.name in layerwise:                          # every device's slice
                rows = all_rows(p._data, p._layout.device_num)
                globals_.append(np.concatenate(list(rows), axis=layerwise[p.name]))
            elif isinstance(p._layout, DeviceLocalLayout):    # a plain layerwise weight
                globals_.append(np.array(p._data[0]))         # copied to every device
            else:
                globals_.append(np.array(p._value()))
        _use_one_device()
        for p, g in zip(weights, globals_):
            p._data, p._layout, p._init, p._shape = g, None, None, g.shape
        single = _run(fn_or_cell, inputs, weights, positions, seed)
        report = _compare(sharded, single, inputs, positions, weights, layerwise, rtol,
                          atol, device_num, mode)
        blocks = [o.name for o in sharded.ops if o.compiled]
        if report.ok or not blocks:
            return report
        if context._STATE.run.mode != context.GRAPH_MODE:
            report.note = _joined(report.note, (
                f"the compiled block{'s' if len(blocks) > 1 else ''} "
                f"{', '.join(_counted(blocks))} run{'' if len(blocks) > 1 else 's'} as one "
                f"op: the ops inside are not compared (a difference may start there)"))
            return report
        # GRAPH_MODE runs the cell as one compiled op: find the op by running the same
        # program eagerly, with the same strategies and weights
        for p, data, lay, init, shape in stored:
            p._data, p._layout, p._init, p._shape = data, lay, init, shape
        context._STATE.run = dataclasses.replace(context._STATE.run,
                                                 mode=context.PYNATIVE_MODE)
        _use_devices(mode, device_num, func)
        eager = _run(fn_or_cell, inputs, weights, positions, seed)
        found = _compare(eager, single, inputs, positions, weights, layerwise, rtol, atol,
                         device_num, mode)
        if found.ok:
            report.note = _joined(report.note, (
                f"the same program run eagerly (PYNATIVE_MODE) with the same strategies "
                f"equals the stand-alone run: only the compiled graph "
                f"({', '.join(_counted(blocks))}) differs"))
            return report
        report.first_divergent_op = found.first_divergent_op
        report.divergent, report.ops = found.divergent, found.ops
        report.only_sharded, report.only_single = found.only_sharded, found.only_single
        report.note = _joined(found.note, (
            "GRAPH_MODE runs the cell as one compiled op: its ops were compared by running "
            "the same program eagerly (PYNATIVE_MODE) with the same strategies"))
        return report
    finally:
        for p, data, lay, init, shape in stored:
            p._data, p._layout, p._init, p._shape = data, lay, init, shape
        saved.restore()


def _joined(*notes: str) -> str:
    return "\n".join(n for n in notes if n)


def _compare(sharded: _Run, single: _Run, inputs, positions, weights, layerwise, rtol, atol,
             device_num, mode) -> EquivalenceReport:
    values = []
    k = 0
    for i, (a, b) in enumerate(zip(sharded.outputs, single.outputs)):
        if a is None or b is None:
            continue
        values.append(_compare_value(f"output {i}", "output", a, b, rtol, atol, True))
        k += 1
    names = [f"input {p}" for p in positions] + [w.name or f"weight {j}"
                                                  for j, w in enumerate(weights)]
    dims = [None] * len(positions) + [layerwise.get(w.name) for w in weights]
    for name, a, b, dim in zip(names, sharded.grads, single.grads, dims):
        values.append(_compare_value(f"d/d {name}", "gradient", a, b, rtol, atol, False, dim))
    ok = all(v.ok for v in values)
    max_abs = max((v.max_abs_diff for v in values), default=0.0)

    a_names = [o.name for o in sharded.ops]
    b_names = [o.name for o in single.ops]
    # ops of one run only (a strategy's Redistribute moves) leave the alignment first
    a_keep = [i for i, n in enumerate(a_names) if n in set(b_names)]
    b_keep = [i for i, n in enumerate(b_names) if n in set(a_names)]
    matcher = difflib.SequenceMatcher(None, [a_names[i] for i in a_keep],
                                      [b_names[i] for i in b_keep], autojunk=False)
    pairs, in_a, in_b = [], set(), set()
    for blk in matcher.get_matching_blocks():
        for j in range(blk.size):
            ia, ib = a_keep[blk.a + j], b_keep[blk.b + j]
            pairs.append((ia, ib))
            in_a.add(ia)
            in_b.add(ib)
    compared, divergent = [], None
    for ia, ib in pairs:
        a, b = sharded.ops[ia], single.ops[ib]
        rel, d = "equal", 0.0
        for val, lay, ref in zip(a.outputs, a.out_layouts, b.outputs):
            r, dd = _relation(val, lay, ref, rtol, atol)
            d = max(d, dd)
            if r == "differs":
                rel = "differs"
            elif r != "equal" and rel == "equal":
                rel = r
        op = ComparedOp(ia, a.name, rel, d, a.in_layouts, tuple(a.out_layouts),
                        a.inputs_from)
        compared.append(op)
        if divergent is None and rel == "differs":
            divergent = op
    note = ""
    if divergent is None and not ok:
        bad = [v for v in values if not v.ok]
        first_out = next((i for i, v in enumerate(values) if v.kind == "output" and not v.ok),
                         None)
        if first_out is not None:
            root = _root_of(sharded, values[first_out].name)
            op = next((c for c in compared if c.index == root), None)
            if op is not None:
                divergent = op
                if op.relation == "per-device partial sums":
                    note = (f"{op.name}'s output holds per-device partial sums of the "
                            f"stand-alone value: an AllReduce is missing after it")
                else:
                    note = f"{op.name}'s output is returned as it is held: {op.relation}"
        else:
            note = ("every forward op and output matches; the gradients of "
                    + ", ".join(v.name[4:] for v in bad)
                    + " differ: the backward pass or the gradient reduction diverges")
    elif divergent is not None and any(divergent.inputs_from):
        srcs = [c for c in compared if c.index < divergent.index
                and c.relation == "per-device partial sums"]
        src = _aligned_source(sharded, {c.index: c for c in compared}, divergent.index)
        if srcs:
            note = (f"{divergent.name} consumes per-device partial sums (from "
                    f"{srcs[-1].name}): an AllReduce is missing before it")
        elif _is_user_collective(divergent.name) and src is not None \
                and src.relation in ("equal", "equal on every device"):
            note = (f"{divergent.name}'s input (from {src.name}) equals the stand-alone "
                    f"value but its output does not: the program already holds that value "
                    f"whole, and {divergent.name} combines the devices' copies (or shards) "
                    f"of it, where on one device it changes nothing; a collective written "
                    f"for per-device values is not needed here")
    if ok:                  # intermediate differences that leave no trace are not reported
        divergent, note = None, ""
    return EquivalenceReport(
        ok=ok, max_abs_diff=max_abs,
        first_divergent_op=None if divergent is None else divergent.name,
        divergent=divergent, values=values, ops=compared,
        only_sharded=[a_names[i] for i in range(len(a_names)) if i not in in_a],
        only_single=[b_names[i] for i in range(len(b_names)) if i not in in_b],
        device_num=device_num, parallel_mode=mode, note=note)


def _is_user_collective(name: str) -> bool:
    """Is `name` one of the collectives a program calls itself (``ops.AllReduce`` & co.)?"""
    op = REGISTRY.get(name)
    return op is not None and "collective" in op.extras


def _aligned_source(run: _Run, compared: dict, index: int) -> Optional[ComparedOp]:
    """The compared op whose output feeds op `index`'s first tensor input, looking
    through ops of the sharded run only (the moves and conversions it inserts)."""
    at = run.ops[index].inputs_at
    i = next((j for j in at if j is not None), None)
    while i is not None and i not in compared:
        i = next((j for j in run.ops[i].inputs_at if j is not None), None)
    return None if i is None else compared[i]


def _root_of(run: _Run, output_name: str) -> Optional[int]:
    i = int(output_name.split()[-1])
    return run.root_ops[i]
