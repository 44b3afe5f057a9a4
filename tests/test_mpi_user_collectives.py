"""The user's collectives (``ops.AllReduce`` & co.) under backend "mpi" (real ranks) and
"sim": one rule for both, equal to the single device.

* A hybrid-parallel layer (a ``layerwise_parallel`` weight cut over the devices, the
  user's AllReduce, AllGather, ReduceScatter or AlltoAll, full batch) trains like the
  single-device layer with the whole weight, whether each rank passes its own slice to ``Parameter``, the slices come from
  ``set_layerwise_slices``, or every device starts from the same value
  (tests/mpi_scripts/user_coll_hybrid.py).
* Without a parallel mode, ``init(); ops.AllReduce()(ones(3))`` on 4 ranks (started by
  ``python -m dualmode.run``) is ``[4, 4, 4]``, as in MindSpore, and so is every
  collective on 4 simulated devices: both backends communicate among the devices
  ``init()`` started (tests/mpi_scripts/user_coll_stand_alone.py).
* The gradient entering a GRAPH_MODE Cell is gathered within the smallest groups of
  devices under "mpi" as under "sim": CommReport lists the same collectives on both
  (tests/mpi_scripts/user_coll_boundary_grad.py).
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, communication, ops

from _mpi import ROOT, SCRIPTS, load_mpi_script, run_mpi_script

HYBRID = "user_coll_hybrid.py"
STAND_ALONE = "user_coll_stand_alone.py"
BOUNDARY = "user_coll_boundary_grad.py"


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
    for how in ("own", "slices"):
        losses, weight = mod.reference("allreduce", how, n)
        np.testing.assert_allclose(data[f"stand_alone_{how}_losses"], losses, rtol=1e-4,
                                   err_msg=f"stand_alone/{how} on {n} ranks")
        np.testing.assert_allclose(data[f"stand_alone_{how}_weight"], weight, rtol=1e-4,
                                   atol=1e-6, err_msg=f"stand_alone/{how} on {n} ranks")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("how", ["slices", "same"])
@pytest.mark.parametrize("kind", ["allreduce", "allgather", "reducescatter", "alltoall"])
def test_hybrid_layer_trains_as_one_device_under_sim(kind, how, n):
    mod = load_mpi_script(HYBRID)
    try:
        losses, weight = mod.train(kind, how, "sim", n)
    finally:
        _reset()
    want_losses, want_weight = mod.reference(kind, how, n)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4)
    np.testing.assert_allclose(weight, want_weight, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("how", ["slices", "same"])
def test_hybrid_layer_without_a_parallel_mode_trains_as_one_device_under_sim(how):
    mod = load_mpi_script(HYBRID)
    try:
        losses, weight = mod.train("allreduce", how, "sim", 4, mode="stand_alone")
    finally:
        _reset()
    want_losses, want_weight = mod.reference("allreduce", how, 4)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4)
    np.testing.assert_allclose(weight, want_weight, rtol=1e-4, atol=1e-6)


def test_layerwise_parameter_made_in_a_hybrid_context_is_per_device():
    try:
        dm.reset_auto_parallel_context()
        dm.set_auto_parallel_context(parallel_mode="hybrid_parallel", device_num=2)
        communication.init()
        w = dm.Parameter(dm.common.initializer.initializer("normal", [4, 3], dm.float32),
                         name="w", layerwise_parallel=True)
        v = dm.Parameter(Tensor(np.ones((4, 3), np.float32)), name="v",
                         layerwise_parallel=True)
        for p in (w, v):
            assert p.layout == dm.parallel.DeviceLocalLayout(2, (4, 3))
            assert p.asnumpy().shape == (2, 4, 3) and p.shape == (4, 3)
        v.set_data(np.full((4, 3), 2.0, np.float32))       # a new value for every device
        assert v.layout == dm.parallel.DeviceLocalLayout(2, (4, 3))
        np.testing.assert_array_equal(v.asnumpy(), np.full((2, 4, 3), 2.0, np.float32))
        plain = dm.Parameter(Tensor(np.ones(3, np.float32)), name="plain")
        assert plain.layout is None
    finally:
        _reset()


# ---------------------------------------------------------------------------
# no parallel mode: the collectives still communicate among the devices init() made
# ---------------------------------------------------------------------------
def test_stand_alone_collectives_communicate_on_four_launched_ranks(tmp_path):
    pytest.importorskip("mpi4py", reason="backend 'mpi' needs mpi4py")
    if shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None and \
            shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    script = tmp_path / STAND_ALONE            # its path names this test's processes
    shutil.copy(os.path.join(SCRIPTS, STAND_ALONE), script)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID", "HYDRA_"))}
    env["PYTHONPATH"] = ROOT
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "dualmode.run", "--worker_num", "4",
                           "--log_dir", str(tmp_path / "logs"), str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[4. 4. 4.]" in proc.stdout
    assert "stand-alone collectives ok: 12 values on 4 ranks" in proc.stdout


def test_stand_alone_collectives_communicate_on_simulated_devices():
    mod = load_mpi_script(STAND_ALONE)
    try:
        dm.reset_auto_parallel_context()
        dm.set_auto_parallel_context(device_num=4)
        communication.init()
        assert dm.get_auto_parallel_context("parallel_mode") == "stand_alone"
        np.testing.assert_array_equal(
            ops.AllReduce()(Tensor(np.ones(3, np.float32))).asnumpy(), [4.0, 4.0, 4.0])
        got = mod.run("sim", 4)
        _, progs = mod.programs(4)
        for name, (_, fw, bw) in progs.items():
            if fw is not None:
                np.testing.assert_allclose(got[name], fw, rtol=1e-6, err_msg=name)
                np.testing.assert_allclose(got[name + " dx"], bw, rtol=1e-5, err_msg=name)
        # ReduceScatter: device d keeps rows [2d, 2d+2) of the sum 4x
        x = mod._f32(1, 8, 3)
        np.testing.assert_allclose(got["ReduceScatter"], 4 * x.reshape(4, 2, 3), rtol=1e-6)
        # one device on purpose, or a backend of one device: the identity
        dm.set_auto_parallel_context(device_num=1)
        np.testing.assert_array_equal(
            ops.AllReduce()(Tensor(np.ones(3, np.float32))).asnumpy(), [1.0, 1.0, 1.0])
        communication.init()
        np.testing.assert_array_equal(
            ops.AllGather()(Tensor(np.ones(3, np.float32))).asnumpy(), [1.0, 1.0, 1.0])
    finally:
        _reset()


def test_stand_alone_collective_in_a_compiled_cell_is_refused_by_name():
    class Net(dm.nn.Cell):
        def __init__(self):
            super().__init__()
            self.allreduce = ops.AllReduce()

        def construct(self, x):
            return self.allreduce(x * 2.0)

    try:
        dm.reset_auto_parallel_context()
        dm.set_auto_parallel_context(device_num=4)
        communication.init()
        dm.set_context(mode=dm.GRAPH_MODE)
        with pytest.raises(ValueError, match=r"^AllReduce: op AllReduce has no sharding rule, "
                                             r"so a compiled graph cannot place it; call it "
                                             r"outside the compiled function \(in PyNative"):
            Net()(Tensor(np.ones(3, np.float32)))
        dm.set_context(mode=dm.PYNATIVE_MODE)
        np.testing.assert_array_equal(Net()(Tensor(np.ones(3, np.float32))).asnumpy(),
                                      [8.0, 8.0, 8.0])
    finally:
        dm.set_context(mode=dm.PYNATIVE_MODE)
        _reset()


# ---------------------------------------------------------------------------
# the gradient entering a compiled Cell: one plan for both backends
# ---------------------------------------------------------------------------
def _check_boundary(loss, grad, entries):
    mod = load_mpi_script(BOUNDARY)
    want_loss, want_grad = mod.reference()
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    backward = [e for e in entries if e[1] == "Inner backward"]
    # the (8, 32) float32 gradient, split in 2 along dim 1: each device receives the
    # other half (512 B) from the other member of its group of 2
    assert [tuple(str(v) for v in e) for e in backward] == \
        [("AllGather", "Inner backward", "redistribution", "2", "2", "512.0")]


def test_cell_gradient_gathered_in_the_smallest_groups_on_four_ranks(tmp_path):
    out = tmp_path / "out.npz"
    run_mpi_script(BOUNDARY, [out], tmp_path, ranks=4, timeout=180)
    data = np.load(out)
    _check_boundary(float(data["loss"]), data["grad"], [tuple(e) for e in data["entries"]])


def test_cell_gradient_gathered_in_the_smallest_groups_on_simulated_devices():
    mod = load_mpi_script(BOUNDARY)
    try:
        loss, grad, entries = mod.run("sim")
    finally:
        _reset()
    _check_boundary(loss, grad, entries)
