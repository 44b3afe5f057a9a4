"""Tensor redistribution: plan, then run, the steps that move a tensor between layouts.

    plan = plan_redistribution(src, dst)        # cached per (src, dst, itemsize)
    print(plan)                                 # one line per step, bytes per device
    out = redistribute(stack, src, dst)         # runs the plan with the backend's collectives

**Planning** (MindSpore's TensorRedistribution, DTensor's planned steps):

1. *Unify the device matrices.* Ranks run row-major over both matrices, so each axis
   covers a range of rank strides; cutting at the strides of both gives the coarsest
   matrix that refines both (``(8,)`` and ``(2, 4)`` give ``(2, 4)``; ``(4, 2)`` and
   ``(2, 4)`` give ``(2, 2, 2)``). Each original axis becomes a run of unified axes
   (outer first), so both layouts are expressed over one matrix with the same ranks.
   Matrices whose strides do not nest (``(2, 3)`` and ``(3, 2)``) have no common
   refinement: the plan then replicates the tensor over the source matrix, switches
   matrix (:class:`Remesh`, no data moves) and slices over the destination matrix.
2. *Search.* A state gives, per tensor dim, the unified axes splitting it (outer first)
   and the axes still holding partial sums to resolve. Only the innermost split of a dim
   can change, so the moves are: :class:`AllGather` (drop the innermost splits of a dim),
   :class:`AllToAll` (move them to the inner end of another dim), :class:`ReduceScatter`
   (resolve partial axes by splitting a dim), :class:`AllReduce` (resolve them) and
   :class:`LocalSlice` (split a dim by free axes: no communication, taken as soon as it
   extends the destination map). Moves never undo the prefix of a dim's splits that
   already agrees with the destination, and only append to dims that agree with it so
   far (which may park splits there for a later AllToAll). An A* search over these
   moves (uniform cost plus a consistent lower bound, so still exact) returns the
   sequence moving the fewest bytes per device (formulas of
   :mod:`dualmode.communication.trace`; ties: fewer steps). If it exceeds
   :data:`SEARCH_BUDGET` expansions it returns the direct plan instead (gather every
   split that disagrees, reduce-scatter or all-reduce the partial sums, slice).

The search runs in the Cython kernel :mod:`dualmode._core._redist` over small int
arrays; :func:`reference_plan` implements the same rules plainly in Python and the
tests compare the two.

**Executing.** :func:`redistribute` runs a plan on a stack of local shards: every
collective goes through the backend (so :class:`~dualmode.parallel.CommReport` records
it, attributed to ``(op_name, "redistribution")``) over the groups
``group_members(axes)`` of the unified device matrix, whose ranks are the original ones.
When this process holds every device ("sim"), :func:`execute` (the sharding engine's
route) runs a communicating plan through the global value instead
(:func:`run_plan_direct`: assemble the source blocks, adding pending sums, then cut the
destination blocks, as views where strides allow) and records exactly the collectives
:func:`run_plan` would run; :func:`run_plan_grid` returns the destination blocks as a
device grid without writing replicas (the optimizers' gradients).

One concept per module: :mod:`.steps` (the steps and the plan), :mod:`.unify` (common
device matrices), :mod:`.planner` (search and cache), :mod:`.reference` (the Python
planner), :mod:`.executor` (running a plan); this package exports their public names.
Moving Tensors (distributed or not) with them is :mod:`dualmode.parallel.moves`.
"""
from __future__ import annotations

from .executor import (blocks_of, execute, global_value, redistribute, run_plan,
                       run_plan_direct, run_plan_grid)
from .planner import (clear_plan_cache, plan_cache_info, plan_redistribution, plan_uncached,
                      reference_plan)
from .steps import (SEARCH_BUDGET, AllGather, AllReduce, AllToAll, LocalSlice, Plan,
                    RedistributionError, ReduceScatter, Remesh, Step)
from .unify import unify_device_matrices

__all__ = ["Step", "LocalSlice", "AllGather", "AllToAll", "ReduceScatter", "AllReduce",
           "Remesh", "Plan", "RedistributionError", "plan_redistribution", "plan_uncached",
           "reference_plan", "redistribute", "run_plan", "run_plan_direct", "run_plan_grid",
           "execute", "global_value", "blocks_of", "unify_device_matrices",
           "plan_cache_info", "clear_plan_cache", "SEARCH_BUDGET"]
