"""A data set read per rank (num_shards = the devices, shard_id = the rank) with a short
last batch: every rank's shard has ceil(rows / ranks) rows (the last ones wrap around to
the start, as MindSpore's DistributedSampler), so every rank's last batch is equally
short and the global last batch (the ranks' batches in rank order) splits evenly.
Trained in one process on 4 simulated devices and under mpiexec -n 4, it equals one
device trained on the same global batches built by hand."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "mpi_scripts", "uneven_rank_dataset.py")


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd, tmp_path):
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def _check(got, ref):
    # 30 rows on 4 ranks: 8 per shard, batches of 3 -> 3, 3, 2 per rank
    assert list(got["sizes"]) == list(ref["sizes"]) == [12, 12, 8]
    for key in ("losses", "weight", "bias"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_short_last_batch_of_per_rank_shards_simulated(tmp_path):
    _run([sys.executable, SCRIPT, str(tmp_path / "ref.npz"), "4", "ref"], tmp_path)
    _run([sys.executable, SCRIPT, str(tmp_path / "sim.npz"), "4"], tmp_path)
    _check(np.load(tmp_path / "sim.npz"), np.load(tmp_path / "ref.npz"))


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found (pip install "
                                                            "mpich)")
def test_short_last_batch_of_per_rank_shards_under_mpi(tmp_path):
    pytest.importorskip("mpi4py")
    _run([sys.executable, SCRIPT, str(tmp_path / "ref.npz"), "4", "ref"], tmp_path)
    _run(["mpiexec", "-n", "4", sys.executable, SCRIPT, str(tmp_path / "mpi.npz")], tmp_path)
    _check(np.load(tmp_path / "mpi.npz"), np.load(tmp_path / "ref.npz"))
