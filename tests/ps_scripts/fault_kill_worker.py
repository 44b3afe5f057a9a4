"""train_ps.py's network in parameter server mode, with one worker SIGKILLed mid-run
(every role runs this script): ``fault_kill_worker.py CONFIG_JSON OUT_DIR``.

CONFIG: train_ps.py's keys (opt, steps, hybrid, hb_timeout, ...) and ``kill_rank``,
``kill_at``: that worker SIGKILLs itself at the start of step ``kill_at`` (after
writing the time to OUT_DIR/killed_at), or before ``init()`` when ``kill_at`` < 0
(under ``dualmode.run --ps``, whose ``DM_PS_WORKER_RANK`` gives the worker's id).
Each worker that finishes writes OUT_DIR/worker_<rank>.npz as train_ps.py does: its
losses and final weights.
"""
import importlib.util
import json
import os
import signal
import sys
import time

import numpy as np

import dualmode as dm
from dualmode import nn

_spec = importlib.util.spec_from_file_location(
    "ps_train_program", os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_ps.py"))
train_ps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_ps)


def main():
    cfg = json.loads(sys.argv[1])
    out = sys.argv[2]
    dm.set_ps_context(enable_ps=True, heartbeat_interval=0.2,
                      heartbeat_timeout=cfg.get("hb_timeout", 2.0), connect_timeout=30.0)
    if cfg.get("hybrid"):
        dm.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    if cfg["kill_at"] < 0 and os.environ.get("DM_ROLE") == "DM_WORKER" and \
            os.environ.get("DM_PS_WORKER_RANK") == str(cfg["kill_rank"]):
        os.kill(os.getpid(), signal.SIGKILL)     # before init(): the workers never joined
    dm.communication.init()
    rank = dm.communication.get_rank()
    workers = dm.communication.get_group_size()
    net, opt = train_ps.build(cfg, rank)
    if cfg.get("hybrid"):
        net.fc1.set_param_ps()                       # fc2 is all-reduced among the workers
    else:
        net.set_param_ps()
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = dm.value_and_grad(lambda x, ids, y: loss_fn(net(x, ids), y), None,
                                opt.parameters)
    losses = []
    for step in range(cfg["steps"]):
        if rank == cfg["kill_rank"] and step == cfg["kill_at"]:
            with open(os.path.join(out, "killed_at"), "w") as fh:
                fh.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg.get("hybrid"):
            data = train_ps.batch(step, 0, 1, cfg.get("batch", 4) * workers)
        else:
            data = train_ps.batch(step, rank, workers, cfg.get("batch", 4))
        loss, grads = grad_fn(*data)
        opt(grads)
        losses.append(float(loss.asnumpy()))
    weights = [p.asnumpy() for p in net.trainable_params()]
    np.savez(os.path.join(out, f"worker_{rank}.npz"), np.array(losses), *weights)
    print(f"worker {rank} done: losses {losses}", flush=True)


if __name__ == "__main__":
    main()
