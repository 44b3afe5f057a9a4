"""Sharding propagation (Cython kernel vs reference), the alpha-beta cost model and the
candidate strategies per op."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualmode.ops import REGISTRY
from dualmode.parallel import TensorLayout
from dualmode.parallel.graph.candidates import Candidate, op_candidates
from dualmode.parallel.graph.cost import (CostModel, partial_cost, redistribution_cost)
from dualmode.parallel.graph.propagate import PropagationError, propagate, total_cost
from dualmode.parallel.sharding import RULES

F32 = np.dtype("float32")
MM = {"transpose_a": False, "transpose_b": False}


# ============================================================================ graphs

def _random_graph(rng, n, cmax=6, extra=0.6, fixed_frac=0.1):
    counts = rng.integers(1, cmax + 1, n)
    nodes = [rng.integers(0, 5, c).astype(np.float64) for c in counts]   # ties on purpose
    pairs = [(i - 1, i) for i in range(1, n) if rng.random() < 0.8]
    for _ in range(int(extra * n)):
        if n > 1:
            a, b = rng.choice(n, 2, replace=False)
            pairs.append((int(a), int(b)))
    edges = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    ecosts = [rng.integers(0, 9, (counts[s], counts[d])).astype(np.float64) for s, d in edges]
    fixed = np.full(n, -1, np.int64)
    for i in np.flatnonzero(rng.random(n) < fixed_frac):
        fixed[i] = rng.integers(counts[i])
    return nodes, edges, ecosts, fixed


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), rounds=st.integers(0, 5))
def test_propagate_kernel_matches_reference(seed, n, rounds):
    g = _random_graph(np.random.default_rng(seed), n)
    a = propagate(*g, rounds=rounds)
    b = propagate(*g, impl="python", rounds=rounds)
    assert a.dtype == np.int64 and a.shape == (n,)
    np.testing.assert_array_equal(a, b)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40))
def test_propagate_keeps_fixed_and_refinement_never_costs_more(seed, n):
    nodes, edges, ecosts, fixed = _random_graph(np.random.default_rng(seed), n,
                                                fixed_frac=0.3)
    greedy = propagate(nodes, edges, ecosts, fixed, rounds=0)
    refined = propagate(nodes, edges, ecosts, fixed)
    for out in (greedy, refined):
        np.testing.assert_array_equal(out[fixed >= 0], fixed[fixed >= 0])
        assert ((out >= 0) & (out < np.array([len(c) for c in nodes]))).all()
    assert total_cost(refined, nodes, edges, ecosts) <= total_cost(greedy, nodes, edges,
                                                                   ecosts)


def test_propagate_chain_hand_worked():
    # chain 0 -> 1 -> 2 -> 3, node 0 fixed to candidate 1; 2 candidates everywhere.
    # Edge costs: 0 when both ends agree, 5 otherwise; own costs favour candidate 0 by
    # 1 on nodes 1 and 2, by 10 on node 3.
    nodes = [np.array([0.0, 0.0]), np.array([0.0, 1.0]), np.array([0.0, 1.0]),
             np.array([0.0, 10.0])]
    agree = np.array([[0.0, 5.0], [5.0, 0.0]])
    edges = np.array([[0, 1], [1, 2], [2, 3]])
    fixed = np.array([1, -1, -1, -1])
    # greedy: node 1 (dist 1): [0 + 5, 1 + 0] -> 1; node 2: [0 + 5, 1 + 0] -> 1;
    # node 3: [0 + 5, 10 + 0] -> 0 (the conflict lands farthest from the fixed op).
    # total: own 1 + 1, edge (2, 3) 5 = 7
    g = (nodes, edges, [agree] * 3, fixed)
    for impl in ("cython", "python"):
        np.testing.assert_array_equal(propagate(*g, impl=impl, rounds=0), [1, 1, 1, 0])
    assert total_cost([1, 1, 1, 0], *g[:3]) == 7.0
    # refinement, sweep 1: node 1 given (1, 1): [10, 1] stays; node 2 given (1, 0):
    # [5, 6] -> 0; node 3 given 0: [0, 15] stays. Sweep 2: node 1 given (1, 0): [5, 6]
    # -> 0. Sweep 3: no change. Total: edge (0, 1) 5 = 5.
    for impl in ("cython", "python"):
        np.testing.assert_array_equal(propagate(*g, impl=impl), [1, 0, 0, 0])
    assert total_cost([1, 0, 0, 0], *g[:3]) == 5.0


def test_propagate_nearest_fixed_wins_and_ties_by_index():
    # 0 (fixed 0) - 1 - 2 - 3 - 4 (fixed 1): nodes 1, 3 at distance 1, node 2 at 2
    agree = np.array([[0.0, 3.0], [3.0, 0.0]])
    nodes = [np.zeros(2)] * 5
    edges = np.array([[0, 1], [1, 2], [2, 3], [3, 4]])
    out = propagate(nodes, edges, [agree] * 4, [0, -1, -1, -1, 1], rounds=0)
    # 1 follows 0, 3 follows 4; 2 ties (3 either way) -> candidate 0
    np.testing.assert_array_equal(out, [0, 0, 0, 1, 1])


def test_propagate_component_without_fixed_node_starts_at_lowest_index():
    # component {0, 1, 2} fixed at 1; component {3, 4} free: node 3 takes its cheapest
    # own candidate (1), node 4 follows it despite its own preference
    agree = np.array([[0.0, 4.0], [4.0, 0.0]])
    nodes = [np.zeros(2), np.zeros(2), np.zeros(2), np.array([2.0, 1.0]),
             np.array([0.0, 1.0])]
    edges = np.array([[0, 1], [1, 2], [3, 4]])
    out = propagate(nodes, edges, [agree] * 3, [-1, 1, -1, -1, -1], rounds=0)
    np.testing.assert_array_equal(out, [1, 1, 1, 1, 1])


def test_propagate_refinement_fixes_greedy_mistake():
    # 0 (fixed 0) -> 1 -> 2; node 1 greedily follows 0 (cost 0) but then node 2 pays 10;
    # refinement moves node 1 to candidate 1 (pays 1 on edge 0, saves 10 on edge 1)
    nodes = [np.zeros(2), np.zeros(2), np.array([0.0])]
    e0 = np.array([[0.0, 1.0], [0.0, 0.0]])
    e1 = np.array([[10.0], [0.0]])
    edges = np.array([[0, 1], [1, 2]])
    g = (nodes, edges, [e0, e1], [0, -1, -1])
    np.testing.assert_array_equal(propagate(*g, rounds=0), [0, 0, 0])
    for impl in ("cython", "python"):
        np.testing.assert_array_equal(propagate(*g, impl=impl), [0, 1, 0])


def test_propagate_empty_and_single():
    assert propagate([], np.zeros((0, 2), np.int64), [], np.zeros(0, np.int64)).shape == (0,)
    out = propagate([np.array([3.0, 1.0, 2.0])], [], [], [-1])
    np.testing.assert_array_equal(out, [1])


def test_propagate_accepts_lists_and_other_dtypes():
    nodes = [[1.0, 0.0], np.array([0, 1], dtype=np.int32)]
    out = propagate(nodes, [[0, 1]], [np.eye(2, dtype=np.float32)[::-1]], [-1, -1])
    np.testing.assert_array_equal(out, propagate(nodes, [[0, 1]], [np.eye(2)[::-1]],
                                                 [-1, -1], impl="python"))


@pytest.mark.parametrize("args, match", [
    (([np.zeros(2), np.zeros(2)], [[0, 1]], [np.zeros((2, 2))], [-1]),
     r"fixed has shape \(1,\); expected \(2,\)"),
    (([np.zeros(2), np.zeros(3)], [[0, 1]], [np.zeros((2, 2))], [-1, -1]),
     r"edge_costs\[0\] has shape \(2, 2\) .* expected shape \(2, 3\)"),
    (([np.zeros(2), np.zeros(2)], [[0, 1]], [], [-1, -1]),
     r"edge_costs has 0 entries but edges has 1 rows"),
    (([np.zeros(2), np.zeros(2)], [[0, 1]], [np.zeros((2, 2))], [-1, 2]),
     r"fixed\[1\]=2 is not valid for node 1 with 2 candidates; expected -1 \(free\) or 0..1"),
    (([np.zeros(2), np.zeros(2)], [[0, 1]], [np.zeros((2, 2))], [-2, -1]),
     r"fixed\[0\]=-2 is not valid"),
    (([np.zeros(2), np.zeros(2)], [[0, 1, 1]], [np.zeros((2, 2))], [-1, -1]),
     r"edges has shape \(1, 3\); expected \(E, 2\)"),
    (([np.zeros(2), np.zeros(2)], [[0, -1]], [np.zeros((2, 2))], [-1, -1]),
     r"edges\[0\]=\(0, -1\) names a node out of range; valid nodes are 0..1"),
    (([np.zeros(2), np.zeros(2)], [[0, 2]], [np.zeros((2, 2))], [-1, -1]),
     r"edges\[0\]=\(0, 2\) names a node out of range"),
    (([np.zeros(2), np.zeros(2)], [[1, 1]], [np.zeros((2, 2))], [-1, -1]),
     r"edges\[0\]=\(1, 1\) is a self-loop"),
    (([np.zeros(2), np.zeros(0)], [], [], [-1, -1]),
     r"node_costs\[1\] is empty; each node needs at least one candidate"),
    (([np.zeros(2), np.zeros((2, 2))], [], [], [-1, -1]),
     r"node_costs\[1\] has shape \(2, 2\); each entry must be a 1-D array"),
    (([np.zeros(2), np.zeros(2)], [[0, 1]], [np.zeros(4)], [-1, -1]),
     r"edge_costs\[0\] has shape \(4,\); each entry must be a 2-D"),
    (([np.array([0.0, np.nan])], [], [], [-1]),
     r"node_costs\[0\] holds nan; costs must be numbers or \+inf"),
    ((np.zeros((2, 2)), [], [], [-1, -1]),
     r"node_costs must be a list of numpy arrays; got ndarray"),
])
@pytest.mark.parametrize("impl", ["cython", "python"])
def test_propagate_bad_input(args, match, impl):
    with pytest.raises(ValueError, match=match):
        propagate(*args, impl=impl)


def test_propagate_bad_impl_and_rounds():
    g = ([np.zeros(1)], [], [], [-1])
    with pytest.raises(PropagationError, match=r"impl='c' is not valid; expected 'cython' "
                                               r"or 'python'"):
        propagate(*g, impl="c")
    with pytest.raises(ValueError, match=r"rounds=-1 is not valid; expected an int >= 0"):
        propagate(*g, rounds=-1)


def test_total_cost_bad_choice():
    with pytest.raises(ValueError, match=r"choice\[0\]=3 is not valid for node 0 with 2 "
                                         r"candidates; expected 0..1"):
        total_cost([3], [np.zeros(2)], [], [])


# ============================================================================ cost model

def test_cost_model_defaults_and_validation():
    m = CostModel()
    assert m.alpha == 10e-6 and m.beta == 1e-10
    assert m.collective(1000) == pytest.approx(10e-6 + 1e-7)
    with pytest.raises(ValueError, match=r"CostModel: alpha=-1 is not valid; expected a "
                                         r"finite number >= 0"):
        CostModel(alpha=-1)
    with pytest.raises(ValueError, match=r"beta=nan is not valid"):
        CostModel(beta=float("nan"))


def test_redistribution_cost_allgather_hand_computed():
    # f32 (8, 8) split (2, 4) on 8 devices: local (4, 2) = 32 bytes. To replicated:
    # AllGather dim 0 over 2 moves (2-1)*32 = 32 bytes, leaving (8, 2) = 64 bytes;
    # AllGather dim 1 over 4 moves (4-1)*64 = 192 bytes. Two collectives, 224 bytes.
    m = CostModel(alpha=1.0, beta=0.5)
    src = TensorLayout.from_strategy((2, 4), (8, 8), 8)
    dst = TensorLayout.replicated((8, 8), 8)
    assert redistribution_cost(src, dst, 4, m) == pytest.approx(2 * 1.0 + 0.5 * 224)
    assert redistribution_cost(src, src, 4, m) == 0.0
    assert redistribution_cost(dst, src, 4, m) == 0.0          # local slices only


def test_redistribution_cost_resolves_partial_like_partial_cost():
    # (8, 8) f32 rows split over axis 0, pending sums over axis 1 of (2, 2): local (4, 8)
    # = 128 bytes; AllReduce over 2 devices moves 2*(2-1)*128/2 = 128 bytes
    m = CostModel(alpha=1.0, beta=0.01)
    part = TensorLayout((2, 2), ((0,), ()), (8, 8), (1,))
    done = TensorLayout((2, 2), ((0,), ()), (8, 8))
    assert redistribution_cost(part, done, 4, m) == pytest.approx(1.0 + 1.28)
    assert partial_cost(part, 4, m) == pytest.approx(1.0 + 1.28)
    assert partial_cost(done, 4, m) == 0.0


def test_redistribution_cost_bad_input():
    lay = TensorLayout.replicated((4,), 2)
    with pytest.raises(ValueError, match=r"redistribution_cost: itemsize=0 is not valid; "
                                         r"expected a positive int"):
        redistribution_cost(lay, lay, 0)
    with pytest.raises(TypeError, match=r"redistribution_cost: dst=\(2,\) is not a "
                                        r"TensorLayout"):
        redistribution_cost(lay, (2,))


# ============================================================================ candidates

def _accepted(op_name, attrs, cand, dtypes):
    plan = RULES[op_name](attrs, list(cand.in_layouts), list(dtypes))
    return plan is not None and tuple(plan.inputs) == cand.in_layouts and \
        tuple(plan.outputs) == cand.out_layouts


def test_candidates_matmul_4_devices():
    cands = op_candidates(REGISTRY["MatMul"], MM, [(8, 8), (8, 8)], [F32, F32], 4)
    strategies = [c.strategy for c in cands]
    assert ((2, 2), (2, 1)) in strategies
    assert strategies[-1] == ((1, 1), (1, 1))
    assert len(set(strategies)) == len(strategies)
    for c in cands:
        assert isinstance(c, Candidate)
        assert _accepted("MatMul", MM, c, [F32, F32])
        assert all(lay.device_num == 4 for lay in c.in_layouts + c.out_layouts)
    rep = cands[-1]
    assert all(lay.is_replicated for lay in rep.in_layouts + rep.out_layouts)
    # ((2, 2), (2, 1)): rows on one axis, the contracted dim on the other -> pending sums
    c = cands[strategies.index(((2, 2), (2, 1)))]
    assert c.out_layouts[0].partial == (1,) and c.out_layouts[0].dim_parts == (2, 1)
    assert c.devices == 4 and c.cost == 0.0
    # the same placement as from_strategy's layouts
    assert c.in_layouts[0] == TensorLayout.from_strategy((2, 2), (8, 8), 4)
    assert c.in_layouts[1] == TensorLayout.from_strategy((2, 1), (8, 8), 4)


def test_candidates_matmul_fully_use_devices():
    cands = op_candidates(REGISTRY["MatMul"], MM, [(8, 8), (8, 8)], [F32, F32], 8,
                          fully_use_devices=True)
    assert cands and all(c.devices == 8 for c in cands)
    assert ((2, 2), (2, 2)) in [c.strategy for c in cands]          # M, K and N split
    assert ((1, 1), (1, 1)) not in [c.strategy for c in cands]
    # (3, 5) x (5, 7) cannot use 8 devices: only the replicated candidate remains
    cands = op_candidates(REGISTRY["MatMul"], MM, [(3, 5), (5, 7)], [F32, F32], 8,
                          fully_use_devices=True)
    assert [c.strategy for c in cands] == [((1, 1), (1, 1))]


def test_candidates_reduce_max_cost_is_its_allreduce():
    m = CostModel(alpha=1.0, beta=0.0)
    attrs = {"axis": (1,), "keep_dims": False}
    cands = op_candidates(REGISTRY["ReduceMax"], attrs, [(8, 16)], [F32], 4, model=m)
    cost = {c.strategy: c.cost for c in cands}
    assert cost[((4, 1),)] == 0.0 and cost[((2, 2),)] == 1.0 and cost[((1, 1),)] == 0.0


def test_candidates_respect_rules_that_keep_dims_whole():
    cands = op_candidates(REGISTRY["Softmax"], {"axis": 1}, [(8, 16)], [F32], 8)
    assert [c.strategy for c in cands] == [((8, 1),), ((4, 1),), ((2, 1),), ((1, 1),)]
    xent = op_candidates(REGISTRY["SparseSoftmaxCrossEntropyWithLogits"], {},
                         [(8, 16), (8,)], [F32, np.dtype("int32")], 4)
    assert [c.strategy for c in xent] == [((4, 1), (4,)), ((2, 1), (2,)), ((1, 1), (1,))]


def test_candidates_op_without_rule_is_replicated():
    op = REGISTRY["AllReduce"]
    assert "AllReduce" not in RULES
    cands = op_candidates(op, {"op": "sum", "group": None}, [(4, 4)], [F32], 4,
                          out_shapes=[(4, 4)])
    assert len(cands) == 1 and cands[0].strategy == ((1, 1),)
    assert cands[0].out_layouts[0] == TensorLayout.replicated((4, 4), 4)


def test_candidates_cap():
    cands = op_candidates(REGISTRY["BatchMatMul"], MM, [(8, 8, 8, 8), (8, 8, 8, 8)],
                          [F32, F32], 64, max_candidates=10)
    assert len(cands) == 11 and cands[-1].devices == 1
    assert all(c.devices == 64 for c in cands[:10])


def test_candidates_bad_input():
    with pytest.raises(ValueError, match=r"MatMul: device_num=0 is not valid; expected a "
                                         r"positive int"):
        op_candidates(REGISTRY["MatMul"], MM, [(8, 8), (8, 8)], [F32, F32], 0)
    with pytest.raises(ValueError, match=r"MatMul: in_dtypes has 1 entries but in_shapes "
                                         r"has 2"):
        op_candidates(REGISTRY["MatMul"], MM, [(8, 8), (8, 8)], [F32], 4)
    with pytest.raises(ValueError, match=r"in_shapes\[1\]='x' is not valid; expected a "
                                         r"tuple of ints"):
        op_candidates(REGISTRY["MatMul"], MM, [(8, 8), "x"], [F32, F32], 4)
