"""Pipeline-parallel training under any backend: run under mpiexec (backend "mpi", each
rank running its own stage's cells) it writes each rank's losses, its stage's weights
and its CommReport counts to OUT_DIR/rank<r>.npz; tests import it and run the same
program on "sim" in-process to compare.

    mpiexec -n N python pipeline_train.py OUT_DIR STAGES MICRO SCHEDULER OPTIMIZER SHARD TIED [ZERO [GRAPH]]

TIED=1: the last block also reads the first block's weight (a parameter shared by the
first and the last stage, as a tied embedding). OPTIMIZER "adamw": Adam with weight
decay. ZERO=1: the parallel optimizer (every weight's states split over its replicas).
GRAPH=1: GRAPH_MODE (each stage's cells compiled for its devices).
Besides the losses and weights, a rank records how many of the other stages' weights
it holds changed (none should: they are their processes' to update) and the gradient
and parallel-optimizer collectives of its last step. It saves every stage's weights
in one file (OUT_DIR/net.ckpt) and its stage's slices and optimizer states in its own
(OUT_DIR/rank_<r>/sliced.ckpt), and records whether that file loads back into it.
"""
import gc
import os
import sys

import numpy as np

import dualmode as dm
from dualmode import communication, nn, ops
from dualmode.parallel import CommReport
from dualmode.parallel.pipeline import parameter_stage
from dualmode.parallel.report import parameter_bytes_per_device
from dualmode.train.serialization import sliced_path

B, D, STEPS = 16, 8, 3


class Block(nn.Cell):
    def __init__(self, w, strategy=None):
        super().__init__()
        self.w = dm.Parameter(dm.Tensor(w), name="w")
        self.b = dm.Parameter(dm.Tensor(np.full((D,), 0.1, np.float32)), name="b")
        self.matmul = ops.MatMul()
        if strategy is not None:
            self.matmul.shard(strategy)
        self.relu = ops.ReLU()

    def construct(self, x):
        y = self.relu(self.matmul(x, self.w) + self.b)
        tied = self.__dict__.get("tied")
        return y if tied is None else y + ops.matmul(x, tied) * 0.5


class MLP(nn.Cell):
    def __init__(self, stages, strategies):
        super().__init__()
        rng = np.random.default_rng(0)
        self.blocks = nn.CellList([
            Block((rng.standard_normal((D, D)) * 0.4).astype(np.float32), s)
            for s in strategies])
        for k, block in enumerate(self.blocks):
            block.pipeline_stage = k * stages // len(strategies)

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def train(stages, micro, scheduler, optimizer, shard, devices=None, tied=False,
          zero=False, ckpt=None, graph=False):
    """Losses, {stage: weights of its blocks} and the Send/Receive counts; `devices`:
    simulated devices (None: the MPI world)."""
    dm.reset_auto_parallel_context()
    communication.init()
    n = devices or communication.get_group_size()
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n,
                                 pipeline_stages=stages,
                                 pipeline_config={"pipeline_scheduler": scheduler})
    if zero:
        dm.set_auto_parallel_context(enable_parallel_optimizer=True, parallel_optimizer_config={
            "parallel_optimizer_threshold": 0})
    communication.init()
    gc.collect()                            # the weights of earlier runs in this process
    before = parameter_bytes_per_device()
    per = n // stages
    blocks = max(stages, 2)
    strategies = [None] * blocks
    if shard and per > 1:                   # tensor parallel inside each stage
        strategies = [((1, per), (per, 1)), ((per, 1), (1, 1))] * (blocks // 2)
    net = MLP(stages, strategies)
    if tied:
        net.blocks[-1].tied = net.blocks[0].w
    model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), micro)
    params = net.trainable_params()
    opt = {"sgd": lambda: nn.SGD(params, learning_rate=0.05),
           "momentum": lambda: nn.Momentum(params, learning_rate=0.05, momentum=0.9),
           "adam": lambda: nn.Adam(params, learning_rate=0.01),
           "adamw": lambda: nn.Adam(params, learning_rate=0.01, weight_decay=0.1)}[optimizer]()
    initial = [p.asnumpy().copy() for p in params]
    grad_fn = dm.value_and_grad(model, None, opt.parameters)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, D)).astype(np.float32)
    y = rng.standard_normal((B, D)).astype(np.float32)
    losses = []
    if graph:                               # each stage's cells compiled
        dm.set_context(mode=dm.GRAPH_MODE)
    try:
        with CommReport() as report:
            for step in range(STEPS):
                with CommReport() as last:  # the last step: every weight in its layout
                    loss, grads = grad_fn(dm.Tensor(x), dm.Tensor(y))
                    opt(grads)
                losses.append(float(loss.asnumpy()))
    finally:
        dm.set_context(mode=dm.PYNATIVE_MODE)
    stage = communication.get_backend().stage
    weights = {}
    for block in net.blocks:
        k = block.pipeline_stage
        if stage is None or stage == k:
            weights.setdefault(k, []).extend(p.asnumpy().copy()
                                             for p in block.trainable_params()
                                             if not (tied and p is net.blocks[0].w and k))
    reloaded = 0
    if ckpt is not None:                    # every stage's trained weights, one file
        dm.save_checkpoint(net, ckpt)
        # one file per rank (rank_<r>/sliced.ckpt): its stage's weights and their
        # optimizer states, as this rank's slices
        sliced = os.path.join(os.path.dirname(ckpt), "sliced.ckpt")
        dm.save_checkpoint([net, opt], sliced, integrated_save=False)
        if stage is not None:               # this rank's file loads back into it
            own = dm.load_checkpoint(sliced_path(sliced, communication.get_rank()))
            mine = [p for p in params if parameter_stage(p) == stage]
            held = [p for p in mine if p.name in own]
            saved = {p.name: np.array(p._data) for p in held}
            for p in held:
                p._data[...] = 0
            dm.load_param_into_net(net, own)
            reloaded = int(len(held) == len(mine) > 0 and all(
                np.array_equal(np.asarray(p._data), saved[p.name]) for p in held)
                and not any(p.name in own for p in params
                            if parameter_stage(p) != stage))
    # the other stages' weights this rank holds (under "mpi"): changed ones
    changed = sum(not np.array_equal(p.asnumpy(), w0) for p, w0 in zip(params, initial)
                  if stage is not None and parameter_stage(p) != stage)
    # the order this process ran its last step in: F m as m, B m as -(m + 1)
    train.order = [m if kind == "F" else -(m + 1) for kind, m in model.last_order or ()]
    counts = (report.count("Send", "pipeline"), report.count("Receive", "pipeline"),
              report.bytes("Send"), last.parameter_memory - before, changed,
              last.count(reason="gradient"), last.count(reason="parallel_optimizer"),
              reloaded)
    return np.array(losses), weights, counts


if __name__ == "__main__":
    out, stages, micro, scheduler, optimizer, shard, tied = sys.argv[1:8]
    zero = sys.argv[8:9] == ["1"]
    graph = sys.argv[9:10] == ["1"]
    losses, weights, counts = train(int(stages), int(micro), scheduler, optimizer,
                                    shard == "1", tied=tied == "1", zero=zero,
                                    ckpt=os.path.join(out, "net.ckpt"), graph=graph)
    rank = communication.get_rank()
    (stage, ws), = weights.items()
    np.savez(os.path.join(out, f"rank{rank}.npz"), losses=losses, stage=stage,
             counts=np.array(counts), order=np.array(train.order, np.int64), **{f"w{i}": w for i, w in enumerate(ws)})
