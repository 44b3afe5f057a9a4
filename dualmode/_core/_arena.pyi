"""Type stub for the caching buffer pool (`_arena.pyx`); the pure-Python model of its
policy: `dualmode._core.arena_reference.PoolReference`."""
from types import TracebackType
from typing import Any, Callable, Dict, Optional, Type

class Installed:
    """The pool as numpy's data-memory handler for the current context inside ``with``
    (the previous handler restored on exit); nothing while the pool is not enabled."""
    def __enter__(self) -> "Installed": ...
    def __exit__(self, exc_type: Optional[Type[BaseException]],
                 exc: Optional[BaseException], tb: Optional[TracebackType]) -> bool: ...

class Calling:
    """`fn` called with the pool installed for the call (while the pool is enabled)."""
    fn: Callable[..., Any]
    def __call__(self, *args: Any) -> Any: ...

class Pool:
    """Keeps freed blocks of `min_block` bytes or more in free lists per size class
    (multiples of `page`) for the next request of the class; at most
    `max_cached_bytes` cached (the oldest evicted first)."""
    handler: Any
    """numpy's "mem_handler" capsule of this pool."""
    min_block: int
    page: int
    max_cached_bytes: int
    enabled: bool
    """False: installed() and calling() install nothing."""
    def __init__(self, min_block: int = 65536, max_cached_bytes: int = 1 << 30,
                 page: int = 4096, hugepages: bool = True) -> None: ...
    def installed(self) -> Installed: ...
    def calling(self, fn: Callable[..., Any]) -> Calling: ...
    def empty_cache(self) -> None:
        """Give every cached block back to the system."""
    def stats(self) -> Dict[str, int]:
        """hits, misses, evictions, oversize, cached_bytes, cached_blocks,
        peak_cached_bytes, active_bytes, active_blocks, peak_active_bytes."""
    def reset_stats(self) -> None: ...
    def malloc(self, size: int) -> int:
        """Address of a new block (tests)."""
    def calloc(self, nelem: int, elsize: int) -> int: ...
    def realloc(self, address: int, size: int) -> int: ...
    def free(self, address: int) -> None: ...
    def block_size(self, address: int) -> int:
        """Usable bytes of the block: its size class, or its request when small."""

def current_handler() -> Any:
    """numpy's data-memory handler capsule of the current context."""

def default_pool() -> Pool:
    """The process-wide pool (never freed)."""
