"""A data set read per rank (num_shards = the devices, shard_id = the rank) with a short
last batch: every rank's shard has ceil(rows / ranks) rows (the last ones wrap around to
the start, as MindSpore's DistributedSampler), so every rank's last batch is equally
short and the global last batch (the ranks' batches in rank order) splits evenly.
Trained in one process on 4 simulated devices and under mpiexec -n 4, it equals one
device trained on the same global batches built by hand."""
import os
import subprocess
import sys

import numpy as np

from _launch import job_env
from _mpi import SCRIPTS, run_mpi_script

NAME = "uneven_rank_dataset.py"


def _run(args, tmp_path):
    """The script in this process's Python (the single device's run or "sim")."""
    p = subprocess.run([sys.executable, os.path.join(SCRIPTS, NAME), *map(str, args)],
                       cwd=tmp_path, env=job_env(), capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def _check(got, ref):
    # 30 rows on 4 ranks: 8 per shard, batches of 3 -> 3, 3, 2 per rank
    assert list(got["sizes"]) == list(ref["sizes"]) == [12, 12, 8]
    for key in ("losses", "weight", "bias"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_short_last_batch_of_per_rank_shards_simulated(tmp_path):
    _run([tmp_path / "ref.npz", 4, "ref"], tmp_path)
    _run([tmp_path / "sim.npz", 4], tmp_path)
    _check(np.load(tmp_path / "sim.npz"), np.load(tmp_path / "ref.npz"))


def test_short_last_batch_of_per_rank_shards_under_mpi(tmp_path):
    _run([tmp_path / "ref.npz", 4, "ref"], tmp_path)
    run_mpi_script(NAME, [tmp_path / "mpi.npz"], tmp_path, ranks=4, timeout=180)
    _check(np.load(tmp_path / "mpi.npz"), np.load(tmp_path / "ref.npz"))
