"""Operator-level parallelism (Primitive.shard strategies) on simulated devices,
compared with the single-device run of the same program."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import CommReport


def _setup(devices, mode="semi_auto_parallel"):
    dm.reset_auto_parallel_context()
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode=mode, device_num=devices,
                                     gradients_mean=True)
    communication.init()


def _example():
    """examples/operator_parallel.py as a module (its Network is the seed-003 network)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "examples" / "operator_parallel.py"
    spec = importlib.util.spec_from_file_location("operator_parallel_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def SeedNet(layouts=False, hidden=64):
    """The tutorial network, small: 48 inputs (3 x 4 x 4 images), `hidden` units."""
    return _example().Network(layouts, in_features=48, hidden=hidden)


def _train(devices, layouts=False, steps=3):
    _setup(devices)
    dm.set_seed(7)
    net = SeedNet(layouts)
    opt = nn.SGD(net.trainable_params(), learning_rate=0.05)
    loss_fn = nn.CrossEntropyLoss()
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    losses = []
    with CommReport() as rep:
        for _ in range(steps):
            x = rng.standard_normal((16, 3, 4, 4)).astype(np.float32)
            y = rng.integers(0, 10, 16).astype(np.int32)
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
            losses.append(float(loss.asnumpy()))
    return losses, [p.asnumpy() for p in net.trainable_params()], rep


@pytest.mark.parametrize("layouts", [False, True], ids=["strategies", "layouts"])
def test_seed_network_trains_like_one_device(layouts):
    ref_losses, ref_w, _ = _train(1, layouts)
    losses, w, rep = _train(8, layouts)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(w, ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert rep.count() > 0


def test_matmul_contracted_split_is_a_pending_sum_resolved_by_allreduce():
    _setup(8)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 16)).astype(np.float32)
    b = rng.standard_normal((16, 4)).astype(np.float32)
    mm = ops.MatMul().shard(((2, 4), (4, 1)))
    relu = ops.ReLU().shard(((8, 1),))
    with CommReport() as rep:
        out = mm(Tensor(a), Tensor(b))
        assert out.layout.partial            # the contracted dim is split 4 ways
        r = relu(out)
    np.testing.assert_allclose(out.asnumpy(), a @ b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r.asnumpy(), np.maximum(a @ b, 0), rtol=1e-5, atol=1e-6)
    assert rep.count(reason="redistribution") >= 1


def test_out_strategy_moves_the_result():
    _setup(8)
    rng = np.random.default_rng(2)
    a = rng.standard_normal((8, 16)).astype(np.float32)
    b = rng.standard_normal((16, 8)).astype(np.float32)
    mm = ops.MatMul().shard(((1, 8), (8, 1)), out_strategy=((8, 1),))
    out = mm(Tensor(a), Tensor(b))
    assert not out.layout.partial and out.layout.tensor_map[0]
    np.testing.assert_allclose(out.asnumpy(), a @ b, rtol=1e-5, atol=1e-5)


def test_strategies_are_ignored_in_stand_alone():
    """As in MindSpore: a network written for 8 devices runs unchanged on one."""
    _setup(1)
    a = Tensor(np.ones((8, 16), np.float32))
    out = ops.MatMul().shard(((2, 4), (4, 1)))(a, Tensor(np.ones((16, 4), np.float32)))
    assert out.layout is None
    out = ops.MatMul().shard(((2, 3), (3, 1)))(a, Tensor(np.ones((16, 4), np.float32)))
    np.testing.assert_array_equal(out.asnumpy(), np.full((8, 4), 16.0, np.float32))
    _setup(8)
    with pytest.raises(ValueError, match=r"MatMul: in_strategy\[0\]=\(2, 3\) needs 6 "
                                         r"devices, which does not divide device_num=8"):
        ops.MatMul().shard(((2, 3), (3, 1)))(a, Tensor(np.ones((16, 4), np.float32)))


def test_strategy_product_larger_than_device_num_is_an_error():
    _setup(4)
    a = Tensor(np.ones((8, 16), np.float32))
    with pytest.raises(ValueError, match="MatMul"):
        ops.MatMul().shard(((2, 4), (4, 1)))(a, Tensor(np.ones((16, 4), np.float32)))


def test_parameters_live_sharded_with_their_optimizer_state():
    _setup(8)
    dm.set_seed(7)
    net = SeedNet()
    opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
    loss_fn = nn.CrossEntropyLoss()
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((16, 3, 4, 4)).astype(np.float32))
    y = Tensor(rng.integers(0, 10, 16).astype(np.int32))
    with CommReport() as rep:
        _, grads = grad_fn(x, y)
        opt(grads)
    # fc1 (48, 64) split 4 ways on rows by matmul1's (4, 1): each device holds a quarter
    assert dm.parallel.local_shape(net.fc1_weight) == (12, 64)
    assert dm.parallel.local_shape(net.fc2_weight) == (8, 64)       # (8, 1) on rows
    assert net.fc1_weight._data.nbytes == 8 * 12 * 64 * 4           # 1/4 per device
    assert opt.moments[0].layout == net.fc1_weight.layout           # state shares it
    assert rep.count(reason="gradient") >= 2      # fc3 (data parallel) and a sharded one
    assert net.fc1_weight.asnumpy().shape == (48, 64)               # the global value


def test_one_parameter_two_strategies_is_an_error_naming_both():
    _setup(8)
    w = Parameter(Tensor(np.ones((16, 4), np.float32)), name="w")
    x = Tensor(np.ones((8, 16), np.float32))
    ops.MatMul().shard(((2, 4), (4, 1)))(x, w)
    with pytest.raises(ValueError, match=r"Parameter w: MatMul needs it in layout .* stored "
                                         r"as .* for MatMul; a parameter used by several ops"):
        ops.MatMul().shard(((1, 8), (8, 1)))(x, w)


@pytest.mark.parametrize("flag", [[], ["--layouts"]], ids=["strategies", "layouts"])
def test_operator_parallel_example_matches_one_device(flag, capsys):
    losses, ref, report = _example().main(["--steps", "2"] + flag)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    out = capsys.readouterr().out
    assert "fc1_weight: global (784, 512), each device stores (196, 512)" in out
    assert report.count("AllReduce", "gradient") >= 2      # at least fc3 (data parallel)
