"""Checkpoints under backend "mpi" (real processes, one device per rank): integrated
(rank 0 writes) and sliced (each rank its own file) saves, and training resumed in new
processes from either equals uninterrupted training and the "sim" run."""
import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="backend 'mpi' needs mpi4py (pip install -e '.[test]')")
if shutil.which("mpiexec") is None:
    pytest.skip("mpiexec not found (pip install mpich)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "mpi_scripts", "checkpoint.py")


def _program():
    spec = importlib.util.spec_from_file_location("mpi_checkpoint_program", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mpi(n, mode, directory):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(["mpiexec", "-n", str(n), sys.executable, SCRIPT, mode, directory],
                          cwd=directory, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return list(np.load(os.path.join(directory, f"{mode}.npy")))


@pytest.mark.parametrize("n", [2, 4])
def test_mpi_checkpoint_resume_equals_uninterrupted_and_sim(n, tmp_path):
    d = str(tmp_path)
    full = _mpi(n, "save", d)
    assert sorted(os.listdir(d)) == ["full.safetensors"] + [f"rank_{r}" for r in range(n)] + \
        ["save.npy", "strategy.json", ]
    resumed = _mpi(n, "resume", d)
    resumed_sliced = _mpi(n, "resume_sliced", d)
    from dualmode import communication
    sim_dir = tmp_path / "sim"
    sim_dir.mkdir()
    ref = _program().run("save", str(sim_dir), devices=n)
    communication.init("sim")
    np.testing.assert_allclose(full, ref, rtol=1e-5)
    np.testing.assert_allclose(resumed, full[3:], rtol=1e-5)
    np.testing.assert_allclose(resumed_sliced, full[3:], rtol=1e-5)
    # the sliced files of the MPI run equal those written on "sim"
    for r in range(n):
        import dualmode as dm
        a = dm.load_checkpoint(os.path.join(d, f"rank_{r}", "s.safetensors"))
        b = dm.load_checkpoint(str(sim_dir / f"rank_{r}" / "s.safetensors"))
        for k in a:
            np.testing.assert_allclose(a[k].asnumpy(), b[k].asnumpy(), rtol=1e-5, atol=1e-7)
