"""Pipeline parallelism: stages on disjoint device groups, micro-batches, the schedule.

``set_auto_parallel_context(pipeline_stages=S)`` (in semi_auto_parallel or
auto_parallel) cuts the ``N`` devices into ``S`` stages of ``N / S`` devices; stage ``s``
holds world ranks ``s * N/S .. (s + 1) * N/S - 1``. The parallel layer then runs on one
stage's devices (the communication layer's *stage view*, ``Backend.stage_view``): every
layout, strategy and collective is over ``N / S`` devices, which is what each stage
runs. Under "sim" every stage runs in this process on that view, one after another;
under "mpi" each rank runs its own stage.

A cell with ``cell.pipeline_stage = k`` runs on stage ``k``. While ``nn.PipelineCell``
runs its network, each staged cell's ``construct`` is wrapped (:class:`PipelineRun`):
its outputs are marked with its stage, and an input made by an earlier stage is moved
to this one first — device ``i`` of the sending stage to device ``i`` of the receiving
one, as the backend's ``send`` / ``recv`` (``Send`` and ``Receive`` in ``CommReport``,
reason ``"pipeline"``), each device its own shard. The move is one op on the tape
(``PipelineTransfer``), whose backward moves the gradient back the same way. Code
outside staged cells runs on the stage of the values it reads.

:func:`pipeline_schedule` gives the time table of a schedule ("1f1b", MindSpore's
default, or "gpipe"): which stage runs which micro-batch's forward or backward in each
time slot, idle slots (bubbles) included.
"""
from __future__ import annotations

import math
import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np

from .. import context
from .._core import _tensor as _core
from .._core._dp import TOTALS
from .._core._tensor import TensorBase
from ..autograd import _zeros_like_meta
from ..communication.sim import replicated_view
from ..communication.totals import DeferredShares, as_stack, known_totals, stored
from ..communication.trace import comm_cause
from ..ops._math import ADD, MUL
from ..ops._registry import register, same_as_input
from ..tensor import Parameter
from .devices import live_backend, parallel_active
from .moves import move_stack, redistribute_tensor
from .redistribution.planner import plan_redistribution
from .rules import build_rule
from .tensor_layout import TensorLayout

__all__ = ["PipelineSchedule", "pipeline_schedule", "active_stages", "staged_cells",
           "micro_batches", "PipelineRun", "Remote", "TRANSFER", "SCHEDULERS",
           "parameter_stage", "note_parameter_stages", "check_outside_run", "RUNNING",
           "PipelinePlan", "PLANNING", "first_stage_values", "stage_order", "gradient_layout",
           "stage_files"]

SCHEDULERS = ("1f1b", "gpipe")
_PIPELINE_MODES = ("semi_auto_parallel", "auto_parallel")


# ------------------------------------------------------------------ the schedule


class PipelineSchedule:
    """The time table of a pipeline schedule.

    Attributes
    ----------
    scheduler : str
        ``"1f1b"`` or ``"gpipe"``.
    stages, micro_size : int
    table : list of lists
        ``table[s][t]`` is ``("F", m)`` (stage ``s`` runs the forward of micro-batch
        ``m`` in time slot ``t``), ``("B", m)`` (its backward) or None (idle: a bubble).
        Every forward and every backward takes one slot; a stage starts a micro-batch's
        forward once the stage before has sent it, and its backward once the stage after
        has sent the gradient.
    """

    def __init__(self, scheduler: str, stages: int, micro_size: int, table):
        self.scheduler, self.stages, self.micro_size = scheduler, stages, micro_size
        self.table = table

    @property
    def num_slots(self) -> int:
        """Time slots from the first forward to the last backward."""
        return len(self.table[0]) if self.table else 0

    @property
    def bubbles(self) -> int:
        """Idle (stage, slot) pairs."""
        return sum(e is None for row in self.table for e in row)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the stages' time: ``bubbles / (stages * num_slots)``."""
        return self.bubbles / (self.stages * self.num_slots)

    @property
    def in_flight(self) -> Tuple[int, ...]:
        """Per stage, the most micro-batches whose forward ran and backward did not yet
        (the activations it keeps at once): ``micro_size`` for every stage under GPipe,
        at most ``stages - s`` for stage ``s`` under 1F1B."""
        out = []
        for row in self.table:
            live = peak = 0
            for e in row:
                if e is not None:
                    live += 1 if e[0] == "F" else -1
                    peak = max(peak, live)
            out.append(peak)
        return tuple(out)

    def rows(self) -> List[List[str]]:
        """The table as text: ``"F0"``, ``"B3"``, ``"."`` (idle), one row per stage."""
        return [["." if e is None else f"{e[0]}{e[1]}" for e in row] for row in self.table]

    def __str__(self) -> str:
        rows = self.rows()
        width = max(3, max(len(c) for r in rows for c in r) + 1)
        name = {"1f1b": "1F1B", "gpipe": "GPipe"}[self.scheduler]
        head = (f"pipeline schedule {name}: {self.stages} stages, {self.micro_size} "
                f"micro-batches, {self.num_slots} time slots, {self.bubbles} idle "
                f"({self.bubble_fraction:.0%}); Fm / Bm = forward / backward of "
                f"micro-batch m, . = idle")
        lines = [head, "time    " + "".join(f"{t:<{width}}" for t in range(self.num_slots))]
        for s, r in enumerate(rows):
            lines.append(f"stage {s:<2}" + "".join(f"{c:<{width}}" for c in r))
        lines.append("micro-batches in flight per stage (activations kept): "
                     + ", ".join(str(n) for n in self.in_flight))
        return "\n".join(line.rstrip() for line in lines)

    def __repr__(self) -> str:
        return (f"PipelineSchedule({self.scheduler!r}, stages={self.stages}, "
                f"micro_size={self.micro_size}, slots={self.num_slots}, "
                f"bubbles={self.bubbles})")


