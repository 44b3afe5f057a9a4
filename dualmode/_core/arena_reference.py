"""Pure-Python model of the buffer pool's policy in ``_arena.pyx`` (tests compare the
two over random sequences of requests; it also documents what the pool decides).

Blocks are numbered in the order they are made. A request of ``min_block`` bytes or
more is large: its size class is the size rounded up to ``page``; it is a hit when a
block of that class is cached (the most recently cached one is handed out), a miss
otherwise (a new block). Small requests are not pooled and change nothing here.
Freeing a large block caches it unless its class exceeds the cap; to stay within the
cap, the longest-cached blocks are evicted first.
"""
from __future__ import annotations

from collections import OrderedDict

__all__ = ["PoolReference"]


class PoolReference:
    """The pool's decisions and statistics, block by block (no memory)."""

    def __init__(self, min_block=1 << 16, max_cached_bytes=1 << 30, page=4096):
        self.min_block, self.cap, self.page = min_block, max_cached_bytes, page
        self.cached = OrderedDict()     # block -> class, oldest first
        self.active = {}                # block -> class, handed out
        self.made = 0
        self.hits = self.misses = self.evictions = self.oversize = 0
        self.peak_cached_bytes = self.peak_active_bytes = 0

    def size_class(self, size):
        """The class of a large request; None for a small one."""
        if size < self.min_block:
            return None
        return -(-size // self.page) * self.page

    def malloc(self, size):
        """The block handed out for `size` bytes (None when small)."""
        cls = self.size_class(size)
        if cls is None:
            return None
        reuse = [b for b, c in self.cached.items() if c == cls]
        if reuse:
            block = reuse[-1]
            del self.cached[block]
            self.hits += 1
        else:
            block = self.made
            self.made += 1
            self.misses += 1
        self.active[block] = cls
        self.peak_active_bytes = max(self.peak_active_bytes, self.active_bytes)
        return block

    def free(self, block):
        """Give back `block` (None: a small block)."""
        if block is None:
            return
        cls = self.active.pop(block)
        if cls > self.cap:
            self.oversize += 1
            return
        self._evict_to(self.cap - cls)
        self.cached[block] = cls
        self.peak_cached_bytes = max(self.peak_cached_bytes, self.cached_bytes)

    def realloc(self, block, size):
        """The block holding `size` bytes after resizing `block` (None: a small block,
        or no block): the same block when its class does not change, else a new one
        (the old one freed after the copy)."""
        cls = self.size_class(size)
        if block is None and cls is None:
            return None
        if block is not None and cls == self.active[block]:
            return block
        out = self.malloc(size)
        self.free(block)
        return out

    def set_max_cached_bytes(self, cap):
        self.cap = cap
        self._evict_to(cap)

    def empty_cache(self):
        self.cached.clear()

    def _evict_to(self, limit):
        while self.cached_bytes > limit:
            self.cached.popitem(last=False)
            self.evictions += 1

    @property
    def cached_bytes(self):
        return sum(self.cached.values())

    @property
    def active_bytes(self):
        return sum(self.active.values())

    def stats(self):
        """The same keys as ``Pool.stats()``."""
        return dict(hits=self.hits, misses=self.misses, evictions=self.evictions,
                    oversize=self.oversize, cached_bytes=self.cached_bytes,
                    cached_blocks=len(self.cached), peak_cached_bytes=self.peak_cached_bytes,
                    active_bytes=self.active_bytes, active_blocks=len(self.active),
                    peak_active_bytes=self.peak_active_bytes)
