"""Two pipeline stages on two MPI ranks: what crosses the stage boundary is the
activation's own buffer, sent and received without copies. Each rank writes
OUT_DIR/rank<r>.npz with, per micro-batch: (stage 0) whether the buffer it handed to
MPI is its block's output buffer itself, (stage 1) whether its block's input is the
buffer MPI received into; and the Send bytes per device of each transfer beside the
activation's bytes.

    mpiexec -n 2 python pipeline_copies.py OUT_DIR
"""
import os
import sys

import numpy as np

import dualmode as dm
from dualmode import communication, nn, ops
from dualmode.parallel import CommReport

B, D, MICRO = 16, 8, 2


class Block(nn.Cell):
    def __init__(self, seed, log):
        super().__init__()
        w = np.random.default_rng(seed).standard_normal((D, D)).astype(np.float32)
        self.w = dm.Parameter(dm.Tensor(w), name="w")
        self.matmul = ops.MatMul()
        self.log = log

    def construct(self, x):
        self.log.append(("in", x))
        out = ops.relu(self.matmul(x, self.w))
        self.log.append(("out", out))
        return out


def main(out_dir):
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=2,
                                 pipeline_stages=2)
    communication.init()
    view = communication.get_backend()
    sent, received = [], []
    send, recv = view._send, view._recv

    def spy_send(stack, stage, tag, meta):
        send(stack, stage, tag, meta)
        sent.append(view._pending[-1][1])           # the buffer MPI sends from

    def spy_recv(stage, tag):
        got = recv(stage, tag)
        received.append(got[0])                     # the buffer MPI received into
        return got

    view._send, view._recv = spy_send, spy_recv
    logs = [[], []]
    net = nn.SequentialCell([Block(0, logs[0]), Block(1, logs[1])])
    net[0].pipeline_stage, net[1].pipeline_stage = 0, 1
    model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), MICRO)
    grad_fn = dm.value_and_grad(model, None, net.trainable_params())
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, D)).astype(np.float32)
    y = rng.standard_normal((B, D)).astype(np.float32)
    with CommReport() as report:
        grad_fn(dm.Tensor(x), dm.Tensor(y))
    stage = view.stage
    def device_bytes(t):                 # one device's part: the whole plain value
        return t._data.nbytes if t._layout is None else t._data[0].nbytes

    def shares(buf, t):
        return np.shares_memory(buf, t._data) and buf.nbytes == device_bytes(t)

    if stage == 0:      # its forward sends: the blocks' outputs (its gradient receives after)
        outs = [t for kind, t in logs[0] if kind == "out"]
        same = [any(shares(buf, t) for t in outs) for buf in sent]
        act = device_bytes(outs[0])
    else:               # its forward receives: the blocks' inputs
        ins = [t for kind, t in logs[1] if kind == "in"]
        same = [any(shares(buf, t) for buf in received) for t in ins]
        act = device_bytes(ins[0])
    sends = [r.bytes_per_device for r in report.records if r.kind == "Send"]
    np.savez(os.path.join(out_dir, f"rank{communication.get_rank()}.npz"), stage=stage,
             same=np.array(same), sends=np.array(sends), act=act)


if __name__ == "__main__":
    main(sys.argv[1])
