"""``python -m dualmode.run --ps``: scheduler, servers and workers (under MPI) with one
log each; hybrid training (fc1 on the servers, fc2 all-reduced among the workers)
equals one device; a failing role is named and nothing is left running."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from _ps import ROOT, SCRIPT, base_env, program

pytest.importorskip("zmq", reason="parameter server mode needs pyzmq")
pytest.importorskip("mpi4py", reason="the launcher runs the workers under MPI")
if shutil.which("mpiexec") is None:
    pytest.skip("mpiexec not found (pip install mpich)", allow_module_level=True)


def _launch(tmp_path, cfg, servers=2, workers=2):
    env = base_env("DM", servers, workers)
    for k in list(env):
        if k.startswith("DM_"):
            del env[k]
    import json
    return subprocess.run([sys.executable, "-m", "dualmode.run", "--ps", "--server_num",
                           str(servers), "--worker_num", str(workers), "--log_dir",
                           str(tmp_path / "logs"), SCRIPT, json.dumps(cfg), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_ps_launcher_hybrid_equals_single_device(tmp_path):
    cfg = {"opt": "momentum", "steps": 4, "hybrid": True}
    proc = _launch(tmp_path, cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = sorted(os.listdir(tmp_path / "logs"))
    assert logs == ["scheduler.log", "server_0.log", "server_1.log", "worker_0.log",
                    "worker_1.log"]
    _, ref_weights = program().reference(cfg, workers=2)
    for rank in (0, 1):
        data = np.load(tmp_path / f"worker_{rank}.npz")
        got = [data[f"arr_{i}"] for i in range(2, len(data.files))]
        for a, b in zip(got, ref_weights):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # only fc1 went to the servers
    servers = (tmp_path / "logs" / "server_0.log").read_text() + \
        (tmp_path / "logs" / "server_1.log").read_text()
    assert "fc1.weight" in servers and "fc2.weight" not in servers


def test_ps_launcher_names_the_failed_role(tmp_path):
    """Workers under MPI in parallel_mode='stand_alone' with fc2 left on them: the
    worker fails with the reason, the launcher names it and stops every role."""
    proc = _launch(tmp_path, {"steps": 2, "hybrid_plain": True})
    assert proc.returncode == 1
    assert "dualmode.run: worker " in proc.stderr and "failed: RuntimeError: SGD: parameter " \
        "'fc2.weight' stays on the workers but parallel_mode='stand_alone'" in proc.stderr, \
        proc.stderr


def test_ps_launcher_flags_checked(tmp_path):
    for flags, message in ((["--ps"], "--ps needs --server_num, an int >= 1; got None"),
                           (["--server_num", "2"], "--server_num=2 needs --ps")):
        proc = subprocess.run([sys.executable, "-m", "dualmode.run", "--worker_num", "2",
                               *flags, SCRIPT], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
