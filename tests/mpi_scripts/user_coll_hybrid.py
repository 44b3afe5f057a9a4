"""Run under ``mpiexec -n N`` (or import it and call :func:`train` under "sim"): the
hybrid-parallel layer of MindSpore's distributed training tutorial (a weight cut on dim 1,
``layerwise_parallel=True``, per-device MatMul, then the user's collective), trained with
``full_batch=True``, SGD (lr 0.002) and three steps of ``value_and_grad`` +
``opt(grads)``. The single-device program is the same layer with the whole weight and
no collective; :func:`reference` computes it in numpy.

Layers (``kind``):

* ``"allreduce"``: ``AllReduce(ReduceSum(x @ w_d, -1))``, the tutorial's layer;
* ``"allgather"``: ``AllGather(Transpose(x @ w_d))``: the devices' columns put together.

How each device gets its slice (``how``):

* ``"slices"``: ``set_layerwise_slices(weight, W, dim=1)``;
* ``"own"`` (MPI only): every rank passes its own slice to ``Parameter(...)``;
* ``"same"``: every device is given the same value ``W0``, which is the single-device
  layer with the whole weight ``W0`` repeated along dim 1.

``python user_coll_hybrid.py OUT.npz``: every rank trains each case; rank 0 writes the
losses and the final weight (every device's slice, joined along dim 1) of each.
"""
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import DeviceLocalLayout, set_layerwise_slices

ROWS, COLS, BATCH, STEPS, LR = 16, 4, 8, 3, 0.002
KINDS = ("allreduce", "allgather")


def data(n):
    """(x, full weight W (ROWS, COLS * n), slice W0 (ROWS, COLS), targets per kind)."""
    rng = np.random.default_rng(28)
    x = rng.uniform(-1, 1, (BATCH, ROWS)).astype(np.float32)
    W = rng.uniform(-0.5, 0.5, (ROWS, COLS * n)).astype(np.float32)
    W0 = rng.uniform(-0.5, 0.5, (ROWS, COLS)).astype(np.float32)
    targets = {"allreduce": rng.uniform(-1, 1, (BATCH,)).astype(np.float32),
               "allgather": rng.uniform(-1, 1, (COLS * n, BATCH)).astype(np.float32)}
    return x, W, W0, targets


def full_weight(how, n):
    _, W, W0, _ = data(n)
    return np.tile(W0, (1, n)) if how == "same" else W


class HybridLayer(nn.Cell):
    def __init__(self, kind, value):
        super().__init__()
        self.weight = Parameter(Tensor(value), name="weight", layerwise_parallel=True)
        self.fc = ops.MatMul()
        self.kind = kind
        if kind == "allreduce":
            self.reduce = ops.ReduceSum()
            self.allreduce = ops.AllReduce(op="sum")
        else:
            self.transpose = ops.Transpose()
            self.allgather = ops.AllGather()

    def construct(self, x):
        y = self.fc(x, self.weight)
        if self.kind == "allreduce":
            return self.allreduce(self.reduce(y, -1))
        return self.allgather(self.transpose(y, (1, 0)))


def train(kind, how, backend=None, n=None):
    """Losses of the steps and the final weight (the devices' slices joined along dim 1)
    on the hybrid-parallel context of `backend` ("sim" with `n` devices, None: mpi)."""
    dm.reset_auto_parallel_context()
    if n is not None:
        dm.set_auto_parallel_context(device_num=n)
    dm.set_auto_parallel_context(parallel_mode="hybrid_parallel", full_batch=True)
    communication.init(backend)
    n = communication.get_group_size()
    x, W, W0, targets = data(n)
    if how == "own":
        r = communication.get_rank()
        value = W[:, COLS * r:COLS * (r + 1)]
    else:
        value = W0
    net = HybridLayer(kind, value)
    if how == "slices":
        set_layerwise_slices(net.weight, W, dim=1)
    if not isinstance(net.weight.layout, DeviceLocalLayout):
        raise AssertionError(f"{kind}/{how}: the layerwise weight is not per-device: "
                             f"{net.weight.layout!r}")
    params = net.trainable_params()
    opt = nn.SGD(params, learning_rate=LR)
    target = Tensor(targets[kind])

    def loss(inp):
        return ops.reduce_sum(ops.square(net(inp) - target))

    grad_fn = dm.value_and_grad(loss, None, params)
    losses = []
    for _ in range(STEPS):
        value_, grads = grad_fn(Tensor(x))
        losses.append(float(value_.asnumpy()))
        opt(grads)
    stack = net.weight.asnumpy()                     # (n, ROWS, COLS): every device's
    return np.array(losses, np.float32), np.concatenate(list(stack), axis=1)


def reference(kind, how, n):
    """The single-device program in numpy (float32): losses and the final weight."""
    x, _, _, targets = data(n)
    W = full_weight(how, n).copy()
    t = targets[kind]
    losses = []
    for _ in range(STEPS):
        y = x @ W
        if kind == "allreduce":
            r = y.sum(-1) - t
            dy = np.broadcast_to((2 * r)[:, None], y.shape)
        else:
            r = y.T - t
            dy = (2 * r).T
        losses.append(np.float32((r * r).sum()))
        W -= np.float32(LR) * (x.T @ dy)
    return np.array(losses, np.float32), W


def main():
    out = sys.argv[1]
    res = {}
    for kind in KINDS:
        for how in ("own", "slices", "same"):
            losses, weight = train(kind, how)
            res[f"{kind}_{how}_losses"] = losses
            res[f"{kind}_{how}_weight"] = weight
    if communication.get_rank() == 0:
        np.savez(out, n=communication.get_group_size(), **res)


if __name__ == "__main__":
    main()
