"""Running a script of tests/mpi_scripts under mpiexec and loading it stand-alone."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

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
