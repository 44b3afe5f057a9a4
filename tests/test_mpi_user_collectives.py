"""The user's collectives (``ops.AllReduce`` & co.) under backend "mpi" (real ranks) and
"sim": one rule for both, equal to the single device.

* A hybrid-parallel layer (a ``layerwise_parallel`` weight cut on dim 1, the user's
  AllReduce or AllGather, full batch) trains like the single-device layer with the whole
  weight, whether each rank passes its own slice to ``Parameter``, the slices come from
  ``set_layerwise_slices``, or every device starts from the same value
  (tests/mpi_scripts/user_coll_hybrid.py).
"""
import numpy as np
import pytest

import dualmode as dm
from dualmode import communication

from _mpi import load_mpi_script, run_mpi_script

HYBRID = "user_coll_hybrid.py"


def _reset():
    dm.reset_auto_parallel_context()
    communication.init("sim")


@pytest.mark.parametrize("n", [2, 4])
def test_hybrid_layer_trains_as_one_device_under_mpi(n, tmp_path):
    out = tmp_path / "out.npz"
    run_mpi_script(HYBRID, [out], tmp_path, ranks=n, timeout=180)
    data = np.load(out)
    assert int(data["n"]) == n
    mod = load_mpi_script(HYBRID)
    for kind in mod.KINDS:
        for how in ("own", "slices", "same"):
            losses, weight = mod.reference(kind, how, n)
            np.testing.assert_allclose(data[f"{kind}_{how}_losses"], losses, rtol=1e-4,
                                       err_msg=f"{kind}/{how} on {n} ranks")
            np.testing.assert_allclose(data[f"{kind}_{how}_weight"], weight, rtol=1e-4,
                                       atol=1e-6, err_msg=f"{kind}/{how} on {n} ranks")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("how", ["slices", "same"])
@pytest.mark.parametrize("kind", ["allreduce", "allgather"])
def test_hybrid_layer_trains_as_one_device_under_sim(kind, how, n):
    mod = load_mpi_script(HYBRID)
    try:
        losses, weight = mod.train(kind, how, "sim", n)
    finally:
        _reset()
    want_losses, want_weight = mod.reference(kind, how, n)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4)
    np.testing.assert_allclose(weight, want_weight, rtol=1e-4, atol=1e-6)
