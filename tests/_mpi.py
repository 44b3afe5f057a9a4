"""Running a script of tests/mpi_scripts under mpiexec and loading it stand-alone."""
import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import dualmode as dm
from dualmode import communication

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "mpi_scripts")


def run_mpi_script(name, args, tmp_path, ranks=2, timeout=120):
    """Run ``tests/mpi_scripts/<name>`` on `ranks` MPI ranks (skipped without mpi4py or
    mpiexec), failing with its output when it fails; returns the finished process."""
    pytest.importorskip("mpi4py", reason="backend 'mpi' needs mpi4py")
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable,
                           os.path.join(SCRIPTS, name), *map(str, args)],
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def load_mpi_script(name):
    """``tests/mpi_scripts/<name>`` imported as a module (to run its code stand-alone)."""
    spec = importlib.util.spec_from_file_location(f"mpi_{name[:-3]}",
                                                  os.path.join(SCRIPTS, name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_fusion_step_under_mpi(tmp_path, mode, counts):
    """Run ``tests/mpi_scripts/fusion_step.py`` in `mode` ("eager" or "compiled") on 2
    ranks and stand-alone: every run of the job (unfused, then fused) made the
    (AllGather, ReduceScatter) `counts` given per run, and gives the stand-alone
    losses and weights."""
    out = tmp_path / "out.npz"
    run_mpi_script("fusion_step.py", [out, mode], tmp_path)
    data = np.load(out)
    mod = load_mpi_script("fusion_step.py")
    try:
        ref_losses, ref_weights, _ = mod.train(mode, mpi=False)
    finally:
        dm.reset_auto_parallel_context()
        communication.init("sim")
    for k, want in enumerate(counts):
        assert tuple(data[f"counts{k}"]) == want
        np.testing.assert_allclose(data[f"losses{k}"], ref_losses, rtol=1e-5)
        for i, w in enumerate(ref_weights):
            np.testing.assert_allclose(data[f"w{k}_{i}"], w, rtol=1e-5, atol=1e-6)
