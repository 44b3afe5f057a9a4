"""Per-rank data sets whose batches have unequal row counts under MPI (one device per
process): row counts that are numpy.array_split's pieces of their total (the first ranks
one row longer) are taken as the uneven pieces of that global batch, and training equals
one device on the concatenated batches; other counts are refused on every rank, naming
the column and every rank's count, and the job ends. The ranks' counts are gathered once
per data set plan / new row count, never per step.

The jobs run tests/mpi_scripts/unequal_rows_train.py (see its docstring for the cases)."""
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from _launch import copy_script, have_mpiexec, job_env, no_survivors

NAME = "unequal_rows_train.py"

pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="mpiexec not found (pip install "
                                                           "mpich)")


def _run(cmd, tmp_path, timeout, env=None):
    """Run `cmd` in its own process group; on timeout end the whole group (no rank left
    behind) and fail."""
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(**(env or {})),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        pytest.fail(f"{cmd} did not end within {timeout} s (a hang)")
    assert not no_survivors(str(tmp_path)), "processes of the job are still running"
    return proc.returncode, out, err


def _job(tmp_path, case, mode, ranks, out="mpi.npz", timeout=180, env=None):
    pytest.importorskip("mpi4py", reason="backend 'mpi' needs mpi4py")
    script = copy_script(tmp_path, "mpi_scripts", NAME)
    return _run(["mpiexec", "-n", str(ranks), sys.executable, script,
                 str(tmp_path / out), case, mode], tmp_path, timeout, env)


def _reference(tmp_path, case, mode, ranks):
    """One device trained on the global batches built by hand."""
    script = copy_script(tmp_path, "mpi_scripts", NAME)
    rc, out, err = _run([sys.executable, script, str(tmp_path / "ref.npz"), case, mode,
                         str(ranks)], tmp_path, 120)
    assert rc == 0, out[-3000:] + err[-3000:]
    return np.load(tmp_path / "ref.npz")


def _trains_as_one_device(tmp_path, case, mode, ranks, sizes, local=None):
    ref = _reference(tmp_path, case, mode, ranks)
    rc, out, err = _job(tmp_path, case, mode, ranks)
    assert rc == 0, out[-3000:] + err[-3000:]
    got = np.load(tmp_path / "mpi.npz")
    assert list(ref["sizes"]) == sizes
    # plain Tensors of rank 0's rows when the parallel mode came after the iterator
    assert list(got["sizes"]) == (sizes if local is None else local)
    assert len(got["losses"]) == len(sizes)
    # a training run whose gradient AllReduce MPI may add in another order: rtol 1e-4
    for key in ("losses", "w0", "w1", "w2", "w3"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-4, atol=1e-6, err_msg=key)
    return got


@pytest.mark.parametrize("mode", ["data_parallel", "model", "semi_auto"])
def test_short_last_batch_on_one_rank_trains_as_one_device(tmp_path, mode):
    # rank 0 reads 8 rows, rank 1 7: batches [4, 4] then [4, 3] (array_split's pieces
    # of 7), the first batch's rows equal: the step counts rank 1's short batch right
    got = _trains_as_one_device(tmp_path, "last", mode, 2, [8, 7])
    # the data set's plan is gathered at its first batch; its second epoch needs nothing
    assert list(got["epochs"]) == [1, 0]


def test_three_ranks_short_last_batch_trains_as_one_device(tmp_path):
    _trains_as_one_device(tmp_path, "last", "data_parallel", 3, [12, 11])


def test_unequal_batches_of_an_unplanned_data_set_train_as_one_device(tmp_path):
    # a repeated data set (its batch sizes not known up front): rank 0 batches of 4, rank
    # 1 of 3, every step [4, 3]; the counts are gathered once per new row count
    got = _trains_as_one_device(tmp_path, "each", "data_parallel", 2, [7, 7, 7, 7])
    assert list(got["epochs"]) == [2, 0]          # the plan (unknown), the count 4 / 3


def test_plain_tensors_of_a_rank_sharded_data_set_train_as_one_device(tmp_path):
    # the iterator made before the parallel mode: its batches are plain Tensors of this
    # rank's rows (4 on rank 0, 3 on rank 1), which the network call takes as its piece
    _trains_as_one_device(tmp_path, "each", "late", 2, [7, 7, 7, 7], local=[4, 4, 4, 4])


def test_counts_changing_out_of_step_end_the_job_by_the_timeout(tmp_path):
    # batches of such plain Tensors are checked once per new row count: at the second
    # batch rank 0 still has 4 rows (known) while rank 1 has 3 (new), so rank 1 waits in
    # the check (on a communicator of its own, never matching another collective) and
    # rank 0 in the step: DUALMODE_COMM_TIMEOUT ends the job with the check named
    rc, out, err = _job(tmp_path, "last", "late", 2, timeout=120,
                        env={"DUALMODE_COMM_TIMEOUT": "5"})
    assert rc != 0 and not (tmp_path / "mpi.npz").exists()
    assert re.search(r"the ranks' rows check of their batches \(made by a rank whose batch "
                     r"has rows it had not had before: every rank's must change at the same "
                     r"steps\) over ranks \[0, 1\] timed out on rank 1 after 5.0 s", err), \
        err[-3000:]


def test_equal_counts_take_no_collective_after_the_first_batch(tmp_path):
    got = _trains_as_one_device(tmp_path, "equal", "data_parallel", 2, [8, 8])
    assert list(got["epochs"]) == [1, 0]


@pytest.mark.parametrize("case, pinned", [
    ("bad", r"data set column 'x': the ranks' batches have unequal row counts \(rank 0: 5, "
            r"rank 1: 9\); .*not how 14 rows split over 2 ranks \(numpy.array_split's "
            r"pieces in rank order: \[7, 7\].*pad or drop rows.*full_batch=True"),
    ("steps", r"the ranks' epochs have different numbers of batches \(rank 0: 2, rank 1: "
              r"1\); every rank must take the same steps"),
    ("tensor", r"input 0: a Tensor given to the network is the whole global batch, the same "
               r"on every rank .*different shapes \(this rank's is \([78], 6\); rank 0: 8 "
               r"rows of 48 values, rank 1: 7 rows of 42 values\); .*data set sharded per "
               r"rank \(num_shards=get_group_size\(\), shard_id=get_rank\(\)\)"),
])
def test_incompatible_counts_are_refused_on_every_rank(tmp_path, case, pinned):
    rc, out, err = _job(tmp_path, case, "data_parallel", 2, timeout=120)
    assert rc != 0
    assert not (tmp_path / "mpi.npz").exists()
    for rank in (0, 1):
        path = tmp_path / f"refused_{rank}.txt"
        assert path.exists(), f"rank {rank} did not refuse: " + out[-3000:] + err[-3000:]
        assert re.search(pinned, path.read_text()), path.read_text()
