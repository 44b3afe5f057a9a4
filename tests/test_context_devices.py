"""Never a silent single device under "sim": context after init() reconfigures the
devices, a parallel mode without device_num is named, a sharded op before init()
starts the backend; a process started by hand as one of several ranks is refused."""
import re

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, ops
from dualmode.parallel import local_shape


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    names = ("RANK_SIZE", "RANK_ID", "PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
             "OMPI_COMM_WORLD_RANK")
    for var in names:
        monkeypatch.delenv(var, raising=False)
    communication.release()
    yield
    for var in names:
        monkeypatch.delenv(var, raising=False)
    dm.reset_auto_parallel_context()
    communication.init()


def _sharded_matmul():
    """The MatMul of seed 003 with an 8-device strategy; its result and the local shape
    of its weight (1/8 of it when the strategy ran)."""
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 100
    w = np.linspace(-1, 1, 16 * 4, dtype=np.float32).reshape(16, 4)
    weight = Parameter(Tensor(w), name="w")
    y = ops.MatMul().shard(((2, 4), (4, 1)))(Tensor(x), weight)
    np.testing.assert_allclose(y.asnumpy(), x @ w, rtol=1e-5, atol=1e-6)
    return local_shape(weight)


def test_context_after_init_reconfigures_sim_devices():
    communication.init()                               # MindSpore's tutorials: init first
    assert communication.get_group_size() == 1
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    assert communication.get_group_size() == 8
    assert communication.get_backend().world_size == 8
    assert _sharded_matmul() == (4, 4)                 # sharded: 16/4 rows on each device


def test_reconfiguring_keeps_groups_that_still_fit():
    dm.set_auto_parallel_context(device_num=8)
    communication.init()
    communication.create_group("low", [0, 1])
    communication.create_group("high", [4, 7])
    dm.set_auto_parallel_context(device_num=4)
    assert communication.get_group_size() == 4
    assert communication.get_group_size("low") == 2
    with pytest.raises(ValueError, match=re.escape("group 'high' does not exist")):
        communication.get_group_size("high")


def test_bad_context_after_init_changes_neither_context_nor_devices():
    dm.set_auto_parallel_context(device_num=4)
    communication.init()
    with pytest.raises(ValueError, match=re.escape(
            "set_auto_parallel_context: global_rank=5 is out of range for device_num=2")):
        dm.set_auto_parallel_context(device_num=2, global_rank=5)
    assert communication.get_group_size() == 4
    assert dm.get_auto_parallel_context("device_num") == 4


def test_parallel_mode_without_device_num_is_named():
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    communication.init()
    with pytest.raises(ValueError, match=re.escape(
            "device_num is not set: parallel_mode='semi_auto_parallel' would run on 1 "
            "simulated device; call dualmode.set_auto_parallel_context(device_num=N)")):
        _sharded_matmul()


def test_sharded_op_before_init_without_device_num_is_named():
    dm.set_auto_parallel_context(parallel_mode="auto_parallel")
    with pytest.raises(ValueError, match=re.escape(
            "device_num is not set: parallel_mode='auto_parallel' would run on 1 simulated "
            "device")):
        _sharded_matmul()
    assert not communication.GlobalComm.INITED


def test_sharded_op_before_init_initialises_the_configured_devices():
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    assert not communication.GlobalComm.INITED
    assert _sharded_matmul() == (4, 4)
    assert communication.get_backend().name == "sim"
    assert communication.get_group_size() == 8


def test_device_num_one_on_purpose_runs_one_device():
    dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=1)
    communication.init()
    y = ops.MatMul()(Tensor(np.ones((2, 3), np.float32)), Tensor(np.ones((3, 2), np.float32)))
    np.testing.assert_array_equal(y.asnumpy(), np.full((2, 2), 3, np.float32))


def test_stand_alone_needs_no_device_num():
    communication.init()
    y = ops.MatMul()(Tensor(np.ones((2, 3), np.float32)), Tensor(np.ones((3, 2), np.float32)))
    np.testing.assert_array_equal(y.asnumpy(), np.full((2, 2), 3, np.float32))


def test_hand_started_rank_is_refused_at_init(monkeypatch):
    """Seed 004's shell scripts start each rank by hand with RANK_SIZE and RANK_ID."""
    monkeypatch.setenv("RANK_SIZE", "8")
    monkeypatch.setenv("RANK_ID", "1")
    with pytest.raises(RuntimeError, match=re.escape(
            "init: environment variable RANK_SIZE=8 (RANK_ID=1) says this process is one of 8 "
            "ranks, but mpiexec did not start it, so it would run alone; start all 8 ranks "
            "with python -m dualmode.run --worker_num 8 script.py (or mpiexec -n 8 python "
            "script.py)")):
        communication.init()
    assert not communication.GlobalComm.INITED
    with pytest.raises(RuntimeError, match="RANK_SIZE=8"):
        communication.init("hccl")
    communication.init("sim")                          # asked for: 8 simulated devices
    assert communication.get_group_size() == 8


def test_mindspore_backend_names_say_what_runs():
    with pytest.warns(UserWarning, match=re.escape(
            "init: backend_name='nccl' is MindSpore's device backend; dualmode runs backend "
            "'sim' in its place (devices simulated in this process)")):
        communication.init("nccl")
    assert communication.GlobalComm.BACKEND == "sim"


def test_strategy_needing_more_devices_than_configured_names_device_num():
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=2)
    communication.init()
    with pytest.raises(ValueError, match=re.escape(
            "MatMul: in_strategy[0]=(2, 4) needs 8 devices but device_num is 2")):
        _sharded_matmul()


def test_device_num_one_on_purpose_refuses_a_strategy_for_more_devices():
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=1)
    communication.init()
    x = Tensor(np.ones((4, 4), np.float32))
    mm = ops.MatMul().shard(((2, 1), (1, 4)))
    with pytest.raises(ValueError, match=r"MatMul: in_strategy\[0\]=\(2, 1\) needs 2 devices "
                                         r"but device_num=1"):
        mm(x, x)
    y = ops.MatMul().shard(((1, 1), (1, 1)))(x, x)      # a one-device strategy runs
    np.testing.assert_array_equal(y.asnumpy(), np.full((4, 4), 4, np.float32))
    dm.set_auto_parallel_context(parallel_mode="stand_alone")
    np.testing.assert_array_equal(mm(x, x).asnumpy(), np.full((4, 4), 4, np.float32))
