"""Communication fusion: many buffers, one collective.

:func:`fused_all_reduce` AllReduces the stacks of many gradients as one collective
(:meth:`~.backend.Backend.all_reduce_fused`) and returns each result as a view into one
reduced buffer. Under MPI the stacks are packed into one fusion buffer
(``_comm.pack``) for one ``Allreduce``; the simulated backend reduces each stack
straight into its slice of the result, so fusing costs no copy there.
:func:`fused_reduce_scatter` and :func:`fused_all_gather` do the same for
ReduceScatter (each device's ``n`` parts of every stack packed part-major, one
``Reduce_scatter_block``) and AllGather (one ``Allgather`` of the packed buffers).
:func:`fusion_offsets` gives the buffer layout, so callers that own preallocated buffers
can use ``_comm.pack`` / ``_comm.unpack`` themselves.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .backend import Backend, fusion_offsets
from .management import get_backend

__all__ = ["fusion_offsets", "fused_all_reduce", "fused_reduce_scatter",
           "fused_all_gather"]


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
    if backend is None:
        backend = get_backend()
    return backend.all_reduce_fused(stacks, members, op)


def fused_reduce_scatter(stacks: Sequence[np.ndarray], members=None, axis=0,
                         op: str = "sum", backend: Optional[Backend] = None
                         ) -> List[np.ndarray]:
    """ReduceScatter many stacks with one collective: result i is
    ``reduce_scatter(stacks[i], members, axis[i], op)``.

    Parameters
    ----------
    stacks : sequence of ndarrays (local devices, *buffer shape), all of one dtype
    members, op : as :meth:`Backend.reduce_scatter`
    axis : int (every stack) or a sequence of ints (one per stack)
    backend : the backend to use; default the live one (``init()`` first)
    """
    if backend is None:
        backend = get_backend()
    return backend.reduce_scatter_fused(stacks, members, axis, op)


def fused_all_gather(stacks: Sequence[np.ndarray], members=None, axis=0,
                     backend: Optional[Backend] = None) -> List[np.ndarray]:
    """AllGather many stacks with one collective: result i is
    ``all_gather(stacks[i], members, axis[i])`` (may be read-only views).

    Parameters
    ----------
    stacks : sequence of ndarrays (local devices, *buffer shape), all of one dtype
    members : as :meth:`Backend.all_gather`
    axis : int (every stack) or a sequence of ints (one per stack)
    backend : the backend to use; default the live one (``init()`` first)
    """
    if backend is None:
        backend = get_backend()
    return backend.all_gather_fused(stacks, members, axis)
