"""A small network trained in parameter server mode (every role runs this script).

    train_ps.py CONFIG_JSON OUT_DIR

CONFIG keys: opt ("sgd" | "momentum" | "adam"), steps, batch (per worker), hidden (the
hidden width, 16; 4096 makes fc1's weights frames ZeroMQ sends without a copy), embed (use an
EmbeddingLookup), cache (its vocab_cache_size), mode ("sync" | "async"), hybrid (keep
fc2 on the workers), sleep (seconds per step, to give a test time to kill a process),
stop_after (this worker exits after that many steps, with its rank given as
stop_rank), init_in_server (the servers initialise the embedding table). Each worker
writes OUT_DIR/worker_<rank>.npz: its losses and the final weights (with embed, also
worker_<rank>_held_rows.npy: the rows of its own table that are not zero before it pulls
the table whole). :func:`reference` trains the same network on one device on the concatenated
batches (the oracle).
"""
import json
import os
import sys
import time

import numpy as np

import dualmode as dm
from dualmode import Tensor, nn

VOCAB, EMB, IN, HID, OUT = 40, 6, 8, 16, 4


class Net(nn.Cell):
    def __init__(self, embed, cache, hidden=HID):
        super().__init__()
        self.embed = embed
        if embed:
            self.lookup = nn.EmbeddingLookup(VOCAB, EMB, sparse=True, vocab_cache_size=cache)
            self.fc1 = nn.Dense(EMB + IN, hidden)
        else:
            self.fc1 = nn.Dense(IN, hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Dense(hidden, OUT)

    def construct(self, x, ids):
        if self.embed:
            e = dm.ops.reduce_mean(self.lookup(ids), 1)
            x = dm.ops.concat((e, x), 1)
        return self.fc2(self.relu(self.fc1(x)))


def build(cfg, rank=0):
    dm.set_seed(1 + (rank if cfg.get("seed_by_rank") else 0))
    net = Net(cfg.get("embed", False), cfg.get("cache", 0), cfg.get("hidden", HID))
    params = net.trainable_params()
    name = cfg.get("opt", "sgd")
    if name == "sgd":
        opt = nn.SGD(params, learning_rate=0.1)
    elif name == "momentum":
        opt = nn.Momentum(params, learning_rate=0.05, momentum=0.9)
    else:
        opt = nn.Adam(params, learning_rate=0.01)
    return net, opt


def batch(step, rank, workers, per):
    """Worker `rank`'s rows of the global batch of `step` (workers * per rows)."""
    rng = np.random.default_rng(1000 + step)
    n = workers * per
    x = rng.standard_normal((n, IN)).astype(np.float32)
    ids = rng.integers(0, VOCAB, (n, 3)).astype(np.int32)
    teacher = np.random.default_rng(7).standard_normal((IN, OUT))
    y = np.argmax(x @ teacher, axis=1).astype(np.int32)       # learnable labels
    sl = slice(rank * per, (rank + 1) * per)
    return Tensor(x[sl]), Tensor(ids[sl]), Tensor(y[sl])


def train(cfg, net, opt, rank, workers, steps):
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def forward(x, ids, y):
        return loss_fn(net(x, ids), y)

    grad_fn = dm.value_and_grad(forward, None, opt.parameters)
    losses = []
    for step in range(steps):
        if cfg.get("stop_after") is not None and rank == cfg.get("stop_rank", 1) \
                and step == cfg["stop_after"]:
            os._exit(0)                                 # dies without saying goodbye
        if cfg.get("hybrid"):       # data parallel under MPI: the global batch, split
            data = batch(step, 0, 1, cfg.get("batch", 4) * workers)
        else:
            data = batch(step, rank, workers, cfg.get("batch", 4))
        loss, grads = grad_fn(*data)
        opt(grads)
        losses.append(float(loss.asnumpy()))
        if cfg.get("sleep"):
            time.sleep(cfg["sleep"])
    return losses


def reference(cfg, workers, alive_until=None):
    """One device, the concatenated batches of the live workers: (losses, weights).
    ``alive_until[r]``: worker r's batches count for steps before it (default: all)."""
    net, opt = build(cfg)
    per = cfg.get("batch", 4)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def forward(x, ids, y):
        return loss_fn(net(x, ids), y)

    grad_fn = dm.value_and_grad(forward, None, opt.parameters)
    losses = []
    for step in range(cfg["steps"]):
        live = [r for r in range(workers)
                if alive_until is None or step < alive_until.get(r, cfg["steps"])]
        parts = [batch(step, r, workers, per) for r in live]
        x, ids, y = (Tensor(np.concatenate([p[i].asnumpy() for p in parts])) for i in range(3))
        loss, grads = grad_fn(x, ids, y)
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, [p.asnumpy() for p in net.trainable_params()]


def main():
    cfg = json.loads(sys.argv[1])
    out = sys.argv[2]
    dm.set_ps_context(enable_ps=True, mode=cfg.get("mode", "sync"),
                      heartbeat_interval=0.2, heartbeat_timeout=cfg.get("hb_timeout", 2.0),
                      connect_timeout=cfg.get("connect_timeout", 30.0),
                      recovery_interval=cfg.get("recovery_interval", 1))
    if cfg.get("hybrid"):
        dm.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    dm.communication.init()
    rank = dm.communication.get_rank()
    workers = dm.communication.get_group_size()
    net, opt = build(cfg, rank)
    if cfg.get("hybrid_plain"):
        net.fc1.set_param_ps()                       # fc2 stays on the workers
    elif cfg.get("hybrid"):
        net.fc1.set_param_ps()
        if cfg.get("embed"):
            net.lookup.set_param_ps()
    else:
        net.set_param_ps()
    if cfg.get("init_in_server"):
        net.lookup.embedding_table.set_param_ps(init_in_server=True)
    with dm.parallel.CommReport() as report:
        losses = train(cfg, net, opt, rank, workers, cfg["steps"])
    held = None
    if cfg.get("embed"):
        # the rows of the worker's own table that are not zero, before pulling it whole
        held = np.flatnonzero(np.any(net.lookup.embedding_table._data != 0, axis=1))
    dm.ps.pull_weights(net)
    weights = [p.asnumpy() for p in net.trainable_params()]
    np.savez(os.path.join(out, f"worker_{rank}.npz"), np.array(losses),
             np.array([report.bytes("Push"), report.bytes("Pull")]), *weights)
    if held is not None:
        np.save(os.path.join(out, f"worker_{rank}_held_rows.npy"), held)
    print(f"worker {rank} done: losses {losses}", flush=True)


if __name__ == "__main__":
    main()
