"""Image ops under backend "mpi" (4 real processes, one device each): Conv2D split on
H/W (the halo is a real AllGather through MPI), N and C, pools on H/W, and a conv +
BatchNorm block trained with an H/W dataset_strategy equal the stand-alone run
(tests/mpi_scripts/conv.py)."""
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py", reason="backend 'mpi' needs mpi4py (pip install -e '.[test]')")
if shutil.which("mpiexec") is None:
    pytest.skip("mpiexec not found (pip install mpich)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "mpi_scripts", "conv.py")


def test_mpi_conv_halo_and_batchnorm_equal_stand_alone(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(["mpiexec", "-n", "4", sys.executable, SCRIPT], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "conv ok: 37 checks" in proc.stdout
