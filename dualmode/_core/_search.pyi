"""Type stub for the recursive-programming kernel (`_search.pyx`); its pure-Python
reference is `dualmode.parallel.graph.search.recursive_programming(..., impl="python")`,
which follows the same rules choice for choice (the tests compare the two).

The graph comes in as the flat CSR arrays of `dualmode._core._propagate` (built by
`dualmode.parallel.graph.propagate.prepare_problem`) plus ``order``, a permutation of the
nodes (fixed nodes first, then by decreasing weight). Each free node in order takes the
candidate minimising its own cost plus the edge costs to its decided neighbours and the
least edge-plus-own cost of each undecided one; then up to ``rounds`` rounds of a node
sweep and an edge sweep (both ends of an edge re-chosen together) change choices only
when that strictly lowers the total cost.
"""
import numpy as np

def ordered_greedy(node_ptr: np.ndarray, node_cost: np.ndarray, src: np.ndarray,
                   dst: np.ndarray, edge_ptr: np.ndarray, edge_cost: np.ndarray,
                   fixed: np.ndarray, order: np.ndarray, rounds: int) -> np.ndarray:
    """The chosen candidate per node (int64, length N).

    Arrays must be C-contiguous: ``node_ptr`` (N + 1,), ``src``/``dst`` (E,),
    ``edge_ptr`` (E + 1,), ``fixed`` and ``order`` (N,) int64; ``node_cost``,
    ``edge_cost`` float64. Values are trusted (the caller validates them); the array
    lengths are checked and ``order`` must be a permutation (ValueError otherwise).
    """
    ...
