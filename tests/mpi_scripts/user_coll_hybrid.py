"""Run under ``mpiexec -n N`` (or import it and call :func:`train` under "sim"): hybrid-
parallel layers in the style of MindSpore's distributed training tutorial (a
``layerwise_parallel`` weight cut over the devices, per-device MatMul, then the user's
collective), trained with ``full_batch=True``, SGD (lr 0.002) and three steps of
``value_and_grad`` + ``opt(grads)``. The single-device program is the same layer with
the whole weight and no collective; :func:`reference` computes it in numpy.

Layers (``kind``), with the dim the weight is cut on:

* ``"allreduce"`` (dim 1): ``AllReduce(ReduceSum(x @ w_d, -1))``, the tutorial's layer;
  loss ``sum((out - t)^2)``;
* ``"allgather"`` (dim 1): ``AllGather(Transpose(x @ w_d))``: the devices' columns put
  together; loss ``sum((out - t)^2)``;
* ``"reducescatter"`` (dim 0): ``ReduceScatter((x @ s_d) @ w_d)``, the partial products
  of the device's rows of the weight (``s_d`` picks the matching columns of x) summed
  and scattered by batch rows;
* ``"alltoall"`` (dim 1): ``AlltoAll(N, 0, 1)(x @ w_d)``: device j receives batch rows
  j of every device's columns.

The last two give each device its own batch rows of the product; the loss is
``AllReduce(ReduceSum((out - p_d @ t)^2))`` (``p_d`` picks device d's target rows), the
single device's ``sum((x @ W - t)^2)``. ``s_d`` and ``p_d`` are ``layerwise_parallel``
constants (``requires_grad=False``).

Each runs in ``hybrid_parallel`` mode; the AllReduce layer also without a parallel mode
(``stand_alone``, where the devices ``init()`` started each run the program).

How each device gets its slice of the weight (``how``):

* ``"slices"``: ``set_layerwise_slices(weight, W, dim)``;
* ``"own"`` (MPI only): every rank passes its own slice to ``Parameter(...)``;
* ``"same"``: every device is given the same value ``W0``, which is the single-device
  layer with the whole weight ``W0`` repeated N times along the cut dim.

``python user_coll_hybrid.py OUT.npz``: every rank trains each case; rank 0 writes the
losses and the final weight (every device's slice, joined along the cut dim) of each.
"""
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import DeviceLocalLayout, set_layerwise_slices

ROWS, COLS, BATCH, STEPS, LR = 16, 4, 8, 3, 0.002
#: kind -> the dim its weight is cut on
KINDS = {"allreduce": 1, "allgather": 1, "reducescatter": 0, "alltoall": 1}


def _rand(rng, *shape, scale=1.0):
    return (scale * rng.uniform(-1, 1, shape)).astype(np.float32)


