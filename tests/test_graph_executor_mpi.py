"""The graph executor under backend "mpi" (real processes, one device each): a compiled
train step with operator-level strategies gives the numbers of the same step on "sim"
with the same device count, and of the stand-alone step."""
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
SCRIPT = os.path.join(ROOT, "tests", "mpi_scripts", "graph_step.py")


def _script():
    spec = importlib.util.spec_from_file_location("mpi_graph_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("n", [2, 4])
def test_compiled_train_step_under_mpi_equals_sim_and_stand_alone(n, tmp_path):
    out = tmp_path / "out.npz"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(["mpiexec", "-n", str(n), sys.executable, SCRIPT, str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = np.load(out)
    losses = data["losses"]
    weights = [data[f"arr_{i}"] for i in range(len(data.files) - 1)]
    from dualmode import communication
    mod = _script()
    try:
        sim_losses, sim_weights = mod.train(devices=n)
        one_losses, one_weights = mod.train(devices=1)
    finally:
        import dualmode as dm
        dm.reset_auto_parallel_context()
        communication.init("sim")
    np.testing.assert_allclose(losses, sim_losses, rtol=1e-5)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    for a, b, c in zip(weights, sim_weights, one_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)
