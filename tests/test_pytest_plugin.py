"""The pytest11 plugin, as a user's suite sees it: pytest run in a subprocess on a small
test file (no conftest, dualmode installed) with a passing and a failing case."""
import subprocess
import sys
import textwrap

import numpy as np

import dualmode as dm
from dualmode import communication

USER_TESTS = textwrap.dedent('''
    import numpy as np
    import dualmode as dm
    from dualmode import Parameter, Tensor, communication, nn, ops


    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.random.default_rng(0).random((8, 4),
                                                                     dtype=np.float32)))
            self.matmul = ops.MatMul().shard(((1, 4), (4, 1)))

        def construct(self, x):
            return ops.relu(self.matmul(x, self.w))


    def _x():
        return Tensor(np.random.default_rng(1).random((4, 8), dtype=np.float32))


    def test_passing(sim_devices, assert_sharded_equal, comm_report):
        sim_devices(4, mode="semi_auto_parallel")
        assert communication.get_group_size() == 4
        net = Net()
        report = assert_sharded_equal(net, _x())
        assert report.ok
        with comm_report as rep:
            net(_x())
        assert rep.count("AllReduce", reason="forward") == 1


    def test_restored_after_previous_test():
        assert dm.get_auto_parallel_context("parallel_mode") == "stand_alone"


    def test_failing(sim_devices, assert_sharded_equal):
        sim_devices(4)
        net = Net()

        def scaled(x):
            return net(x) * communication.get_group_size()

        assert_sharded_equal(scaled, _x(), weights=net.trainable_params())
''')


def test_plugin_fixtures_in_a_users_suite(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_user.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 2 passed" in out, out
    assert "test_failing" in out and "sharded run differs from the stand-alone run" in out
    assert "first divergent op: Mul" in out, out


def test_sim_devices_fixture_restores_the_context(sim_devices):
    dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=2)
    communication.init()
    backend = sim_devices(8, mode="semi_auto_parallel", gradients_mean=True)
    assert backend.world_size == 8
    assert dm.get_auto_parallel_context("gradients_mean") is True
    assert sim_devices(None) is None
    assert dm.get_auto_parallel_context("parallel_mode") == "stand_alone"


def test_comm_report_fixture_is_fresh(comm_report):
    assert len(comm_report) == 0
    b = communication.SimBackend(2)
    with comm_report as rep:
        b.all_reduce(np.ones((2, 4), np.float32))
    assert rep.count("AllReduce") == 1
