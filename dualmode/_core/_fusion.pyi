"""Type stub for the fused AllReduce's member loops in C (`_fusion.pyx`); pure-Python
references in `fusion_reference.py`, `Backend._all_reduce_fused` and
`SimBackend._all_reduce_fused_reference`."""
from typing import Any, List, Sequence, Tuple

import numpy as np

def check_stacks(func: str, stacks: Sequence[Any], rows: int, deferred: bool) -> list:
    """`stacks` as a new list of stacks of one dtype with the leading (device) dim
    `rows`; deferred stacks kept when `deferred`, else written."""
    ...

def fusion_offsets(stacks: Sequence[np.ndarray]) -> Tuple[List[int], int]:
    """Per-device element offsets of each stack in a fusion buffer, and its row length."""
    ...

def whole_world_all_reduce(stacks: list, n: int, op: str, pack_elems: int,
                           backend: Any) -> List[np.ndarray]:
    """The simulated fused AllReduce over one group of every device: per stack, a
    read-only stride-0 view ``(n, *local)`` of its result (float32, float64, int32,
    int64 stacks)."""
    ...

def grouped_all_reduce(stacks: list, plan: Any, op: str, backend: Any) -> List[np.ndarray]:
    """The fused AllReduce over the groups of `plan` as ``Backend._all_reduce_fused``
    runs it: the stacks packed side by side, one ``backend._all_reduce``, per stack a
    view of its columns of the result."""
    ...
