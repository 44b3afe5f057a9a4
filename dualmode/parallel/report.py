"""CommReport: what collectives ran, why, how many bytes they moved, peak memory.

    with dm.parallel.CommReport() as report:
        step(x, y)
    print(report)                                   # a table
    report.count("AllReduce", reason="gradient")    # -> 1
    report.bytes(reason="redistribution")           # bytes per device

Every collective a backend executes while a report is active becomes one
:class:`CommRecord` (kind, group size, number of groups, bytes moved per device, the op
that caused it and the reason) in **every** active report, so reports nest. The causing
op and reason come from :func:`comm_cause` blocks (``op=None, reason="user"`` outside
them); reasons are "forward", "backward", "gradient", "redistribution",
"parameter_broadcast" and "user".

Bytes per device, for groups of ``n`` devices and ``S`` one device's buffer bytes:
AllReduce ``2 (n-1)/n S`` (ring), AllGather ``(n-1) S_in``, ReduceScatter
``(n-1)/n S_in``, AlltoAll ``(n-1)/n S``, Broadcast ``S``, Reduce ``S``, Scatter and Gather
``(n-1)/n S_total`` (the root's whole buffer), Send/Recv ``S``. A collective over groups
of one device moves 0 bytes and is still recorded, so counts do not depend on group
sizes.

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

from ..communication.trace import (KINDS, REASONS, CommRecord, activate, comm_cause,
                                   deactivate, note_memory)
from ..tensor import live_parameters

__all__ = ["CommReport", "CommRecord", "comm_cause", "note_memory",
           "parameter_bytes_per_device"]


def parameter_bytes_per_device(params: Optional[Iterable] = None) -> int:
    """Bytes one device stores for `params` (default: every live Parameter): the local
    block of a parameter stored in a layout (its distinct local data, once), the whole
    value of a plain one, nothing while its initialisation is delayed."""
    if params is None:
        params = live_parameters()
    total = 0
    for p in params:
        data = p._data
        if data is None:
            continue
        local = getattr(p._layout, "local_shape", None)
        total += data.nbytes if local is None else math.prod(local) * data.itemsize
    return total


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
    """

    def __init__(self) -> None:
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

    def _select(self, func: str, kind: Optional[str], reason: Optional[str]):
        if kind is not None and kind not in KINDS:
            raise ValueError(f"CommReport.{func}: kind={kind!r} is not valid; expected None or "
                             "one of " + ", ".join(repr(k) for k in KINDS))
        if reason is not None and reason not in REASONS:
            raise ValueError(f"CommReport.{func}: reason={reason!r} is not valid; expected None "
                             "or one of " + ", ".join(repr(r) for r in REASONS))
        return [r for r in self.records
                if (kind is None or r.kind == kind) and (reason is None or r.reason == reason)]

    def count(self, kind: Optional[str] = None, reason: Optional[str] = None) -> int:
        """Number of collectives of ``kind`` (e.g. ``"AllReduce"``) for ``reason``
        (None: any)."""
        return len(self._select("count", kind, reason))

    def bytes(self, kind: Optional[str] = None, reason: Optional[str] = None) -> float:
        """Bytes moved per device by the selected collectives (None: any)."""
        return float(sum(r.bytes_per_device for r in self._select("bytes", kind, reason)))

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return (f"CommReport({len(self.records)} collectives, "
                f"{_fmt_bytes(self.bytes())} per device, peak memory "
                f"{_fmt_bytes(self.peak_memory)} per device)")

    def __str__(self) -> str:
        lines = [repr(self)]
        if not self.records:
            return lines[0]
        head = f"{'#':>4}  {'kind':<13} {'op':<16} {'reason':<19} {'groups x size':>13}  " \
               f"{'bytes/device':>12}"
        lines += [head, "-" * len(head)]
        for i, r in enumerate(self.records):
            gs = f"{r.num_groups} x {r.group_size}"
            lines.append(f"{i:>4}  {r.kind:<13} {str(r.op or '-'):<16} {r.reason:<19} "
                         f"{gs:>13}  {_fmt_bytes(r.bytes_per_device):>12}")
        lines.append("-" * len(head))
        for kind in KINDS:
            n = self.count(kind)
            if n:
                lines.append(f"{'':>4}  {kind:<13} {n:>3} call(s) "
                             f"{'':>35}  {_fmt_bytes(self.bytes(kind)):>12}")
        return "\n".join(lines)