def stage_order(scheduler: str, stages: int, micro: int, s: int) -> List[Tuple[str, int]]:
    """What stage `s` runs, in order: ``[("F", m) | ("B", m), ...]``."""
    if scheduler == "gpipe":          # every forward, then every backward
        return [("F", m) for m in range(micro)] + [("B", m) for m in range(micro)]
    warmup = min(stages - s - 1, micro)   # 1F1B: forwards in flight, then alternate
    order = [("F", m) for m in range(warmup)]
    for i in range(micro - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", m) for m in range(micro - warmup, micro)]


def _check_int(func, name, value, low):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{func}: {name}={value!r} is not valid; expected an int >= {low}")
    return int(value)


def pipeline_schedule(stages: Optional[int] = None, micro_size: int = 1,
                      scheduler: Optional[str] = None) -> PipelineSchedule:
    """The time table of a pipeline schedule; ``print`` it to see it.

    Parameters
    ----------
    stages : int, optional
        Pipeline stages (default: the context's ``pipeline_stages``).
    micro_size : int
        Micro-batches per batch (``nn.PipelineCell``'s ``micro_size``).
    scheduler : str, optional
        ``"1f1b"`` or ``"gpipe"`` (default: the context's
        ``pipeline_config["pipeline_scheduler"]``, itself ``"1f1b"`` by default).
    """
    func = "pipeline_schedule"
    cfg = context._STATE.auto_parallel
    stages = _check_int(func, "stages", cfg.pipeline_stages if stages is None else stages, 1)
    micro = _check_int(func, "micro_size", micro_size, 1)
    if scheduler is None:
        scheduler = cfg.pipeline_config["pipeline_scheduler"]
    if scheduler not in SCHEDULERS:
        raise ValueError(f"{func}: scheduler={scheduler!r} is not valid; expected one of "
                         + ", ".join(repr(s) for s in SCHEDULERS))
    orders = [stage_order(scheduler, stages, micro, s) for s in range(stages)]
    done = {}                         # (kind, stage, m) -> end slot
    free = [0] * stages
    pos = [0] * stages
    placed = [[] for _ in range(stages)]  # (start slot, entry)
    left = 2 * stages * micro
    while left:
        progressed = False
        for s in range(stages):
            if pos[s] == len(orders[s]):
                continue
            kind, m = orders[s][pos[s]]
            if kind == "F":
                dep = [("F", s - 1, m)] if s else []
            else:
                dep = [("B", s + 1, m)] if s < stages - 1 else [("F", s, m)]
            if any(d not in done for d in dep):
                continue
            start = max([free[s]] + [done[d] for d in dep])
            done[(kind, s, m)] = free[s] = start + 1
            placed[s].append((start, (kind, m)))
            pos[s] += 1
            left -= 1
            progressed = True
        if not progressed:            # cannot happen for these two orders
            raise RuntimeError(f"{func}: the {scheduler} order deadlocks")
    slots = max(free)
    table = [[None] * slots for _ in range(stages)]
    for s in range(stages):
        for start, entry in placed[s]:
            table[s][start] = entry
    return PipelineSchedule(scheduler, stages, micro, table)


# ------------------------------------------------------------- stages and cells

#: id(Parameter) -> (weak reference, stage): the stage each parameter of a network run
#: by a PipelineCell belongs to (the first stage whose cells hold it)
_PARAM_STAGES: Dict[int, tuple] = {}
#: Parameter name -> (weak reference, stage), for the states an optimizer keeps for a
#: parameter (clones named ``<prefix>.<name>``)
_NAME_STAGES: Dict[str, tuple] = {}


def _holders(network, explicit=None):
    """``[(name, cell, stage)]``: each cell of `network` with the stage its parameters
    belong to (its own ``pipeline_stage``, else its nearest staged ancestor's; None
    outside every staged cell)."""
    within, out = {}, []
    for name, cell in network.cells_and_names():
        k = getattr(cell, "pipeline_stage", -1) if explicit is None else \
            explicit.get(id(cell), -1)
        parent = name.rpartition(".")[0] if name else None
        within[name] = k if k >= 0 else within.get(parent)
        out.append((name or type(cell).__name__, cell, within[name]))
    return out


def _parameter_stages(holders) -> dict:
    """id(Parameter) -> (Parameter, {stage: [(cell, attribute, cell name)]})."""
    by_param = {}
    for name, cell, k in holders:
        if k is None:
            continue
        for attr, p in cell.parameters_and_names(expand=False):
            by_param.setdefault(id(p), (p, {}))[1].setdefault(k, []).append(
                (cell, attr, name))
    return by_param


def note_parameter_stages(network) -> None:
    """Remember which stage each parameter of `network` belongs to (the first stage
    whose cells hold it), for :func:`parameter_stage`."""
    for p, stages in _parameter_stages(_holders(network)).values():
        _note(p, min(stages))


def _note(p, stage):
    ref = weakref.ref(p)
    _PARAM_STAGES[id(p)] = (ref, stage)
    if p.name:
        _NAME_STAGES[p.name] = (ref, stage)


def parameter_stage(p) -> Optional[int]:
    """The pipeline stage parameter `p` belongs to (the stage of the cells holding it,
    the first of them when several do), once a PipelineCell ran its network; None for
    a parameter outside every staged cell or of no pipeline."""
    hit = _PARAM_STAGES.get(id(p))
    if hit is not None and hit[0]() is p:
        return hit[1]
    name = getattr(p, "name", None) or ""
    hit = _NAME_STAGES.get(name.partition(".")[2])  # an optimizer's state of a parameter
    if hit is not None:
        source = hit[0]()
        if source is not None and source is not p and source.shape == p.shape:
            return hit[1]
    return None


def active_stages(owner: str) -> int:
    """The number of pipeline stages the network runs on now: 1 unless
    ``pipeline_stages`` > 1 in a parallel mode (a ValueError names the key when the mode
    or the device count does not allow it)."""
    cfg = context._STATE.auto_parallel
    stages = cfg.pipeline_stages
    if stages <= 1 or cfg.parallel_mode == "stand_alone":
        return 1
    if cfg.parallel_mode not in _PIPELINE_MODES:
        raise ValueError(f"{owner}: pipeline_stages={stages} needs parallel_mode "
                         f"'semi_auto_parallel' or 'auto_parallel', not "
                         f"{cfg.parallel_mode!r} (set_auto_parallel_context)")
    parallel_active()                 # starts the backend init() would make
    b = live_backend()
    if b is None or b.world is None or b.stages != stages:
        n = b.world_size if b is not None else cfg.device_num
        raise ValueError(f"{owner}: pipeline_stages={stages} does not divide device_num="
                         f"{n}; each stage runs on device_num / pipeline_stages devices")
    return stages


#: how many PipelineRun blocks are running (a staged cell runs only inside one)
RUNNING = [0]


def check_outside_run(cell) -> None:
    """A cell with a ``pipeline_stage`` called outside ``nn.PipelineCell``: fine unless
    pipeline parallelism is on, where it would run on no stage (a RuntimeError)."""
    stages = active_stages(type(cell).__name__)
    if stages > 1:
        raise RuntimeError(f"{type(cell).__name__}: this cell has pipeline_stage="
                           f"{cell.pipeline_stage} and pipeline_stages={stages}, but it "
                           f"runs outside nn.PipelineCell; train the network wrapped as "
                           f"nn.PipelineCell(net_with_loss, micro_size), which runs each "
                           f"cell on its stage's devices")


def staged_cells(network, stages: int, owner: str):
    """``[(name, cell, stage)]`` for the cells of `network` with a ``pipeline_stage``,
    checked: every stage below `stages` has a cell, none is at or past `stages`."""
    found = []
    for name, cell in network.cells_and_names():
        k = getattr(cell, "pipeline_stage", -1)
        if k < 0:
            continue
        label = name or type(cell).__name__
        if k >= stages:
            raise ValueError(f"{owner}: cell {label!r} has pipeline_stage={k}, but "
                             f"pipeline_stages={stages}; valid stages are 0 .. "
                             f"{stages - 1}")
        if "_shard_fn" in cell.__dict__:
            raise ValueError(f"{owner}: cell {label!r} (pipeline_stage={k}) runs as a "
                             f"compiled graph (Cell.shard); the PipelineCell runs a "
                             f"pipeline stage's cells itself (compiled for the stage's "
                             f"devices in GRAPH_MODE), give its ops strategies with "
                             f"Primitive.shard instead")
        found.append((label, cell, k))
    have = {k for _, _, k in found}
    missing = [k for k in range(stages) if k not in have]
    if missing:
        listed = ", ".join(f"{n!r}: {k}" for n, _, k in found) or "none"
        raise ValueError(f"{owner}: pipeline stage {missing[0]} has no cell: "
                         f"pipeline_stages={stages} needs cells with pipeline_stage = "
                         f"0 .. {stages - 1} (cells with a stage: {listed}); set "
                         f"cell.pipeline_stage = {missing[0]} on the cells it runs")
    return found


def micro_batches(inputs, micro_size: int, owner: str) -> List[tuple]:
    """`inputs` cut into `micro_size` micro-batches along dim 0. A distributed input
    is cut on each device (device ``d``'s rows are split in `micro_size` parts, part
    ``m`` goes to micro-batch ``m``), as MindSpore does, without moving data; a plain
    one into consecutive rows. Non-Tensor and 0-d inputs go to every micro-batch."""
    cols = []
    for i, x in enumerate(inputs):
        if not isinstance(x, TensorBase) or x.ndim == 0:
            cols.append([x] * micro_size)
            continue
        layout = x._layout
        if getattr(layout, "abstract", False):
            layout = None             # a graph being traced: a value of the global batch
        if layout is not None and not isinstance(layout, TensorLayout):
            raise ValueError(f"{owner}: input {i} holds per-device values "
                             f"({type(layout).__name__}); micro-batches are cut from "
                             f"batch data")
        batch = x.shape[0]
        parts = 1 if layout is None else layout.parts(0)
        rows = batch // parts
        if batch % parts or rows % micro_size:
            where = "" if parts == 1 else f", {rows} on each of the {parts} devices " \
                                          f"that split it"
            raise ValueError(f"{owner}: micro_size={micro_size} does not divide the "
                             f"batch of input {i} (shape {tuple(x.shape)}: {batch} "
                             f"rows{where}); the batch must be a multiple of micro_size"
                             + ("" if parts == 1 else " times the devices splitting it"))
        step = rows // micro_size
        if layout is None:
            cols.append([x[m * step:(m + 1) * step] for m in range(micro_size)])
            continue
        stack = x._data
        shape = (batch // micro_size,) + tuple(x.shape[1:])
        sub = layout.replace(shape=shape)
        rec = x._node is not None and _core.recording()   # differentiated: taped
        cols.append([_core.finish(TRANSFER, {"kind": "slice", "rows": (m * step, step),
                                             "layout": layout, "sub": sub, "cell": owner},
                                  (x,), stack[:, m * step:(m + 1) * step], rec, (sub,))
                     for m in range(micro_size)])
    return [tuple(c[m] for c in cols) for m in range(micro_size)]


# --------------------------------------------------------------- the transfers


class Remote:
    """A value that another pipeline stage computes, on a process that does not run that
    stage (backend "mpi"): it only stands for the value in the network's code."""

    __slots__ = ("stage", "__weakref__")

    def __init__(self, stage: int):
        self.stage = stage

    def __repr__(self) -> str:
        return f"<value of pipeline stage {self.stage}, computed by another process>"

    def _refuse(self, what):
        return TypeError(f"PipelineCell: {what} a value of pipeline stage {self.stage}, "
                         f"which another process computes (backend 'mpi'); code outside "
                         f"the cells of a stage runs where its inputs are, so give cells "
                         f"of other stages their values whole (one Tensor in, one out) "
                         f"and put the code that reads them in a cell of a stage")

    def __getattr__(self, name):
        # an AttributeError, so that hasattr / getattr with a default still answer
        raise AttributeError(str(self._refuse(f"reading .{name} of")))

    def __iter__(self):
        raise self._refuse("unpacking")

    def __getitem__(self, key):
        raise self._refuse("indexing")


def _transfer_backward(node, g):
    attrs = node.attrs
    if attrs["kind"] == "slice":      # a micro-batch cut from each device's rows
        start, rows = attrs["rows"]
        part = redistribute_tensor(g, attrs["sub"], attrs["cell"])
        layout = attrs["layout"]
        full = np.zeros((part.shape[0],) + layout.local_shape, part.dtype)
        full[:, start:start + rows] = part
        return (_core.wrap_dist(full, layout),)
    if attrs["kind"] == "accumulated":  # 1F1B: the gradients each micro-batch's backward
        g0 = g._value() if g._layout is None else None      # made, times the seed
        one = g0 is not None and np.all(g0 == 1)
        return tuple(None if a is None else a if one else _core.apply(MUL, None, (a, g))
                     for a in attrs["grads"])
    if attrs["kind"] == "plan":       # a traced boundary: the gradient crosses it back
        back = dict(attrs, src=attrs["dst"], dst=attrs["src"], grad=True)
        return (_core.apply(TRANSFER, back, (g,)),)
    return attrs["run"].backward(node, g)


#: a micro-batch of a distributed input (kind "slice": the rows each device keeps; its
#: backward puts the gradient back at those rows), a value moved from one pipeline
#: stage's devices to another's (kind "move": each
#: device's shard goes to the same device of the other stage; the backward moves the
#: gradient back), or, under "mpi", the output of a stage that does not compute the
#: loss (kind "output": its inputs are the values the stage sent on; the backward
#: receives their gradients). Made by PipelineRun, not dispatched; only a traced plan
#: (kind "plan", :class:`PipelinePlan`) dispatches it: an identity that keeps its
#: input's layout (each device's shard goes to the same device of the other stage).
TRANSFER = register("PipelineTransfer", linear=(0,), family=("elementwise",),
                    infer=same_as_input, kernel=lambda attrs, *x: x[0],
                    backward=_transfer_backward)
build_rule(TRANSFER)                         # registered after the rules were built

#: the input of a transfer received from another process (a constant: no gradient)
_ANCHOR = _core.wrap_dist(np.zeros((), np.float32), None)


def _stack(x, n):
    """``(stack, layout)`` of a Tensor to send: its shards, or a plain value once per
    device (`n`: the devices of the stage this process holds)."""
    layout = x._layout
    if layout is None:
        return replicated_view(np.asarray(x._value()), n), None
    return x._data, layout


def gradient_layout(sent, grad):
    """The layout in which the gradient of a value that crossed a stage boundary in
    layout `sent` goes back, when it arrives in layout `grad`: `sent`'s pieces with
    `grad`'s pending sums (each device keeps the part of its share, or of the whole
    value when `grad` is None, that its device of the other stage holds, without
    communication), when that is smaller than `grad`'s; else `grad`. A weight sent to a
    later stage as its slices (a tied embedding table split over the vocabulary) thus
    has its gradient sent back as those slices, not whole as the later stage's product
    makes it."""
    if not isinstance(sent, TensorLayout) or sent.partial:
        return grad
    if grad is None:            # a whole value on every device: each keeps its piece
        return sent if math.prod(sent.local_shape) < math.prod(sent.shape) else grad
    if not isinstance(grad, TensorLayout) or sent == grad or sent.shape != grad.shape \
            or sent.device_matrix != grad.device_matrix \
            or set(sent.split_axes) & set(grad.partial):
        return grad
    want = sent.with_partial(grad.partial).with_partial_op(grad.partial_op) \
        if grad.partial else sent
    if want == grad or math.prod(want.local_shape) >= math.prod(grad.local_shape) \
            or plan_redistribution(grad, want).bytes:
        return grad
    return want


def _in_sent_pieces(g, sent, name):
    """`g` moved into :func:`gradient_layout` (a local cut: nothing is communicated)."""
    lay = getattr(g, "_layout", None)
    want = gradient_layout(sent, lay)
    if want is lay:
        return g
    if lay is None:                           # this process's blocks of the whole value
        return _core.wrap_dist(redistribute_tensor(g, want, name, "pipeline"), want)
    return _core.wrap_dist(move_stack(stored(g), lay, want, name, "pipeline"), want)


def _unstack(stack, layout):
    return _core.wrap_dist(stack[0] if layout is None else stack, layout)


class PipelineRun:
    """One network call over the micro-batches: inside the ``with`` block every cell's
    ``construct`` runs on its stage (its ``pipeline_stage``, else the latest stage of
    the values it reads), moving inputs made by earlier stages to it first and marking
    its outputs with its stage. Under "mpi" a cell of another stage is not run: its
    outputs are :class:`Remote`, and the values this stage made that it reads are sent
    to it."""

    def __init__(self, network, staged, owner: str, graph=None):
        self.owner = owner
        # GRAPH_MODE: graph(cell, construct, name) gives the staged cell's compiled call
        self.graph = graph
        self.view = live_backend()
        self.here = self.view.stage          # None: every stage runs in this process
        explicit = {id(cell): k for _, cell, k in staged}
        self.cells = [(name or type(cell).__name__, cell, explicit.get(id(cell), -1))
                      for name, cell in network.cells_and_names()]
        self._holders = _holders(network, explicit)
        self._lent = []               # (cell __dict__, attribute, Parameter) lent out
        self._marks = {}              # id(value) -> (value, stage)
        self._moved = {}              # (id(value), stage) -> moved value
        self._events = 0
        self._saved = []
        self.sent = []                # under "mpi": (value, stage, event, cell) sent on
        self._leaves = None           # 1F1B: (private tape, next slot)
        self._shared = []             # 1F1B: (moved weight, its leaf stand-in)
        self._kept = set()            # 1F1B: _moved keys of weights (kept all call)
        self._weights_sent = []       # 1F1B, "mpi": weights sent on (gradients once)

    def __enter__(self) -> "PipelineRun":
        RUNNING[0] += 1
        self.view.wait_sends()
        for name, cell, k in self.cells:
            d = cell.__dict__
            self._saved.append((d, d.get("construct")))
            d["construct"] = self._wrap(name, cell, k)
        try:
            self._share_parameters()
        except BaseException:
            self.__exit__(None, None, None)          # every cell as it was
            raise
        return self

    def _share_parameters(self):
        """A parameter held by cells of several stages (a tied embedding) belongs to the
        first of them; the later ones read it as a value that stage sends them, once per
        call, whose gradient comes back to it (and is added to its own there)."""
        for p, stages in _parameter_stages(self._holders).values():
            first = min(stages)
            self._marks[id(p)] = (p, first)
            _note(p, first)
            for k in sorted(stages):
                if k == first:
                    continue
                if self.graph is not None:
                    _, attr, holder = stages[k][0]
                    raise RuntimeError(
                        f"{self.owner}: weight {p.name!r} is held by cells of pipeline "
                        f"stages {first} and {k} (cell {holder!r}, attribute {attr!r}); "
                        f"in GRAPH_MODE a stage's compiled cells cannot read a weight of "
                        f"another stage as an attribute: pass it to the later stage's "
                        f"cell as an argument (as a tied embedding table passed to the "
                        f"output layer), or train in PyNative mode")
                holders = stages[k]
                y = self._arrive(p, k, holders[0][2])
                for cell, attr, _ in holders:
                    self._lent.append((cell.__dict__, attr, p))
                    cell.__dict__[attr] = y

    def __exit__(self, *exc) -> bool:
        RUNNING[0] -= 1
        for d, attr, p in self._lent:
            d[attr] = p
        self._lent.clear()
        for d, old in self._saved:
            if old is None:
                d.pop("construct", None)
            else:
                d["construct"] = old
        self._saved.clear()
        self._marks.clear()
        self._moved.clear()
        return False

    def _wrap(self, name, cell, explicit):
        construct = type(cell).construct

        def staged(*args, **kwargs):
            k = explicit if explicit >= 0 else self._latest((args, kwargs))
            if k is None:
                return construct(cell, *args, **kwargs)
            args = tuple(self._arrive(a, k, name) for a in args)
            kwargs = {key: self._arrive(v, k, name) for key, v in kwargs.items()}
            if self.here not in (None, k):
                out = Remote(k)
            elif self.graph is not None and explicit >= 0:
                out = self.graph(cell, construct, name)(*args, **kwargs)
            else:
                out = construct(cell, *args, **kwargs)
            self._mark(out, k)
            return out
        return staged

    def _latest(self, values):
        """The latest stage among the marked values in `values` (None: none marked)."""
        if isinstance(values, (tuple, list)):
            found = [self._latest(v) for v in values]
            found = [k for k in found if k is not None]
            return max(found) if found else None
        if isinstance(values, dict):
            return self._latest(list(values.values()))
        hit = self._marks.get(id(values))
        return hit[1] if hit is not None and hit[0] is values else None

    def _mark(self, out, k):
        if isinstance(out, (TensorBase, Remote)):
            self._marks[id(out)] = (out, k)
        elif isinstance(out, (tuple, list)):
            for o in out:
                self._mark(o, k)

    def _arrive(self, x, k, name):
        if isinstance(x, (tuple, list)):
            return type(x)(self._arrive(v, k, name) for v in x)
        if not isinstance(x, (TensorBase, Remote)):
            return x
        hit = self._marks.get(id(x))
        if hit is None or hit[0] is not x or hit[1] == k:
            return x
        j = hit[1]
        if j > k:
            raise ValueError(f"{self.owner}: cell {name!r} (pipeline_stage {k}) takes an "
                             f"output of pipeline stage {j}, a later stage; a cell reads "
                             f"values of its own stage or of earlier ones")
        y = self._moved.get((id(x), k))
        if y is None:
            y = self._cross(x, j, k, name, self.next_event())
            self._moved[(id(x), k)] = y
            self._marks[id(y)] = (y, k)
            if self._leaves is not None and isinstance(x, Parameter):
                # 1F1B: a weight moves once per call and its gradient goes back once
                y = self._leaf_for(y)
                self._moved[(id(x), k)] = y
                self._kept.add((id(x), k))
        return y

    def _leaf_for(self, y):
        """1F1B: a stand-in of the moved weight `y` with a leaf of this run's tape, whose
        gradient the micro-batches accumulate; :meth:`run_1f1b` moves the sum back once
        at the end."""
        if not isinstance(y, TensorBase) or y._node is None:
            return y
        tape, slots = self._leaves
        hit = _core.wrap_dist(y._data, y._layout)
        hit._node = _core.make_leaf(slots, tape)
        self._leaves = (tape, slots + 1)
        self._shared.append((y, hit))
        self._marks[id(hit)] = (hit, self._marks[id(y)][1])
        return hit

    def next_event(self) -> int:
        """A new transfer's number (every process counts the same transfers in the same
        order: its forward message has tag ``2 e``, its gradient's ``2 e + 1``)."""
        self._events += 1
        return self._events

    def _cross(self, x, j, k, name, event):
        """`x`, made by stage `j`, as stage `k` reads it."""
        here, view = self.here, self.view
        if here is not None and here not in (j, k):
            return Remote(k)
        with comm_cause(name, "pipeline"):
            if here in (None, j):
                stack, layout = _stack(x, len(view.local_ranks))
                view.send(stack, k, 2 * event, meta=layout)
            if here == j:                             # "mpi": stage k receives it
                if self._leaves is not None and isinstance(x, Parameter):
                    self._weights_sent.append((x, k, event, name))   # 1F1B: once
                else:
                    self.sent.append((x, k, event, name))
                return Remote(k)
            got, layout = view.recv(j, 2 * event)
        data = got[0] if layout is None else got
        src = x if here is None else _ANCHOR
        rec = _core.recording() and (here is not None or x._node is not None)
        return _core.finish(TRANSFER, {"kind": "move", "src": j, "dst": k, "run": self,
                                       "cell": name, "event": event, "layout": layout},
                            (src,), data, rec, None if layout is None else (layout,))

    def run_1f1b(self, network, inputs, micro_size, order):
        """Run `network` over the micro-batches of `inputs` in `order` (``[("F", m)``,
        ``("B", m)]``: a stage's 1F1B order; under "sim", where a micro-batch's forward
        runs every stage, the first stage's), each micro-batch's backward run where the
        order puts it, so that its activations are dropped then. Called while a tape
        records: the network's weights and the differentiated inputs get leaves of a
        tape of this run; each backward adds its gradients to theirs; the result is the
        summed output (as :meth:`output` gives it) as one op whose backward hands the
        accumulated gradients (times its seed) to the weights and inputs. A weight that
        a later stage reads moves there once and its gradient comes back once, after
        the last backward. Returns ``(result, order run)``."""
        tape = _next_private_tape()
        weights = [p for p in network.get_parameters() if p._node is not None]
        saved = [p._node for p in weights]
        for slot, p in enumerate(weights):
            p._node = _core.make_leaf(slot, tape)
        slots = len(weights)
        ins, sources = [], []
        for x in inputs:
            if isinstance(x, TensorBase) and x._node is not None:
                leaf = _core.wrap_dist(x._value() if x._layout is None else x._data,
                                       x._layout)
                leaf._node = _core.make_leaf(slots, tape)
                slots += 1
                sources.append(x)
                x = leaf
            ins.append(x)
        self._leaves = (tape, slots)
        acc, owned = [], set()          # the sums so far; the slots whose sum is ours
        try:
            lent = {}
            for d, attr, p in self._lent:     # weights lent to later stages' cells
                y = d[attr]
                if id(y) not in lent:
                    lent[id(y)] = self._leaf_for(y)
                d[attr] = lent[id(y)]
            self._weights_sent, self.sent = self.sent, []   # their sends: once
            micros = micro_batches(tuple(ins), micro_size, self.owner)
            live, total, done = {}, None, []
            for kind, m in order:
                done.append((kind, m))
                if kind == "F":
                    start = len(self.sent)
                    marks, moved = set(self._marks), set(self._moved)
                    out = network(*micros[m])
                    if not isinstance(out, (TensorBase, Remote)):
                        raise TypeError(f"{self.owner}: with pipeline_scheduler '1f1b' the "
                                        f"network of a differentiated call must return "
                                        f"one Tensor (its loss), got "
                                        f"{type(out).__name__}; return the loss alone, "
                                        f"or set pipeline_config={{'pipeline_scheduler': "
                                        f"'gpipe'}}")
                    if isinstance(out, TensorBase):
                        value = _core.detached(out) if out._layout is not None else \
                            _core.wrap_dist(out._value(), None)
                        total = value if total is None else total + value
                    live[m] = (out, start, len(self.sent), set(self._marks) - marks,
                               set(self._moved) - moved - self._kept)
                    continue
                out, a, b, marks, moved = live.pop(m)
                for key in marks:                 # its values are dropped after it
                    if self._marks.get(key, (None,))[0] is not None and \
                            not any(self._marks[key][0] is h for _, h in self._shared):
                        self._marks.pop(key, None)
                for key in moved:
                    self._moved.pop(key, None)
                if isinstance(out, TensorBase):
                    root = out
                elif b > a:                               # "mpi": what this stage sent on
                    root = self._sent_root(self.sent[a:b])
                else:
                    continue
                _add_to(acc, _backward(root, tape, self._leaves[1]), owned)
                del out, root
                self.sent[a:b] = [None] * (b - a)       # "mpi": dropped once sent back
            for y, leaf in self._shared:                 # the weights moved, once
                g = acc[leaf._node.slot] if leaf._node.slot < len(acc) else None
                if g is not None:
                    _add_to(acc, _backward(y, tape, self._leaves[1], g), owned)
            if self.here is not None and self._weights_sent:   # "mpi": their gradients
                _add_to(acc, _backward(self._sent_root(self._weights_sent), tape,
                                       self._leaves[1]), owned)
        finally:
            for p, node in zip(weights, saved):
                p._node = node
            self._leaves = None
        acc += [None] * (len(weights) + len(sources) - len(acc))
        value = self.output_value(total)
        n = len(weights) + len(sources)
        result = _core.finish(TRANSFER, {"kind": "accumulated", "grads": tuple(acc[:n])},
                              tuple(weights) + tuple(sources),
                              value._value() if value._layout is None else value._data,
                              True, None if value._layout is None else (value._layout,))
        return result, done

    def _sent_root(self, sent):
        """Under "mpi": an op over values this stage sent on, whose backward receives
        their gradients (the root of a backward on a stage without the loss)."""
        return _core.finish(TRANSFER, {"kind": "output", "run": self, "sent": sent},
                            tuple(x for x, _, _, _ in sent), np.zeros((), np.float32),
                            True, None)

    def _shared_output(self, total):
        """Under "mpi": ``(computed here, value)`` of the summed output; the stage that
        computes it sends its value to the other stages' processes (not recorded: an
        observation, as MindSpore's ``pipeline_result_broadcast``)."""
        view = self.view
        last = view.stages - 1
        event = self.next_event()
        if self.here == last:
            value = np.asarray(total.asnumpy())
            for s in range(last):
                view.send(replicated_view(value, len(view.local_ranks)), s, 2 * event,
                          record=False)
            view.wait_sends()
            return True, value
        got, _ = view.recv(last, 2 * event, record=False)
        return False, np.array(got[0])

    def output_value(self, total):
        """The summed output as every stage sees it, without a gradient."""
        if self.here is None:
            return total
        return _core.wrap_dist(self._shared_output(total)[1], None)

    def output(self, total):
        """The network's summed output as every stage sees it; under "mpi" a stage that
        sent values on returns it as an op whose gradient receives theirs."""
        if self.here is None:
            return total
        computed_here, value = self._shared_output(total)
        if computed_here:
            return total
        sent = tuple(x for x, _, _, _ in self.sent)
        rec = _core.recording() and any(x._node is not None for x in sent)
        if not rec:
            return _core.wrap_dist(value, None)
        return _core.finish(TRANSFER, {"kind": "output", "run": self}, sent, value, True,
                            None)

    def backward(self, node, g):
        """The backward of a TRANSFER node."""
        attrs, view = node.attrs, self.view
        if attrs["kind"] == "output":                 # "mpi": the gradients sent back
            grads = []
            for x, k, event, name in attrs.get("sent", self.sent):
                with comm_cause(name, "pipeline"):
                    got, layout = view.recv(k, 2 * event + 1)
                grads.append(_unstack(got, layout))
            return tuple(grads)
        j, k, event = attrs["src"], attrs["dst"], attrs["event"]
        with comm_cause(attrs["cell"], "pipeline"):
            g = _in_sent_pieces(g, attrs.get("layout"), attrs["cell"])
            stack, layout = _stack(g, len(view.local_ranks))
            view.send(stack, j, 2 * event + 1, meta=layout)
            if self.here is None:
                got, layout = view.recv(k, 2 * event + 1)
                return (_unstack(got, layout),)
        return (g,)                                   # for the constant input: unused


_PRIVATE_TAPE = [0]


def _next_private_tape() -> int:
    """A tape id of its own for one 1F1B run's leaves (negative: never a recording's)."""
    _PRIVATE_TAPE[0] -= 1
    return _PRIVATE_TAPE[0]


def _backward(root, tape, slots, seed=None):
    """The gradients ``root``'s backward gives the leaves of `tape` (seed: ones)."""
    if seed is None:
        seed = _core.wrap_dist(np.ones(root.shape, root.dtype), None)
    return _core.run_backward((root,), (seed,), tape, slots, ADD, _zeros_like_meta)


def _add_to(acc, grads, owned):
    """Add each micro-batch's gradients `grads` (per leaf slot) to the sums `acc`: the
    first as it comes, the second with the Add op (into a new buffer, whatever the two
    layouts), each later one into that buffer in place (:func:`_add_in_place`). `owned`
    holds the slots whose sum is such a buffer, which nothing else has read."""
    acc += [None] * (len(grads) - len(acc))
    with _core.paused_recording():
        for i, g in enumerate(grads):
            if g is None:
                continue
            a = acc[i]
            if a is None:
                acc[i] = g
            elif i not in owned or not _add_in_place(a, g):
                acc[i] = _core.apply(ADD, None, (a, g))
                owned.add(i)


def _add_in_place(a, g) -> bool:
    """``a += g`` in `a`'s own storage (a sum :func:`_add_to` made, not read since) when
    both are stored alike: as equal shares of pending sums whose totals are known (the
    totals added), or as written stacks (values) in one layout. False: nothing done."""
    if a._layout != g._layout or a.dtype != g.dtype or a.shape != g.shape:
        return False
    sa, sg = stored(a), stored(g)
    if type(sa) is DeferredShares:
        tg = known_totals(sg, sa.device_matrix, sa.axes)
        return tg is not None and sa.add_in_place(tg)
    if type(sa) is not np.ndarray or not sa.flags.writeable or id(sa) in TOTALS:
        return False                          # a stride-0 view, or totals remembered
    sg = as_stack(sg)
    if sg.shape != sa.shape:
        return False
    np.add(sa, sg, out=sa)
    return True


#: the number of stages while a dry run traces a pipelined step (None otherwise): then
#: ``nn.PipelineCell`` runs its network once, on one micro-batch, inside a
#: :class:`PipelinePlan`
PLANNING: List[Optional[int]] = [None]


class PipelinePlan(PipelineRun):
    """One micro-batch of a pipelined network traced for a plan (``dm.parallel.dry_run``):
    every stage's cells on one stage's devices, as :class:`PipelineRun` runs them on
    simulated devices, with each value that goes from stage ``j`` to stage ``k`` passed
    through a recorded ``PipelineTransfer`` (kind ``"plan"``, attrs ``src``, ``dst``,
    ``cell``, ``once``: a weight read on a later stage, sent once per step), whose
    backward records the gradient's way back. The plan reads the stages off these
    transfers."""

    def __init__(self, network, staged, owner: str):
        self.owner = owner
        self.graph = None             # traced whole: every cell inlined in the plan
        self.view = None
        self.here = None
        explicit = {id(cell): k for _, cell, k in staged}
        self.cells = [(name or type(cell).__name__, cell, explicit.get(id(cell), -1))
                      for name, cell in network.cells_and_names()]
        self._holders = _holders(network, explicit)
        self._lent, self._marks, self._moved, self._saved = [], {}, {}, []
        self._events = 0
        self.sent = []
        self._leaves, self._shared, self._kept, self._weights_sent = None, [], set(), []

    def __enter__(self) -> "PipelinePlan":
        RUNNING[0] += 1
        for name, cell, k in self.cells:
            d = cell.__dict__
            self._saved.append((d, d.get("construct")))
            d["construct"] = self._wrap(name, cell, k)
        self._share_parameters()
        return self

    def _cross(self, x, j, k, name, event):
        return _core.apply(TRANSFER, {"kind": "plan", "src": j, "dst": k, "cell": name,
                                      "once": isinstance(x, Parameter), "grad": False},
                           (x,))

    def output(self, total):
        return total



#: the tag of the checkpoint values a later stage's process sends to the first stage's
#: (one tag: MPI keeps the order of the messages between two processes)
_CHECKPOINT_TAG = 30000


def first_stage_values(named_values, owners):
    """``(values, writes)`` for a checkpoint written by one process under pipeline
    parallelism. `named_values` is ``[(name, numpy value)]`` as this process computed
    them, `owners` the saved objects by name (Parameters, optimizer states). With one
    stage per process (backend "mpi") only a stage's own processes hold its weights'
    trained values: each later stage's process sends the values of its stage's entries
    to the same device of the first stage, whose processes put them in place of their
    own copies; `writes` is True on the first stage only. Without stages (or with every
    stage in this process) the values are returned as they are, ``writes`` True."""
    view = live_backend()
    here = getattr(view, "stage", None) if view is not None else None
    if here is None:
        return named_values, True
    stages = [parameter_stage(owners.get(name)) for name, _ in named_values]
    out = list(named_values)
    for (name, value), k in zip(named_values, stages):
        if k is not None and k == here and here != 0:
            view.send(replicated_view(np.ascontiguousarray(value), len(view.local_ranks)),
                      0, _CHECKPOINT_TAG, record=False)
    view.wait_sends()
    if here == 0:
        for i, ((name, value), k) in enumerate(zip(named_values, stages)):
            if k is not None and k != 0:
                got, _ = view.recv(k, _CHECKPOINT_TAG, record=False)
                out[i] = (name, np.array(got[0]))
    return out, here == 0


def stage_files(owners):
    """Where a checkpoint of per-rank pieces (``integrated_save=False``) puts each entry
    under pipeline parallelism: None without stages; else ``[(world rank, index of the
    device in this process's stack, stage, rank in the stage, names)]`` for each device
    this process holds. A device of stage ``s`` (world rank ``s * n + i``, ``n`` devices
    per stage) writes the entries of its stage (`owners`: the saved objects by name;
    a weight held by several stages belongs to the first, an optimizer's state to its
    weight's stage) and those of no stage (an optimizer's step counter, weights outside
    every staged cell), each as its slot ``i`` in its layout over the stage's ``n``
    devices. Only a stage's own processes hold its weights' trained values, so under
    "mpi" each process writes its stage's files; on simulated devices this process
    writes every stage's."""
    view = live_backend()
    if view is None or view.world is None or view.stages <= 1:
        return None
    n = view.world_size
    stage_of = {name: parameter_stage(v) for name, v in owners.items()}
    out = []
    for s in ([view.stage] if view.stage is not None else range(view.stages)):
        names = [name for name, k in stage_of.items() if k is None or k == s]
        for i, r in enumerate(view.local_ranks):
            out.append((s * n + int(r), i, s, int(r), names))
    return out
