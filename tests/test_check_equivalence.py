"""check_equivalence: passes on the seed network (operator parallel, Layout variant, data
parallel, hybrid parallel) and names the first diverging op on deliberately wrong
programs (a hybrid-parallel layer without its ops.AllReduce; a value scaled by the device
count); bad arguments are named and change nothing."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.common.initializer import initializer
from dualmode.parallel import (EquivalenceReport, Layout, check_equivalence,
                               set_layerwise_slices)


class SeedNet(nn.Cell):
    """Seed 003's operator-parallel network, small."""

    def __init__(self, layouts=False, fin=64, hidden=32):
        super().__init__()
        self.flatten = ops.Flatten()
        self.fc1_weight = Parameter(initializer("normal", [fin, hidden], dm.float32))
        self.fc2_weight = Parameter(initializer("normal", [hidden, hidden], dm.float32))
        self.fc3_weight = Parameter(initializer("normal", [hidden, 10], dm.float32))
        if layouts:
            lay, lay2 = Layout((2, 2, 2), ("dp", "sp", "mp")), Layout((8,), ("tp",))
            self.matmul1 = ops.MatMul().shard((lay("mp", ("sp", "dp")),
                                               lay(("sp", "dp"), "None")))
            self.matmul2 = ops.MatMul().shard((lay2("None", "tp"), lay2("tp", "None")))
        else:
            self.matmul1 = ops.MatMul().shard(((2, 4), (4, 1)))
            self.matmul2 = ops.MatMul().shard(((1, 8), (8, 1)))
        self.relu1 = ops.ReLU().shard(((4, 1),))
        self.relu2 = ops.ReLU().shard(((8, 1),))
        self.matmul3 = ops.MatMul()

    def construct(self, x):
        x = self.flatten(x)
        x = self.relu1(self.matmul1(x, self.fc1_weight))
        x = self.relu2(self.matmul2(x, self.fc2_weight))
        return self.matmul3(x, self.fc3_weight)


class HybridNet(nn.Cell):
    """Seed 004's hybrid-parallel layer: weight columns per device, ReduceSum per device,
    AllReduce of the partial sums (left out when `allreduce` is False), then ReLU."""

    def __init__(self, cols, allreduce=True):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((32, cols), np.float32)), name="weight",
                                layerwise_parallel=True)
        self.allreduce = ops.AllReduce() if allreduce else None

    def construct(self, x):
        y = ops.reduce_sum(ops.matmul(x, self.weight), -1)
        if self.allreduce is not None:
            y = self.allreduce(y)
        return ops.relu(y)


def _images(b=16):
    return Tensor(np.random.default_rng(0).random((b, 1, 8, 8), dtype=np.float32))


@pytest.mark.parametrize("layouts", [False, True])
def test_seed_network_is_equivalent(layouts):
    dm.set_seed(1)
    net = SeedNet(layouts)
    rep = check_equivalence(net, _images(), device_num=8)
    assert isinstance(rep, EquivalenceReport)
    assert rep.ok and rep.first_divergent_op is None, str(rep)
    assert rep.max_abs_diff < 1e-4
    names = [v.name for v in rep.values]
    assert names == ["output 0", "d/d input 0", "d/d fc1_weight", "d/d fc2_weight",
                     "d/d fc3_weight"]
    assert [op.name for op in rep.ops] == ["Reshape", "MatMul", "ReLU", "MatMul", "ReLU",
                                           "MatMul"]
    assert all(op.relation == "equal" for op in rep.ops)
    assert "Redistribute" in rep.only_sharded
    assert rep.ops[1].strategy == ((2, 4), (4, 1)) if not layouts else True
    text = str(rep)
    assert "OK" in text and "fc2_weight" in text


def test_state_is_restored_after_a_check():
    dm.set_seed(3)
    net = SeedNet()
    w_before = net.fc1_weight.asnumpy().copy()
    draw = dm.context.rng().random()
    dm.set_seed(3)
    check_equivalence(net, _images(), device_num=8)
    assert dm.get_auto_parallel_context("parallel_mode") == "stand_alone"
    assert net.fc1_weight.layout is None
    np.testing.assert_array_equal(net.fc1_weight.asnumpy(), w_before)
    assert dm.context.rng().random() == draw          # the generator was given back


def test_data_parallel_loss_and_default_devices_from_the_context(sim_devices):
    sim_devices(4, mode="data_parallel", gradients_mean=True)
    dm.set_seed(2)
    net = nn.SequentialCell([nn.Dense(12, 8), nn.ReLU(), nn.Dense(8, 3)])
    loss_fn = nn.MSELoss()
    y = Tensor(np.random.default_rng(5).random((8, 3), dtype=np.float32))

    def loss(x):
        return loss_fn(net(x), y)

    x = Tensor(np.random.default_rng(4).random((8, 12), dtype=np.float32))
    rep = check_equivalence(loss, x, weights=net.trainable_params())
    assert rep.ok, str(rep)
    assert rep.device_num == 4 and rep.parallel_mode == "data_parallel"
    assert dm.get_auto_parallel_context("parallel_mode") == "data_parallel"
    assert communication.get_group_size() == 4


