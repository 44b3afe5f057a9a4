"""Dry runs: compile a step for N devices on abstract inputs and report what one step
would cost, without running it or making its parameters.

    x = dm.parallel.abstract((256, 784), dm.float32)
    rep = dm.parallel.dry_run(step, x, y, device_num=1024, link="100GbE",
                              device_flops=100e12)
    print(rep)                       # memory per device, collectives, times, strategies

:func:`dry_run` runs the compile path of a real call (:class:`~.graph.api.ShardFunction`:
trace, strategies, sharding propagation, lowering with its redistribution plans, fusion)
for ``device_num`` simulated devices that hold no data, then walks the lowered graph the
executor would run:

* **collectives**: each communication node records, through the same recording calls
  the executor's paths make (:func:`dualmode.communication.trace.record`, with the same
  causes and pending-sum makers), what it would record in a :class:`CommReport` — so a
  dry run's records equal a real run's, collective for collective; their predicted
  times use the report's ring formulas and link presets;
* **memory per device**: parameter storage (each parameter's local block in the layout
  the graph stores it in), optimizer states (stored as their weights), the gradients the
  optimizer update reads, and the live values of the step: the executor drops a value
  after its last reader, so the same walk over the same release points gives the peak
  of what one device holds at once (parameters + states + live values, the inputs and
  outputs of the running node included);
* **compute**: a FLOP count per op node on its local shapes, from the op's registration:
  an op of the contraction family (MatMul, BatchMatMul...) does ``2 * prod(sizes of
  its letters)`` (``2 m n k`` for MatMul), an op that declares ``extras["flops"]`` (a
  function ``(attrs, input shapes, output shapes) -> flops``) that, any other op one
  operation per element of the largest tensor it reads or writes (an estimate).

With ``pipeline_stages`` > 1 the step must run one ``nn.PipelineCell``: one micro-batch
of it is compiled for one stage's devices, its nodes are given to their stages, and the
schedule multiplies and overlaps them (see :func:`_walk_pipeline`).

Delayed parameters (made under ``no_init_parameters()``) are never made: tracing only
reads shapes and dtypes. :func:`abstract` makes an input with a shape and dtype only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers

import numpy as np

from .. import context
from .._core._tensor import TensorBase
from ..common import dtype as _dtype
from ..communication import trace as _trace
from ..communication.management import HCCL_WORLD_COMM_GROUP
from ..communication.sim import SimBackend
from ..communication.trace import comm_cause, pending_sum
from ..tensor import DeclaredShape, Parameter, Tensor
from .graph.api import AutoParallel, ShardFunction
from .graph.executor import _releases
from .graph.ir import CALL, FUSED, FUSED_AG, FUSED_RS, MOVE, REDUCE, Ref
from .graph.trace import find_parameters, walk_reachable
from .inputs import input_layout
from . import optimizer_shard
from .pipeline import (PLANNING, TRANSFER, gradient_layout, parameter_stage,
                       pipeline_schedule)
from .grad_reduce import bucket_name, fused_bucket, grouped_buckets, single_step, step_group
from .redistribution.executor import _record_steps
from .redistribution.planner import plan_redistribution
from .report import CommReport, _fmt_bytes, _fmt_seconds, network_model
from .stacks import is_batch_layout
from .tensor_layout import TensorLayout

__all__ = ["abstract", "AbstractTensor", "dry_run", "DryRunReport"]


# ---------------------------------------------------------------------------
# abstract inputs
# ---------------------------------------------------------------------------
class AbstractTensor(DeclaredShape, Tensor):
    """A tensor with a shape and a dtype and no value: an input of :func:`dry_run`.
    Reading its value raises."""

    __slots__ = ("_shape", "_dtype")

    def _no_value(self):
        return TypeError(f"abstract tensor (shape {self._shape}, dtype {self._dtype}) has no "
                         f"value; it is an input of dm.parallel.dry_run, which plans a "
                         f"step without running it (pass a Tensor to run it)")

    def asnumpy(self):
        raise self._no_value()

    def __array__(self, dtype=None, copy=None):
        raise self._no_value()

    def item(self):
        raise self._no_value()

    def __bool__(self):
        raise self._no_value()

    def __repr__(self):
        return f"abstract(shape={self._shape}, dtype={self._dtype})"

    __str__ = __repr__


def abstract(shape, dtype=None) -> AbstractTensor:
    """A tensor of `shape` and `dtype` (default float32) without a value, for
    :func:`dry_run`: nothing of its size is allocated.

    Raises ValueError for a dim that is not a positive int, TypeError for a dtype that
    is not one."""
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"abstract: shape={shape!r} has type {type(shape).__name__}; "
                        f"expected a tuple of positive ints")
    for d, s in enumerate(shape):
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s <= 0:
            raise ValueError(f"abstract: shape={tuple(shape)!r} has dim {d} = {s!r}; every "
                             f"dim must be a positive int")
    try:
        dt = np.dtype(_dtype.float32 if dtype is None else getattr(dtype, "np", dtype))
    except TypeError:
        raise TypeError(f"abstract: dtype={dtype!r} is not a dtype; use one such as "
                        f"dm.float32 or dm.int32") from None
    t = TensorBase.__new__(AbstractTensor)
    t._shape = tuple(int(s) for s in shape)
    t._dtype = dt
    t._data = None
    return t


# ---------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------
class DryRunReport(CommReport):
    """What one step costs per device, planned by :func:`dry_run`.

    It is a :class:`CommReport` of the step's collectives (``records``, ``count``,
    ``bytes``, ``predicted_time`` under the dry run's network model, the table), plus:

    Attributes
    ----------
    device_num : int
    parameter_bytes, optimizer_state_bytes, gradient_bytes : int
        Per device: the parameters' storage as the step reads them, the optimizer
        states' (stored as their weights, or as their slices under the parallel
        optimizer), the gradients the optimizer update reads (in their weights' layouts).
        A weight the parallel optimizer splits counts its whole block here: gathered
        before its first read, it is held until the update stores it as its slices.
    stored_parameter_bytes : int
        Per device, the parameters' storage between steps: a weight the parallel
        optimizer splits n ways as its slice (1/n of its block); otherwise equal to
        ``parameter_bytes``.
    activation_bytes : int
        Per device: the most the step's live values other than parameters take at once
        (activations kept for the backward pass, gradients in flight, the buffers of
        the running node).
    peak_memory : int
        Per device: ``parameter_bytes + optimizer_state_bytes + activation_bytes``.
    comm_peak_memory : int
        What :class:`CommReport` measures as ``peak_memory`` in a real run: parameter
        and state storage plus the largest collective's input and output buffers.
    flops : float
        Floating-point operations of one device in one step (see the module docstring).
    compute_time, comm_time, step_time : float or None
        ``flops / device_flops``; the collectives' predicted time (network model given);
        their sum (communication is not assumed to overlap compute). None when the
        figure it needs was not given.
    strategies : dict
        The chosen strategy per op (``compiled.strategies()`` of the compiled step).
    compiled : CompiledGraph
        The compiled step (``compiled.program.graph`` is the lowered graph).
    stages : list of DryRunReport or None
        With pipeline stages: one report per stage (its ``device_num`` devices, the
        figures of one of them over the whole step). The report's own memory figures
        are then the stage that needs the most, its ``records`` every stage's.
    schedule : PipelineSchedule or None
        The pipeline's time table (``in_flight``: micro-batches each stage keeps).
    micro_batch_time, bubble_time : float or None
        With pipeline stages: the slowest stage's time for one micro-batch (compute
        plus its communication), and the schedule's ``stages - 1`` idle slots of it;
        ``step_time`` is then ``(micro_size + stages - 1) * micro_batch_time`` plus the
        slowest stage's once-per-step communication.
    """

    def __init__(self, device_num, model, link):
        super().__init__()
        self.model = model
        self.link = link
        self.device_num = device_num
        self.parameter_bytes = 0
        self.stored_parameter_bytes = 0
        self.optimizer_state_bytes = 0
        self.gradient_bytes = 0
        self.activation_bytes = 0
        self.comm_peak_memory = 0
        self.flops = 0.0
        self.device_flops = None
        self.compute_time = None
        self.comm_time = None
        self.step_time = None
        self.strategies = {}
        self.compiled = None
        self.stages = None
        self.schedule = None
        self.micro_batch_time = None
        self.bubble_time = None
        self._buffers = 0

    # the walk offers collective buffers only; storage is added once at the end
    def _note_memory(self, nbytes: int) -> None:
        if nbytes > self._buffers:
            self._buffers = nbytes

    def __repr__(self):
        t = "" if self.step_time is None else f", step {_fmt_seconds(self.step_time)}"
        return (f"DryRunReport({self.device_num} devices: peak memory "
                f"{_fmt_bytes(self.peak_memory)} per device, {len(self.records)} collectives "
                f"moving {_fmt_bytes(self.bytes())} per device{t})")

    def summary(self) -> str:
        """The per-device figures as a few lines of text."""
        rows = [("parameters", _fmt_bytes(self.parameter_bytes)),
                ("between steps", _fmt_bytes(self.stored_parameter_bytes)),
                ("optimizer states", _fmt_bytes(self.optimizer_state_bytes)),
                ("gradients", _fmt_bytes(self.gradient_bytes)),
                ("activations (peak)", _fmt_bytes(self.activation_bytes)),
                ("peak memory", _fmt_bytes(self.peak_memory)),
                ("collectives", f"{len(self.records)} moving {_fmt_bytes(self.bytes())}"),
                ("compute", f"{self.flops:.4g} FLOP" + (
                    "" if self.compute_time is None else
                    f" = {_fmt_seconds(self.compute_time)}")),
                ("communication", "-" if self.comm_time is None
                 else _fmt_seconds(self.comm_time)),
                ("step", "-" if self.step_time is None else _fmt_seconds(self.step_time))]
        return "\n".join([repr(self)] + [f"  {k:<20} {v}" for k, v in rows])

    def __str__(self):
        return self.summary() + "\n" + CommReport.__str__(self).split("\n", 1)[-1]


# ---------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------
_MODES = ("semi_auto_parallel", "auto_parallel")


def _check_device_num(n):
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"dry_run: device_num={n!r} is not valid; expected a positive int "
                         f"(the number of devices to plan for)")
    return int(n)


def _check_flops(v):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
            or v <= 0:
        raise ValueError(f"dry_run: device_flops={v!r} is not valid; expected a positive "
                         f"number of floating-point operations per second (e.g. 100e12)")
    return float(v)


@contextlib.contextmanager
def _virtual_devices(n, mode, search_mode=None, **more):
    """`n` simulated devices that hold no data, for the compile: the context's
    device_num, parallel mode (and an AutoParallel's own search mode, and the `more`
    keys given), and a stand-in backend; everything restored after."""
    st = context._STATE
    saved_ap, comm = st.auto_parallel, st.comm
    saved = (comm.backend, comm.groups, comm.member_arrays)
    changes = dict(more, device_num=n, parallel_mode=mode)
    if search_mode is not None:
        changes["search_mode"] = search_mode
    st.auto_parallel = dataclasses.replace(saved_ap, **changes)
    comm.backend = SimBackend(n)
    comm.groups = {HCCL_WORLD_COMM_GROUP: tuple(range(n))}
    comm.member_arrays = {}
    try:
        yield
    finally:
        st.auto_parallel = saved_ap
        comm.backend, comm.groups, comm.member_arrays = saved


@contextlib.contextmanager
def _unplaced(params, n):
    """Parameters stored in a layout for another device count are planned as if new."""
    swapped = []
    for p in params:
        lay = p._layout
        if isinstance(lay, TensorLayout) and lay.device_num != n:
            swapped.append((p, lay))
            p._layout = None
    try:
        yield
    finally:
        for p, lay in swapped:
            p._layout = lay


def dry_run(fn_or_cell, *inputs, device_num, link=None, alpha_s=None,
            beta_s_per_byte=None, device_flops=None, parallel_mode=None) -> DryRunReport:
    """Plan one step of `fn_or_cell` on `device_num` devices without running it.

    Parameters
    ----------
    fn_or_cell : a function, a Cell, or what ``AutoParallel`` / ``ops.shard`` /
        ``Cell.shard`` returned
        A plain function or Cell is compiled as ``AutoParallel`` compiles it (a training
        step with ``value_and_grad`` and an optimizer call, or a network): its tensor
        inputs split as batch data per ``dataset_strategy``.
    *inputs : abstract tensors (:func:`abstract`), Tensors (only their shapes and dtypes
        are read), or other arguments
    device_num : int
        The devices to plan for; the current backend is not used.
    link, alpha_s, beta_s_per_byte
        The network model of the collectives' predicted times, as for
        :class:`CommReport` (``link="10GbE" | "100GbE" | "nvlink"``); none: no times.
    device_flops : float, optional
        One device's speed (floating-point operations per second) for the compute time.
    parallel_mode : "semi_auto_parallel" or "auto_parallel", optional
        Default: the context's when it is one of them, else "semi_auto_parallel".

    Returns
    -------
    DryRunReport
    """
    n = _check_device_num(device_num)
    model = network_model("dry_run", alpha_s, beta_s_per_byte, link)
    flops_rate = _check_flops(device_flops)
    mode = parallel_mode if parallel_mode is not None else \
        context._STATE.auto_parallel.parallel_mode
    if mode not in _MODES:
        if parallel_mode is not None:
            raise ValueError(f"dry_run: parallel_mode={parallel_mode!r} is not valid; "
                             f"expected one of {list(_MODES)}")
        mode = "semi_auto_parallel"
    sf = fn_or_cell if isinstance(fn_or_cell, ShardFunction) else AutoParallel(
        fn_or_cell, "semi_auto" if mode == "semi_auto_parallel"
        else context._STATE.auto_parallel.search_mode)
    stages = getattr(context._STATE.auto_parallel, "pipeline_stages", 1)
    if stages > 1:
        return _dry_run_pipeline(sf, inputs, n, stages, mode, model, link, flops_rate)
    params = find_parameters(sf.fn)
    report = DryRunReport(n, model, link)
    with _virtual_devices(n, sf.mode or mode, sf.search_mode), _unplaced(params, n):
        args = _placed_inputs(sf, inputs, n)
        compiled = sf._compile(args, {}, True)
        report.compiled = compiled
        report.strategies = compiled.strategies()
        _walk(compiled, report)
    report.device_flops = flops_rate
    if flops_rate is not None:
        report.compute_time = report.flops / flops_rate
    if model is not None:
        report.comm_time = report.predicted_time()
    if report.compute_time is not None and report.comm_time is not None:
        report.step_time = report.compute_time + report.comm_time
    return report


def _placed_inputs(sf, inputs, n):
    """The inputs as abstract tensors; for a top-level network call, placed as batch data
    (the layouts ``distribute_inputs`` gives real tensors)."""
    strategy = context.get_auto_parallel_context("dataset_strategy")
    out, k = [], 0
    for i, a in enumerate(inputs):
        if isinstance(a, Parameter) or not isinstance(a, TensorBase):
            out.append(a)
            continue
        t = a if isinstance(a, AbstractTensor) and a._layout is None else \
            abstract(tuple(a.shape), a.dtype)
        if sf.top_level and strategy != "full_batch" and t.ndim > 0:
            t = abstract(t.shape, t.dtype)
            t._layout = input_layout(i, tuple(t.shape), k, strategy, n)
            k += 1
        out.append(t)
    return tuple(out)


# ---------------------------------------------------------------------------
# the walk over the lowered graph
# ---------------------------------------------------------------------------
def _local_bytes(lay, value) -> int:
    """Bytes one device holds of `value` (an ir.Value) in layout `lay` (None: whole)."""
    shape = value.shape if lay is None else lay.local_shape
    return math.prod(shape) * value.dtype.itemsize


def _record(kind, group, groups, nbytes, out_bytes):
    """One collective as a backend records it (``Backend._record``): the record, and its
    input plus output buffers per device offered as memory."""
    _trace.record(kind, group, groups, nbytes)
    _trace.note_memory(nbytes + out_bytes)


def _reason(extra):
    """The executor's ``op_reason``: its step's reason, else "forward" (a step runs
    outside any backward pass of a tape)."""
    return extra or "forward"


def _step_reason(node):
    if node.op == MOVE and node.attrs["reason"] == "gradient":
        return "gradient"
    if node.op == FUSED:
        return "gradient"
    if node.op in (FUSED_RS, FUSED_AG):
        return node.attrs["reason"]
    return "backward" if node.backward else None


def _move_records(attrs, value, extra):
    """The collectives the executor's ``_move`` records for one MOVE node."""
    src, dst, kind = attrs["src"], attrs["dst"], attrs["kind"]
    if kind in ("view", "gridview", "slice"):
        return
    itemsize = value.dtype.itemsize
    cause = attrs["cause"]
    with pending_sum(src.partial_op) if src is not None and src.partial else \
            contextlib.nullcontext():
        plan = attrs["plan"]
        if kind == "grid":
            if src is None:
                return
            if plan is None:
                _move_stack_records(src, dst, value, cause, attrs["reason"])
            elif len(plan) and (dst.partial or plan.communicates):
                with comm_cause(cause, attrs["reason"]):
                    _record_steps(plan, itemsize)
            return
        if kind == "resolve":
            b = _local_bytes(src, value)
            group = math.prod(src.device_matrix[a] for a in src.partial)
            with comm_cause(cause, _reason(extra)):
                _record("AllReduce", group, src.device_num // group, b, b)
            return
        if kind == "gather":
            with comm_cause(cause, _reason(extra)):
                _gather_records(src, value, cause,
                                "gradient" if attrs["reason"] == "gradient" else None)
            return
        if plan is not None:
            with comm_cause(cause, attrs["reason"]):
                _record_steps(plan, itemsize)
            return
        _move_stack_records(src, dst, value, cause, attrs["reason"])


def _gather_records(src, value, cause, reason=None):
    """What ``moves.gather_stack`` records for a value in `src` gathered whole (with
    `reason`, as the executor passes it)."""
    lay = src
    if lay.partial:
        b = _local_bytes(lay, value)
        group = math.prod(lay.device_matrix[a] for a in lay.partial)
        with comm_cause(cause, _reason(reason)), pending_sum(lay.partial_op):
            _record("AllReduce", group, lay.device_num // group, b, b)
        lay = lay.without_partial()
        if all(m == () for m in lay.tensor_map):
            return
    b = _local_bytes(lay, value)
    with comm_cause(cause, reason or "redistribution"):
        if is_batch_layout(lay):
            _record("AllGather", lay.device_num, 1, b, b * (lay.device_num + 1))
        else:
            group = math.prod(lay.device_matrix[a] for a in lay.split_axes)
            _trace.record("AllGather", group, lay.device_num // group, b)


def _move_stack_records(src, dst, value, cause, reason):
    raise RuntimeError(f"dry_run: a move of a value of shape {value.shape} from {src!r} to "
                       f"{dst!r} (for {cause}) has no redistribution plan; the dry run "
                       f"cannot count its collectives")


def _node_records(node, lays, extra):
    """Record the collectives one lowered node makes when the executor runs it."""
    a = node.attrs
    if node.op == MOVE:
        _move_records(a, node.outputs[0], extra)
    elif node.op == REDUCE:
        lay = a["layout"]
        b = _local_bytes(lay, node.outputs[0])
        group = math.prod(lay.device_matrix[x] for x in a["axes"])
        with comm_cause(a["cause"], _reason(extra)):
            _record("AllReduce", group, lay.device_num // group, b, b)
    elif node.op == FUSED:
        src = a["src"]
        b = sum(_local_bytes(s, v) for s, v in zip(a["srcs"], node.outputs))
        group = math.prod(src.device_matrix[x] for x in src.partial)
        with comm_cause(a["cause"], _reason(extra)):
            _record("AllReduce", group, src.device_num // group, b, b)
    elif node.op in (FUSED_RS, FUSED_AG):
        ins = [lays.get(x.id) for x in node.inputs]
        b = sum(_local_bytes(lay, v) for lay, v in zip(ins, node.outputs))
        out = sum(_local_bytes(lays.get(v.id), v) for v in node.outputs)
        members = a["members"]
        kind = "ReduceScatter" if node.op == FUSED_RS else "AllGather"
        with comm_cause(a["cause"], _reason(extra)):
            _record(kind, int(members.shape[1]), int(members.shape[0]), b, out)


def _flops(node, lays, values) -> float:
    """Floating-point operations of one op node on one device (its local shapes)."""
    def shape_of(x):
        if isinstance(x, Ref):
            lay = lays.get(x.id)
            return tuple(lay.local_shape) if lay is not None else values[x.id].shape
        v = x.value
        return tuple(v.shape) if isinstance(v, TensorBase) else np.shape(v)
    ins = [shape_of(x) for x in node.inputs]
    run_outs = node.run.outputs if node.run is not None and node.run.outputs else \
        (None,) * len(node.outputs)
    outs = [tuple(lay.local_shape) if lay is not None else v.shape
            for lay, v in zip(run_outs, node.outputs)]
    op = node.op
    declared = op.extras.get("flops")
    if declared is not None:
        return float(declared(node.attrs, ins, outs))
    fam = op.extras.get("family")
    if fam and fam[0] == "contract" and (len(fam) < 3 or fam[2] == "mul"):
        found = fam[1](node.attrs, tuple(len(s) for s in ins))
        if found is not None:
            sizes = {}
            for sub, shape in zip(found[0], ins):
                for letter, size in zip(sub, shape):
                    sizes[letter] = max(sizes.get(letter, 1), int(size))
            return 2.0 * math.prod(sizes.values())
    return float(max([math.prod(s) for s in ins + outs if s is not None] or [0]))


def _check_no_inner_collective(node):
    """An op whose rule communicates inside its own computation marks its plan with a
    ``post`` of Nones (BatchNorm over a split batch: the statistics' AllReduce); the
    graph does not show that collective, so the dry run refuses rather than miss it."""
    plan = getattr(node.run, "plan", None)
    post = getattr(plan, "post", ())
    if post and all(p is None for p in post):
        raise RuntimeError(f"dry_run: {node.name} communicates inside its own computation "
                           f"(a collective its sharding rule runs, not a node of the "
                           f"compiled graph), which the dry run does not count yet; plan "
                           f"it with a strategy that does not split what {node.op_name} "
                           f"reduces over")


def _optimizer_states(call):
    """``[(state Parameter, its weight), ...]`` of the optimizer whose update `call` (a
    CALL node) records: the optimizer is what the recorded update closes over."""
    fn = call.attrs.get("fn")
    weights = call.attrs.get("params") or ()
    for cell in getattr(fn, "__closure__", None) or ():
        opt = cell.cell_contents
        names = getattr(opt, "__dict__", {}).get("_state_names")
        if names:
            return [(st, w) for name in names for st, w in zip(getattr(opt, name), weights)]
    return []


def _gather_units(call, planned, n, keep=None):
    """The parallel optimizer's gathers of the weights an optimizer update (a CALL node)
    stores as their slices: ``[(weight ids, record)]``, one unit per collective —
    the buckets of ``comm_fusion["allgather"]`` (one fused AllGather each), then every
    other weight alone — as ``ParameterShards.gather`` forms them; ``record()``
    records the unit's collectives (reason "parallel_optimizer"). A real step runs a
    unit where one of its weights is first read."""
    if optimizer_shard.settings() is None:
        return []
    fusion = "allgather" in (context.get_auto_parallel_context("comm_fusion") or {})
    moves = []                       # (weight, slice layout, use layout, plan)
    for p in call.attrs.get("params") or ():
        if id(p) not in planned or not p.requires_grad or \
                (keep is not None and id(p) not in keep):
            continue
        use = planned[id(p)]
        sliced = optimizer_shard.shard_layout(p, use)
        if sliced is None:
            continue
        dst = use or TensorLayout.replicated(tuple(p.shape), n)
        moves.append((p, sliced, dst,
                      plan_redistribution(sliced, dst, np.dtype(p.dtype).itemsize)))
    keys, sizes, groups = [], [], []
    for p, sliced, dst, plan in moves:
        itemsize = np.dtype(p.dtype).itemsize
        sizes.append(math.prod(dst.local_shape) * itemsize)
        step = single_step(plan, "AllGather") if fusion else None
        if step is None:
            keys.append(None)
            groups.append(None)
            continue
        key, members = step_group(plan, step, p.dtype)
        keys.append(key)
        groups.append(members)

    def fused(bucket):
        members = groups[bucket[0]]
        ins = sum(math.prod(moves[k][1].local_shape) * np.dtype(moves[k][0].dtype).itemsize
                  for k in bucket)
        with comm_cause(bucket_name([moves[k][0].name for k in bucket], "parameters"),
                        "parallel_optimizer"):
            _record("AllGather", int(members.shape[1]), int(members.shape[0]), ins,
                    ins * int(members.shape[1]))

    def alone(k):
        p, _, _, plan = moves[k]
        with comm_cause(p.name, "parallel_optimizer"):
            _record_steps(plan, np.dtype(p.dtype).itemsize)

    units, done = [], set()
    for bucket in grouped_buckets(keys, sizes, "allgather"):
        if fused_bucket([np.dtype(moves[k][0].dtype) for k in bucket]):
            units.append(([id(moves[k][0]) for k in bucket],
                          lambda bucket=bucket: fused(bucket)))
            done.update(bucket)
    units += [([id(moves[k][0])], lambda k=k: alone(k))
              for k in range(len(moves)) if k not in done]
    return units


def _update_records(call, planned, n, keep=None):
    """The parallel optimizer's gathers of the weights an optimizer update (a CALL
    node) stores as their slices, all at once (see :func:`_gather_units`)."""
    for _, record in _gather_units(call, planned, n, keep):
        record()


def _split_bytes(call, planned, n, keep=None):
    """Per device, what the weights an optimizer update (a CALL node) stores as their
    slices take less between steps than read whole: their blocks minus their slices."""
    saved = 0
    for p in call.attrs.get("params") or ():
        if id(p) in planned and p.requires_grad and (keep is None or id(p) in keep):
            use = planned[id(p)]
            sliced = optimizer_shard.shard_layout(p, use)
            if sliced is not None:
                whole = tuple(p.shape) if use is None else use.local_shape
                saved += (math.prod(whole) - math.prod(sliced.local_shape)) * \
                    np.dtype(p.dtype).itemsize
    return saved


def _walk(compiled, report):
    """Fill `report` from the lowered graph of `compiled`."""
    prog = compiled.program
    g = prog.graph
    lays = g.meta["layouts"]
    plans = g.meta["params"]
    values = g.values()
    report.parameter_bytes = sum(_local_bytes(plans[v.id].layout, v) for _, v in g.params)
    by_weight = {id(p): plans[v.id].layout for p, v in g.params}
    # the parallel optimizer: the weights it stores as their slices are gathered where
    # the step first reads one of a unit's weights
    units, unit_of, calls = [], {}, [node for node in g.nodes if node.op == CALL]
    for node in calls:
        for ids, record in _gather_units(node, by_weight, report.device_num):
            unit_of.update((i, len(units)) for i in ids)
            units.append(record)
    weight_of = {v.id: id(p) for p, v in g.params}
    gathered = set()
    saved = list(_trace._STATE.reports)
    _trace._STATE.reports[:] = [report]
    try:
        for p, v in g.params:     # a weight the graph reads whole: read as it is bound
            u = unit_of.get(id(p))
            if plans[v.id].layout is None and u is not None and u not in gathered:
                gathered.add(u)
                units[u]()
    finally:
        _trace._STATE.reports[:] = saved
    report.stored_parameter_bytes = report.parameter_bytes - sum(
        _split_bytes(node, by_weight, report.device_num) for node in calls)
    states = []
    for node in g.nodes:
        if node.op == CALL:
            states += _optimizer_states(node)
            report.gradient_bytes += sum(_local_bytes(lays.get(x.id), values[x.id])
                                         for x in node.inputs if isinstance(x, Ref))
    seen = set()
    for st, w in states:
        if id(st) not in seen:
            seen.add(id(st))
            lay = by_weight.get(id(w))
            lay = optimizer_shard.shard_layout(w, lay) or lay     # the parallel optimizer's
            shape = tuple(st.shape) if lay is None else tuple(lay.local_shape)
            report.optimizer_state_bytes += math.prod(shape) * np.dtype(st.dtype).itemsize
    # live values: the arguments, then each node's outputs until their last reader
    size = {}
    for v in g.args:
        size[v.id] = _local_bytes(lays.get(v.id), v)
    for _, v in g.params:
        size[v.id] = 0                               # counted as parameter storage
    live = sum(size[v.id] for v in g.args)
    peak = live
    saved = list(_trace._STATE.reports)
    _trace._STATE.reports[:] = [report]
    try:
        for node, done in zip(g.nodes, _releases(g)):
            extra = _step_reason(node)
            for x in node.inputs:
                u = unit_of.get(weight_of.get(x.id)) if isinstance(x, Ref) else None
                if u is not None and u not in gathered:
                    gathered.add(u)
                    units[u]()
            _node_records(node, lays, extra)
            for v in node.outputs:
                aliased = node.op == MOVE and node.attrs["kind"] in ("view", "gridview")
                size[v.id] = 0 if aliased else _local_bytes(lays.get(v.id), v)
                live += size[v.id]
            peak = max(peak, live)
            for vid in done:
                live -= size.pop(vid, 0)
            if node.op not in (MOVE, REDUCE, FUSED, FUSED_RS, FUSED_AG, CALL):
                _check_no_inner_collective(node)
                report.flops += _flops(node, lays, values)
    finally:
        _trace._STATE.reports[:] = saved
    report.activation_bytes = peak
    storage = report.parameter_bytes + report.optimizer_state_bytes
    report.peak_memory = storage + peak
    report.parameter_memory = storage
    report.comm_peak_memory = storage + report._buffers



# ---------------------------------------------------------------------------
# pipeline parallelism
# ---------------------------------------------------------------------------
def _pipeline_cells(fn, depth=4) -> list:
    """The ``nn.PipelineCell`` objects reachable from `fn` (its closure, the globals it
    names, the cells inside the cells found), as :func:`find_parameters` searches."""
    found = {}

    def on_cell(cell):
        for _, c in cell.cells_and_names():
            if getattr(type(c), "runs_pipeline", False):
                found.setdefault(id(c), c)

    walk_reachable(fn, depth, on_cell)
    return list(found.values())


@contextlib.contextmanager
def _planning(stages):
    PLANNING[0] = stages
    try:
        yield
    finally:
        PLANNING[0] = None


class _Records:
    """Collects the records (and the largest collective buffers) of one part of a step."""

    def __init__(self):
        self.records = []
        self.buffers = 0

    def _add_record(self, rec):
        self.records.append(rec)

    def _note_memory(self, nbytes):
        self.buffers = max(self.buffers, nbytes)


def _dry_run_pipeline(sf, inputs, n, stages, mode, model, link, rate):
    """The dry run of a step built on ``nn.PipelineCell`` over `stages` pipeline stages:
    one micro-batch of the whole step compiled on one stage's ``n / stages`` devices,
    each compiled node given to the stage it runs on, then the schedule applied."""
    if n % stages:
        raise ValueError(f"dry_run: pipeline_stages={stages} does not divide device_num={n}; "
                         f"each stage runs on device_num / pipeline_stages devices")
    cells = _pipeline_cells(sf.fn)
    if len(cells) != 1:
        raise ValueError(f"dry_run: pipeline_stages={stages} plans a step that runs one "
                         f"nn.PipelineCell (its network's cells carry pipeline_stage); "
                         f"{len(cells)} were found in what the step reaches")
    micro = cells[0].micro_size
    per = n // stages
    schedule = pipeline_schedule(stages, micro)
    cut = []
    for i, a in enumerate(inputs):
        if isinstance(a, TensorBase) and not isinstance(a, Parameter) and len(a.shape):
            if a.shape[0] % micro:
                raise ValueError(f"dry_run: micro_size={micro} (nn.PipelineCell) does not "
                                 f"divide the batch of input {i} (shape {tuple(a.shape)}); "
                                 f"the batch must be a multiple of micro_size")
            a = abstract((a.shape[0] // micro,) + tuple(a.shape[1:]), a.dtype)
        cut.append(a)
    params = find_parameters(sf.fn)
    report = DryRunReport(n, model, link)
    with _virtual_devices(per, sf.mode or mode, sf.search_mode, pipeline_stages=1), \
            _unplaced(params, per), _planning(stages):
        args = _placed_inputs(sf, cut, per)
        compiled = sf._compile(args, {}, True)
        report.compiled = compiled
        report.strategies = compiled.strategies()
        _walk_pipeline(compiled, report, schedule, per, rate)
    return report


def _node_stages(g, stages):
    """``(node stages, value stages)``: the stage each node of the lowered graph runs on
    (None for the optimizer update, which each stage runs for its weights). A pipeline
    transfer runs on its receiving stage; a parameter belongs to its stage; any other
    node to the latest stage of what it reads; a node reading nothing staged (the labels'
    moves) to the earliest stage that reads what it makes."""
    nodes = g.nodes
    vstage = {}
    for p, v in g.params:
        k = parameter_stage(p)
        if k is not None:
            vstage[v.id] = k
    nst = [None] * len(nodes)
    for i, node in enumerate(nodes):
        if node.op == CALL:
            continue
        if node.op is TRANSFER:
            k = node.attrs["dst"]
        else:
            ks = [vstage[x.id] for x in node.inputs if isinstance(x, Ref) and x.id in vstage]
            k = max(ks) if ks else None
        nst[i] = k
        if k is not None:
            for v in node.outputs:
                vstage[v.id] = k
    need = {}
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        if node.op == CALL:
            continue
        if nst[i] is None:
            ks = [need[v.id] for v in node.outputs if v.id in need]
            nst[i] = min(ks) if ks else 0
            for v in node.outputs:
                vstage[v.id] = nst[i]
        for x in node.inputs:
            if isinstance(x, Ref) and x.id not in vstage:
                need[x.id] = min(need.get(x.id, stages), nst[i])
    for v in list(g.args) + [v for _, v in g.params]:
        vstage.setdefault(v.id, min(need.get(v.id, 0), stages - 1))
    return nst, vstage


def _walk_pipeline(compiled, report, schedule, per, rate):
    """Fill `report` (and one report per stage, ``report.stages``) from the lowered graph
    of one micro-batch of a pipelined step."""
    S, micro = schedule.stages, schedule.micro_size
    g = compiled.program.graph
    lays, plans, values = g.meta["layouts"], g.meta["params"], g.values()
    nst, vstage = _node_stages(g, S)
    subs = [DryRunReport(per, report.model, report.link) for _ in range(S)]
    per_micro = [_Records() for _ in range(S)]
    per_step = [_Records() for _ in range(S)]
    by_weight = {id(p): plans[v.id].layout for p, v in g.params}
    for p, v in g.params:
        subs[vstage[v.id]].parameter_bytes += _local_bytes(plans[v.id].layout, v)
    weight_stage = {id(p): vstage[v.id] for p, v in g.params}
    for k, sub in enumerate(subs):
        sub.stored_parameter_bytes = sub.parameter_bytes - sum(
            _split_bytes(node, by_weight, per, {i for i, j in weight_stage.items() if j == k})
            for node in g.nodes if node.op == CALL)
    size = {}
    live = [0] * S
    for v in g.args:
        size[v.id] = _local_bytes(lays.get(v.id), v)
        live[vstage[v.id]] += size[v.id]
    for _, v in g.params:
        size[v.id] = 0                               # counted as parameter storage
    peak, stash = list(live), None
    flops = [0.0] * S
    states = []
    reports = _trace._STATE.reports
    saved = list(reports)
    sent = {}                                        # (cell, src, dst) -> a weight's layout
    try:
        for i, (node, done) in enumerate(zip(g.nodes, _releases(g))):
            if stash is None and node.backward:
                stash = list(live)                   # what the forward keeps per stage
            if node.op == CALL:
                states += _optimizer_states(node)
                for x in node.inputs:
                    if isinstance(x, Ref):
                        subs[vstage[x.id]].gradient_bytes += _local_bytes(lays.get(x.id),
                                                                          values[x.id])
                for k in range(S):
                    reports[:] = [per_step[k]]
                    keep = {id(p) for p in node.attrs.get("params") or ()
                            if weight_stage.get(id(p)) == k}
                    _update_records(node, by_weight, per, keep)
            elif node.op is TRANSFER:
                a = node.attrs
                x = node.inputs[0]
                lay = lays.get(x.id)
                if a["once"]:           # a weight's gradient goes back in its sent pieces
                    key = (a["cell"],) + ((a["dst"], a["src"]) if a["grad"] else
                                          (a["src"], a["dst"]))
                    if a["grad"]:
                        lay = gradient_layout(sent.get(key), lay)
                    else:
                        sent[key] = lay
                b = _local_bytes(lay, values[x.id])
                part = per_step if a["once"] else per_micro
                with comm_cause(a["cell"], "pipeline"):
                    reports[:] = [part[a["src"]]]
                    _trace.record("Send", 2, per, b)
                    reports[:] = [part[a["dst"]]]
                    _trace.record("Receive", 2, per, b)
            else:
                k = nst[i]
                if node.op in (FUSED, FUSED_RS, FUSED_AG):
                    across = {vstage[x.id] for x in node.inputs if isinstance(x, Ref)}
                    if len(across) > 1:
                        raise RuntimeError(
                            f"dry_run: {node.name} fuses the collectives of weights of "
                            f"pipeline stages {sorted(across)}, which run on different "
                            f"devices; plan a pipelined step without comm_fusion")
                extra = _step_reason(node)
                once = extra in ("gradient", "parallel_optimizer")
                reports[:] = [(per_step if once else per_micro)[k]]
                _node_records(node, lays, extra)
                if node.op not in (MOVE, REDUCE, FUSED, FUSED_RS, FUSED_AG):
                    _check_no_inner_collective(node)
                    flops[k] += _flops(node, lays, values)
            for v in node.outputs:
                aliased = node.op == MOVE and node.attrs["kind"] in ("view", "gridview")
                size[v.id] = 0 if aliased else _local_bytes(lays.get(v.id), v)
                live[vstage[v.id]] += size[v.id]
            for k in range(S):
                peak[k] = max(peak[k], live[k])
            for vid in done:
                live[vstage.get(vid, 0)] -= size.pop(vid, 0)
    finally:
        reports[:] = saved
    if stash is None:
        stash = list(live)
    seen = set()
    for st, w in states:
        if id(st) not in seen and id(w) in weight_stage:
            seen.add(id(st))
            lay = by_weight.get(id(w))
            lay = optimizer_shard.shard_layout(w, lay) or lay
            shape = tuple(st.shape) if lay is None else tuple(lay.local_shape)
            subs[weight_stage[id(w)]].optimizer_state_bytes += \
                math.prod(shape) * np.dtype(st.dtype).itemsize
    in_flight = schedule.in_flight
    model = report.model
    for k, sub in enumerate(subs):
        sub.records = per_micro[k].records * micro + per_step[k].records
        sub.activation_bytes = (in_flight[k] - 1) * stash[k] + peak[k]
        storage = sub.parameter_bytes + sub.optimizer_state_bytes
        sub.parameter_memory = storage
        sub.peak_memory = storage + sub.activation_bytes
        sub.comm_peak_memory = storage + max(per_micro[k].buffers, per_step[k].buffers)
        sub.flops = flops[k] * micro
        sub.device_flops = rate
        sub.micro_batch_flops = flops[k]
        sub.micro_batch_records = per_micro[k].records
        sub.step_records = per_step[k].records
        sub.strategies = report.strategies
        if rate is not None:
            sub.compute_time = sub.flops / rate
        if model is not None:
            sub.comm_time = sub.predicted_time()
        if rate is not None and model is not None:
            sub.step_time = sub.compute_time + sub.comm_time
    report.stages = subs
    report.schedule = schedule
    report.records = [r for sub in subs for r in sub.records]
    worst = max(subs, key=lambda r: r.peak_memory)
    for key in ("parameter_bytes", "stored_parameter_bytes", "optimizer_state_bytes",
                "gradient_bytes",
                "activation_bytes", "peak_memory", "parameter_memory", "comm_peak_memory"):
        setattr(report, key, getattr(worst, key))
    busiest = max(range(S), key=lambda k: flops[k])
    report.flops = subs[busiest].flops
    report.device_flops = rate
    report.compute_time = subs[busiest].compute_time
    report.comm_time = None if model is None else max(sub.comm_time for sub in subs)
    report.micro_batch_time = report.bubble_time = None
    if rate is not None and model is not None:
        def predicted(records):
            part = CommReport()
            part.model, part.records = model, records
            return part.predicted_time()
        slot = max(flops[k] / rate + predicted(per_micro[k].records) for k in range(S))
        report.micro_batch_time = slot
        report.bubble_time = (S - 1) * slot
        report.step_time = (micro + S - 1) * slot + \
            max(predicted(per_step[k].records) for k in range(S))
