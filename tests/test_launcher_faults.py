"""``python -m dualmode.run`` when a rank or a parameter-server worker dies, with real
processes: the first rank to fail is the one named, run after run, whatever mpiexec
then does to the others; the flags' help agrees with what they do.

Every job runs in a subprocess with a timeout; each test checks with ps that no process
of its script survived.
"""
import os
import shutil
import subprocess
import sys
import time

import pytest

from dualmode import k8s, run

pytest.importorskip("mpi4py", reason="the launcher needs mpi4py (pip install -e '.[test]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "mpi_scripts")
TIMEOUT = 60
VENV_BIN = os.path.dirname(sys.executable)

if shutil.which("mpiexec", path=VENV_BIN) is None and shutil.which("mpiexec") is None:
    pytest.skip("mpiexec not found (pip install mpich)", allow_module_level=True)


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID", "HYDRA_", "DM_",
                                "MS_"))}
    env["PYTHONPATH"] = ROOT
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _copy(tmp_path, folder, name):
    """A copy of the script under tmp_path: its path names this test's processes."""
    dst = tmp_path / name
    shutil.copy(os.path.join(ROOT, "tests", folder, name), dst)
    return str(dst)


def launch(*flags, cwd, timeout=TIMEOUT):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dualmode.run", *map(str, flags)], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=timeout)
    proc.seconds = time.monotonic() - start
    return proc


def survivors(marker):
    """Processes whose command line contains ``marker`` (the test's own tmp path)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True,
                         timeout=10).stdout
    return [line for line in out.splitlines()[1:] if marker in line and "ps -ww" not in line]


def no_survivors(marker, wait=5.0):
    deadline = time.monotonic() + wait
    while survivors(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return survivors(marker)


# ------------------------------------------------------------- the first rank


def test_sigkilled_rank_is_named_run_after_run(tmp_path):
    """A rank SIGKILLed while the other three sleep: mpiexec's banner names whichever
    process its cleanup reported first; the launcher names the killed rank, 10 runs
    out of 10."""
    s = _copy(tmp_path, "mpi_scripts", "fault_first_rank.py")
    wrong = []
    for run_no in range(10):
        bad = (run_no % 3) + 1                 # ranks 1, 2, 3: never mpiexec's rank 0
        proc = launch("--worker_num", 4, "--log_dir", tmp_path / "logs", s, "kill", bad,
                      cwd=tmp_path)
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.seconds < TIMEOUT / 2, proc.seconds
        want = f"dualmode.run: rank {bad} was killed by signal 9 (SIGKILL)"
        if want not in proc.stderr:
            wrong.append((bad, proc.stderr.strip().splitlines()[-1:]))
        assert no_survivors(str(tmp_path)) == []
    assert wrong == [], wrong


def test_rank_exiting_while_others_are_in_allreduces_is_named(tmp_path):
    """Rank R calls os._exit(7) in a loop of AllReduces (the others wait for it inside
    the next one, then mpiexec kills them with SIGKILL): rank R exited with code 7."""
    s = _copy(tmp_path, "mpi_scripts", "fault_first_rank.py")
    wrong = []
    for run_no in range(6):
        bad = run_no % 4
        proc = launch("--worker_num", 4, "--log_dir", tmp_path / "logs", s, "exit7", bad,
                      cwd=tmp_path)
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        want = f"dualmode.run: rank {bad} exited with code 7 (without a Python traceback)"
        if want not in proc.stderr:
            wrong.append((bad, proc.stderr.strip().splitlines()[-1:]))
        assert no_survivors(str(tmp_path)) == []
    assert wrong == [], wrong


# ------------------------------------------------------------------ help texts


def test_help_of_image_and_mpiexec_says_what_they_do():
    helps = {a.dest: a.help for a in run._parser()._actions}
    assert repr(k8s.DEFAULT_IMAGE) in helps["image"], helps["image"]
    assert "python:3" not in helps["image"]
    # the launcher looks beside sys.executable first (tested in test_launcher.py)
    assert "beside this Python" in helps["mpiexec"] and "else the one on PATH" in \
        helps["mpiexec"], helps["mpiexec"]
    docs = open(os.path.join(ROOT, "docs", "mpi.md"), encoding="utf-8").read()
    assert f"default image `{k8s.DEFAULT_IMAGE}`" in docs
    manifests = k8s.to_yaml(k8s.mpijob_manifests("train.py", (), 2))
    assert f'"{k8s.DEFAULT_IMAGE}"' in manifests or k8s.DEFAULT_IMAGE in manifests
