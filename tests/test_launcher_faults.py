"""``python -m dualmode.run`` when a rank or a parameter-server worker dies, with real
processes: the first rank to fail is the one named, run after run, whatever mpiexec
then does to the others; the flags' help agrees with what they do.

Every job runs in a subprocess with a timeout; each test checks with ps that no process
of its script survived.
"""
import os
import shutil
import time

import pytest

from dualmode import k8s, run

pytest.importorskip("mpi4py", reason="the launcher needs mpi4py (pip install -e '.[test]')")

from _launch import ROOT, TIMEOUT, have_mpiexec, launch, no_survivors
from _launch import copy_script as _copy

if not have_mpiexec():
    pytest.skip("mpiexec not found (pip install mpich)", allow_module_level=True)


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


# ------------------------------------------- parameter server: a worker dies


def _ps_launch(tmp_path, cfg, timeout=120):
    import json
    s = _copy(tmp_path, "ps_scripts", "fault_kill_worker.py")
    shutil.copy(os.path.join(ROOT, "tests", "ps_scripts", "train_ps.py"), tmp_path)
    return launch("--ps", "--server_num", 2, "--worker_num", 2, "--log_dir",
                  tmp_path / "logs", s, json.dumps(cfg), tmp_path, cwd=tmp_path,
                  timeout=timeout)


def test_ps_worker_killed_under_the_launcher_the_other_finishes(tmp_path):
    """Every trainable weight on the servers: worker 1 SIGKILLed at step 2 of 5 does not
    end worker 0 (each worker is its own MPI job); after the heartbeat timeout the
    servers apply the steps with worker 0 alone, so its weights equal the single
    device trained on both batches for steps 0-1 and on worker 0's from step 2. The
    launcher says at once that worker 1 died, and exits 1 at the end naming it."""
    import numpy as np
    from _ps import program
    cfg = {"opt": "momentum", "steps": 5, "kill_rank": 1, "kill_at": 2}
    proc = _ps_launch(tmp_path, cfg)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 1, out
    assert proc.stderr.count("dualmode.run: worker 1 was killed by signal 9 (SIGKILL)") == 2, out
    assert "the other roles finished without it" in proc.stderr, out
    assert not os.path.exists(tmp_path / "worker_1.npz")
    data = np.load(tmp_path / "worker_0.npz")
    assert len(data["arr_0"]) == 5
    _, ref = program().reference(cfg, workers=2, alive_until={1: 2})
    got = [data[f"arr_{i}"] for i in range(1, len(data.files))]
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    logs = (tmp_path / "logs" / "server_0.log").read_text()
    assert "sync steps go on with the live workers [0]" in logs, logs
    assert no_survivors(str(tmp_path)) == []


def test_ps_hybrid_worker_killed_ends_the_job_naming_it(tmp_path):
    """fc2 all-reduced among the workers: worker 0 waits for the dead worker 1 in the
    AllReduce; the launcher ends every role within 30 s of the kill, naming worker 1."""
    cfg = {"opt": "sgd", "steps": 5, "hybrid": True, "kill_rank": 1, "kill_at": 2}
    proc = _ps_launch(tmp_path, cfg)
    ended = time.time()
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 1, out
    killed_at = float((tmp_path / "killed_at").read_text())
    assert ended - killed_at < 30, (ended - killed_at, out)
    assert ("dualmode.run: worker 1 was killed by signal 9 (SIGKILL) while worker 0 waits "
            "for it in the MPI collective") in proc.stderr, out
    assert not os.path.exists(tmp_path / "worker_0.npz")
    assert no_survivors(str(tmp_path)) == []


def test_ps_worker_dead_before_the_workers_joined_ends_the_job(tmp_path):
    """Worker 1 dies before init(): worker 0 waits for it to join the workers' MPI
    world; the launcher ends every role, naming worker 1."""
    cfg = {"opt": "sgd", "steps": 2, "kill_rank": 1, "kill_at": -1}
    proc = _ps_launch(tmp_path, cfg)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 1 and proc.seconds < TIMEOUT, out
    assert ("dualmode.run: worker 1 was killed by signal 9 (SIGKILL) before the workers "
            "joined their MPI world, for which worker 0 waits in init()") in proc.stderr, out
    assert no_survivors(str(tmp_path)) == []
