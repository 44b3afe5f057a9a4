"""CommReport: what collectives ran, why, how many bytes they moved, peak memory.

    with dm.parallel.CommReport() as report:
        step(x, y)
    print(report)                                   # a table
    report.count("AllReduce", reason="gradient")    # -> 1
    report.bytes(reason="redistribution")           # bytes per device
    report.bytes(op="MatMul")                       # what the MatMul's strategy costs

Every collective a backend executes while a report is active becomes one
:class:`CommRecord` (kind, group size, number of groups, bytes moved per device, the op
that caused it and the reason) in **every** active report, so reports nest. The causing
op and reason come from :func:`comm_cause` blocks (``op=None, reason="user"`` outside
them); reasons are "forward", "backward", "gradient", "redistribution",
"parameter_broadcast" and "user".

Pending sums: an op whose strategy splits a dim it sums over (``MatMul`` with
``((2, 4), (4, 1))`` splits the contracted dim in 4) leaves partial values, which the
first op that needs the sum resolves (an AllReduce, or a ReduceScatter when that op
wants the result split), possibly several ops later (ops linear in the sum, such as
``Reshape`` or a multiplication by a value, keep it pending). That collective is listed
under the op whose strategy made the sum (``op == "MatMul"``), with the op where it was
resolved as ``resolved_by`` (the "resolved by" column of the table), so that
``report.bytes(op="MatMul")`` is what that strategy costs. Every other collective has
``resolved_by`` None (shown as "-"). Gradient reductions stay listed under their
parameters (reason "gradient").

Bytes per device, for groups of ``n`` devices and ``S`` one device's buffer bytes:
AllReduce ``2 (n-1)/n S`` (ring), AllGather ``(n-1) S_in``, ReduceScatter
``(n-1)/n S_in``, AlltoAll ``(n-1)/n S``, Broadcast ``S``, Reduce ``S``, Scatter and Gather
``(n-1)/n S_total`` (the root's whole buffer), Send/Recv ``S``. A collective over groups
of one device moves 0 bytes and is still recorded, so counts do not depend on group
sizes.

Predicted time: ``CommReport(alpha_s=..., beta_s_per_byte=...)`` or ``CommReport(link=
"10GbE" | "100GbE" | "nvlink")`` sets an alpha-beta network model;
``report.predicted_time(kind=None, reason=None)`` is then the sum of the selected
collectives' times by the ring formulas of :mod:`dualmode.communication.trace`
(:func:`~dualmode.communication.trace.predicted_seconds`), ``report.record_time(rec)``
one record's, and the table gains a column of them. Two strategies' reports under the
same model compare their cost on that network without running on it.

``peak_memory`` is the largest per-device live total seen while the report was active:
the parameter storage of one device (:func:`parameter_bytes_per_device`: each live
parameter's local block when it is stored sharded, its whole value when plain, nothing
while its initialisation is delayed) plus the largest byte count offered at that moment
through :func:`dualmode.communication.trace.note_memory` (backends offer, for each
collective, its input plus output buffer per device; the sharding engine offers 0 when it
stores a parameter, so the change is seen at once). ``parameter_memory`` is the largest
parameter storage alone, also taken when the report is entered and left.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional

from ..communication.trace import (KINDS, LINKS, REASONS, CommRecord, activate, comm_cause,
                                   deactivate, note_memory, predicted_seconds)
from ..tensor import live_parameters
from .devices import live_backend
from .pipeline import parameter_stage

__all__ = ["CommReport", "CommRecord", "comm_cause", "note_memory",
           "parameter_bytes_per_device", "network_model", "LINKS"]


def parameter_bytes_per_device(params: Optional[Iterable] = None) -> int:
    """Bytes one device stores for `params` (default: every live Parameter): the local
    block of a parameter stored in a layout (its distinct local data, once), the whole
    value of a plain one, nothing while its initialisation is delayed; a weight the
    parallel optimizer stores as its slices, its slice until it is gathered for a read.
    No value is read (nothing deferred is written or gathered). Under pipeline
    parallelism a device holds its stage's parameters only: the largest stage's (on
    simulated devices), this rank's stage's (under MPI)."""
    if params is None:
        params = live_parameters()
    total = 0
    stages: dict = {}
    for p in params:
        data = p._lazy if p._lazy is not None else p._arr   # a deferred value stays so
        if data is None:
            continue
        local = getattr(p._layout, "local_shape", None)
        held = getattr(data, "device_bytes", None)   # e.g. a weight stored as its slices
        if held is not None:
            nbytes = held
        else:
            nbytes = data.nbytes if local is None else math.prod(local) * data.itemsize
        stage = parameter_stage(p)
        if stage is None:
            total += nbytes
        else:
            stages[stage] = stages.get(stage, 0) + nbytes
    if stages:
        view = live_backend()
        if view is None or view.world is None:       # no pipeline now: every one
            total += sum(stages.values())
        elif view.stage is None:                     # every stage in this process
            total += max(stages.values())
        else:
            total += stages.get(view.stage, 0)
    return total


def network_model(func: str, alpha_s=None, beta_s_per_byte=None,
                  link=None) -> Optional[tuple]:
    """``(alpha, beta)`` from explicit values or a ``link`` preset (:data:`LINKS`), or
    None when neither is given; raises errors naming `func` and the bad argument."""
    if link is not None:
        if alpha_s is not None or beta_s_per_byte is not None:
            raise ValueError(f"{func}: give either link={link!r} or alpha_s/beta_s_per_byte, "
                             f"not both")
        if not isinstance(link, str) or link not in LINKS:
            raise ValueError(f"{func}: link={link!r} is not valid; expected one of "
                             + ", ".join(repr(k) for k in LINKS))
        return LINKS[link]
    if alpha_s is None and beta_s_per_byte is None:
        return None
    if alpha_s is None or beta_s_per_byte is None:
        missing = "alpha_s" if alpha_s is None else "beta_s_per_byte"
        raise ValueError(f"{func}: {missing} is missing; the alpha-beta model needs both "
                         f"alpha_s (seconds per message) and beta_s_per_byte")
    for name, v in (("alpha_s", alpha_s), ("beta_s_per_byte", beta_s_per_byte)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{func}: {name}={v!r} has type {type(v).__name__}; expected a "
                            f"number of seconds")
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{func}: {name}={v!r} is not valid; expected a finite number "
                             f">= 0")
    return float(alpha_s), float(beta_s_per_byte)


def _fmt_seconds(t: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns" if t else "0 s"


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


class CommReport:
    """Record the collectives executed inside a ``with`` block (nestable).

    Attributes
    ----------
    records : list of CommRecord
        In execution order.
    peak_memory : int
        Largest live bytes per device seen while active: parameter storage plus the
        buffers of the collective running at that moment (0 if nothing was seen).
    parameter_memory : int
        Largest parameter storage per device seen while active.

    Parameters
    ----------
    alpha_s, beta_s_per_byte : float, optional
        The alpha-beta network model for :meth:`predicted_time`: seconds per message and
        seconds per byte (both or neither).
    link : str, optional
        A preset model instead: ``"10GbE"``, ``"100GbE"`` or ``"nvlink"``
        (:data:`dualmode.communication.trace.LINKS`).
    """

    def __init__(self, alpha_s: Optional[float] = None,
                 beta_s_per_byte: Optional[float] = None, link: Optional[str] = None) -> None:
        self.model = network_model("CommReport", alpha_s, beta_s_per_byte, link)
        self.link = link
        self.records: List[CommRecord] = []
        self.peak_memory: int = 0
        self.parameter_memory: int = 0

    def __enter__(self) -> "CommReport":
        activate(self)
        self._note_memory(0)
        return self

    def __exit__(self, *exc) -> None:
        self._note_memory(0)
        deactivate(self)

    # hooks called by dualmode.communication.trace
    def _add_record(self, rec: CommRecord) -> None:
        self.records.append(rec)

    def _note_memory(self, nbytes: int) -> None:
        params = parameter_bytes_per_device()
        if params > self.parameter_memory:
            self.parameter_memory = params
        if params + nbytes > self.peak_memory:
            self.peak_memory = params + nbytes

    def _select(self, func: str, kind: Optional[str], reason: Optional[str],
                op: Optional[str] = None, resolved_by: Optional[str] = None):
        if kind is not None and kind not in KINDS:
            raise ValueError(f"CommReport.{func}: kind={kind!r} is not valid; expected None or "
                             "one of " + ", ".join(repr(k) for k in KINDS))
        if reason is not None and reason not in REASONS:
            raise ValueError(f"CommReport.{func}: reason={reason!r} is not valid; expected None "
                             "or one of " + ", ".join(repr(r) for r in REASONS))
        for name, v in (("op", op), ("resolved_by", resolved_by)):
            if v is not None and not isinstance(v, str):
                raise TypeError(f"CommReport.{func}: {name}={v!r} has type "
                                f"{type(v).__name__}; expected None or an op's name such as "
                                f"'MatMul'")
        return [r for r in self.records
                if (kind is None or r.kind == kind) and (reason is None or r.reason == reason)
                and (op is None or r.op == op)
                and (resolved_by is None or r.resolved_by == resolved_by)]

    def count(self, kind: Optional[str] = None, reason: Optional[str] = None, *,
              op: Optional[str] = None, resolved_by: Optional[str] = None) -> int:
        """Number of collectives of ``kind`` (e.g. ``"AllReduce"``) for ``reason``, listed
        under ``op`` (e.g. ``"MatMul"``), resolving a pending sum in ``resolved_by``
        (None: any)."""
        return len(self._select("count", kind, reason, op, resolved_by))

    def bytes(self, kind: Optional[str] = None, reason: Optional[str] = None, *,
              op: Optional[str] = None, resolved_by: Optional[str] = None) -> float:
        """Bytes moved per device by the selected collectives (as :meth:`count`; None:
        any)."""
        return float(sum(r.bytes_per_device
                         for r in self._select("bytes", kind, reason, op, resolved_by)))

    def record_time(self, rec: CommRecord) -> float:
        """Predicted seconds of one record under this report's network model."""
        alpha, beta = self._model("record_time")
        return predicted_seconds(rec.kind, rec.group_size, rec.buffer_bytes, alpha, beta)

    def predicted_time(self, kind: Optional[str] = None, reason: Optional[str] = None, *,
                       op: Optional[str] = None, resolved_by: Optional[str] = None) -> float:
        """Predicted seconds of the selected collectives (as :meth:`count`; None: any),
        run one after another, under the alpha-beta model given to the constructor."""
        alpha, beta = self._model("predicted_time")
        return float(sum(predicted_seconds(r.kind, r.group_size, r.buffer_bytes, alpha, beta)
                         for r in self._select("predicted_time", kind, reason, op,
                                               resolved_by)))

    def _model(self, func: str) -> tuple:
        if self.model is None:
            raise RuntimeError(f"CommReport.{func}: no network model; create the report "
                               f"with CommReport(alpha_s=..., beta_s_per_byte=...) or "
                               f"CommReport(link=...) with link one of "
                               + ", ".join(repr(k) for k in LINKS))
        return self.model

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        timed = "" if self.model is None else \
            f", predicted {_fmt_seconds(self.predicted_time())}"
        return (f"CommReport({len(self.records)} collectives, "
                f"{_fmt_bytes(self.bytes())} per device{timed}, peak memory "
                f"{_fmt_bytes(self.peak_memory)} per device)")

    def __str__(self) -> str:
        lines = [repr(self)]
        if not self.records:
            return lines[0]
        timed = self.model is not None
        head = f"{'#':>4}  {'kind':<13} {'op':<16} {'resolved by':<16} {'reason':<19} " \
               f"{'groups x size':>13}  {'bytes/device':>12}" + \
               (f"  {'predicted':>10}" if timed else "")
        lines += [head, "-" * len(head)]
        for i, r in enumerate(self.records):
            gs = f"{r.num_groups} x {r.group_size}"
            t = f"  {_fmt_seconds(self.record_time(r)):>10}" if timed else ""
            lines.append(f"{i:>4}  {r.kind:<13} {str(r.op or '-'):<16} "
                         f"{str(r.resolved_by or '-'):<16} {r.reason:<19} "
                         f"{gs:>13}  {_fmt_bytes(r.bytes_per_device):>12}{t}")
        lines.append("-" * len(head))
        for kind in KINDS:
            n = self.count(kind)
            if n:
                t = f"  {_fmt_seconds(self.predicted_time(kind)):>10}" if timed else ""
                lines.append(f"{'':>4}  {kind:<13} {n:>3} call(s) "
                             f"{'':>55}  {_fmt_bytes(self.bytes(kind)):>12}{t}")
        return "\n".join(lines)


