"""The GPT of examples/gpt_model.py, dp 1 x mp 2 x pp 2, 2 micro-batches (1F1B), under
any backend: under mpiexec -n 4 (backend "mpi", each rank running its stage's cells) it
writes OUT_DIR/rank<r>.npz with its losses, its stage's weights (by name) and the Send
records of its last step (transfer cell and bytes per device); tests import it and run
the same program on simulated devices to compare.

    mpiexec -n 4 python pipeline_gpt.py OUT_DIR
"""
import os
import sys

import numpy as np

import dualmode as dm
from dualmode import communication, nn
from dualmode.parallel import CommReport
from dualmode.parallel.pipeline import parameter_stage

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples"))
from gpt_model import GPT, GPTConfig, synthetic_batch  # noqa: E402

CFG = GPTConfig(dp=1, mp=2, pp=2, micro_size=2)
STEPS = 2


def train(devices=None):
    """(losses, {stage: {name: weight}}, [(cell, bytes per device)] of the last step's
    Sends); `devices`: simulated devices (None: the MPI world)."""
    dm.reset_auto_parallel_context()
    communication.init()
    n = devices or communication.get_group_size()
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n,
                                 pipeline_stages=CFG.pp)
    communication.init()
    dm.set_seed(0)
    net = GPT(CFG)
    model = nn.PipelineCell(net, CFG.micro_size)
    opt = nn.SGD(net.trainable_params(), 0.5)
    grad_fn = dm.value_and_grad(model, None, opt.parameters)
    ids, labels = synthetic_batch(CFG, np.random.default_rng(0))
    losses = []
    for _ in range(STEPS):
        with CommReport() as last:
            loss, grads = grad_fn(dm.Tensor(ids), dm.Tensor(labels))
            opt(grads)
        losses.append(float(loss.asnumpy()))
    stage = communication.get_backend().stage
    weights = {}
    for p in net.trainable_params():
        k = parameter_stage(p)
        if stage is None or k == stage:
            weights.setdefault(k, {})[p.name] = p.asnumpy().copy()
    sends = [(r.op, r.bytes_per_device) for r in last.records if r.kind == "Send"]
    return np.array(losses), weights, sends


if __name__ == "__main__":
    losses, weights, sends = train()
    (stage, ws), = weights.items()
    np.savez(os.path.join(sys.argv[1], f"rank{communication.get_rank()}.npz"),
             losses=losses, stage=stage, send_cells=np.array([c for c, _ in sends]),
             send_bytes=np.array([b for _, b in sends], np.int64),
             names=np.array(sorted(ws)), **{f"w_{k}": v for k, v in ws.items()})
