"""Graph mode's buffer pool (issue 17, "graph mode reuses buffers between steps"): the
8-device seed train step compiled with AutoParallel, pool on vs off, beside the numpy
step, as ratios to numpy -- with glibc's default malloc (what users run with) and with
the steady malloc bench/conftest.py sets for every other bench (for reference).

bench/conftest.py sets the steady malloc process-wide at import, so every measurement
runs in a fresh process (bench/arena_step.py, read back as JSON): one for the compiled
step pool on and off, one for the eager step pool on and off, one for numpy inside the
pool, each beside the numpy step, every round each step once in turn (paired), `reps`
processes of each, alternating. A ratio is the median over the processes of (a step's
median / the other's median in the same process), in wall time and in the process's
CPU time (user + system, steadier on a busy machine). glibc's default malloc adapts its
mmap and trim thresholds to what the process freed before, so its page faults depend
on the process's history: they are reported per step (getrusage ru_minflt), beside the
guarantee the pool gives (0 a step). ``extra_info`` has every process's figures.

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
JOBS = (("graph-pool", "graph-nopool"), ("eager-pool", "eager-nopool"), ("numpy-pooled",))
VARIANTS = tuple(v for job in JOBS for v in job)


def _job(malloc, batch, hidden, rounds, steps):
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, os.path.join(HERE, "arena_step.py"), malloc,
                           str(batch), str(hidden), str(rounds), ",".join(steps)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    out["load"] = os.getloadavg()[0]
    return out


def _jobs(malloc, batch, hidden, rounds, reps):
    """Per variant, the processes that ran it."""
    runs = {v: [] for v in VARIANTS}
    for _ in range(reps):
        for steps in JOBS:
            out = _job(malloc, batch, hidden, rounds, steps)
            for v in steps:
                runs[v].append(out)
    return runs


def _ratio(runs, a, b, key):
    """The median over the processes that ran `a` of a[key] / b[key] in that process."""
    return float(np.median([out[a][key] / out[b][key] for out in runs[a]]))


@pytest.mark.parametrize("malloc,batch,hidden,rounds,reps", CASES,
                         ids=[f"{m}-B{b}-H{h}" for m, b, h, _, _ in CASES])
def test_graph_step_buffer_pool(benchmark, record_value, malloc, batch, hidden, rounds,
                                reps):
    benchmark.group = "seed step, buffer pool on vs off (fresh processes)"
    runs = benchmark.pedantic(_jobs, args=(malloc, batch, hidden, rounds, reps), rounds=1,
                              iterations=1)
    benchmark.extra_info["jobs"] = runs
    size = f"B{batch} H{hidden} ({malloc} malloc)"
    numpy = f"numpy seed step {size}"
    record_value(numpy, 1.0)                        # the ratios are to numpy already
    for v in VARIANTS:
        record_value(f"{v} seed step {size}", _ratio(runs, v, "numpy", "median_s"), numpy)
    for kind in ("graph", "eager"):
        on, off = f"{kind}-pool", f"{kind}-nopool"
        for key, what in (("median_s", ""), ("cpu_s", " cpu time")):
            record_value(f"{off}{what} {size}", 1.0)
            record_value(f"{on}/{off}{what} {size}", _ratio(runs, on, off, key),
                         f"{off}{what} {size}", target=1.0)
    faults = {v: float(np.median([out[v]["minflt"] for out in runs[v]])) for v in VARIANTS}
    faults["numpy"] = float(np.median([out["numpy"]["minflt"] for out in runs["graph-pool"]]))
    benchmark.extra_info["page_faults_per_step"] = faults
    print(f"\npage faults a step, {size}: " + ", ".join(f"{v} {n:.0f}"
                                                       for v, n in faults.items()))
    assert all(out[v]["correct"] for v in VARIANTS for out in runs[v])
    assert faults["graph-pool"] == 0 and faults["eager-pool"] == 0
