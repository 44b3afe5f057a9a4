"""Running ``python -m dualmode.run`` jobs from tests: a clean environment, the launch
with a timeout, and the processes a test's job may have left behind (found by the
test's own tmp path in their command lines)."""
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "mpi_scripts")
TIMEOUT = 60
VENV_BIN = os.path.dirname(sys.executable)


def have_mpiexec():
    return shutil.which("mpiexec", path=VENV_BIN) is not None or \
        shutil.which("mpiexec") is not None


def job_env(**extra):
    """This environment without another launcher's, MPI's or a role's variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID", "HYDRA_", "DM_",
                                "MS_"))}
    env["PYTHONPATH"] = ROOT
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def copy_script(tmp_path, folder, name):
    """A copy of ``tests/<folder>/<name>`` under tmp_path: its path names this test's
    processes."""
    dst = tmp_path / name
    shutil.copy(os.path.join(ROOT, "tests", folder, name), dst)
    return str(dst)


def launch(*flags, cwd, timeout=TIMEOUT, **env):
    """``python -m dualmode.run *flags``, finished within `timeout` seconds (its run time
    in ``.seconds``)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dualmode.run", *map(str, flags)], cwd=cwd,
                          env=job_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    proc.seconds = time.monotonic() - start
    return proc


def survivors(marker):
    """Processes whose command line contains ``marker`` (the test's own tmp path)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True,
                         timeout=10).stdout
    return [line for line in out.splitlines()[1:] if marker in line and "ps -ww" not in line]


def no_survivors(marker, wait=5.0):
    """The survivors still there after up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while survivors(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return survivors(marker)
