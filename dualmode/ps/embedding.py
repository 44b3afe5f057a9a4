"""The worker side of a sparse server-held embedding table (``nn.EmbeddingLookup``).

Each forward pass looks at the de-duplicated ids of its batch. Without a cache
(``vocab_cache_size=0``) their rows are pulled from the servers (only those rows) into
the worker's table before the lookup; with a cache of K rows, the rows used most
recently (at most K) stay valid on the worker and only the others are pulled. The
gradient pushed for the table is its rows at the ids used since the last step
(de-duplicated), with the cached ids; the servers' step is the dense one (see
:mod:`.server`), and their answer carries the cached rows that changed since they last
answered this worker, which overwrite the cached ones. So a cached row always equals the
server's: results equal the uncached run and the single device.
"""
from __future__ import annotations

import collections
from typing import List, Optional

import numpy as np

from ..common.initializer import Initializer

__all__ = ["RowCache", "before_lookup", "server_initialised"]


class RowCache:
    """Which rows of one table are valid on this worker, and which ids were used since
    the last push."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.lru: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        self.touched: List[np.ndarray] = []

    def cached_ids(self) -> np.ndarray:
        """The ids whose rows are valid here (int64, least recently used first)."""
        return np.fromiter(self.lru.keys(), dtype=np.int64, count=len(self.lru))

    def to_pull(self, uniq: np.ndarray) -> np.ndarray:
        """The ids among `uniq` whose rows are not valid here."""
        if not self.capacity or not self.lru:
            return uniq
        return uniq[~np.isin(uniq, self.cached_ids())]

    def use(self, uniq: np.ndarray) -> None:
        """Mark `uniq` as used now (cached, most recent) and to be pushed."""
        self.touched.append(uniq)
        if not self.capacity:
            return
        lru = self.lru
        for i in uniq[-self.capacity:].tolist():
            lru[i] = None
            lru.move_to_end(i)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def touched_ids(self) -> np.ndarray:
        """The de-duplicated ids used since the last push."""
        if not self.touched:
            return np.zeros(0, np.int64)
        return np.unique(np.concatenate(self.touched)).astype(np.int64)

    def clear_touched(self) -> None:
        self.touched = []

    def refresh(self, param, ids: np.ndarray, rows: np.ndarray) -> None:
        """Overwrite the cached rows among `ids` with the servers' `rows`."""
        if not self.capacity or not self.lru:
            return
        keep = np.fromiter((i in self.lru for i in ids.tolist()), dtype=bool, count=len(ids))
        if keep.any():
            param._value()[ids[keep]] = rows[keep]


def server_initialised(param) -> Optional[Initializer]:
    """The initializer of the table `param` when the servers initialise it
    (``set_param_ps(init_in_server=True)``), else None. The first time, the worker's
    table, still delayed (an ``EmbeddingLookup`` built on a worker makes it so), gets
    zeros for storage (pages the system maps only as rows are written) instead of its
    value, and its initializer is kept; RuntimeError when the value was already made."""
    if not param.__dict__.get("ps_init_in_server"):
        return None
    init = param.__dict__.get("ps_initializer")
    if init is None:
        if param._data is not None or param._init is None:
            raise RuntimeError(f"Parameter {param.name}: set_param_ps(init_in_server=True), "
                               "but this worker already made the table's value; build the "
                               "network after init() and mark the table before its first "
                               "use, so that only the servers make it")
        init = param.__dict__["ps_initializer"] = param._init
        param._data = np.zeros(param.shape, param.dtype)
        param._init = None
    return init


def before_lookup(client, param, cache: RowCache, ids: np.ndarray) -> None:
    """Make the rows of `ids` in `param` current (pull what is not cached) and note the
    ids for the next push. Before the first optimizer call no server holds the table
    yet: a server-initialised table's rows are made here from its initializer (the
    values the servers will make), any other table is the worker's own value."""
    uniq = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
    client.sparse[id(param)] = cache
    need = cache.to_pull(uniq)
    init = server_initialised(param)
    if len(need):
        if client.holds(param):
            client.pull_rows(param, need)
        elif init is not None:
            starts = np.zeros((len(need), param.ndim), np.int64)
            starts[:, 0] = need
            rows = init.blocks(param.shape, param.dtype, starts, (1,) + param.shape[1:])
            param._data[need] = rows[:, 0]
    cache.use(uniq)
