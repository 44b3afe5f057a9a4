"""``ops.BatchNorm`` with strategies under backend "mpi" (4 real processes, one device
each): the training statistics' AllReduce inside the op runs through MPI, and training
and inference in PyNative and GRAPH_MODE equal the stand-alone run
(tests/mpi_scripts/batchnorm_strategy.py)."""
from _mpi import run_mpi_script


def test_mpi_batchnorm_strategies_equal_stand_alone(tmp_path):
    proc = run_mpi_script("batchnorm_strategy.py", [], tmp_path, ranks=4, timeout=300)
    # 2 modes x 2 (training, inference) x 3 strategies x (2 losses, 2 dx, 4 parameters)
    assert "batchnorm ok: 96 checks" in proc.stdout, proc.stdout[-2000:]
