"""User-facing collectives (ops.AllReduce with sum/max/min/prod/mean, AllGather,
ReduceScatter, Broadcast, AlltoAll over the world and create_group groups) and a
hybrid-parallel network trained with Momentum give the same numbers under backend "mpi"
(2 and 4 real processes) as on the same number of simulated devices, forward and
backward (tests/mpi_scripts/user_collectives.py)."""
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py", reason="backend 'mpi' needs mpi4py (pip install -e '.[test]')")
if shutil.which("mpiexec") is None:
    pytest.skip("mpiexec not found (pip install mpich)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "mpi_scripts", "user_collectives.py")


@pytest.mark.parametrize("n", [2, 4])
def test_mpi_user_collectives_and_hybrid_equal_sim(n, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(["mpiexec", "-n", str(n), sys.executable, SCRIPT, str(n)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"user collectives ok: 92 checks on {n} ranks" in proc.stdout