# ------------------------------------------------------- compiled graphs: time per op

#: lowered-graph node ops that communicate (dualmode.parallel.graph.ir MOVE / REDUCE /
#: FUSED / FUSED_RS / FUSED_AG)
_MOVE, _REDUCE, _FUSED = "Move", "AllReduce", "FusedAllReduce"
_FUSED_RS, _FUSED_AG = "FusedReduceScatter", "FusedAllGather"
_COMM_NODES = (_MOVE, _REDUCE, _FUSED, _FUSED_RS, _FUSED_AG)
_STEP_KIND = {"AllGather": "AllGather", "AllToAll": "AlltoAll", "AlltoAll": "AlltoAll",
              "ReduceScatter": "ReduceScatter", "AllReduce": "AllReduce"}


def _axes_size(layout, axes) -> int:
    return int(math.prod(layout.device_matrix[a] for a in axes))


def _local_bytes(layout, itemsize: int) -> float:
    return float(math.prod(layout.local_shape) * itemsize)


def _node_collectives(node) -> list:
    """``[(kind, p, n), ...]``: the collectives one lowered node runs (``n`` the full
    buffer of the alpha-beta formulas)."""
    itemsize = node.outputs[0].dtype.itemsize
    if node.op == _REDUCE:
        lay = node.attrs["layout"]
        return [("AllReduce", _axes_size(lay, node.attrs["axes"]), _local_bytes(lay, itemsize))]
    if node.op == _FUSED:                 # one AllReduce of the whole bucket
        src = node.attrs["src"]
        return [("AllReduce", _axes_size(src, src.partial),
                 sum(_local_bytes(s, v.dtype.itemsize)
                     for s, v in zip(node.attrs["srcs"], node.outputs)))]
    if node.op in (_FUSED_RS, _FUSED_AG):  # one collective of the whole bucket: n is the
        # reduced buffer of a ReduceScatter, the gathered buffer of an AllGather
        side = "srcs" if node.op == _FUSED_RS else "dsts"
        return [("ReduceScatter" if node.op == _FUSED_RS else "AllGather",
                 int(node.attrs["members"].shape[1]),
                 sum(_local_bytes(lay, v.dtype.itemsize)
                     for lay, v in zip(node.attrs[side], node.outputs)))]
    plan, src, kind = node.attrs.get("plan"), node.attrs.get("src"), node.attrs.get("kind")
    out = []
    if plan is not None:
        for step in plan.steps:
            p = int(step.parts)
            if not step.communicates or p <= 1:
                continue
            k = _STEP_KIND[step.kind]
            moved = float(step[4])        # bytes per device (trace.bytes_per_device)
            n = moved * p / (2 * (p - 1)) if k == "AllReduce" else moved * p / (p - 1)
            out.append((k, p, n))
        return out
    if src is None or kind not in ("resolve", "gather"):
        return out                        # a local slice or a relabelling: no traffic
    if src.partial:
        out.append(("AllReduce", _axes_size(src, src.partial), _local_bytes(src, itemsize)))
    if kind == "gather":
        split = [a for dims in src.tensor_map for a in dims]
        if split:
            out.append(("AllGather", _axes_size(src, split),
                        float(math.prod(src.shape) * itemsize)))
    return out