def data(kind, n):
    """(x, full weight W, slice W0, target) of `kind` on `n` devices."""
    rng = np.random.default_rng(28)
    x = _rand(rng, BATCH, ROWS)
    if KINDS[kind] == 0:
        W, W0 = _rand(rng, ROWS, COLS, scale=0.5), _rand(rng, ROWS // n, COLS, scale=0.5)
    else:
        W, W0 = _rand(rng, ROWS, COLS * n, scale=0.5), _rand(rng, ROWS, COLS, scale=0.5)
    target = {"allreduce": (BATCH,), "allgather": (COLS * n, BATCH),
              "reducescatter": (BATCH, COLS), "alltoall": (BATCH, COLS * n)}[kind]
    return x, W, W0, _rand(rng, *target)


def full_weight(kind, how, n):
    _, W, W0, _ = data(kind, n)
    if how != "same":
        return W
    return np.tile(W0, (n, 1) if KINDS[kind] == 0 else (1, n))


def _constant(name, full, dim):
    p = Parameter(Tensor(np.zeros_like(np.split(full, communication.get_group_size(),
                                                axis=dim)[0])),
                  name=name, requires_grad=False, layerwise_parallel=True)
    return set_layerwise_slices(p, full, dim=dim)


class HybridLayer(nn.Cell):
    def __init__(self, kind, value, target):
        super().__init__()
        n = communication.get_group_size()
        self.kind = kind
        self.weight = Parameter(Tensor(value), name="weight", layerwise_parallel=True)
        self.fc = ops.MatMul()
        self.target = Tensor(target)
        self.sum = ops.ReduceSum()
        if kind == "allreduce":
            self.coll = ops.AllReduce(op="sum")
        elif kind == "allgather":
            self.coll = ops.AllGather()
        else:
            self.loss_sum = ops.AllReduce()
            # p_d: device d's target rows
            self.pick = _constant("pick", np.eye(BATCH, dtype=np.float32), 0)
            if kind == "reducescatter":
                self.coll = ops.ReduceScatter()
                # s_d: the columns of x matching device d's rows of the weight
                self.cols = _constant("cols", np.eye(ROWS, dtype=np.float32), 1)
            else:
                self.coll = ops.AlltoAll(n, 0, 1)

    def construct(self, x):
        if self.kind == "reducescatter":
            x = self.fc(x, self.cols)
        y = self.fc(x, self.weight)
        if self.kind == "allreduce":
            return self.sum(ops.square(self.coll(self.sum(y, -1)) - self.target))
        if self.kind == "allgather":
            return self.sum(ops.square(self.coll(ops.transpose(y, (1, 0))) - self.target))
        rows = self.coll(y)
        return self.loss_sum(self.sum(ops.square(rows - self.fc(self.pick, self.target))))


def train(kind, how, backend=None, n=None, mode="hybrid_parallel"):
    """Losses of the steps and the final weight (the devices' slices joined along the
    cut dim) in `mode` ("hybrid_parallel" with ``full_batch``, or "stand_alone": the
    devices ``init()`` started each run the program) on `backend` ("sim" with `n`
    devices, None: mpi)."""
    dm.reset_auto_parallel_context()
    if n is not None:
        dm.set_auto_parallel_context(device_num=n)
    if mode == "hybrid_parallel":
        dm.set_auto_parallel_context(parallel_mode=mode, full_batch=True)
    communication.init(backend)
    n = communication.get_group_size()
    dim = KINDS[kind]
    x, W, W0, target = data(kind, n)
    if how == "own":
        value = np.split(W, n, axis=dim)[communication.get_rank()]
    else:
        value = W0
    net = HybridLayer(kind, value, target)
    if how == "slices":
        set_layerwise_slices(net.weight, W, dim=dim)
    if not isinstance(net.weight.layout, DeviceLocalLayout):
        raise AssertionError(f"{kind}/{how}: the layerwise weight is not per-device: "
                             f"{net.weight.layout!r}")
    params = net.trainable_params()
    assert [p.name for p in params] == ["weight"]
    opt = nn.SGD(params, learning_rate=LR)
    grad_fn = dm.value_and_grad(net, None, params)
    losses = []
    for _ in range(STEPS):
        value_, grads = grad_fn(Tensor(x))
        losses.append(float(value_.asnumpy()))
        opt(grads)
    stack = net.weight.asnumpy()                     # every device's slice
    return np.array(losses, np.float32), np.concatenate(list(stack), axis=dim)


def reference(kind, how, n):
    """The single-device program in numpy (float32): losses and the final weight."""
    x, _, _, t = data(kind, n)
    W = full_weight(kind, how, n).copy()
    losses = []
    for _ in range(STEPS):
        y = x @ W
        if kind == "allreduce":
            r = y.sum(-1) - t
            dy = np.broadcast_to((2 * r)[:, None], y.shape)
        elif kind == "allgather":
            r = y.T - t
            dy = (2 * r).T
        else:
            r = y - t
            dy = 2 * r
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
    for how in ("own", "slices"):          # no parallel mode: the same layer
        losses, weight = train("allreduce", how, mode="stand_alone")
        res[f"stand_alone_{how}_losses"] = losses
        res[f"stand_alone_{how}_weight"] = weight
    if communication.get_rank() == 0:
        np.savez(out, n=communication.get_group_size(), **res)


if __name__ == "__main__":
    main()
