"""Training under backend "mpi" (real processes, one device each) equals the same
program on the "sim" backend: data parallel, the seed network with operator-level
strategies, an ops.shard block, and data parallel with each rank reading its own shard
of the data set (tests/mpi_scripts/train.py)."""
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
SCRIPT = os.path.join(ROOT, "tests", "mpi_scripts", "train.py")


def _program():
    spec = importlib.util.spec_from_file_location("mpi_train_program", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_mpi(n, program, tmp_path):
    out = tmp_path / f"{program}-{n}.npz"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")          # ranks share the cores (see dualmode.run)
    proc = subprocess.run(["mpiexec", "-n", str(n), sys.executable, SCRIPT, program, str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = np.load(out)
    return data["losses"], [data[f"arr_{i}"] for i in range(len(data.files) - 1)]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("program", ["dp", "seed", "shard", "shards"])
def test_mpi_training_equals_sim(program, n, tmp_path):
    losses, weights = _run_mpi(n, program, tmp_path)
    from dualmode import communication
    ref_losses, ref_weights = _program().train(program, devices=n)
    communication.init("sim")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert len(weights) == len(ref_weights)
    for a, b in zip(weights, ref_weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
