"""Communication fusion: many buffers, one collective.

:func:`fused_all_reduce` AllReduces the stacks of many gradients as one collective
(:meth:`~.backend.Backend.all_reduce_fused`) and returns each result as a view into one
reduced buffer. Under MPI the stacks are packed into one fusion buffer
(``_comm.pack``) for one ``Allreduce``; the simulated backend reduces each stack
straight into its slice of the result, so fusing costs no copy there.
:func:`fusion_offsets` gives the buffer layout, so callers that own preallocated buffers
can use ``_comm.pack`` / ``_comm.unpack`` themselves.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .backend import Backend, fusion_offsets
from .management import get_backend

__all__ = ["fusion_offsets", "fused_all_reduce"]


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
