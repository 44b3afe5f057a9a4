"""Data-parallel MLP step on 8 simulated devices with a batch one row short of dividing
(2,047 and 255: pieces of unequal size, the short ones padded) against the same step at
the dividing batch (2,048 and 256), each round of one alternating with a round of the
other (the ``paired`` fixture). Target: at most 1.1x at B=2,047 (a step one row off
dividing costs about what the dividing step costs). The uneven step runs each op's
sharding rule on the padded stacks (the dividing one takes the data-parallel shortcut:
the op's kernel once over the global rows). Measured on this shared 2-core VM: wall
time 1.03-1.06x in quiet runs, 1.15-1.17x under a load of ~4.7; process CPU time of the
two steps alternated by hand 0.89x (the GEMMs are the same sizes: a replicated weight's
per-device products are one GEMM over every device's rows).
"""
import pytest

from dualmode import Tensor

from test_bench_mlp import _data, _dualmode_step, step_matches_numpy

CASES = [(2047, 512), (255, 512)]


@pytest.mark.parametrize("batch,hidden", CASES, ids=[f"B{b}-H{h}" for b, h in CASES])
def test_uneven_dp_step(benchmark, paired, parallel_context, batch, hidden):
    parallel_context("data_parallel", 8)
    benchmark.group = f"data-parallel step, 8 devices, B={batch} vs {batch + 1}, H={hidden}"
    x, y, params = _data(batch, hidden)
    x2, y2, _ = _data(batch + 1, hidden)
    _, step = _dualmode_step(params)
    _, even = _dualmode_step(params)
    benchmark.extra_info["correct"] = step_matches_numpy(params, x, y)
    rounds = dict(rounds=5, warmup_rounds=1) if batch > 256 else dict(rounds=20,
                                                                      warmup_rounds=2)
    ratio = paired(benchmark, step, (Tensor(x), Tensor(y)), even, (Tensor(x2), Tensor(y2)),
                   f"dualmode dp step B{batch} H{hidden} (uneven)",
                   f"dualmode dp step B{batch + 1} H{hidden}, paired with B{batch}",
                   target=1.1 if batch > 256 else None, **rounds)
    if ratio is not None:
        benchmark.extra_info.update(ratio=ratio)
