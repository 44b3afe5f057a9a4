"""Graph mode's buffer pool (issue 17, "graph mode reuses buffers between steps"): the
8-device seed train step compiled with AutoParallel, pool on vs off, beside the numpy
step, as ratios to numpy -- with glibc's default malloc (what users run with) and with
the steady malloc bench/conftest.py sets for every other bench (for reference).

bench/conftest.py sets the steady malloc process-wide at import, so every measurement
runs in a fresh process (bench/arena_step.py, read back as JSON). glibc's default malloc
adapts its mmap and trim thresholds to what the process freed before, so one process
runs one step beside the numpy step (as a user's process runs one kind of step), every
round both in turn; the variants' processes alternate, `REPS` of each. The ratio of a
variant is the median over its processes of (its median step / numpy's median step in
the same process); the same for the process's CPU time (user + system, steadier on a
busy machine). Besides time, minor page faults per step (getrusage ru_minflt),
and the eager sharded step with the pool on and off (its distributed ops run in the
pool, docs/architecture.md). ``extra_info`` has every process's figures and the load.

Target: with the default malloc, the compiled step with the pool is not slower than
without it (pool on / pool off <= 1.0) and page-faults nothing per step; with the
steady malloc, the pool costs nothing (about 1.0x).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = [("default", 256, 512, 30, 3), ("steady", 256, 512, 30, 3),
         ("default", 2048, 2048, 6, 2), ("steady", 2048, 2048, 6, 2)]
VARIANTS = ("graph-pool", "graph-nopool", "eager-pool", "eager-nopool", "numpy-pooled")


def _job(malloc, batch, hidden, rounds, variant):
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, os.path.join(HERE, "arena_step.py"), malloc,
                           str(batch), str(hidden), str(rounds), variant],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    out["load"] = os.getloadavg()[0]
    return out


def _jobs(malloc, batch, hidden, rounds, reps):
    return [[_job(malloc, batch, hidden, rounds, v) for v in VARIANTS] for _ in range(reps)]


def _ratios(reps, key):
    """variant -> the median over its processes of its `key` / numpy's `key`."""
    return {v: float(np.median([jobs[k][v][key] / jobs[k]["numpy"][key] for jobs in reps]))
            for k, v in enumerate(VARIANTS)}


@pytest.mark.parametrize("malloc,batch,hidden,rounds,reps", CASES,
                         ids=[f"{m}-B{b}-H{h}" for m, b, h, _, _ in CASES])
def test_graph_step_buffer_pool(benchmark, record_value, malloc, batch, hidden, rounds,
                                reps):
    benchmark.group = "seed step, buffer pool on vs off (one process per step)"
    reps = benchmark.pedantic(_jobs, args=(malloc, batch, hidden, rounds, reps), rounds=1,
                              iterations=1)
    benchmark.extra_info["jobs"] = reps
    size = f"B{batch} H{hidden} ({malloc} malloc)"
    numpy = f"numpy seed step {size}"
    ratios, cpu = _ratios(reps, "median_s"), _ratios(reps, "cpu_s")
    faults = {v: float(np.median([jobs[k][v]["minflt"] for jobs in reps]))
              for k, v in enumerate(VARIANTS)}
    faults["numpy"] = float(np.median([j["numpy"]["minflt"] for jobs in reps for j in jobs]))
    benchmark.extra_info.update(ratios=ratios, cpu_ratios=cpu, page_faults_per_step=faults)
    record_value(numpy, 1.0)                        # the ratios are to numpy already
    for v in VARIANTS:
        record_value(f"{v} seed step {size}", ratios[v], numpy)
    for kind in ("graph", "eager"):
        record_value(f"{kind}-pool / {kind}-nopool {size}", ratios[f"{kind}-pool"],
                     f"{kind}-nopool seed step {size}", target=1.0)
        record_value(f"{kind}-nopool cpu {size}", cpu[f"{kind}-nopool"])
        record_value(f"{kind}-pool / {kind}-nopool cpu time {size}", cpu[f"{kind}-pool"],
                     f"{kind}-nopool cpu {size}", target=1.0)
    for v in ("graph-pool", "graph-nopool"):
        print(f"{v} {size}: {faults[v]:.0f} page faults a step (numpy {faults['numpy']:.0f})")
    assert all(j[v]["correct"] for jobs in reps for j, v in zip(jobs, VARIANTS))
    assert faults["graph-pool"] == 0 and faults["eager-pool"] == 0
