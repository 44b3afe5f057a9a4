"""Pieces of unequal size across real MPI processes (one device per rank): data parallel
with a batch that does not divide over the ranks equals the same program stand-alone
(tests/mpi_scripts/uneven_dp.py); every rank holds its own rows, the gradients' AllReduces
have equal counts (the pieces are padded alike)."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import communication

from _mpi import load_mpi_script, run_mpi_script


def _equals_stand_alone(script, args, tmp_path, ranks):
    """Run `script` (its ``train(*args, parallel=...)`` saves the losses then each weight)
    on `ranks` MPI processes and check its losses and weights against the same
    ``train`` run stand-alone in this process."""
    out = tmp_path / "out.npz"
    run_mpi_script(script, [out, *args], tmp_path, ranks=ranks, timeout=180)
    data = np.load(out)
    mod = load_mpi_script(script)
    try:
        ref_losses, ref_weights = mod.train(*args, parallel=False)
    finally:
        dm.reset_auto_parallel_context()
        communication.init("sim")
    np.testing.assert_allclose(data["arr_0"], ref_losses, rtol=1e-5)
    for k, want in enumerate(ref_weights):
        np.testing.assert_allclose(data[f"arr_{k + 1}"], want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("ranks,batch", [(3, 32), (2, 31)])
def test_data_parallel_batch_that_does_not_divide_the_ranks(ranks, batch, tmp_path):
    _equals_stand_alone("uneven_dp.py", [batch], tmp_path, ranks)


def test_operator_strategies_that_do_not_divide(tmp_path):
    """Weights cut 2, 2, 1 over 3 ranks by MatMul strategies, a contracted dim of unequal
    pieces, rows of 10 over 3: trained under mpiexec equal to stand-alone (moves of
    unequal pieces across processes gather the world's padded pieces for now)."""
    _equals_stand_alone("uneven_strategies.py", [], tmp_path, 3)


def test_moves_of_unequal_pieces_between_processes(tmp_path):
    """Split to whole, whole to split, rows to columns, 4 pieces to 2 and back, a grid to
    rows, pending sums to a split, to a grid and to whole, between 4 processes: every
    rank gets exactly its destination piece. A move that communicates is one AlltoAll
    of the parts each device lacks (a whole source is only cut)."""
    out = tmp_path / "out.npz"
    run_mpi_script("uneven_moves.py", [out], tmp_path, ranks=4, timeout=180)
    data = np.load(out)
    mod = load_mpi_script("uneven_moves.py")
    names = [c[0] for c in mod.cases()]
    assert dict(zip(names, data["ok"].tolist())) == {n: 1.0 for n in names}
    spent = dict(zip(names, data["nbytes"].tolist()))
    assert spent["whole_to_split"] == 0
    # split to whole: 7 rows of 5 float64 in 4 AlltoAll slots of the largest piece (2
    # rows): (4 - 1) / 4 of 4 slots of 80 bytes each
    assert spent["split_to_whole"] == pytest.approx(3 / 4 * 4 * 80)