def test_value_scaled_by_device_count_names_the_op():
    dm.set_seed(1)
    net = SeedNet()

    def wrong(x):                       # a "mean" that multiplies by the device count
        return ops.reduce_mean(ops.relu(net(x)) * communication.get_group_size())

    rep = check_equivalence(wrong, _images(), device_num=8, weights=net.trainable_params())
    assert not rep.ok
    assert rep.first_divergent_op == "Mul"
    assert rep.divergent.inputs_from[0] == "ReLU"
    # exactly 8x: every output and gradient is off by the device count
    assert rep.values[0].max_rel_diff == pytest.approx(7.0, rel=1e-5)
    assert "first divergent op: Mul" in str(rep)


def _hybrid(n, allreduce):
    dm.set_auto_parallel_context(parallel_mode="hybrid_parallel", device_num=n,
                                 dataset_strategy="full_batch")
    communication.init()
    net = HybridNet(16 // n, allreduce)
    W = np.random.default_rng(2).standard_normal((32, 16)).astype(np.float32)
    set_layerwise_slices(net.weight, W, dim=1)
    x = Tensor(np.random.default_rng(3).standard_normal((6, 32)).astype(np.float32))
    return net, x


@pytest.mark.parametrize("n", [2, 4])
def test_hybrid_parallel_layer_is_equivalent(sim_devices, n):
    net, x = _hybrid(n, allreduce=True)
    stack = net.weight.asnumpy().copy()
    rep = check_equivalence(net, x, layerwise={"weight": 1})
    assert rep.ok, str(rep)
    assert rep.values[-1].note == "per-device slices along dim 1"
    np.testing.assert_array_equal(net.weight.asnumpy(), stack)        # still the slices
    assert net.weight.shape == (32, 16 // n)


def test_hybrid_parallel_without_allreduce_names_the_op_and_the_missing_allreduce(
        sim_devices):
    net, x = _hybrid(4, allreduce=False)
    rep = check_equivalence(net, x, layerwise={"weight": 1})
    assert not rep.ok
    assert rep.first_divergent_op == "ReLU"
    assert [op.relation for op in rep.ops[:2]] == ["device slices along dim 1",
                                                   "per-device partial sums"]
    assert "an AllReduce is missing before it" in rep.note
    assert "ReduceSum" in rep.note


def test_hybrid_output_left_as_partial_sums_names_the_producer(sim_devices):
    dm.set_auto_parallel_context(parallel_mode="hybrid_parallel", device_num=2,
                                 dataset_strategy="full_batch")
    communication.init()
    w = Parameter(Tensor(np.zeros((32, 8), np.float32)), name="w", layerwise_parallel=True)
    set_layerwise_slices(w, np.random.default_rng(1).random((32, 16), dtype=np.float32), dim=1)

    def prog(x):
        return ops.reduce_sum(ops.matmul(x, w), -1)          # no AllReduce at the end

    x = Tensor(np.random.default_rng(2).random((4, 32), dtype=np.float32))
    rep = check_equivalence(prog, x, weights=[w], layerwise={"w": 1})
    assert not rep.ok and rep.first_divergent_op == "ReduceSum"
    assert "an AllReduce is missing after it" in rep.note
    assert "devices hold per-device partial sums" in rep.values[0].note


@pytest.mark.parametrize("call, exc, match", [
    (lambda net, x: check_equivalence(3, x), TypeError,
     r"check_equivalence: fn_or_cell=3 is not callable"),
    (lambda net, x: check_equivalence(net, x, device_num=0), ValueError,
     r"check_equivalence: device_num=0 is not valid; expected an int in \[1, 4096\]"),
    (lambda net, x: check_equivalence(net, [1, 2]), TypeError,
     r"check_equivalence: inputs\[0\] is a list; expected a Tensor"),
    (lambda net, x: check_equivalence(net, x, rtol=-1), ValueError,
     r"check_equivalence: rtol=-1 is not valid; expected a number >= 0"),
    (lambda net, x: check_equivalence(net, x, weights=[x]), TypeError,
     r"check_equivalence: weights\[0\] is a Tensor; expected Parameters"),
])
def test_bad_arguments_are_named_and_change_nothing(call, exc, match):
    net = SeedNet()
    x = _images()
    with pytest.raises(exc, match=match):
        call(net, x)
    assert dm.get_auto_parallel_context("parallel_mode") == "stand_alone"
    assert net.fc1_weight.layout is None


def test_layerwise_weight_without_its_dim_is_named(sim_devices):
    net, x = _hybrid(2, allreduce=True)
    set_layerwise_slices(net.weight, net.weight.asnumpy())     # the same slices, as a stack
    with pytest.raises(ValueError, match=r"check_equivalence: Parameter 'weight' is "
                                         r"layerwise_parallel with per-device slices given "
                                         r"as a stack.*pass layerwise=\{'weight': dim\}"):
        check_equivalence(net, x)
    with pytest.raises(ValueError, match=r"check_equivalence: layerwise\['weight'\]=5 is not "
                                         r"valid; expected a dim in \[-2, 2\)"):
        check_equivalence(net, x, layerwise={"weight": 5})


def test_program_returning_no_float_tensor_is_named():
    p = Parameter(Tensor(np.ones((4,), np.float32)), name="p")

    def prog(x):
        return ops.cast(x * p, dm.int32)

    with pytest.raises(ValueError, match=r"check_equivalence: the program returned no "
                                         r"floating Tensor"):
        check_equivalence(prog, Tensor(np.ones((4,), np.float32)), weights=[p], device_num=2)
    assert dm.get_auto_parallel_context("parallel_mode") == "stand_alone"
