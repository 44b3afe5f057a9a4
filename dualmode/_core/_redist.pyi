"""Type stub for the redistribution planner kernel (`_redist.pyx`); its pure-Python
reference is `dualmode.parallel.redistribution.reference_plan`, which follows the same
rules move for move (the tests compare the two).

The layouts come in as TensorLayout fields (tuples of ints): device matrix, tensor map
(per dim, the device axes splitting it, outer first) and partial axes, for the source
and the destination, plus the common global shape. The kernel unifies the two device
matrices (cut at every rank stride of either), then runs an A* search for the sequence
of steps moving the fewest bytes per device.
"""
from typing import List, Optional, Tuple

#: Expansions of the search before it returns the direct plan instead.
DEFAULT_BUDGET: int
#: Step names, in kind-code order: LocalSlice, AllGather, AllToAll, ReduceScatter, AllReduce.
NAMES: Tuple[str, ...]
#: Fixed sizes of the kernel: unified device axes and tensor dims (beyond them `plan`
#: raises OverflowError and callers use the Python reference).
LIMITS: dict

RawStep = Tuple[str, Tuple[int, ...], Tuple[int, ...], int, float]

def plan(src_dm: Tuple[int, ...], src_map: Tuple[Tuple[int, ...], ...],
         src_partial: Tuple[int, ...], dst_dm: Tuple[int, ...],
         dst_map: Tuple[Tuple[int, ...], ...], dst_partial: Tuple[int, ...],
         shape: Tuple[int, ...], itemsize: int = 4, budget: int = ...
         ) -> Tuple[int, Optional[Tuple[int, ...]], Optional[List[RawStep]]]:
    """Plan a redistribution between two valid layouts of one shape and device count.

    Returns ``(status, sizes, steps)``:

    * ``0``: ``sizes`` is the unified device matrix and ``steps`` the plan, each step
      ``(name, dims, axes, parts, bytes)`` with axes of the unified matrix (outer first),
      ``parts`` devices per group and ``bytes`` moved per device for ``itemsize``-byte
      elements (trace.py's formulas);
    * ``1``: the device matrices have no common refinement (``sizes``, ``steps`` None);
    * ``2``: the destination keeps partial axes that are not partial in the source.

    Raises OverflowError beyond ``LIMITS`` and MemoryError when the search runs out of
    memory.
    """
    ...
