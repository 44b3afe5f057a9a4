"""The three search modes (graph/search.py): dynamic programming against brute-force
enumeration, recursive programming's kernel against its Python reference and its cost
against the exact optimum, and each mode end to end against the single-device run."""
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dualmode as dm
from dualmode import Parameter, Tensor, context, nn, ops
from dualmode.parallel import compile_count
from dualmode.parallel.auto_parallel import AutoParallel
from dualmode.parallel.graph import compile as graph_compile
from dualmode.parallel.graph.propagate import propagate, total_cost
from dualmode.parallel.graph.search import (SEARCH_MODES, PlanTable, SearchError,
                                            SearchResult, dynamic_programming,
                                            recursive_programming, search)

from _devices import set_devices

MODES = list(SEARCH_MODES)


@pytest.fixture(autouse=True)
def _reset_context():
    yield
    dm.set_context(mode=dm.PYNATIVE_MODE)
    dm.reset_auto_parallel_context()
    context.reset_algo_parameters()


# ---------------------------------------------------------------------------
# problems
# ---------------------------------------------------------------------------
def _brute_force(nodes, edges, ecosts, fixed):
    """The least total cost over every assignment (vectorised enumeration)."""
    domains = [np.arange(len(c)) if f < 0 else np.array([f]) for c, f in zip(nodes, fixed)]
    grid = np.stack([g.ravel() for g in np.meshgrid(*domains, indexing="ij")], axis=1) \
        if domains else np.zeros((1, 0), np.int64)
    tot = np.zeros(grid.shape[0])
    for i, c in enumerate(nodes):
        tot += np.asarray(c)[grid[:, i]]
    for (s, d), m in zip(edges, ecosts):
        tot += np.asarray(m)[grid[:, s], grid[:, d]]
    return float(tot.min())


def _random_problem(rng, n, e, cmax=3, p_fixed=0.15, p_inf=0.0, integer=True):
    counts = rng.integers(1, cmax + 1, n)
    while np.prod(counts.astype(float)) > 200_000:           # keep enumeration quick
        counts[np.argmax(counts)] -= 1

    def draw(shape, high):
        x = rng.integers(0, high, shape).astype(float) if integer else rng.random(shape) * high
        if p_inf:
            x[rng.random(shape) < p_inf] = np.inf
        return x

    nodes = [draw(c, 10) for c in counts]
    edges = rng.integers(0, max(n, 1), (e, 2)) if n > 1 else np.zeros((0, 2), np.int64)
    edges = edges[edges[:, 0] != edges[:, 1]]
    ecosts = [draw((counts[s], counts[d]), 20) for s, d in edges]
    fixed = np.where(rng.random(n) < p_fixed, 0, -1)
    fixed = np.array([rng.integers(counts[i]) if f == 0 else -1 for i, f in enumerate(fixed)],
                     dtype=np.int64)
    return nodes, edges.astype(np.int64).reshape(-1, 2), ecosts, fixed