def compiled_comm_times(compiled, alpha_s: Optional[float] = None,
                        beta_s_per_byte: Optional[float] = None,
                        link: Optional[str] = None) -> dict:
    """Predicted communication time per op of a compiled graph, by the same alpha-beta
    formulas as :meth:`CommReport.predicted_time`.

    Parameters
    ----------
    compiled : CompiledGraph or a compiled function
        What ``ops.shard`` / ``Cell.shard`` / ``AutoParallel`` compiled (its lowered graph
        ``compiled.program.graph``), or the function ``ops.shard`` returned (its last
        compiled graph).
    alpha_s, beta_s_per_byte, link
        The network model, as for :class:`CommReport` (one of them is required).

    Returns
    -------
    dict
        op node name (the keys of ``compiled.strategies()``) -> ``{"time": seconds,
        "collectives": [(kind, group size, n bytes, seconds), ...], "backward": bool}``,
        for every op that communicates: the redistributions made for it (Move nodes) and
        the AllReduces finishing its outputs. The AllReduce / ReduceScatter that resolves
        a pending sum counts for the op node that made the sum, as in :class:`CommReport`.
    """
    func = "compiled_comm_times"
    model = network_model(func, alpha_s, beta_s_per_byte, link)
    if model is None:
        raise ValueError(f"{func}: no network model; pass alpha_s and beta_s_per_byte, or "
                         f"link= one of " + ", ".join(repr(k) for k in LINKS))
    if not hasattr(compiled, "program") and hasattr(compiled, "compiled"):
        compiled = compiled.compiled          # ops.shard's function: its last graph
    program = getattr(compiled, "program", None)
    graph = getattr(program, "graph", None)
    if graph is None or not hasattr(graph, "nodes"):
        raise TypeError(f"{func}: compiled={type(compiled).__name__} is not a compiled graph "
                        f"with a lowered program; expected what ops.shard, Cell.shard or "
                        f"AutoParallel compiled, after its first call")
    alpha, beta = model
    out: dict = {}
    layouts = graph.meta.get("layouts", {}) if isinstance(graph.meta, dict) else {}
    made = {v.id: node for node in graph.nodes for v in node.outputs}
    for node in graph.nodes:
        if node.op not in _COMM_NODES:
            continue
        coll = _node_collectives(node)
        if not coll:
            continue
        owner = node.attrs.get("for") if node.op != _REDUCE else \
            node.name.split("/")[0]
        owner = owner or node.attrs.get("cause") or node.name
        maker = _sum_maker(node, made, layouts)
        for kind, p, n in coll:
            t = predicted_seconds(kind, p, n, alpha, beta)
            key = maker if maker is not None and kind in ("AllReduce", "ReduceScatter") \
                else owner
            entry = out.setdefault(key, {"time": 0.0, "collectives": [],
                                         "backward": bool(node.backward)})
            entry["collectives"].append((kind, p, n, t))
            entry["time"] += t
    return out


def _sum_maker(node, made, layouts) -> Optional[str]:
    """The name of the op node that made the pending sum a Move node resolves (walking
    back through the moves and the ops linear in it that kept it), or None when the
    node resolves none (or moves a gradient, listed under its parameter)."""
    src = node.attrs.get("src") if node.op == _MOVE else None
    if src is None or not getattr(src, "partial", ()) or \
            node.attrs.get("reason") == "gradient":
        return None
    x = node.inputs[0]
    while True:
        n = made.get(getattr(x, "id", None))
        if n is None:
            return None                   # an argument or a constant: made outside
        carrier = next((i for i in n.inputs if getattr(layouts.get(getattr(i, "id", None)),
                                                       "partial", ())), None)
        if carrier is None:
            return n.name                 # the op whose strategy made the sum
        x = carrier
