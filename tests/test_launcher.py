"""``python -m dualmode.run`` supervising real MPI jobs: every fault ends the job within
seconds, names the rank and the cause, and leaves no process behind.

Every job runs in a subprocess with a timeout; each test checks with ps that no process
of its script survived.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("mpi4py", reason="the launcher needs mpi4py (pip install -e '.[test]')")

from _launch import SCRIPTS, TIMEOUT, have_mpiexec, launch, no_survivors, survivors
from _launch import job_env as _env

if not have_mpiexec():
    pytest.skip("mpiexec not found (pip install mpich)", allow_module_level=True)


def _script(tmp_path, name="faults.py"):
    """A copy of the script under tmp_path: its path names this test's processes."""
    dst = tmp_path / name
    shutil.copy(os.path.join(SCRIPTS, name), dst)
    return str(dst)


def test_launcher_names_rank_killed_by_signal(tmp_path):
    s = _script(tmp_path)
    proc = launch("--worker_num", 3, "--log_dir", tmp_path / "logs", s, "kill", 1,
                  cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.seconds < TIMEOUT / 2, proc.seconds      # ended by the launcher, not the timeout
    assert "dualmode.run: rank 1 was killed by signal 9 (SIGKILL)" in proc.stderr
    assert no_survivors(str(tmp_path)) == []


def test_launcher_ends_job_when_a_rank_exits_while_others_wait(tmp_path):
    s = _script(tmp_path)
    proc = launch("--worker_num", 2, "--log_dir", tmp_path / "logs", s, "exit0", 1,
                  cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.seconds < TIMEOUT / 2, proc.seconds      # ended by the launcher, not the timeout
    assert ("dualmode.run: rank 1 exited (status 0) while rank 0 still wait(s) for it in "
            "the MPI collective all_reduce") in proc.stderr
    assert "BAD TERMINATION" not in proc.stdout + proc.stderr
    assert no_survivors(str(tmp_path)) == []


def test_launcher_names_rank_exiting_nonzero_without_traceback(tmp_path):
    s = _script(tmp_path)
    proc = launch("--worker_num", 2, "--log_dir", tmp_path / "logs", s, "exit3", 0,
                  cwd=tmp_path)
    assert proc.returncode == 1 and proc.seconds < TIMEOUT / 2
    assert "dualmode.run: rank 0 exited with code 3" in proc.stderr
    assert no_survivors(str(tmp_path)) == []


def test_launcher_timeout_ends_hung_job_with_every_stack_in_the_logs(tmp_path):
    s = _script(tmp_path)
    logs = tmp_path / "logs"
    proc = launch("--worker_num", 2, "--log_dir", logs, "--timeout", 2, s, "hang", 1,
                  cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.seconds < TIMEOUT / 2, proc.seconds      # the 2 s --timeout, not ours
    assert ("dualmode.run: no rank made progress for 2 s (--timeout): rank 1 at faults.py:"
            in proc.stderr)
    assert "in stuck_here; rank 0 waiting in the MPI collective all_reduce" in proc.stderr
    one = (logs / "worker_1.log").read_text()
    zero = (logs / "worker_0.log").read_text()
    assert re.search(r'File ".*faults\.py", line \d+ in stuck_here', one), one
    assert re.search(r'File ".*mpi\.py", line \d+ in _all_reduce', zero), zero
    assert no_survivors(str(tmp_path)) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launcher_signal_stops_mpiexec_and_every_rank(sig, tmp_path):
    s = _script(tmp_path)
    logs = tmp_path / "logs"
    p = subprocess.Popen([sys.executable, "-m", "dualmode.run", "--worker_num", "2",
                          "--log_dir", str(logs), s, "none", "1"],
                         cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:          # until both ranks run the script
            texts = [(logs / f"worker_{r}.log") for r in range(2)]
            if all(t.exists() and "env RANK_ID" in t.read_text() for t in texts):
                break
            time.sleep(0.2)
        assert len(survivors(str(tmp_path))) >= 3   # mpiexec and two ranks at least
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.wait(timeout=10)
    assert p.returncode == 1, out + err
    assert f"dualmode.run: stopped by {sig.name}: ended mpiexec and every rank" in err
    assert no_survivors(str(tmp_path)) == []


def test_launcher_finds_mpiexec_beside_python_without_path(tmp_path):
    s = _script(tmp_path)
    proc = launch("--nproc_per_node", 2, "--log_dir", tmp_path / "logs", s, "env", 9,
                  cwd=tmp_path, PATH="/usr/bin:/bin")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        text = (tmp_path / "logs" / f"worker_{r}.log").read_text()
        assert (f"env RANK_ID={r} RANK={r} RANK_SIZE=2 WORLD_SIZE=2 LOCAL_RANK={r} "
                f"DEVICE_ID={r}") in text
        assert "finished" in text


def test_launcher_mpiexec_missing_is_named(tmp_path, monkeypatch):
    from dualmode import run as launcher
    monkeypatch.setattr(launcher.shutil, "which", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match=r"dualmode\.run: mpiexec was not found beside .* "
                                           r"nor on PATH; install MPICH with pip install"):
        launcher._find_mpiexec(None)
    with pytest.raises(RuntimeError, match=r"dualmode\.run: --mpiexec='/no/mpiexec' was not "
                                           "found"):
        launcher._find_mpiexec("/no/mpiexec")


@pytest.mark.parametrize("flags, message", [
    (["--nproc_per_node", "0"], "dualmode.run: --nproc_per_node=0 is not valid; expected an "
                                "int >= 1"),
    (["--nproc_per_node", "2", "--worker_num", "3"],
     "dualmode.run: --worker_num=3 contradicts --nproc_per_node=2 with --nnodes=1 (2 ranks)"),
    (["--worker_num", "2", "--timeout", "0"], "dualmode.run: --timeout=0.0 is not valid"),
    (["--worker_num", "2", "--ssh_timeout", "-1"], "dualmode.run: --ssh_timeout=-1.0 is not "
                                                   "valid"),
])
def test_launcher_new_flags_checked(flags, message, tmp_path):
    proc = launch(*flags, _script(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr


def test_launcher_nproc_per_node_times_nnodes():
    from dualmode import run as launcher
    cfg = launcher.parse_args(["--nproc_per_node", "2", "--nnodes", "2", "--master_addr",
                               "h", "--master_port", "9", os.path.join(SCRIPTS, "hello.py")])
    assert cfg.worker_num == 4


def test_launcher_unreachable_host_fails_in_time_and_leaves_no_ssh(tmp_path):
    """The rank table of docs/mpi.md pasted as is: its hosts do not answer (a fake ssh
    that never returns stands for them); the launcher names the host within
    --ssh_timeout and kills its ssh children."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text(f"#!/bin/sh\nexec sleep 300 # {tmp_path}\n")
    (fake / "ssh").chmod(0o755)
    table = tmp_path / "table.json"
    table.write_text(
        '{"version": "1.0", "server_count": "2", "server_list": ['
        '{"server_id": "10.0.0.1", "device": [{"device_id": "0", "device_ip": "192.1.27.6", '
        '"rank_id": "0"}], "host_nic_ip": "reserve"},'
        '{"server_id": "10.0.0.2", "device": [{"device_id": "0", "device_ip": "192.1.27.8", '
        '"rank_id": "1"}], "host_nic_ip": "reserve"}], "status": "completed"}')
    proc = launch("--ssh_timeout", 2, "--log_dir", tmp_path / "logs", _script(tmp_path),
                  cwd=tmp_path, RANK_TABLE_FILE=str(table),
                  PATH=f"{fake}:{os.environ.get('PATH', '')}")
    assert proc.returncode == 2 and proc.seconds < TIMEOUT / 2, proc.stderr
    assert re.search(r"dualmode\.run: host '10\.0\.0\.[12]' cannot be reached over ssh \(no "
                     r"answer within --ssh_timeout=2 s\)", proc.stderr), proc.stderr
    assert no_survivors(f"sleep 300 # {tmp_path}") == []
    assert not (tmp_path / "logs").exists()


def test_hand_started_rank_process_is_told_how_to_launch(tmp_path):
    """Seed 004's run.sh starts every rank by hand with RANK_SIZE / RANK_ID / DEVICE_ID:
    without MPI each would run alone; init() refuses and says how to launch."""
    code = ("import dualmode as dm\n"
            "dm.communication.init()\n"
            "print('ran alone')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                          env=_env(RANK_SIZE="8", RANK_ID="1", DEVICE_ID="1"),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0 and "ran alone" not in proc.stdout
    assert ("RuntimeError: init: environment variable RANK_SIZE=8 (RANK_ID=1) says this "
            "process is one of 8 ranks, but mpiexec did not start it, so it would run alone; "
            "start all 8 ranks with python -m dualmode.run --worker_num 8 script.py"
            in proc.stderr), proc.stderr
