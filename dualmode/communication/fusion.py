"""Communication fusion: many buffers, one collective.

:func:`fused_all_reduce` packs the stacks of many gradients into one fusion buffer with
the Cython kernel ``_comm.pack``, runs one AllReduce over it, and returns each result as
a view into the reduced buffer (no unpack copy; when the AllReduce result is a
replicated view, so are the pieces). :func:`fusion_offsets` gives the layout, so callers
that own preallocated buffers can use ``_comm.unpack`` themselves.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .._core import _comm
from .backend import Backend
from .management import get_backend

__all__ = ["fusion_offsets", "fused_all_reduce"]


def fusion_offsets(stacks: Sequence[np.ndarray]) -> Tuple[List[int], int]:
    """Per-device element offsets of each stack in a fusion buffer, and its row length."""
    offsets, total = [], 0
    for s in stacks:
        offsets.append(total)
        total += math.prod(s.shape[1:])
    return offsets, total


def fused_all_reduce(stacks: Sequence[np.ndarray], members=None, op: str = "sum",
                     backend: Optional[Backend] = None) -> List[np.ndarray]:
    """AllReduce many stacks with one collective.

    Parameters
    ----------
    stacks : sequence of ndarrays (local devices, *buffer shape), all of one dtype
    members, op : as :meth:`Backend.all_reduce`
    backend : the backend to use; default the live one (``init()`` first)

    Returns
    -------
    list of ndarrays, the reduced stacks (views into one buffer; do not write into them)
    """
    func = "fused_all_reduce"
    if backend is None:
        backend = get_backend()
    stacks = list(stacks)
    if not stacks:
        return []
    for i, s in enumerate(stacks):
        if not isinstance(s, np.ndarray):
            raise TypeError(f"{func}: stacks[{i}] must be a numpy array, got "
                            f"{type(s).__name__}")
        if s.dtype != stacks[0].dtype:
            raise TypeError(f"{func}: stacks[{i}] has dtype {s.dtype} but stacks[0] has "
                            f"{stacks[0].dtype}; fuse buffers of one dtype per call")
        if s.ndim < 1 or s.shape[0] != stacks[0].shape[0]:
            raise ValueError(f"{func}: stacks[{i}] has shape {s.shape}; every stack needs the "
                             f"leading (device) dim {stacks[0].shape[0]}")
    offsets, total = fusion_offsets(stacks)
    rows = stacks[0].shape[0]
    buf = np.empty((rows, total), dtype=stacks[0].dtype)
    _comm.pack([np.ascontiguousarray(s) for s in stacks], buf, offsets)
    red = backend.all_reduce(buf, members, op)
    return [red[:, o:o + math.prod(s.shape[1:])].reshape(s.shape)
            for s, o in zip(stacks, offsets)]
