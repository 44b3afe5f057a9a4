"""Type stub for the sharding-propagation kernel (`_propagate.pyx`); its pure-Python
reference is `dualmode.parallel.graph.propagate.propagate(..., impl="python")`, which
follows the same rules choice for choice (the tests compare the two).

The graph comes in as flat CSR arrays built by `dualmode.parallel.graph.propagate`:
node i's own costs are ``node_cost[node_ptr[i]:node_ptr[i+1]]``; edge e runs from
``src[e]`` to ``dst[e]`` and its ``(c_src, c_dst)`` cost matrix, row-major, is
``edge_cost[edge_ptr[e]:edge_ptr[e+1]]``; ``fixed[i]`` is -1 (free) or node i's
configured candidate. The kernel visits free nodes in breadth-first layers from the fixed
nodes (each layer by node index; components without a fixed node from their lowest
node), gives each the candidate minimising its own cost plus the edge costs to its
decided neighbours, then runs up to ``rounds`` refinement sweeps that change a node only
when that strictly lowers the total cost.
"""
import numpy as np

#: Refinement sweeps run by default after the first pass.
DEFAULT_ROUNDS: int

def propagate(node_ptr: np.ndarray, node_cost: np.ndarray, src: np.ndarray,
              dst: np.ndarray, edge_ptr: np.ndarray, edge_cost: np.ndarray,
              fixed: np.ndarray, rounds: int = ...) -> np.ndarray:
    """The chosen candidate per node (int64, length N).

    Arrays must be C-contiguous: ``node_ptr`` (N + 1,), ``src``/``dst`` (E,),
    ``edge_ptr`` (E + 1,), ``fixed`` (N,) int64; ``node_cost``, ``edge_cost`` float64.
    Values are trusted (the caller validates them); only the array lengths are checked
    (ValueError when they disagree).
    """
    ...

def flatten(items: list, ndim: int) -> tuple:
    """Concatenate ragged cost arrays (each ``ndim``-D) into one float64 array, row-major.

    Returns ``(bad, shapes, flat)``: ``bad`` is -1 and ``shapes`` an (n, ndim) int64 array,
    or ``bad`` is the index of the first item with another number of dims (``shapes`` and
    ``flat`` None). Float64 C-contiguous arrays are copied with one memcpy each; anything
    else goes through ``np.ascontiguousarray(item, dtype=np.float64)`` first (which may
    raise TypeError / ValueError).
    """
    ...
