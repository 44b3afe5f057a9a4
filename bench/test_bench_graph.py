"""Graph mode: compile time, cached-call overhead, and the graph-mode sharded train
step of the seed network next to the eager sharded step and the numpy step.

Targets (issue 5): first-call compile of the seed MLP train step <= 50 ms (JAX:
0.2-0.35 s); a cached call <= 100 us above the execution (the eager step of the same
program is the execution baseline).

Buffers (issue 17): the compiled seed step drops each value after its last reader, so
the allocator hands its memory to the next values of the step, vs keeping every value
to the end of the step (the executor before): peak traced memory and time, paired.

Fusion (issue 17): a train step whose weights are stored sharded and gathered whole
(parameter AllGathers, gradient ReduceScatters), fused by ``comm_fusion`` vs unfused on
8 simulated devices: never slower (<= 1.0x).
"""
import functools
import time
import tracemalloc

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel.auto_parallel import AutoParallel
from dualmode.parallel.graph.executor import Program

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
def test_graph_step(benchmark, record, paired, parallel_context, batch, hidden, impl):
    """The numpy row times numpy alone. The eager row alternates its rounds with numpy
    steps, the graph row with eager steps of the same program (``paired``): graph/eager
    is measured over the same seconds."""
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
    if impl == "eager-8dev":
        paired(benchmark, step, (xt, yt), NumpySeed(ws).step, (x, y),
               f"eager-8dev seed step B{batch} H{hidden}",
               f"numpy seed step B{batch} H{hidden}, paired with eager-8dev", **rounds)
        return
    _, eager = _step_fn(ws)
    eager(xt, yt)
    paired(benchmark, step, (xt, yt), eager, (xt, yt),
           f"graph/eager seed step B{batch} H{hidden}",
           f"eager-8dev seed step B{batch} H{hidden}, paired with graph-8dev", **rounds)
    record(benchmark, f"graph-8dev seed step B{batch} H{hidden} (numpy alone)",
           f"numpy seed step B{batch} H{hidden}")


class _ShardedWeights(nn.Cell):
    """`k` data-parallel MatMuls whose (h, h) weights live split on dim 0."""

    def __init__(self, k, h, n):
        super().__init__()
        rng = np.random.default_rng(3)
        self.names = [f"w{i}" for i in range(k)]
        for name in self.names:
            w = (rng.standard_normal((h, h)) / np.sqrt(h)).astype(np.float32)
            setattr(self, name, Parameter(Tensor(w), name=name))
        self.mm = ops.MatMul().shard(((n, 1), (1, 1)))

    def construct(self, x):
        for name in self.names:
            x = ops.tanh(self.mm(x, getattr(self, name)))
        return x


def _sharded_weights_step(fusion, k, h, n, x):
    """The compiled step (its CompiledGraph, called directly) and its first loss."""
    dm.reset_auto_parallel_context()
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n,
                                 gradients_mean=True)
    if fusion is not None:
        dm.set_auto_parallel_context(comm_fusion=fusion)
    communication.init()
    net = _ShardedWeights(k, h, n)
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
    grad_fn = dm.value_and_grad(lambda x: ops.reduce_mean(ops.square(net(x))), None,
                                opt.parameters)

    def step(x):
        loss, grads = grad_fn(x)
        opt(grads)
        return loss
    run = ops.shard(step, in_strategy=((n, 1),),
                    parameter_plan={name: (n, 1) for name in net.names})
    loss = float(run(x).asnumpy())
    return run.compiled, loss


@pytest.mark.parametrize("k,h", [(16, 128), (8, 512)], ids=["16x64KiB", "8x1MiB"])
def test_fused_gather_scatter_step(benchmark, record_value, k, h):
    """Fused (one AllGather and one ReduceScatter a step) and unfused (k of each)
    compiled steps alternate call by call, so both see the same machine; the ratio is
    of the medians."""
    benchmark.group = f"sharded-weights train step, {k} weights ({h}x{h}), 8 devices"
    n = 8
    x = Tensor(np.random.default_rng(4).standard_normal((64, h)).astype(np.float32))
    fusion = {"allgather": {"mode": "auto"}, "reducescatter": {"mode": "auto"}}
    try:
        steps, first = {}, {}
        for name, setting in (("unfused", None), ("fused", fusion)):
            steps[name], first[name] = _sharded_weights_step(setting, k, h, n, x)
        benchmark.extra_info["correct"] = bool(np.isclose(first["fused"], first["unfused"],
                                                          rtol=1e-6))
        times = {name: [] for name in steps}
        for _ in range(20):
            for name, compiled in steps.items():
                t = time.perf_counter()
                compiled([x])
                times[name].append(time.perf_counter() - t)
        benchmark.pedantic(steps["fused"], args=([x],), rounds=3, warmup_rounds=0)
    finally:
        dm.reset_auto_parallel_context()
        communication.init()
    unfused, fused = (float(np.median(times[name])) for name in ("unfused", "fused"))
    benchmark.extra_info["median_unfused_s"] = unfused
    benchmark.extra_info["median_fused_s"] = fused
    record_value(f"unfused gather/scatter step {k}x{h}", unfused)
    record_value(f"fused gather/scatter step {k}x{h}", fused,
                 f"unfused gather/scatter step {k}x{h}", target=1.0)


@pytest.mark.parametrize("batch,hidden", [(256, 512), (2048, 2048)],
                         ids=["B256-H512", "B2048-H2048"])
def test_graph_step_value_release(benchmark, record_value, parallel_context, batch, hidden):
    """The same compiled program run releasing values after their last reader (the
    default) and keeping every value (``keep=True``), call by call alternating; plus the
    peak memory traced by tracemalloc for one step of each."""
    parallel_context("semi_auto_parallel", 8)
    benchmark.group = f"graph seed step: values released vs kept, B={batch} H={hidden}"
    x, y, ws = _data(batch, hidden)
    _, step = _step_fn(ws)
    step = AutoParallel(step, parallel_mode="semi_auto")
    xt, yt = Tensor(x), Tensor(y)
    step(xt, yt)
    prog = step.compiled.program
    modes = {"kept": functools.partial(Program.run, prog, keep=True),
             "released": functools.partial(Program.run, prog, keep=False)}
    times, peaks = {m: [] for m in modes}, {}
    try:
        for mode, run in modes.items():
            prog.run = run                   # this program only: the executor's two ways
            tracemalloc.start()
            step(xt, yt)
            peaks[mode] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        for _ in range(12 if batch > 1000 else 30):
            for mode, run in modes.items():
                prog.run = run
                t = time.perf_counter()
                step(xt, yt)
                times[mode].append(time.perf_counter() - t)
        prog.run = modes["released"]
        benchmark.pedantic(step, args=(xt, yt), rounds=3, warmup_rounds=0)
    finally:
        del prog.run
    kept, released = (float(np.median(times[m])) for m in ("kept", "released"))
    benchmark.extra_info.update(median_kept_s=kept, median_released_s=released,
                                peak_kept_bytes=peaks["kept"],
                                peak_released_bytes=peaks["released"])
    record_value(f"graph step keep values B{batch} H{hidden}", kept)
    record_value(f"graph step release values B{batch} H{hidden}", released,
                 f"graph step keep values B{batch} H{hidden}", target=1.0)
    record_value(f"graph step kept peak B{batch} H{hidden}", float(peaks["kept"]))
    record_value(f"graph step released peak B{batch} H{hidden}", float(peaks["released"]),
                 f"graph step kept peak B{batch} H{hidden}", target=1.0)
