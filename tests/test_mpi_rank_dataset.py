"""A data set sharded per rank (``num_shards=get_group_size(), shard_id=get_rank()``):
in one simulated process device d reads shard d, so the simulated run and the MPI run
of the same script train identically (Model.train and a hand-written loop whose labels
meet the output outside any Cell)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import dualmode as dm
from dualmode import communication

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "mpi_scripts", "rank_dataset.py")


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def sim4():
    dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=4)
    communication.init()
    yield
    dm.reset_auto_parallel_context()
    communication.init()


def test_sim_device_d_reads_shard_d(sim4):
    data = np.arange(32, dtype=np.int64).reshape(16, 2)
    ds = dm.dataset.NumpySlicesDataset({"a": data}, shuffle=False,
                                       num_shards=communication.get_group_size(),
                                       shard_id=communication.get_rank()).batch(2)
    batches = [b[0].asnumpy() for b in ds.create_tuple_iterator(num_epochs=1)]
    assert len(batches) == ds.get_dataset_size() == 2
    for step, batch in enumerate(batches):
        # rows 2d:2d+2 of the global batch (device d's) are shard d's batch `step`
        shards = [data[d::4][2 * step:2 * step + 2] for d in range(4)]
        np.testing.assert_array_equal(batch, np.concatenate(shards))


def test_sim_unsharded_or_other_shard_counts_are_read_as_written(sim4):
    data = np.arange(16, dtype=np.int64).reshape(8, 2)
    whole = dm.dataset.NumpySlicesDataset({"a": data}, shuffle=False).batch(4)
    np.testing.assert_array_equal(next(iter(whole))[0].asnumpy(), data[:4])
    two = dm.dataset.NumpySlicesDataset({"a": data}, shuffle=False, num_shards=2,
                                        shard_id=1).batch(2)
    np.testing.assert_array_equal(next(iter(two))[0].asnumpy(), data[[1, 3]])


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found (pip install "
                                                            "mpich)")
@pytest.mark.parametrize("n", [2])          # 4 ranks: tests/test_mpi_examples.py (train.py)
def test_rank_sharded_dataset_trains_the_same_in_sim_and_under_mpi(n, tmp_path):
    pytest.importorskip("mpi4py")
    sim = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "sim.npz"), str(n)],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert sim.returncode == 0, sim.stderr[-3000:]
    mpi = subprocess.run(["mpiexec", "-n", str(n), sys.executable, SCRIPT,
                          str(tmp_path / "mpi.npz")],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert mpi.returncode == 0, mpi.stdout[-3000:] + mpi.stderr[-3000:]
    a, b = np.load(tmp_path / "sim.npz"), np.load(tmp_path / "mpi.npz")
    assert int(a["devices"]) == int(b["devices"]) == n
    assert a["losses"].shape == (2 * 64 // (4 * n),) and a["loop"].shape == (64 // (4 * n),)
    # a training run whose gradient AllReduce MPI may add in another order: rtol 1e-4
    for key in ("losses", "loop", "weight", "bias"):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)
