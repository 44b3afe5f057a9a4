"""Run under ``mpiexec -n 4``: image ops split on H/W (halo exchange through the MPI
backend, one device per process) and N/C equal the stand-alone run in the same process,
forward and gradients, and a conv + BatchNorm block trains like one device with an H/W
``dataset_strategy``. Rank 0 prints "conv ok: <count> checks"."""
import sys

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication, nn, ops
from dualmode.parallel import CommReport

N = 4
CHECKS = [0]


def _ctx(mode, **kw):
    dm.reset_auto_parallel_context()
    dm.set_auto_parallel_context(parallel_mode=mode, device_num=N, **kw)
    communication.init()


def _close(what, got, want, rtol=1e-4):
    got, want = np.asarray(got), np.asarray(want)
    scale = max(float(np.abs(want).max()), 1e-6)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale * 1e-2,
                               err_msg=f"rank {communication.get_rank()}: {what}")
    CHECKS[0] += 1


def _both(name, fn, args):
    g = dm.value_and_grad(fn, grad_position=tuple(range(len(args))))
    _ctx("stand_alone")
    ref = g(*[Tensor(a) for a in args])
    _ctx("semi_auto_parallel")
    with CommReport() as rep:
        got = g(*[Tensor(a) for a in args])
    _close(f"{name} loss", got[0].asnumpy(), ref[0].asnumpy())
    for i, (a, b) in enumerate(zip(got[1], ref[1])):
        _close(f"{name} grad {i}", a.asnumpy(), b.asnumpy())
    return rep


def ops_checks():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 4, 8, 8)).astype(np.float32)
    w = rng.normal(size=(4, 4, 3, 3)).astype(np.float32)
    for st in [((1, 1, 2, 2), (1, 1, 1, 1)), ((2, 2, 1, 1), (1, 2, 1, 1)),
               ((1, 1, 4, 1), (1, 1, 1, 1))]:
        for kw in [dict(pad_mode="same"), dict(pad_mode="same", stride=2),
                   dict(pad_mode="pad", pad=1, stride=2)]:
            def fn(a, b, st=st, kw=kw):
                y = ops.Conv2D(4, 3, **kw).shard(st)(a, b)
                return ops.reduce_sum(ops.mul(y, y))
            rep = _both(f"Conv2D {st} {kw}", fn, (x, w))
            if st[0][2] > 1 and kw.get("stride", 1) == 1:
                halo = [r for r in rep.records if r.op == "Conv2D"]
                assert halo and all(r.kind == "AllGather" for r in halo), rep
    for prim in (ops.MaxPool(3, 2, "same"), ops.AvgPool(2, 2, "valid")):
        def fn(a, prim=prim):
            y = prim.shard(((1, 1, 2, 2),))(a)
            return ops.reduce_sum(ops.mul(y, y))
        _both(prim.name, fn, (x,))


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, weight_init="normal")
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(3, 2, "same")

    def construct(self, x):
        return ops.reduce_mean(ops.square(self.pool(ops.relu(self.bn(self.conv(x))))))


def train_checks():
    data = [np.random.default_rng(s).normal(1.0, 2.0, (4, 3, 8, 8)).astype(np.float32)
            for s in range(2)]
    out = {}
    for mode, kw in (("stand_alone", {}),
                     ("semi_auto_parallel", dict(dataset_strategy=((1, 1, 2, 2),)))):
        _ctx(mode, **kw)
        dm.set_seed(2)
        net = Block()
        net.set_train()
        opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
        grad_fn = dm.value_and_grad(net, None, opt.parameters)
        losses = []
        for x in data:
            loss, grads = grad_fn(Tensor(x))
            opt(grads)
            losses.append(float(loss.asnumpy()))
        out[mode] = losses, {p.name: p.asnumpy() for p in net.get_parameters()}
    (la, pa), (lb, pb) = out["semi_auto_parallel"], out["stand_alone"]
    _close("block losses", la, lb)
    for name in pb:
        _close(f"block {name}", pa[name], pb[name])


if __name__ == "__main__":
    communication.init()
    ops_checks()
    train_checks()
    if communication.get_rank() == 0:
        print(f"conv ok: {CHECKS[0]} checks")
    sys.stdout.flush()
