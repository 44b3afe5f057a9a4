"""Pure-Python references for the member checks and offsets in ``_fusion.pyx`` (tests
compare the two; they also document what each computes). The reference of
``_fusion.whole_world_all_reduce`` is ``SimBackend._all_reduce_fused_reference``."""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np

from ._tensor import Deferred


def check_stacks(func: str, stacks, rows: int, deferred: bool) -> list:
    """Reference for `_fusion.check_stacks`: `stacks` as a list of stacks of one dtype,
    each with the leading (device) dim `rows`; a deferred stack kept when `deferred`,
    else written."""
    stacks = list(stacks)
    for i, s in enumerate(stacks):
        if isinstance(s, Deferred):
            if not deferred:
                stacks[i] = s = s.materialize()
        elif not isinstance(s, np.ndarray):
            raise TypeError(f"{func}: stacks[{i}] must be a numpy array, got "
                            f"{type(s).__name__}")
        if s.dtype != stacks[0].dtype:
            raise TypeError(f"{func}: stacks[{i}] has dtype {s.dtype} but stacks[0] has "
                            f"{stacks[0].dtype}; fuse buffers of one dtype per call")
        if s.ndim < 1 or s.shape[0] != rows:
            raise ValueError(f"{func}: stacks[{i}] has shape {s.shape}; every stack needs "
                             f"the leading (device) dim {rows} (the devices this "
                             f"process holds)")
    return stacks


def fusion_offsets(stacks: Sequence[np.ndarray]) -> Tuple[List[int], int]:
    """Reference for `_fusion.fusion_offsets`: per-device element offsets of each stack
    in a fusion buffer, and its row length."""
    offsets, total = [], 0
    for s in stacks:
        offsets.append(total)
        total += math.prod(s.shape[1:])
    return offsets, total
