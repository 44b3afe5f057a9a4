"""Graph mode: compile time, cached-call overhead, and the graph-mode sharded train
step of the seed network next to the eager sharded step and the numpy step.

Targets (issue 5): first-call compile of the seed MLP train step <= 50 ms (JAX:
0.2-0.35 s); a cached call <= 100 us above the execution (the eager step of the same
program is the execution baseline).
"""
import numpy as np
import pytest

from dualmode import Tensor
from dualmode.parallel.auto_parallel import AutoParallel

from test_bench_operator_parallel import NumpySeed, _data
from test_bench_operator_parallel import _dualmode_step as _step_fn


def test_compile_seed_train_step(benchmark, record, parallel_context):
    """Trace + compile (every pass) of the whole seed train step, no execution."""
    parallel_context("semi_auto_parallel", 8)
    benchmark.group = "graph mode: compile the seed train step (8 devices)"
    x, y, ws = _data(256, 512)
    _, train_step = _step_fn(ws)
    xt, yt = Tensor(x), Tensor(y)

    def compile_once():
        return AutoParallel(train_step, parallel_mode="semi_auto")._compile((xt, yt), {}, True)

    compiled = compile_once()
    assert len(compiled.graph.nodes) > 10
    benchmark.pedantic(compile_once, iterations=1, rounds=10, warmup_rounds=1)
    record(benchmark, "compile seed train step")
    benchmark.extra_info["target_s"] = 0.05


SIZES = [(32, 64), (256, 512)]
IMPLS = ("numpy", "eager-8dev", "graph-8dev")
CASES = [(b, h, i) for b, h in SIZES for i in IMPLS]


@pytest.mark.parametrize("batch,hidden,impl", CASES,
                         ids=[f"B{b}-H{h}-{i}" for b, h, i in CASES])
def test_graph_step(benchmark, record, parallel_context, batch, hidden, impl):
    parallel_context("semi_auto_parallel", 8)
    benchmark.group = f"seed train step, graph vs eager vs numpy, B={batch} H={hidden}"
    x, y, ws = _data(batch, hidden)
    rounds = dict(rounds=30, warmup_rounds=3)
    if impl == "numpy":
        benchmark.pedantic(NumpySeed(ws).step, args=(x, y), iterations=1, **rounds)
        record(benchmark, f"numpy seed step B{batch} H{hidden}")
        return
    net, step = _step_fn(ws)
    if impl == "graph-8dev":
        step = AutoParallel(step, parallel_mode="semi_auto")
    ref = NumpySeed(ws)
    ref_loss = ref.step(x, y)
    xt, yt = Tensor(x), Tensor(y)
    loss = float(step(xt, yt).asnumpy())
    benchmark.extra_info["correct"] = bool(np.isclose(loss, ref_loss, rtol=1e-4))
    benchmark.pedantic(step, args=(xt, yt), iterations=1, **rounds)
    record(benchmark, f"{impl} seed step B{batch} H{hidden}",
           f"numpy seed step B{batch} H{hidden}")
    if impl == "graph-8dev":
        record(benchmark, f"graph/eager seed step B{batch} H{hidden}",
               f"eager-8dev seed step B{batch} H{hidden}")
