"""Which server holds which part of the server-held weights.

Embedding tables (parameters an ``EmbeddingLookup`` marks ``ps_split``) are split by
rows over every server, as evenly as the rows allow. Every other weight goes whole to
the server holding the fewest bytes so far, largest weights first (ties: the lower
server id, then the parameter's position), so the servers carry about equal shares.
Every worker computes the same placement from the same parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Shard", "place"]


@dataclass(frozen=True)
class Shard:
    """Parameter ``index`` (of its optimizer), rows ``[start, stop)`` of it (None: all
    of it), and whether it travels as sparse rows."""

    index: int
    rows: Optional[Tuple[int, int]]
    sparse: bool = False


def place(params: Sequence[Tuple[int, object]], server_num: int) -> Dict[int, List[Shard]]:
    """``{server: [Shard, ...]}`` for the ``(index, Parameter)`` pairs given."""
    out: Dict[int, List[Shard]] = {k: [] for k in range(server_num)}
    load = np.zeros(server_num, dtype=np.int64)
    whole = []
    for index, p in params:
        nbytes = int(np.prod(p.shape, dtype=np.int64)) * np.dtype(p.dtype).itemsize
        if getattr(p, "ps_split", False) and len(p.shape) >= 1:
            bounds = np.linspace(0, p.shape[0], server_num + 1).round().astype(np.int64)
            for k in range(server_num):
                lo, hi = int(bounds[k]), int(bounds[k + 1])
                if hi > lo:
                    out[k].append(Shard(index, (lo, hi), bool(getattr(p, "ps_sparse", False))))
                    load[k] += nbytes * (hi - lo) // p.shape[0]
        else:
            whole.append((-nbytes, index, nbytes))
    for _, index, nbytes in sorted(whole):
        k = int(np.argmin(load))
        out[k].append(Shard(index, None))
        load[k] += nbytes
    return {k: sorted(v, key=lambda s: s.index) for k, v in out.items() if v}
