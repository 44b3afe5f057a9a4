"""Image ops sharded on 8 simulated devices against the stand-alone run of the same
program: Conv2D split on N, C_out, C_in (pending sums) and H/W (halo exchange), pools
on H/W, BatchNorm statistics of the global batch under data parallel and under an
H/W ``dataset_strategy``; loss, every input and weight gradient, moving statistics."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel import CommReport

from _devices import devices

RTOL = 1e-4          # float32 sums reordered across devices


def _close(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(float(np.abs(b).max()), 1e-6)
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * scale * 1e-2, err_msg=what)


def _run_both(fn, args, n=8, **ctx):
    """value_and_grad of fn over every argument, stand-alone and on n devices."""
    g = dm.value_and_grad(fn, grad_position=tuple(range(len(args))))
    with devices(None):
        ref = g(*[Tensor(a) for a in args])
    with devices(n, **ctx):
        with CommReport() as rep:
            got = g(*[Tensor(a) for a in args])
    _close(got[0].asnumpy(), ref[0].asnumpy(), "loss")
    for i, (a, b) in enumerate(zip(got[1], ref[1])):
        _close(a.asnumpy(), b.asnumpy(), f"gradient of input {i}")
    return rep


CONV_STRATEGIES = {
    "N": ((8, 1, 1, 1), (1, 1, 1, 1)),
    "Cout": ((1, 1, 1, 1), (8, 1, 1, 1)),
    "Cin": ((1, 4, 1, 1), (1, 4, 1, 1)),
    "HW": ((1, 1, 2, 4), (1, 1, 1, 1)),
    "N-Cin-H": ((2, 2, 2, 1), (1, 2, 1, 1)),
    "Cout-W": ((1, 1, 1, 2), (4, 1, 1, 1)),
}
CONV_GEOMETRY = [dict(pad_mode="same"), dict(pad_mode="same", stride=2),
                 dict(pad_mode="pad", pad=1, stride=2), dict(pad_mode="valid"),
                 dict(pad_mode="same", dilation=2), dict(pad_mode="same", stride=2, k=1)]


@pytest.mark.parametrize("geometry", CONV_GEOMETRY, ids=lambda g: "-".join(
    f"{k}{v}" for k, v in g.items()))
@pytest.mark.parametrize("split", list(CONV_STRATEGIES))
def test_conv2d_sharded_equals_stand_alone(split, geometry):
    rng = np.random.default_rng(0)
    geometry = dict(geometry)
    k = geometry.pop("k", 3)          # 1x1 stride 2: each device's block is cropped
    x = rng.normal(size=(8, 4, 8, 16)).astype(np.float32)
    w = rng.normal(size=(8, 4, k, k)).astype(np.float32)

    def fn(a, b):
        y = ops.Conv2D(8, k, **geometry).shard(CONV_STRATEGIES[split])(a, b)
        return ops.reduce_sum(ops.mul(y, y))

    rep = _run_both(fn, (x, w))
    if split == "HW" and geometry.get("pad_mode") != "valid" and k == 3:
        # the halo is exchanged, not the whole image: forward and both backward ops
        fwd = [r for r in rep.records if r.op == "Conv2D"]
        assert [r.kind for r in fwd] == ["AllGather", "AllGather"]
        assert all(r.reason == "forward" for r in fwd)
        # gathering the image would move 7/8 of it per device (a dilated kernel's halo
        # here is as tall as a device's block)
        assert geometry.get("dilation") or sum(r.bytes_per_device for r in fwd) < x.nbytes / 2


def test_conv2d_groups_sharded_on_n_and_h():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 4, 8, 8)).astype(np.float32)
    w = rng.normal(size=(8, 2, 3, 3)).astype(np.float32)

    def fn(a, b):
        y = ops.Conv2D(8, 3, pad_mode="same", group=2).shard(((2, 1, 4, 1), (1, 1, 1, 1)))(a, b)
        return ops.reduce_sum(ops.mul(y, y))

    _run_both(fn, (x, w))


@pytest.mark.parametrize("pool, kernel, stride, pad_mode", [
    ("max", 3, 2, "same"), ("max", 2, 2, "valid"), ("avg", 2, 2, "valid"),
    ("avg", 3, 2, "same"), ("max", 3, 1, "same"), ("max", 1, 2, "valid")])
def test_pool_sharded_on_hw_equals_stand_alone(pool, kernel, stride, pad_mode):
    x = np.random.default_rng(2).permutation(8 * 2 * 8 * 16).reshape(8, 2, 8, 16)
    x = (x / 100.0).astype(np.float32)
    prim = ops.MaxPool if pool == "max" else ops.AvgPool

    def fn(a):
        y = prim(kernel, stride, pad_mode).shard(((2, 1, 2, 2),))(a)
        return ops.reduce_sum(ops.mul(y, y))

    _run_both(fn, (x,))


class _Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, weight_init="normal")
        self.bn1 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, "same")
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, weight_init="normal", has_bias=True)
        self.bn2 = nn.BatchNorm2d(8, gamma_init="normal")
        self.relu = nn.ReLU()

    def construct(self, x):
        y = self.pool(self.relu(self.bn1(self.conv1(x))))
        y = self.relu(self.bn2(self.conv2(y)))
        return ops.reduce_mean(y, (2, 3))


def _train_block(n, steps=2, **ctx):
    rng = np.random.default_rng(3)
    data = [rng.normal(1.0, 2.0, size=(8, 3, 16, 16)).astype(np.float32) for _ in range(steps)]
    with devices(n, **ctx):
        dm.set_seed(5)
        net = _Block()
        net.set_train()
        opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
        grad_fn = dm.value_and_grad(lambda x: ops.reduce_mean(ops.square(net(x))), None,
                                    opt.parameters)
        losses = []
        with CommReport() as rep:
            for x in data:
                loss, grads = grad_fn(Tensor(x))
                opt(grads)
                losses.append(float(loss.asnumpy()))
        params = {p.name: p.asnumpy() for p in net.get_parameters()}
    return losses, params, rep


@pytest.mark.parametrize("ctx", [
    dict(parallel_mode="data_parallel", gradients_mean=True),
    dict(parallel_mode="semi_auto_parallel", dataset_strategy=((1, 1, 2, 4),),
         gradients_mean=True),
    dict(parallel_mode="semi_auto_parallel", dataset_strategy=((2, 1, 2, 2),),
         gradients_mean=True),
], ids=["data_parallel", "tiles_HW", "tiles_NHW"])
def test_conv_bn_training_equals_stand_alone(ctx):
    ref_losses, ref_params, _ = _train_block(None)
    losses, params, rep = _train_block(8, **ctx)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for name, want in ref_params.items():
        _close(params[name], want, name)        # weights and moving statistics
    # BatchNorm (nn.BatchNorm2d's bn_train, one op): one AllReduce of the (2, C) sums per
    # layer and step, inside the op, reported under it as forward communication
    ar = [r for r in rep.records if r.kind == "AllReduce" and r.op == "BatchNorm"]
    assert all(r.reason == "forward" for r in ar)
    # (float64 sums: 2 rows x 8 channels x 8 bytes; a ring AllReduce moves < 2x that)
    assert len(ar) == 2 * 2 and all(r.bytes_per_device <= 2 * 2 * 8 * 8 for r in ar)
    if ctx["parallel_mode"] == "data_parallel":
        # its backward finishes the per-channel sums (small AllReduces) rather than
        # gathering an activation to keep them pending
        assert not [r for r in rep.records if r.kind == "AllGather"]


class _GraphBlock(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, weight_init="normal")
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2, 2)

    def construct(self, x):
        return ops.reduce_mean(ops.square(self.pool(ops.relu(self.bn(self.conv(x))))))


def _graph_run(n, graph):
    x = np.random.default_rng(6).normal(size=(8, 3, 8, 8)).astype(np.float32)
    with devices(n):
        if graph:
            dm.set_context(mode=dm.GRAPH_MODE)
        dm.set_seed(1)
        net = _GraphBlock()
        net.set_train()
        if n:
            net.conv.conv2d.shard(((1, 1, 2, 4), (1, 1, 1, 1)))
        opt = nn.SGD(net.trainable_params(), 0.1)
        g = dm.value_and_grad(net, None, opt.parameters)
        losses = []
        for _ in range(2):
            loss, grads = g(Tensor(x))
            opt(grads)
            losses.append(float(loss.asnumpy()))
        return losses, {p.name: p.asnumpy() for p in net.get_parameters()}


@pytest.mark.parametrize("graph", [False, True], ids=["pynative", "graph_mode"])
def test_conv_hw_strategy_and_bn_in_both_modes(graph):
    ref_losses, ref = _graph_run(None, False)
    losses, got = _graph_run(8, graph)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for name, want in ref.items():          # moving statistics included (an opaque node
        _close(got[name], want, name)       # in graph mode)


@pytest.mark.parametrize("strategy, match", [
    (((1, 2, 1, 1), (1, 4, 1, 1)), r"Conv2D: in_strategy\[0\]\[1\]=2 and in_strategy\[1\]\[1\]=4 "
                                   r"split the input channel dim differently"),
    # (8 rows in 3 pieces would be 3, 3, 2; but 3 parts do not fit 8 devices)
    (((1, 1, 3, 1), (1, 1, 1, 1)), r"Conv2D: in_strategy\[0\]=\(1, 1, 3, 1\) needs 3 devices, "
                                   r"which does not divide device_num=8"),
])
def test_bad_conv_strategies_are_named(strategy, match):
    x = Tensor(np.zeros((8, 4, 8, 8), np.float32))
    w = Tensor(np.zeros((4, 4, 3, 3), np.float32))
    with devices(8):
        with pytest.raises(ValueError, match=match):
            ops.Conv2D(4, 3).shard(strategy)(x, w)
