"""Parameters stored in pieces of unequal size (a weight of 6 columns split over 4
devices by its op's strategy or a parameter_plan): trained with SGD, Momentum and Adam
they equal the single device in PyNative mode and in GRAPH_MODE; each device stores
its piece; an integrated checkpoint round-trips, a per-rank (sliced) one is refused by
name."""
import os

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import Layout


def _setup(devices, graph=False):
    dm.reset_auto_parallel_context()
    dm.set_context(mode=dm.GRAPH_MODE if graph else dm.PYNATIVE_MODE)
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=devices)
    communication.init()


@pytest.fixture(autouse=True)
def _reset():
    yield
    dm.reset_auto_parallel_context()
    dm.set_context(mode=dm.PYNATIVE_MODE)


class Net(nn.Cell):
    """w1 (12, 6) split 4 ways over its columns (2, 2, 1, 1); w2 (6, 5) over its rows."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.w1 = Parameter(Tensor(rng.standard_normal((12, 6)).astype(np.float32) * 0.3),
                            name="w1")
        self.w2 = Parameter(Tensor(rng.standard_normal((6, 5)).astype(np.float32) * 0.3),
                            name="w2")
        self.mm1 = ops.MatMul().shard(((2, 1), (1, 4)))
        self.mm2 = ops.MatMul().shard(((2, 4), (4, 1)))

    def construct(self, x):
        return self.mm2(ops.tanh(self.mm1(x, self.w1)), self.w2)


OPTS = {"SGD": lambda ps: nn.SGD(ps, 0.1), "Momentum": lambda ps: nn.Momentum(ps, 0.1, 0.9),
        "Adam": lambda ps: nn.Adam(ps, 0.01)}


def _train(devices, opt, graph=False, steps=3):
    _setup(devices, graph)
    net = Net()
    params = net.trainable_params()
    optimizer = OPTS[opt](params)
    g = dm.value_and_grad(lambda x: ops.reduce_mean(ops.square(net(x))), None,
                          optimizer.parameters)
    x = Tensor(np.random.default_rng(1).standard_normal((10, 12)).astype(np.float32))
    losses = []
    for _ in range(steps):
        loss, grads = g(x)
        optimizer(grads)
        losses.append(float(loss.asnumpy()))
    return losses, net


@pytest.mark.parametrize("graph", [False, True], ids=["pynative", "graph"])
@pytest.mark.parametrize("opt", sorted(OPTS))
def test_training_weights_split_unevenly_equals_single_device(opt, graph):
    ref_losses, ref = _train(1, opt)
    want = [p.asnumpy() for p in ref.trainable_params()]
    losses, net = _train(8, opt, graph)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for p, w in zip(net.trainable_params(), want):
        np.testing.assert_allclose(p.asnumpy(), w, rtol=1e-4, atol=1e-6, err_msg=p.name)
    if not graph:
        lay = net.w1.layout
        assert not lay.even
        # each device stores its own piece (the padded slot: 2 columns), zeros past it
        assert [dm.parallel.local_shape(net.w1, rank=r)[1] for r in range(8)] == \
            [2, 2, 1, 1] * 2
        assert net.w1._data.shape[-1] == 2
        short = [r for r in range(8) if lay.local_shape_of(r)[1] == 1]
        assert not np.asarray(net.w1._data)[short, :, 1].any()


def test_parameter_plan_places_a_weight_in_unequal_pieces():
    def run(devices):
        _setup(devices)
        w = Parameter(Tensor(np.arange(36, dtype=np.float32).reshape(6, 6) / 36), name="w")
        x = Tensor(np.random.default_rng(2).standard_normal((5, 6)).astype(np.float32))
        fn = lambda t: ops.tanh(ops.matmul(t, w))                          # noqa: E731
        if devices > 1:
            fn = ops.shard(fn, in_strategy=((1, 1),),
                           parameter_plan={"w": Layout((4,), ("mp",))("None", "mp")})
        out, g = dm.value_and_grad(lambda t: ops.reduce_sum(fn(t)), None, [w])(x)
        return out.asnumpy(), g[0].asnumpy(), w
    ref_out, ref_g, _ = run(1)
    out, g, w = run(4)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5)
    np.testing.assert_allclose(g, ref_g, rtol=1e-4, atol=1e-6)
    assert w.layout is not None and not w.layout.even


def test_checkpoints_of_unequal_pieces(tmp_path):
    """Integrated and per-rank (sliced) saves of weights cut 2, 2, 1, 1: each rank's file
    holds its own piece (no pads); loading them back into the same layout, into one
    device, or merging them gives the trained values."""
    from dualmode.train.safetensors_io import CheckpointFile
    _, net = _train(8, "SGD")
    want = {p.name: p.asnumpy() for p in net.trainable_params()}
    lay = net.w1.layout
    full = str(tmp_path / "full.ckpt")
    dm.save_checkpoint(net, full)
    base = str(tmp_path / "n.ckpt")
    dm.save_checkpoint(net, base, integrated_save=False)
    files = [str(tmp_path / f"rank_{r}" / "n.ckpt") for r in range(8)]
    for r, path in enumerate(files):
        with CheckpointFile(path) as f:
            np.testing.assert_array_equal(f.read("w1"), want["w1"][lay.device_slices()[r]])
    fresh = Net()
    fresh(Tensor(np.zeros((10, 12), np.float32)))           # stored in its layouts
    assert dm.load_distributed_checkpoint(fresh, files) == []
    assert fresh.w1.layout == lay
    for p in fresh.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), want[p.name])
    short = [r for r in range(8) if lay.local_shape_of(r)[1] == 1]
    assert not np.asarray(fresh.w1._data)[short, :, 1].any()       # zero pads
    merged = str(tmp_path / "merged.ckpt")
    dm.merge_sliced_checkpoints(files, str(tmp_path / "strategy.json"), merged)
    for name, value in dm.load_checkpoint(merged).items():
        if name in want:
            np.testing.assert_array_equal(value.asnumpy(), want[name])
    _setup(1)
    one = Net()
    dm.load_distributed_checkpoint(one, files)
    for p in one.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), want[p.name])
    dm.load_param_into_net(one, dm.load_checkpoint(full))
    for p in one.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), want[p.name])


def test_transform_checkpoints_into_other_unequal_pieces(tmp_path):
    """Sliced files of 8 devices (w1's columns 2, 2, 1, 1) transformed to 3 devices with
    w1's rows cut 4, 4, 4 and w2's columns 2, 2, 1: each new rank file holds its piece, and
    they load into one device as the trained values."""
    from dualmode.parallel import TensorLayout
    from dualmode.train.safetensors_io import CheckpointFile
    from dualmode.train.strategy_file import save_strategy_file
    _, net = _train(8, "SGD")
    want = {p.name: p.asnumpy() for p in net.trainable_params()}
    src = tmp_path / "src"
    src.mkdir()
    dm.save_checkpoint(net, str(src / "n.ckpt"), integrated_save=False)
    layouts = {"w1": TensorLayout((3,), ((0,), ()), (12, 6)),
               "w2": TensorLayout((3,), ((), (0,)), (6, 5))}
    dst_strategy = str(tmp_path / "dst.json")
    save_strategy_file(dst_strategy, layouts)
    dst = str(tmp_path / "dst")
    dm.transform_checkpoints(str(src), dst, str(src / "strategy.json"), dst_strategy)
    files = [os.path.join(dst, f"rank_{r}", "n.ckpt") for r in range(3)]
    for r, path in enumerate(files):
        with CheckpointFile(path) as f:
            for name, lay in layouts.items():
                np.testing.assert_array_equal(f.read(name), want[name][lay.device_slices()[r]])
    _setup(1)
    one = Net()
    dm.load_distributed_checkpoint(one, files)
    for p in one.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), want[p.name])
