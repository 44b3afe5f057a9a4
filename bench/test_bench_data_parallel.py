"""Data-parallel train step of the 3-layer MLP on 8 simulated devices against the
numpy single-device step (hand-written forward/backward/SGD), with the single-device
dualmode step of the same program beside them (what the data-parallel machinery costs).

Target (issue 17): <= 1.1x at both sizes (JAX jit on 8 simulated CPU devices: 1.40x at
B=2048 H=2048). Each dualmode row's rounds alternate with numpy steps (the ``paired``
fixture), so both see the machine at the same speed. A gradient is computed once over every device's rows and kept as equal
shares of its total, not even written (a deferred stack), so its AllReduce reads the
total without a pass.
"""
import pytest

from dualmode import Tensor

from test_bench_mlp import NumpyMLP, _data, _dualmode_step, step_matches_numpy

SIZES = [(256, 512), (2048, 2048)]
CASES = [(b, h, impl) for b, h in SIZES
         for impl in ("numpy", "dualmode-1dev", "dualmode-8dev")]


@pytest.mark.parametrize("batch,hidden,impl", CASES,
                         ids=[f"B{b}-H{h}-{impl}" for b, h, impl in CASES])
def test_dp_step(benchmark, record, paired, parallel_context, batch, hidden, impl):
    """The numpy row times numpy alone; the dualmode rows alternate their rounds with
    numpy steps (``paired``) and their ratios are to those."""
    if impl == "dualmode-8dev":
        parallel_context("data_parallel", 8)
    benchmark.group = f"data-parallel step, 8 devices, B={batch} H={hidden}"
    x, y, params = _data(batch, hidden)
    rounds = dict(rounds=20, warmup_rounds=2) if batch <= 256 else dict(rounds=5,
                                                                        warmup_rounds=1)
    if impl == "numpy":
        model = NumpyMLP(params)
        benchmark.pedantic(model.step, args=(x, y), iterations=1, **rounds)
        record(benchmark, f"numpy step B{batch} H{hidden} (dp)")
        return
    net, step = _dualmode_step(params)
    xt, yt = Tensor(x), Tensor(y)
    benchmark.extra_info["correct"] = step_matches_numpy(params, x, y)
    key = f"dualmode {'1-device' if impl == 'dualmode-1dev' else 'dp'} step B{batch} H{hidden}"
    base = f"numpy step B{batch} H{hidden}, paired with {impl}"
    target = None if impl == "dualmode-1dev" else 1.1
    ratio = paired(benchmark, step, (xt, yt), NumpyMLP(params).step, (x, y), key, base,
                   target=target, **rounds)
    if impl == "dualmode-8dev" and ratio is not None:
        record(benchmark, f"dualmode dp step B{batch} H{hidden} (vs 1 device)",
               f"dualmode 1-device step B{batch} H{hidden}")
        # extra_info keeps the ratio to numpy (the table has both)
        benchmark.extra_info.update(ratio=ratio, baseline=base, target=target)
