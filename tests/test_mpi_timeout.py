"""Every wait of backend "mpi" ends after ``DUALMODE_COMM_TIMEOUT`` seconds with an error
that says what is stuck, instead of hanging: a rank that skips an AllReduce, a pipeline
stage that never sends what the next one receives (or never receives what it sends).
Real processes (``python -m dualmode.run`` or plain ``mpiexec``), each job with a
timeout; each test checks with ps that no process of its script survived. A training
job with a short timeout gives the single-device numbers; bad values of the variable are
refused by name.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="backend 'mpi' needs mpi4py (pip install -e '.[test]')")

from _launch import TIMEOUT, copy_script, have_mpiexec, job_env, launch, no_survivors

from dualmode.communication.mpi import DEFAULT_TIMEOUT, TIMEOUT_VAR, comm_timeout

if not have_mpiexec():
    pytest.skip("mpiexec not found (pip install mpich)", allow_module_level=True)

LIMIT = ("The limit is DUALMODE_COMM_TIMEOUT=2 seconds; set that environment variable "
         "higher, or to 0 or 'none' to wait forever.")


def _skip_job(tmp_path, mode, ranks=2, limit="2"):
    """timeout_skip.py MODE under the launcher with the given limit."""
    s = copy_script(tmp_path, "mpi_scripts", "timeout_skip.py")
    return launch("--worker_num", ranks, "--log_dir", tmp_path / "logs", s, mode,
                  cwd=tmp_path, DUALMODE_COMM_TIMEOUT=limit)


def _waited(pattern, text):
    """The seconds the error says it waited (the pattern's group 1), else a failure
    showing the text."""
    m = re.search(pattern, text)
    assert m, text[-3000:]
    return float(m.group(1))


def test_rank_skipping_an_allreduce_makes_the_waiting_rank_raise(tmp_path):
    """Rank 1 skips the AllReduce of a MatMul's sum (and sleeps 120 s): rank 0 raises
    after 2 s naming the collective, the op it was for, the ranks and itself; the
    launcher ends the job at once (status 1, nothing left running)."""
    proc = _skip_job(tmp_path, "allreduce")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.seconds < TIMEOUT / 2, proc.seconds
    waited = _waited(
        r"dualmode\.run: rank 0 failed: RuntimeError: mpi backend: AllReduce for Exp "
        r"\(forward\) over ranks \[0, 1\] timed out on rank 0 after (\d+\.\d) s: not every "
        r"rank of the group called it \(a rank skipped it, e\.g\. in a branch that depends "
        r"on the rank, runs another collective, is stuck elsewhere, or died\)\. "
        + re.escape(LIMIT), proc.stderr)
    assert 2.0 <= waited < 3.0, waited
    log = (tmp_path / "logs" / "worker_0.log").read_text()
    assert re.search(r'File ".*mpi\.py", line \d+, in _all_reduce', log), log[-3000:]
    assert no_survivors(str(tmp_path)) == []


def test_pipeline_receive_without_a_sender_raises(tmp_path):
    """Two pipeline stages of one rank each; stage 1 receives a message stage 0 never
    sends: rank 1 raises after 2 s naming the sender, its stage and the tag."""
    proc = _skip_job(tmp_path, "recv")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.seconds < TIMEOUT / 2, proc.seconds
    waited = _waited(
        r"dualmode\.run: rank 1 failed: RuntimeError: mpi backend: Receive \(tag 7\) from "
        r"rank 0 \(pipeline stage 0\) timed out on rank 1 after (\d+\.\d) s: rank 0 has not "
        r"sent it \(it runs another schedule, is stuck elsewhere, or died\)\. "
        + re.escape(LIMIT), proc.stderr)
    assert 2.0 <= waited < 3.0, waited
    assert no_survivors(str(tmp_path)) == []


def test_pipeline_send_never_received_raises(tmp_path):
    """Stage 0 sends 4 MiB that stage 1 never receives and waits for it to leave: rank
    0 raises after 2 s naming the receiver."""
    proc = _skip_job(tmp_path, "send")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.seconds < TIMEOUT / 2, proc.seconds
    waited = _waited(
        r"dualmode\.run: rank 0 failed: RuntimeError: mpi backend: Send \(tag 3\) to rank 1 "
        r"\(pipeline stage 1\) timed out on rank 0 after (\d+\.\d) s: rank 1 has not "
        r"received it .*" + re.escape(LIMIT), proc.stderr)
    assert 2.0 <= waited < 3.0, waited
    assert no_survivors(str(tmp_path)) == []


def test_four_rank_pipeline_under_plain_mpiexec_ends(tmp_path):
    """Plain ``mpiexec -n 4`` (no launcher): stage 1 (ranks 2, 3) waits for stage 0
    (ranks 0, 1), which never sends; a receiving rank raises and the uncaught error
    aborts the whole job within seconds."""
    s = copy_script(tmp_path, "mpi_scripts", "timeout_skip.py")
    proc = subprocess.run(["mpiexec", "-n", "4", sys.executable, s, "recv4"], cwd=tmp_path,
                          env=job_env(DUALMODE_COMM_TIMEOUT="2"), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = re.findall(r"RuntimeError: mpi backend: Receive \(tag 7\) from rank (\d) "
                     r"\(pipeline stage 0\) timed out on rank (\d) after \d+\.\d s",
                     proc.stderr)
    assert got and set(got) <= {("0", "2"), ("1", "3")}, proc.stderr[-3000:]
    assert no_survivors(str(tmp_path)) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_training_with_a_short_timeout_equals_one_device(tmp_path, ranks):
    """The seed network with operator-level strategies (tests/mpi_scripts/train.py)
    trained by the launcher with DUALMODE_COMM_TIMEOUT=5: the losses and weights of the
    simulated devices; nothing times out."""
    import importlib.util

    from _launch import ROOT
    from dualmode import communication
    script = os.path.join(ROOT, "tests", "mpi_scripts", "train.py")
    out = tmp_path / "out.npz"
    proc = launch("--worker_num", ranks, "--log_dir", tmp_path / "logs", script, "seed", out,
                  cwd=tmp_path, timeout=2 * TIMEOUT, DUALMODE_COMM_TIMEOUT="5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = np.load(out)
    spec = importlib.util.spec_from_file_location("mpi_train_program_t", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        ref_losses, ref_weights = mod.train("seed", devices=ranks)
    finally:
        communication.init("sim")
    np.testing.assert_allclose(data["losses"], ref_losses, rtol=1e-5)
    weights = [data[f"arr_{i}"] for i in range(len(data.files) - 1)]
    assert len(weights) == len(ref_weights)
    for a, b in zip(weights, ref_weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------ the variable's values


@pytest.mark.parametrize("raw, want", [(None, DEFAULT_TIMEOUT), ("", DEFAULT_TIMEOUT),
                                       ("2", 2.0), (" 0.5 ", 0.5), ("0", None),
                                       ("none", None), ("None", None), ("inf", None)])
def test_timeout_values(raw, want):
    env = {} if raw is None else {TIMEOUT_VAR: raw}
    assert comm_timeout(env) == want
    assert DEFAULT_TIMEOUT == 1800.0


@pytest.mark.parametrize("raw", ["-1", "abc", "nan", "2s", "-inf"])
def test_bad_timeout_values_are_refused_by_name(raw):
    with pytest.raises(ValueError, match=re.escape(f"DUALMODE_COMM_TIMEOUT={raw!r} is not "
                                                   "valid; expected the seconds an MPI "
                                                   "collective or receive may wait, a number "
                                                   ">= 0 (0 or 'none': wait forever; unset: "
                                                   "1800)")):
        comm_timeout({TIMEOUT_VAR: raw})


def test_bad_timeout_fails_the_job_at_init(tmp_path):
    """A job started with DUALMODE_COMM_TIMEOUT=-3 fails at init() on every rank with
    the ValueError, before any collective."""
    proc = _skip_job(tmp_path, "allreduce", limit="-3")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"dualmode\.run: rank [01] failed: ValueError: init: environment "
                     r"variable DUALMODE_COMM_TIMEOUT='-3' is not valid", proc.stderr), \
        proc.stderr[-3000:]
    assert "ready" not in proc.stdout
    assert no_survivors(str(tmp_path)) == []


# ------------------------------------------------- beside the launcher's --timeout


def test_polling_rank_is_not_progress_for_the_launchers_timeout(tmp_path):
    """DUALMODE_COMM_TIMEOUT=60 and ``--timeout 3``: rank 0 polls in its AllReduce (the
    wait loop's lines change), rank 1 sleeps; neither is progress, so the launcher ends
    the job after 3 s naming where each rank is."""
    s = copy_script(tmp_path, "mpi_scripts", "timeout_skip.py")
    proc = launch("--worker_num", 2, "--log_dir", tmp_path / "logs", "--timeout", 3, s,
                  "allreduce", cwd=tmp_path, DUALMODE_COMM_TIMEOUT="60")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.seconds < TIMEOUT / 2, proc.seconds
    assert re.search(r"dualmode\.run: no rank made progress for 3 s \(--timeout\): rank 1 at "
                     r"timeout_skip\.py:\d+ in <module>; rank 0 waiting in the MPI collective "
                     r"all_reduce", proc.stderr), proc.stderr[-3000:]
    assert "RuntimeError" not in proc.stderr
    assert no_survivors(str(tmp_path)) == []


def test_zero_waits_forever(tmp_path):
    """DUALMODE_COMM_TIMEOUT=0: rank 0 waits in MPI's own wait, not raising; the
    launcher's ``--timeout 4`` ends the job."""
    s = copy_script(tmp_path, "mpi_scripts", "timeout_skip.py")
    proc = launch("--worker_num", 2, "--log_dir", tmp_path / "logs", "--timeout", 4, s,
                  "recv", cwd=tmp_path, DUALMODE_COMM_TIMEOUT="0")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.seconds >= 4, proc.seconds
    assert "dualmode.run: no rank made progress for 4 s (--timeout)" in proc.stderr, \
        proc.stderr[-3000:]
    assert "timed out" not in proc.stderr
    assert no_survivors(str(tmp_path)) == []
