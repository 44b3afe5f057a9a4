"""Sharding propagation on synthetic graphs: ladders of MatMul-like ops.

Each graph has ``n`` ops with 8-16 candidates each (random own costs), a chain of edges
``i -> i+1`` plus a rung ``i -> i+2`` every other op (a residual-style ladder), random
redistribution matrices on every edge, and one fixed op per 500 (at least one). Every
benchmark times :func:`propagate` end to end (validation, flattening, the kernel).

* scaling: 1k, 10k and 20k ops with the Cython kernel. Targets: 10k <= 0.2 s; the
  20k / 10k ratio <= 2.3 (linear).
* Cython vs its pure-Python reference on the 1k graph: target >= 20x faster (the
  reference is the baseline, measured first; both must give the same choices).
"""
import numpy as np
import pytest

from dualmode.parallel.graph.propagate import propagate

pytestmark = pytest.mark.benchmark(group="sharding propagation")


def _ladder(n, seed=0):
    rng = np.random.default_rng(seed)
    counts = rng.integers(8, 17, n)
    nodes = [rng.random(c) for c in counts]
    src = np.concatenate([np.arange(n - 1), np.arange(0, n - 2, 2)])
    dst = np.concatenate([np.arange(1, n), np.arange(2, n, 2)])
    edges = np.stack([src, dst], axis=1).astype(np.int64)
    ecosts = [rng.random((counts[s], counts[d])) * 4 for s, d in edges]
    fixed = np.full(n, -1, np.int64)
    for i in rng.choice(n, max(1, n // 500), replace=False):
        fixed[i] = rng.integers(counts[i])
    return nodes, edges, ecosts, fixed


GRAPHS = {n: _ladder(n) for n in (1000, 10000, 20000)}


def _check(benchmark, out, g):
    fixed = g[3]
    benchmark.extra_info["correct"] = bool(
        out.shape == fixed.shape and (out[fixed >= 0] == fixed[fixed >= 0]).all())


def test_propagate_1k_python_reference(benchmark, record):
    g = GRAPHS[1000]
    out = benchmark.pedantic(propagate, args=g, kwargs={"impl": "python"}, rounds=5,
                             iterations=1, warmup_rounds=1)
    _check(benchmark, out, g)
    record(benchmark, "propagate 1k (Python reference)")


def test_propagate_1k_cython(benchmark, record):
    g = GRAPHS[1000]
    out = benchmark(propagate, *g)
    _check(benchmark, out, g)
    benchmark.extra_info["correct"] &= bool((out == propagate(*g, impl="python")).all())
    record(benchmark, "propagate 1k (Cython)", "propagate 1k (Python reference)",
           target=1 / 20)


def test_propagate_10k_cython(benchmark, record):
    g = GRAPHS[10000]
    out = benchmark(propagate, *g)
    _check(benchmark, out, g)
    if getattr(benchmark, "stats", None) is not None:
        benchmark.extra_info["target_s"] = 0.2
        benchmark.extra_info["meets_target"] = benchmark.stats.stats.median <= 0.2
    record(benchmark, "propagate 10k (Cython)")


def test_propagate_20k_cython(benchmark, record):
    g = GRAPHS[20000]
    out = benchmark(propagate, *g)
    _check(benchmark, out, g)
    record(benchmark, "propagate 20k (Cython)", "propagate 10k (Cython)", target=2.3)
