"""Graph mode's buffer pool (issue 17, "graph mode reuses buffers between steps"): the
8-device seed train step compiled with AutoParallel, pool on vs off, beside the numpy
step, as ratios to numpy -- with glibc's default malloc (what users run with) and with
the steady malloc bench/conftest.py sets for every other bench (for reference).

bench/conftest.py sets the steady malloc process-wide at import, so both settings run
in a fresh process (bench/arena_step.py, one job per setting, read back as JSON; the
job's own wall time is what pytest-benchmark shows). Inside a job every step runs once
per round, in turn, so all see the same machine; medians over the rounds. Besides time,
minor page faults per step (getrusage ru_minflt), and the eager sharded step with the
pool on and off (its distributed ops run in the pool, docs/architecture.md).

Target: with the default malloc, the compiled step with the pool is faster than
without it (pool on / pool off < 1.0) and page-faults nothing per step; with the steady
malloc, the pool costs nothing (about 1.0x).
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = [("default", 256, 512, 30), ("steady", 256, 512, 30),
         ("default", 2048, 2048, 6), ("steady", 2048, 2048, 6)]
STEPS = ("numpy-pooled", "graph-pool", "graph-nopool", "eager-pool", "eager-nopool")


def _job(malloc, batch, hidden, rounds):
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, os.path.join(HERE, "arena_step.py"), malloc,
                           str(batch), str(hidden), str(rounds)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("malloc,batch,hidden,rounds", CASES,
                         ids=[f"{m}-B{b}-H{h}" for m, b, h, _ in CASES])
def test_graph_step_buffer_pool(benchmark, record_value, malloc, batch, hidden, rounds):
    benchmark.group = "graph seed step, buffer pool on vs off (subprocess)"
    out = benchmark.pedantic(_job, args=(malloc, batch, hidden, rounds), rounds=1,
                             iterations=1)
    benchmark.extra_info["load"] = os.getloadavg()[0]
    benchmark.extra_info.update({f"{name}_{k}": v for name, r in out.items()
                                 if name != "pool" for k, v in r.items()})
    benchmark.extra_info["pool"] = out["pool"]
    size = f"B{batch} H{hidden} ({malloc} malloc)"
    numpy = f"numpy seed step {size}"
    record_value(numpy, out["numpy"]["median_s"])
    for name in STEPS:
        record_value(f"{name} seed step {size}", out[name]["median_s"], numpy)
    record_value(f"graph pool on/off {size}", out["graph-pool"]["median_s"],
                 f"graph-nopool seed step {size}", target=1.0)
    assert all(r["correct"] for name, r in out.items() if name != "pool")
    assert out["graph-pool"]["minflt"] == 0
