"""Type stub for the data-parallel dispatch in C (`_dp.pyx`); its pure-Python
reference is the parallel layer's general path (`dualmode.parallel.dtensor`), and
`np.broadcast_to` is `broadcast_view`'s."""
from typing import Any, Callable, Optional, Sequence

import numpy as np

#: id(stack) -> (weak reference to the stack, totals, device matrix, summed axes)
TOTALS: dict

def broadcast_view(a: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``np.broadcast_to(a, shape)`` (read-only, stride 0 along broadcast dims)."""
    ...

def share_of(total: np.ndarray, n: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """``total / n`` in `total`'s dtype (one multiplication for a power of two)."""
    ...

def remember_totals(stack: np.ndarray, totals: np.ndarray, device_matrix: Sequence[int],
                    axes: Sequence[int]) -> np.ndarray:
    """Record `totals` as the totals of `stack`'s pending sums over `axes`."""
    ...

def equal_shares(total: np.ndarray, n: int) -> np.ndarray:
    """The stack of `n` equal shares of `total`, stored once, its total remembered."""
    ...

class Dispatch:
    """``dist_apply(op, attrs, inputs, rec)`` with the data-parallel routes in C."""
    routes: dict
    defer_bytes: int

    def __init__(self, routes: dict, moves: Any, layout_cls: type, layout_kinds: dict,
                 rule: Callable, general: Callable, is_batch: Callable,
                 backend_state: Any, deferred: Callable, shares: Callable) -> None: ...
    def __call__(self, op: Any, attrs: Any, inputs: tuple, rec: bool) -> Any: ...
    def signature(self, op: Any, attrs: Any, inputs: tuple, layouts: list) -> Optional[tuple]: ...
    def run_route(self, op: Any, attrs: Any, inputs: tuple, rec: bool, route: tuple) -> Any: ...
    def stored_outputs(self, out: Any, op: Any, kinds: tuple, merged: list) -> Any: ...
    def stored(self, o: Any, kind: str, n: Any, merged: list, defer: bool = False) -> Any: ...
