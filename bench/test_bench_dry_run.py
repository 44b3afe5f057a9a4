"""The dry run of a GPT-3-sized step (96 layers, hidden 12,288, vocabulary 51,200, about
175 B parameters) on 1,024 devices as tensor 8 x data 128 with Adam, with and without the
parallel optimizer, and as tensor 8 x pipeline 16 x data 8 with the parallel optimizer
(16 micro-batches): the whole compile path on abstract tensors, in a fresh process.
Target: under 30 s. A dry run has no numpy counterpart (numpy would need the model's
700 GB of weights), so the figure is the absolute time; its peak memory (under 2 GB)
and its numbers are checked in tests/test_dry_run.py."""
import json
import subprocess
import sys

import pytest

from test_dry_run import _GPT3, _GPT3_PP, EXAMPLES, ROOT


@pytest.mark.parametrize("zero", [False, True], ids=["adam", "adam-parallel-optimizer"])
def test_gpt3_dry_run(benchmark, zero):
    benchmark.group = "dry run, GPT-3 175B on 1,024 devices (tensor 8 x data 128)"
    out = {}

    def run():
        proc = subprocess.run([sys.executable, "-c", _GPT3.format(examples=EXAMPLES,
                                                                  zero=zero)],
                              capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(dry_run_s=round(out["elapsed"], 2), target_s=30,
                                maxrss_mb=round(out["maxrss_mb"]))


def test_gpt3_pipeline_dry_run(benchmark):
    benchmark.group = "dry run, GPT-3 175B on 1,024 devices (tensor 8 x pipeline 16 x data 8)"
    out = {}

    def run():
        proc = subprocess.run([sys.executable, "-c", _GPT3_PP.format(examples=EXAMPLES)],
                              capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(dry_run_s=round(out["elapsed"], 2), target_s=30,
                                maxrss_mb=round(out["maxrss_mb"]))