def _local_graph(n, seed, window=4, p=0.3, cmin=4, cmax=12):
    """A network-like graph: a chain with skip edges back at most `window` ops."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(cmin, cmax + 1, n)
    nodes = [rng.random(c) for c in counts]
    src, dst = list(range(n - 1)), list(range(1, n))
    for i in range(2, n):
        if rng.random() < p:
            src.append(int(rng.integers(max(0, i - window), i - 1)))
            dst.append(i)
    edges = np.stack([src, dst], 1).astype(np.int64)
    ecosts = [rng.random((counts[s], counts[d])) * 4 for s, d in edges]
    fixed = np.full(n, -1, np.int64)
    for i in rng.choice(n, max(1, n // 100), replace=False):
        fixed[i] = rng.integers(counts[i])
    return nodes, edges, ecosts, fixed


# ---------------------------------------------------------------------------
# dynamic programming: exact
# ---------------------------------------------------------------------------
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 12), density=st.floats(0.0, 3.0),
       p_inf=st.sampled_from([0.0, 0.1]))
def test_dp_equals_brute_force(seed, n, density, p_inf):
    rng = np.random.default_rng(seed)
    g = _random_problem(rng, n, int(density * n) + 1, p_inf=p_inf)
    choice = dynamic_programming(*g)
    fixed = g[3]
    assert (choice[fixed >= 0] == fixed[fixed >= 0]).all()
    assert total_cost(choice, *g[:3]) == _brute_force(*g)


@pytest.mark.parametrize("seed", range(20))
def test_dp_equals_brute_force_cycles_and_parallel_edges(seed):
    """A ring, its chords (every node of degree >= 3: the exact core) and every edge
    doubled in both directions."""
    rng = np.random.default_rng(seed)
    n = 10
    counts = rng.integers(2, 4, n)
    ring = [(i, (i + 1) % n) for i in range(n)] + [(i, (i + n // 2) % n) for i in range(n // 2)]
    edges = np.array(ring + [(d, s) for s, d in ring], dtype=np.int64)
    nodes = [rng.integers(0, 10, c).astype(float) for c in counts]
    ecosts = [rng.integers(0, 20, (counts[s], counts[d])).astype(float) for s, d in edges]
    fixed = np.full(n, -1, np.int64)
    fixed[seed % n] = 0
    g = (nodes, edges, ecosts, fixed)
    choice = dynamic_programming(*g)
    assert choice[seed % n] == 0
    assert total_cost(choice, *g[:3]) == _brute_force(*g)


@pytest.mark.parametrize("seed", range(10))
def test_dp_float_costs_no_worse_than_any_assignment(seed):
    rng = np.random.default_rng(seed)
    g = _random_problem(rng, 9, 20, integer=False)
    best = total_cost(dynamic_programming(*g), *g[:3])
    domains = [range(len(c)) if f < 0 else [f] for c, f in zip(g[0], g[3])]
    costs = [total_cost(np.array(ch), *g[:3]) for ch in itertools.product(*domains)]
    assert best == min(costs)


def test_dp_hand_worked_chain():
    # a - b - c, two candidates each: the greedy start (a=0, cheaper alone) is wrong
    nodes = [np.array([0.0, 1.0]), np.array([0.0, 0.0]), np.array([0.0, 0.0])]
    edges = np.array([[0, 1], [1, 2]])
    ecosts = [np.array([[0.0, 5.0], [5.0, 0.0]]), np.array([[9.0, 9.0], [0.0, 9.0]])]
    fixed = np.array([-1, -1, -1])
    assert dynamic_programming(nodes, edges, ecosts, fixed).tolist() == [1, 1, 0]
    assert total_cost(np.array([1, 1, 0]), nodes, edges, ecosts) == 1.0


def test_dp_empty_single_and_fixed_only():
    empty = dynamic_programming([], np.zeros((0, 2), np.int64), [], np.zeros(0, np.int64))
    assert empty.shape == (0,)
    one = dynamic_programming([np.array([3.0, 1.0, 2.0])], np.zeros((0, 2)), [], [-1])
    assert one.tolist() == [1]
    fixed = dynamic_programming([np.array([1.0, 0.0]), np.array([0.0, 1.0])], [[0, 1]],
                                [np.array([[0.0, 1.0], [1.0, 0.0]])], [0, 1])
    assert fixed.tolist() == [0, 1]


def test_dp_large_core_raises_naming_it():
    """A complete graph of 8 ops with 16 candidates has no degree-2 node: exact
    elimination needs a 16**8 table."""
    rng = np.random.default_rng(0)
    n = 8
    edges = np.array([(i, j) for i in range(n) for j in range(i + 1, n)], dtype=np.int64)
    nodes = [rng.random(16) for _ in range(n)]
    ecosts = [rng.random((16, 16)) for _ in edges]
    with pytest.raises(SearchError, match=r"dynamic_programming: the graph does not reduce "
                                          r"to a core small enough to solve exactly: with 8 "
                                          r"ops left.*7 neighbours\) needs a table of "
                                          r"4294967296 entries, more than max_table=4194304; "
                                          r"use search_mode='recursive_programming'"):
        dynamic_programming(nodes, edges, ecosts, np.full(n, -1))
    with pytest.raises(SearchError, match=r"more than max_table=10"):
        dynamic_programming(nodes[:3], edges[:1], ecosts[:1], np.full(3, -1), max_table=10)


def test_dp_solves_a_1k_network_graph_exactly_beating_the_heuristics():
    g = _local_graph(1000, 0)
    best = search(*g, search_mode="dynamic_programming").cost
    assert best <= search(*g, search_mode="recursive_programming").cost
    assert best <= search(*g, search_mode="sharding_propagation").cost


# ---------------------------------------------------------------------------
# recursive programming: kernel == reference; cost near the optimum
# ---------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), density=st.floats(0.0, 3.0),
       rounds=st.sampled_from([0, 1, 8]))
def test_rp_kernel_matches_reference(seed, n, density, rounds):
    rng = np.random.default_rng(seed)
    g = _random_problem(rng, n, int(density * n) + 1, cmax=5, integer=bool(seed % 2),
                        p_inf=0.05 if seed % 3 == 0 else 0.0)
    got = recursive_programming(*g, rounds=rounds)
    ref = recursive_programming(*g, impl="python", rounds=rounds)
    assert got.tolist() == ref.tolist()
    fixed = g[3]
    assert (got[fixed >= 0] == fixed[fixed >= 0]).all()


@pytest.mark.parametrize("seed", range(10))
def test_rp_refinement_never_costs_more(seed):
    g = _random_problem(np.random.default_rng(seed), 30, 60, cmax=6)
    costs = [total_cost(recursive_programming(*g, rounds=r), *g[:3]) for r in (0, 1, 2, 8)]
    assert costs == sorted(costs, reverse=True)
    assert costs[-1] >= total_cost(dynamic_programming(*g), *g[:3])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rp_within_10_percent_of_dp_on_network_graphs(seed):
    g = _local_graph(1000, seed)
    dp = search(*g, search_mode="dynamic_programming").cost
    rp = search(*g, search_mode="recursive_programming").cost
    assert dp <= rp <= 1.1 * dp


# ---------------------------------------------------------------------------
# dispatch and errors
# ---------------------------------------------------------------------------
def test_search_dispatch_reads_the_context():
    g = _local_graph(60, 3)
    for mode in MODES:
        dm.set_auto_parallel_context(search_mode=mode)
        res = search(*g)
        assert isinstance(res, SearchResult) and res.search_mode == mode
        assert res.cost == total_cost(res.choice, *g[:3])
    dm.set_auto_parallel_context(search_mode="dynamic_programming")
    assert search(*g, search_mode="sharding_propagation").choice.tolist() == \
        propagate(*g).tolist()
    assert search(*g).choice.tolist() == dynamic_programming(*g).tolist()
    assert search(*g, search_mode="recursive_programming", impl="python").choice.tolist() \
        == recursive_programming(*g).tolist()


@pytest.mark.parametrize("call, match", [
    (lambda g: search(*g, search_mode="greedy"),
     r"search: search_mode='greedy' is not valid; expected one of \['sharding_propagation', "
     r"'dynamic_programming', 'recursive_programming'\]"),
    (lambda g: search(*g, impl="c"), r"search: impl='c' is not valid"),
    (lambda g: recursive_programming(*g, rounds=-1),
     r"recursive_programming: rounds=-1 is not valid; expected an int >= 0"),
    (lambda g: recursive_programming(*g, impl="numba"), r"impl='numba' is not valid"),
    (lambda g: dynamic_programming(*g, max_table=0),
     r"dynamic_programming: max_table=0 is not valid"),
    (lambda g: dynamic_programming(g[0], [[0, 9]], g[2][:1], g[3]),
     r"dynamic_programming: edges\[0\]=\(0, 9\) names a node out of range"),
    (lambda g: search(g[0], g[1], g[2], g[3][:2], search_mode="recursive_programming"),
     r"recursive_programming: fixed has shape \(2,\); expected \(5,\)"),
])
def test_search_bad_input(call, match):
    g = _local_graph(5, 0)
    with pytest.raises(SearchError, match=match):
        call(g)
    assert issubclass(SearchError, ValueError)


# ---------------------------------------------------------------------------
# end to end: each search mode compiles a network that equals the single-device run
# ---------------------------------------------------------------------------
class _Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(16, 32)
        self.fc2 = nn.Dense(32, 32)
        self.fc3 = nn.Dense(32, 4)
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.fc3(self.relu(self.fc2(self.relu(self.fc1(x)))))


def _setup(devices):
    set_devices(devices if devices > 1 else None, "auto_parallel", gradients_mean=True)


def _run(devices, parallel_mode=None, search_mode=None, steps=3):
    _setup(devices)
    if search_mode is not None:
        dm.set_auto_parallel_context(search_mode=search_mode)
    dm.set_seed(5)
    net = _Net()
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    loss_fn = nn.MSELoss()
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)

    def train_step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    step = AutoParallel(train_step, parallel_mode=parallel_mode) \
        if parallel_mode is not None else train_step
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        x = Tensor(rng.standard_normal((32, 16)).astype(np.float32))
        y = Tensor(rng.standard_normal((32, 4)).astype(np.float32))
        losses.append(float(step(x, y).asnumpy()))
    return losses, [p.asnumpy() for p in net.trainable_params()], step


@pytest.mark.parametrize("mode", MODES)
def test_autoparallel_each_search_mode_equals_single_device(mode):
    ref_losses, ref_w, _ = _run(1)
    # the context says otherwise: AutoParallel's parallel_mode names the search
    other = "dynamic_programming" if mode != "dynamic_programming" else "sharding_propagation"
    losses, w, step = _run(8, parallel_mode=mode, search_mode=other)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(w, ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    table = step.strategies()
    assert isinstance(table, PlanTable) and table.search_mode == mode
    assert table.plan_cost is not None and table.plan_cost >= 0
    assert table.total_cost == sum(v["cost"] for v in table.values())
    assert context.get_auto_parallel_context("search_mode") == other
    forward = [k for k, v in table.items() if not v["backward"]]
    assert forward and all(table[k]["strategy"] is not None for k in forward)


@pytest.mark.parametrize("mode", MODES)
def test_context_search_mode_graph_mode_equals_single_device(mode):
    _setup(1)
    dm.set_seed(3)
    ref_net = _Net()
    x = Tensor(np.random.default_rng(2).standard_normal((32, 16)).astype(np.float32))
    ref = ref_net(x).asnumpy()
    _setup(8)
    dm.set_auto_parallel_context(search_mode=mode)
    dm.set_context(mode=dm.GRAPH_MODE)
    dm.set_seed(3)
    net = _Net()
    np.testing.assert_allclose(net(x).asnumpy(), ref, rtol=1e-5, atol=1e-6)
    table = net.__dict__["_graph_fn"].strategies()
    assert table.search_mode == mode and table.plan_cost is not None


def test_dp_plan_is_never_costlier_than_the_heuristics_end_to_end():
    costs = {}
    for mode in MODES:
        _, _, step = _run(8, parallel_mode=mode, steps=1)
        costs[mode] = step.strategies().plan_cost
    assert costs["dynamic_programming"] <= costs["sharding_propagation"]
    assert costs["dynamic_programming"] <= costs["recursive_programming"]
    assert costs["recursive_programming"] <= 1.1 * costs["dynamic_programming"]


def _chain_problem(devices, n_ops=12):
    """The problem compile.py builds for a chain of MatMuls (batch 64, hidden 128)."""
    seen = []
    real = graph_compile.search

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    class Chain(nn.Cell):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(0)
            self.ws = [Parameter(Tensor(rng.standard_normal((128, 128)).astype(np.float32)
                                        * 0.05), name=f"w{i}") for i in range(n_ops)]
            for i, w in enumerate(self.ws):
                setattr(self, f"w{i}", w)
            self.mms = [ops.MatMul() for _ in range(n_ops)]

        def construct(self, x):
            for mm, w in zip(self.mms, self.ws):
                x = mm(x, w)
            return x

    _setup(1)
    x = Tensor(np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32))
    net = Chain()
    ref = net(x).asnumpy()
    _setup(devices)
    graph_compile.search = spy
    try:
        got = AutoParallel(net, parallel_mode="sharding_propagation")(x).asnumpy()
    finally:
        graph_compile.search = real
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    return seen[0]


@pytest.mark.parametrize("devices", [8, 16])
def test_rp_within_10_percent_of_dp_on_compiled_matmul_chains(devices):
    g = _chain_problem(devices)
    dp = search(*g, search_mode="dynamic_programming").cost
    rp = search(*g, search_mode="recursive_programming").cost
    assert dp <= rp <= 1.1 * dp
    assert dp <= search(*g, search_mode="sharding_propagation").cost


def test_semi_auto_table_has_no_plan_cost():
    _, _, step = _run(8, parallel_mode="semi_auto", steps=1)
    table = step.strategies()
    assert table.plan_cost is None and table.search_mode is None
    assert table.total_cost == sum(v["cost"] for v in table.values())


@pytest.mark.parametrize("mode", MODES)
def test_fully_use_devices_filters_candidates_for_every_mode(mode, monkeypatch):
    """Every search chooses among the candidates compile.py hands it; with
    fully_use_devices those are fewer, and each chosen one uses all 8 devices (or is the
    replicated fallback of an op with no such candidate)."""
    seen = []
    real = graph_compile.search

    def spy(*args, **kwargs):
        res = real(*args, **kwargs)
        seen.append((args, res))
        return res

    monkeypatch.setattr(graph_compile, "search", spy)
    offered = {}
    for fully in (False, True):
        seen.clear()
        context.set_algo_parameters(fully_use_devices=fully)
        _, _, step = _run(8, parallel_mode=mode, steps=1)
        (nodes, _, _, fixed), res = seen[0][0][:4], seen[0][1]
        assert res.search_mode == mode
        offered[fully] = sum(len(c) for c, f in zip(nodes, fixed) if f < 0)
        used = []
        for node in step.compiled.graph.nodes:
            if node.chosen is None:
                continue
            lays = [lay for lay in node.in_layouts if lay is not None]
            axes = {a for lay in lays for a in lay.split_axes}
            used.append(int(np.prod([lays[0].device_matrix[a] for a in axes])))
        assert used
        if fully:
            assert set(used) <= {1, 8}
    assert offered[True] < offered[False]


def test_changing_search_mode_recompiles_with_the_new_search():
    _setup(8)
    w = Parameter(Tensor(np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)),
                  name="w")
    mm, relu = ops.MatMul(), ops.ReLU()
    fn = ops.shard(lambda x: relu(mm(x, w)), in_strategy=((8, 1),))
    x = Tensor(np.random.default_rng(1).standard_normal((32, 16)).astype(np.float32))
    ref = np.maximum(x.asnumpy() @ w.asnumpy(), 0)
    seen = []
    for mode in MODES + MODES[:1]:
        dm.set_auto_parallel_context(search_mode=mode)
        before = compile_count()
        np.testing.assert_allclose(fn(x).asnumpy(), ref, rtol=1e-5, atol=1e-6)
        seen.append((fn.strategies().search_mode, compile_count() - before))
    assert seen == [(m, 1) for m in MODES] + [(MODES[0], 0)]     # the first plan is cached
