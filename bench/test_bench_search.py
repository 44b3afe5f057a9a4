"""The three search modes: plan cost and plan time on the bench graphs, and the plan of a
realistic graph on 4,096 simulated devices.

Bench graphs (each a search problem as compile.py builds it, or network-like synthetic):

* ``seed-mlp-8``: the seed MLP train step (784 -> 512 -> 512 -> 10, batch 256, no
  configured strategies) on 8 devices, its problem captured from compile.py;
* ``matmul-chain-100``: a chain of 100 MatMuls (batch 256, hidden 512) on 64 devices,
  captured the same way;
* ``random-1k``: a random network-like graph of 1,000 ops (4-12 candidates, a chain
  with skip edges back at most 4 ops, random costs, 1% fixed);
* ``random-10k``: the same with 10,000 ops (recursive programming's target: <= 1 s).

Each benchmark times :func:`~dualmode.parallel.graph.search.search` end to end
(validation, flattening, the search) and records in ``extra_info`` the plan's cost and
its ratio to the exact optimum (dynamic programming's cost, computed once beside the
timing): targets are ratio == 1 for dynamic programming and <= 1.1 for recursive
programming. Time ratios are read against sharding propagation on the same graph.

``test_plan_4096_devices`` times the whole planning pass of compile.py
(``propagate_strategies``: candidates, cost matrices, the search) for the seed MLP
train step with batch 8192 and hidden 1024 on 4,096 devices, cold (candidate and cost
caches cleared before every round) and warm.
"""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel.graph import compile as graph_compile
from dualmode.parallel.graph.candidates import clear_candidate_cache
from dualmode.parallel.graph.cost import clear_cost_cache
from dualmode.parallel.graph.search import SEARCH_MODES, search
from dualmode.parallel.graph.trace import find_parameters, trace
from dualmode.parallel.inputs import distribute_inputs

MODES = list(SEARCH_MODES)


# ---------------------------------------------------------------------------
# bench graphs
# ---------------------------------------------------------------------------
class _MLP(nn.Cell):
    """The seed MLP without configured strategies (every op is searched)."""

    def __init__(self, sizes):
        super().__init__()
        rng = np.random.default_rng(0)
        self.ws = [Parameter(Tensor((rng.standard_normal(s) * 0.02).astype(np.float32)),
                             name=f"w{i}") for i, s in enumerate(sizes)]
        for i, w in enumerate(self.ws):
            setattr(self, f"w{i}", w)
        self.mms = [ops.MatMul() for _ in sizes]
        self.relu = ops.ReLU()

    def construct(self, x):
        for k, (mm, w) in enumerate(zip(self.mms, self.ws)):
            x = mm(x, w)
            if k < len(self.ws) - 1:
                x = self.relu(x)
        return x


def _train_step(net):
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)

    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    return step


def _planning_input(devices, sizes, batch):
    """(traced graph with strategies applied, argument layouts) of the MLP train step,
    its inputs split as batch data under ``auto_parallel`` on `devices`."""
    dm.reset_auto_parallel_context()
    dm.set_auto_parallel_context(parallel_mode="auto_parallel", device_num=devices,
                                 gradients_mean=True)
    communication.init()
    rng = np.random.default_rng(1)
    x = Tensor(rng.standard_normal((batch, sizes[0][0])).astype(np.float32))
    y = Tensor(rng.integers(0, sizes[-1][1], batch).astype(np.int32))
    net = _MLP(sizes)
    step = _train_step(net)
    args = distribute_inputs((x, y))
    graph = trace(step, args, {}, name="train_step", params=find_parameters(net))
    sources = {v.id: a._layout for v, a in zip(graph.args, args)}
    graph = graph_compile.apply_strategies(graph, devices, name="bench")
    return graph, sources


def _captured_problem(devices, sizes, batch):
    """The search problem compile.py builds for the MLP train step."""
    graph, sources = _planning_input(devices, sizes, batch)
    seen = []
    real = graph_compile.search

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    graph_compile.search = spy
    try:
        graph_compile.propagate_strategies(graph, devices, arg_sources=sources)
    finally:
        graph_compile.search = real
        dm.reset_auto_parallel_context()
        communication.init()
    return seen[0]


def _network_graph(n, seed=0, window=4, p=0.3, cmin=4, cmax=12):
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


_GRAPHS = {
    "seed-mlp-8": lambda: _captured_problem(8, [(784, 512), (512, 512), (512, 10)], 256),
    "matmul-chain-100": lambda: _captured_problem(64, [(512, 512)] * 100, 256),
    "random-1k": lambda: _network_graph(1000),
    "random-10k": lambda: _network_graph(10000),
}
_CACHE = {}


