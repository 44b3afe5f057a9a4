"""What the backends report about each collective: the hooks behind ``CommReport``.

The comm layer owns this state so that backends never import from the layers above
them; :class:`dualmode.parallel.CommReport` is the user-facing view. One module-level
:class:`TraceState` holds the active reports and the stack of causes set by
:func:`comm_cause`.

* :func:`record` (called by a backend once per collective it executes) builds a
  :class:`CommRecord` with the current cause and appends it to every active report.
* :func:`note_memory` (called by backends and by callers that hold stacks) offers a
  per-device byte count to every active report, which keeps the maximum.
* :func:`comm_cause` names the op and the reason for collectives issued inside it.
* :func:`pending_sum` marks the resolution of a pending sum: the reductions issued
  inside it (see below) are listed under the op that made the sum.

Pending sums: an op whose strategy splits a contracted dim (``MatMul`` with
``((2, 4), (4, 1))``) leaves partial values that a later op resolves (an AllReduce, or
a ReduceScatter when that op wants the result split). The AllReduce / ReduceScatter
made for it inside a :func:`pending_sum` block is recorded with ``op`` the op that made
the sum and ``resolved_by`` the op of the current :func:`comm_cause` (the one where it
was resolved); other collectives of the block (an AllGather into the consumer's layout)
stay the consumer's. Gradient reductions (reason ``"gradient"``) stay listed under their
parameters, and collectives issued outside any :func:`pending_sum` block have
``resolved_by`` None.

Bytes moved per device, for a group of ``n`` devices and ``S`` the bytes of one device's
buffer (the input unless said otherwise):

============== ============================ ===============================================
kind           bytes per device             why
============== ============================ ===============================================
AllReduce      ``2 (n-1)/n S``              ring: reduce-scatter then all-gather passes
AllGather      ``(n-1) S``                  receives the n-1 other buffers
ReduceScatter  ``(n-1)/n S``                ring reduce-scatter pass
AlltoAll       ``(n-1)/n S``                keeps 1/n of its buffer, sends the rest
Broadcast      ``S``                        every device sends or receives one buffer
Reduce         ``S``
Scatter        ``(n-1)/n S_total``          ``S_total`` = the root's whole buffer
Gather         ``(n-1)/n S_total``          ``S_total`` = the gathered buffer (n S)
Send/Recv      ``S``
Push, Pull     ``S``                        a PS worker's gradients to / weights from the
                                            servers (S = the bytes of the arrays moved)
============== ============================ ===============================================

A collective over groups of one device moves nothing: it is **recorded** with
``bytes_per_device == 0`` so that counts stay predictable (one record per collective
call, whatever the group size).

Predicted time (alpha-beta model)
---------------------------------
:func:`predicted_seconds` gives the time of one collective on a network with latency
``alpha`` (seconds per message) and inverse bandwidth ``beta`` (seconds per byte), by
the ring formulas with ``p`` the group size and ``n`` the bytes of the full buffer a
device holds after AllReduce / AllGather (before ReduceScatter), stored in each record
as ``buffer_bytes``:

============================== ==============================================
kind                           seconds
============================== ==============================================
AllReduce                      ``2(p-1) alpha + 2(p-1)/p n beta``
AllGather, ReduceScatter,      ``(p-1) alpha + (p-1)/p n beta``
AlltoAll, Scatter, Gather
Broadcast, Reduce              ``ceil(log2 p) (alpha + n beta)`` (binomial tree)
Send/Recv, Push, Pull          ``alpha + n beta`` (one message)
============================== ==============================================

Groups that run a collective side by side take the time of one group; a group of one
device takes no time. :data:`LINKS` holds the presets accepted as ``link=``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

__all__ = ["KINDS", "REASONS", "LINKS", "CommRecord", "TraceState", "comm_cause",
           "pending_sum", "current_cause", "record", "note_memory", "bytes_per_device", "full_buffer_bytes",
           "predicted_seconds", "activate", "deactivate"]

KINDS = ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "Broadcast", "Reduce",
         "Scatter", "Gather", "Send/Recv", "Push", "Pull")
REASONS = ("forward", "backward", "gradient", "redistribution", "parameter_broadcast", "user",
           "parallel_optimizer")

#: ``link=`` presets of the alpha-beta model: name -> (alpha seconds per message,
#: beta seconds per byte). 10GbE: 1.25 GB/s and 20 us per message (TCP); 100GbE:
#: 12.5 GB/s and 5 us (RDMA); nvlink: 300 GB/s per direction and 1 us.
LINKS = {
    "10GbE": (20e-6, 1.0 / 1.25e9),
    "100GbE": (5e-6, 1.0 / 12.5e9),
    "nvlink": (1e-6, 1.0 / 300e9),
}

#: point-to-point transfers between pipeline stages: device i of one stage sends its
#: buffer (an activation, or its gradient) to device i of another (``Send`` on the
#: sending devices, ``Receive`` on the receiving ones, each ``S`` bytes per device)
KINDS += ("Send", "Receive")
REASONS += ("pipeline",)


@dataclass(frozen=True)
class CommRecord:
    """One executed collective.

    Attributes
    ----------
    kind : str
        One of :data:`KINDS`.
    group_size : int
        Devices per group (2 for Send/Recv).
    num_groups : int
        Groups that ran it at once (pairs for Send/Recv).
    bytes_per_device : float
        Bytes each device sends (see the module docstring for the formulas).
    op : str or None
        The op that caused it (from :func:`comm_cause`), None when issued directly. For
        the reduction that resolves a pending sum: the op whose strategy made the sum
        (e.g. ``"MatMul"``).
    reason : str
        One of :data:`REASONS`; ``"user"`` outside any :func:`comm_cause`.
    buffer_bytes : float
        ``n`` of the alpha-beta formulas (:func:`full_buffer_bytes`): the bytes of the full
        buffer a device holds after AllReduce / AllGather, before ReduceScatter.
    resolved_by : str or None
        For the reduction that resolves a pending sum: the op where it was resolved (the
        first op that needed the sum, e.g. ``"ReLU"``); None for every other collective.
    """

    kind: str
    group_size: int
    num_groups: int
    bytes_per_device: float
    op: Optional[str] = None
    reason: str = "user"
    buffer_bytes: float = field(default=0.0, compare=False)
    resolved_by: Optional[str] = None


#: the kinds that resolve a pending sum inside a :func:`pending_sum` block
_RESOLVING = ("AllReduce", "ReduceScatter")
#: the reasons under which a resolution is listed under the op that made the sum
_OP_REASONS = ("forward", "backward", "redistribution")


class TraceState:
    """The active reports (innermost last), the stack of ``(op, reason)`` causes and the
    op that made the pending sum being resolved (None outside :func:`pending_sum`)."""

    __slots__ = ("reports", "causes", "made_by")

    def __init__(self) -> None:
        self.reports: List[object] = []
        self.causes: List[Tuple[Optional[str], str]] = []
        self.made_by: Optional[str] = None


_STATE = TraceState()


def bytes_per_device(kind: str, group_size: int, buffer_bytes: int,
                     total_bytes: Optional[int] = None) -> float:
    """Bytes one device moves for a collective (formulas in the module docstring).

    ``buffer_bytes`` is one device's input buffer; ``total_bytes`` the root's whole
    buffer for Scatter and the gathered buffer for Gather (defaults to
    ``group_size * buffer_bytes``).
    """
    n, s = int(group_size), float(buffer_bytes)
    if n <= 1:
        return 0.0
    if kind == "AllReduce":
        return 2.0 * (n - 1) * s / n
    if kind == "AllGather":
        return (n - 1) * s
    if kind in ("ReduceScatter", "AlltoAll"):
        return (n - 1) * s / n
    if kind in ("Broadcast", "Reduce", "Send/Recv", "Send", "Receive", "Push", "Pull"):
        return s
    if kind in ("Scatter", "Gather"):
        total = n * s if total_bytes is None else float(total_bytes)
        return (n - 1) * total / n
    raise ValueError(f"bytes_per_device: kind={kind!r} is not valid; expected one of "
                     + ", ".join(repr(k) for k in KINDS))


def full_buffer_bytes(kind: str, group_size: int, buffer_bytes: int,
                      total_bytes: Optional[int] = None) -> float:
    """``n`` of the alpha-beta formulas for a collective whose input buffer on one device
    is ``buffer_bytes``: the gathered buffer (``p`` times the input) for AllGather, the
    root's whole buffer for Scatter / Gather (``total_bytes``, default ``p`` times the
    input), the input buffer otherwise."""
    p, s = int(group_size), float(buffer_bytes)
    if kind == "AllGather":
        return p * s
    if kind in ("Scatter", "Gather"):
        return p * s if total_bytes is None else float(total_bytes)
    return s


def _check_model(func: str, alpha: float, beta: float) -> None:
    for name, v in (("alpha", alpha), ("beta", beta)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            raise ValueError(f"{func}: {name}={v!r} is not valid; expected a finite number "
                             f">= 0 (seconds{' per byte' if name == 'beta' else ''})")


def predicted_seconds(kind: str, group_size: int, n_bytes: float, alpha: float,
                      beta: float) -> float:
    """Seconds one collective takes under the alpha-beta model (formulas in the module
    docstring): ``p = group_size`` devices per group, ``n_bytes`` the full buffer ``n``,
    ``alpha`` seconds per message, ``beta`` seconds per byte."""
    if kind not in KINDS:
        raise ValueError(f"predicted_seconds: kind={kind!r} is not valid; expected one of "
                         + ", ".join(repr(k) for k in KINDS))
    _check_model("predicted_seconds", alpha, beta)
    p, n = int(group_size), float(n_bytes)
    if kind in ("Push", "Pull"):
        return alpha + n * beta          # a worker's message to / from the servers
    if p <= 1:
        return 0.0
    if kind == "AllReduce":
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta
    if kind in ("AllGather", "ReduceScatter", "AlltoAll", "Scatter", "Gather"):
        return (p - 1) * alpha + (p - 1) / p * n * beta
    if kind in ("Broadcast", "Reduce"):
        return math.ceil(math.log2(p)) * (alpha + n * beta)
    return alpha + n * beta              # Send/Recv


def current_cause() -> Tuple[Optional[str], str]:
    """The innermost ``(op, reason)`` set by :func:`comm_cause`, else ``(None, "user")``."""
    return _STATE.causes[-1] if _STATE.causes else (None, "user")


def record(kind: str, group_size: int, num_groups: int, buffer_bytes: int,
           total_bytes: Optional[int] = None) -> None:
    """Record one executed collective in every active report (nothing when none is)."""
    if not _STATE.reports:
        return
    op, reason = current_cause()
    resolved_by = None
    made_by = _STATE.made_by
    if made_by is not None and kind in _RESOLVING and reason in _OP_REASONS:
        op, resolved_by = made_by, op        # listed under the op that made the sum
    rec = CommRecord(kind, int(group_size), int(num_groups),
                     bytes_per_device(kind, group_size, buffer_bytes, total_bytes), op, reason,
                     full_buffer_bytes(kind, group_size, buffer_bytes, total_bytes),
                     resolved_by)
    for report in _STATE.reports:
        report._add_record(rec)


#: functions given the member ranks ``(G, n)`` of every collective run, whether or not a
#: report is active (the writer of ``group_ckpt_save_file`` installs one)
GROUP_SINKS: list = []


def note_groups(members) -> None:
    """Offer the groups (an int array ``(G, n)``: one row of ranks per group) of one
    collective to every sink of :data:`GROUP_SINKS`."""
    for sink in GROUP_SINKS:
        sink(members)


def note_memory(bytes_per_device: int) -> None:
    """Offer a per-device live-memory figure (bytes) to every active report; each keeps
    the largest it was offered as its ``peak_memory``."""
    if not _STATE.reports:
        return
    for report in _STATE.reports:
        report._note_memory(int(bytes_per_device))


def activate(report) -> None:
    """Start recording into `report` (an object with ``_add_record`` and ``_note_memory``)."""
    _STATE.reports.append(report)


def deactivate(report) -> None:
    """Stop recording into `report` (its innermost activation)."""
    for i in range(len(_STATE.reports) - 1, -1, -1):
        if _STATE.reports[i] is report:
            del _STATE.reports[i]
            return


class comm_cause:
    """Attribute the collectives issued inside the ``with`` block to ``op_name`` and
    ``reason``.

    Parameters
    ----------
    op_name : str or None
        The op (e.g. ``"MatMul"``) whose forward, backward or redistribution needs them.
    reason : str
        One of ``"forward"``, ``"backward"``, ``"gradient"``, ``"redistribution"``,
        ``"parameter_broadcast"`` (``parameter_broadcast=True`` before training), ``"user"``.

    Nested blocks override outer ones until they exit. (A small class rather than a
    generator: every collective of every op enters one.)
    """

    __slots__ = ("_cause",)

    def __init__(self, op_name: Optional[str], reason: str):
        if op_name is not None and not isinstance(op_name, str):
            raise TypeError(f"comm_cause: op_name={op_name!r} has type "
                            f"{type(op_name).__name__}; expected a str or None")
        if reason not in REASONS:
            raise ValueError(f"comm_cause: reason={reason!r} is not valid; expected one of "
                             + ", ".join(repr(r) for r in REASONS))
        self._cause = (op_name, reason)

    def __enter__(self) -> None:
        _STATE.causes.append(self._cause)

    def __exit__(self, *exc) -> bool:
        _STATE.causes.pop()
        return False


class pending_sum:
    """Inside the ``with`` block a pending sum made by ``made_by`` is resolved: its
    AllReduce / ReduceScatter is recorded under ``made_by`` with ``resolved_by`` the op
    of the current :func:`comm_cause` (see the module docstring). ``made_by`` None (a
    sum whose maker is not known) changes nothing.

    Parameters
    ----------
    made_by : str or None
        The class name of the op whose strategy made the sum (e.g. ``"MatMul"``).
    """

    __slots__ = ("_made_by", "_outer")

    def __init__(self, made_by: Optional[str]):
        if made_by is not None and not isinstance(made_by, str):
            raise TypeError(f"pending_sum: made_by={made_by!r} has type "
                            f"{type(made_by).__name__}; expected a str or None")
        self._made_by = made_by
        self._outer = None

    def __enter__(self) -> None:
        self._outer = _STATE.made_by
        _STATE.made_by = self._made_by

    def __exit__(self, *exc) -> bool:
        _STATE.made_by = self._outer
        return False
