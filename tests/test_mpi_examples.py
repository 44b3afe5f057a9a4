"""The examples run under MPI with any rank count that divides their sizes (2 and 4
here), taking the device count from the launched world, and give the single-device
numbers (each example compares itself with one device and prints the difference);
examples/train.py, the script docs/mpi.md launches, trains exactly as the simulated run
of the same device count."""
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py", reason="backend 'mpi' needs mpi4py (pip install -e '.[test]')")
if shutil.which("mpiexec") is None:
    pytest.skip("mpiexec not found (pip install mpich)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _mpi(n, example, *args, cwd):
    """The example as n ranks through the launcher (rank 0's output on stdout)."""
    return _run([sys.executable, "-m", "dualmode.run", "--worker_num", str(n), "--log_dir",
                 str(cwd / f"logs_{example}"), os.path.join(EXAMPLES, example), *args], cwd)


@pytest.mark.parametrize("n", [2, 4])
def test_examples_run_on_the_launched_ranks_and_equal_one_device(n, tmp_path):
    out = _mpi(n, "data_parallel.py", "--steps", "2", "--batch", "32", cwd=tmp_path)
    assert f"{n} devices:" in out
    loss_err, w_err = map(float, re.search(r"max relative loss difference (\S+), max weight "
                                           r"difference (\S+)", out).groups())
    assert loss_err < 1e-5 and w_err < 1e-5, out
    out = _mpi(n, "operator_parallel.py", "--steps", "2", cwd=tmp_path)
    pairs = re.findall(r"loss is (\S+)\s+\(one device: (\S+)\)", out)
    assert len(pairs) == 2 and all(abs(float(a) - float(b)) <= 1e-5 * abs(float(b))
                                   for a, b in pairs), out
    assert f"fc1_weight: global (784, 512), each device stores ({784 // (n // 2)}, 512)" in out
    out = _mpi(n, "pynative_shard.py", "--steps", "2", cwd=tmp_path)
    worst = float(re.search(r"largest relative difference from the single-device run: (\S+)",
                            out).group(1))
    assert worst < 1e-5, out


@pytest.mark.parametrize("n", [2, 4])
def test_docs_train_script_under_mpi_equals_simulated_devices(n, tmp_path):
    mpi = _mpi(n, "train.py", "--epochs", "1", cwd=tmp_path)
    sim = _run([sys.executable, os.path.join(EXAMPLES, "train.py"), "--epochs", "1",
                "--device_num", str(n)], tmp_path)
    assert f"{n} devices (mpi)" in mpi and f"{n} devices (sim)" in sim
    losses = [re.findall(r"loss is (\S+)", text) for text in (mpi, sim)]
    assert len(losses[0]) == len(losses[1]) >= 2
    for a, b in zip(*losses):          # the gradient AllReduce may add in another order
        assert abs(float(a) - float(b)) <= 1e-4 * abs(float(b)) + 1e-6, (mpi, sim)
    assert "accuracy 1.000" in mpi and "accuracy 1.000" in sim