def _graph(name):
    """(problem, exact optimum) of a bench graph, built once per session."""
    if name not in _CACHE:
        problem = _GRAPHS[name]()
        _CACHE[name] = problem, search(*problem, search_mode="dynamic_programming").cost
    return _CACHE[name]


# ---------------------------------------------------------------------------
# plan cost and time per search mode
# ---------------------------------------------------------------------------
CASES = [(g, m) for g in _GRAPHS for m in MODES]


@pytest.mark.parametrize("graph,mode", CASES, ids=[f"{g}-{m}" for g, m in CASES])
def test_search_plan(benchmark, record, graph, mode):
    benchmark.group = f"search modes: plan of {graph}"
    problem, optimum = _graph(graph)
    rounds = dict(rounds=3, warmup_rounds=0) if mode == "dynamic_programming" and \
        graph == "random-10k" else dict(rounds=10, warmup_rounds=1)
    res = benchmark.pedantic(search, args=problem, kwargs={"search_mode": mode},
                             iterations=1, **rounds)
    fixed = problem[3]
    ratio = res.cost / optimum if optimum > 0 else 1.0
    benchmark.extra_info["ops"] = len(problem[0])
    benchmark.extra_info["plan_cost"] = res.cost
    benchmark.extra_info["optimum"] = optimum
    benchmark.extra_info["cost_ratio_to_dp"] = ratio
    target = {"dynamic_programming": 1.0, "recursive_programming": 1.1}.get(mode)
    if target is not None:
        benchmark.extra_info["cost_target"] = target
    benchmark.extra_info["correct"] = bool(
        (res.choice[fixed >= 0] == fixed[fixed >= 0]).all() and ratio >= 1.0 - 1e-12
        and (target is None or ratio <= target + 1e-12))
    record(benchmark, f"{mode} plan {graph}", f"sharding_propagation plan {graph}")
    if mode == "recursive_programming" and graph == "random-10k" and \
            getattr(benchmark, "stats", None) is not None:
        benchmark.extra_info["time_target_s"] = 1.0
        benchmark.extra_info["meets_time_target"] = benchmark.stats.stats.median <= 1.0


# ---------------------------------------------------------------------------
# a realistic graph on 4,096 devices: the whole planning pass
# ---------------------------------------------------------------------------
_SIZES_4096 = [(784, 1024), (1024, 1024), (1024, 10)]
CASES_4096 = [(m, c) for m in MODES for c in ("cold", "warm")]


@pytest.mark.parametrize("mode,caches", CASES_4096, ids=[f"{m}-{c}" for m, c in CASES_4096])
def test_plan_4096_devices(benchmark, record, mode, caches):
    benchmark.group = "search modes: plan the seed MLP train step on 4,096 devices"
    graph, sources = _planning_input(4096, _SIZES_4096, 8192)
    dm.set_auto_parallel_context(search_mode=mode)

    def plan():
        return graph_compile.propagate_strategies(graph, 4096, arg_sources=sources)

    def cold():
        clear_candidate_cache()
        clear_cost_cache()
        return (), {}

    try:
        dm.set_auto_parallel_context(search_mode="dynamic_programming")    # the optimum
        optimum = plan().meta["plan_cost"]
        dm.set_auto_parallel_context(search_mode=mode)
        if caches == "cold":
            out = benchmark.pedantic(plan, setup=cold, rounds=3, iterations=1)
        else:
            out = benchmark.pedantic(plan, rounds=10, iterations=1, warmup_rounds=1)
    finally:
        dm.reset_auto_parallel_context()
        communication.init()
    cost = out.meta["plan_cost"]
    benchmark.extra_info["forward_ops"] = sum(1 for n in graph.nodes if not n.backward)
    benchmark.extra_info["plan_cost"] = cost
    benchmark.extra_info["cost_ratio_to_dp"] = cost / optimum
    benchmark.extra_info["correct"] = bool(out.meta["search_mode"] == mode
                                           and cost >= optimum * (1 - 1e-12))
    record(benchmark, f"{mode} plan 4096 devices ({caches})",
           f"sharding_propagation plan 4096 devices ({caches})")
    if getattr(benchmark, "stats", None) is not None:
        benchmark.extra_info["time_target_s"] = 1.0
        benchmark.extra_info["meets_time_target"] = benchmark.stats.stats.median <= 1.0
