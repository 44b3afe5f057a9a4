"""Reads of server-held weights on a worker after training (every role runs this script).

    fault_stale_reads.py CONFIG_JSON OUT_DIR

CONFIG keys: mode ("sync" | "async"), opt ("sgd" | "momentum"), cache (the table's
vocab_cache_size), steps.

sync: a sparse EmbeddingLookup(1000, 8) table and a Dense layer, both on the servers;
worker r looks up ids of its own half of the vocabulary only, so the rows the other
worker used are stale in this worker's copy unless a read pulls them. After training,
worker 0 writes OUT_DIR/reads_0.npz: the table as asnumpy() and numpy.asarray() give
it, the table as save_checkpoint() wrote it, the network's output on ids of both
halves, and how many pulls the reads (not the training steps) made.

async: worker 1 waits until worker 0 has trained, makes one more step and writes its
weights (the servers' latest values); worker 0 then reads its own (older) copy, which
must be the servers' latest too (OUT_DIR/async_<rank>.npz).

:func:`reference` trains the same network on one device on the concatenated batches.
"""
import json
import os
import sys
import time

import numpy as np

import dualmode as dm
from dualmode import Tensor, nn

VOCAB, DIM, OUT, PER = 1000, 8, 2, 4


class Net(nn.Cell):
    def __init__(self, cache):
        super().__init__()
        self.lookup = nn.EmbeddingLookup(VOCAB, DIM, sparse=True, vocab_cache_size=cache)
        self.fc = nn.Dense(DIM, OUT)

    def construct(self, ids):
        return self.fc(dm.ops.reduce_mean(self.lookup(ids), 1))


def build(cfg):
    dm.set_seed(3)
    net = Net(cfg.get("cache", 0))
    if cfg.get("opt", "momentum") == "sgd":
        opt = nn.SGD(net.trainable_params(), learning_rate=0.5)
    else:
        opt = nn.Momentum(net.trainable_params(), learning_rate=0.5, momentum=0.9)
    return net, opt


def batch(step, rank):
    """Worker `rank`'s batch of `step`: ids from its own half of the vocabulary."""
    rng = np.random.default_rng(100 * step + rank)
    half = VOCAB // 2
    ids = rng.integers(rank * half, (rank + 1) * half, (PER, 3)).astype(np.int32)
    y = rng.integers(0, OUT, PER).astype(np.int32)
    return ids, y


def probe_ids():
    """Ids of both halves, for the output check."""
    return np.arange(0, VOCAB, 37, dtype=np.int32)[:27].reshape(-1, 3)


def train_steps(net, opt, batches):
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = dm.value_and_grad(lambda ids, y: loss_fn(net(ids), y), None, opt.parameters)
    for ids, y in batches:
        loss, grads = grad_fn(Tensor(ids), Tensor(y))
        opt(grads)
        float(loss.asnumpy())          # reading a loss is not reading a weight


def reference(cfg, workers=2):
    """One device, the workers' batches concatenated: (table, fc weight, output)."""
    net, opt = build(cfg)
    batches = []
    for step in range(cfg["steps"]):
        parts = [batch(step, r) for r in range(workers)]
        batches.append((np.concatenate([p[0] for p in parts]),
                        np.concatenate([p[1] for p in parts])))
    train_steps(net, opt, batches)
    out = net(Tensor(probe_ids())).asnumpy()
    return net.lookup.embedding_table.asnumpy(), net.fc.weight.asnumpy(), out


def _wait_for(path, timeout=60.0):
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise RuntimeError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def main():
    cfg = json.loads(sys.argv[1])
    out = sys.argv[2]
    dm.set_ps_context(enable_ps=True, mode=cfg.get("mode", "sync"), heartbeat_interval=0.2,
                      heartbeat_timeout=5.0, connect_timeout=30.0)
    dm.communication.init()
    rank = dm.communication.get_rank()
    net, opt = build(cfg)
    net.set_param_ps()
    worker = dm.ps.active_worker()
    pulls = []
    original = getattr(type(worker), "refresh", None)

    def counted(self, p):
        pulls.append(p.name)
        return original(self, p)

    if original is not None:
        type(worker).refresh = counted
    if cfg.get("mode") == "async":
        train_steps(net, opt, [batch(s, rank) for s in range(cfg["steps"])])
        assert not pulls, f"training pulled {pulls}"
        if rank == 0:
            open(os.path.join(out, "trained_0"), "w").close()
            _wait_for(os.path.join(out, "async_1.npz"))
        else:
            _wait_for(os.path.join(out, "trained_0"))
            train_steps(net, opt, [batch(cfg["steps"], rank)])
        # worker 1 has just had its answer: its copy is the servers' latest value
        np.savez(os.path.join(out, f"async_{rank}.npz"), net.fc.weight.asnumpy(),
                 net.lookup.embedding_table.asnumpy(), np.array(len(pulls)))
        return
    train_steps(net, opt, [batch(s, rank) for s in range(cfg["steps"])])
    during = len(pulls)
    if rank == 0:
        table = net.lookup.embedding_table
        as_numpy = table.asnumpy()
        as_array = np.asarray(table)
        path = os.path.join(out, "net.safetensors")
        dm.save_checkpoint(net, path)
        saved = dm.load_checkpoint(path)[table.name].asnumpy()
        output = net(Tensor(probe_ids())).asnumpy()
        np.savez(os.path.join(out, "reads_0.npz"), as_numpy, as_array, saved, output,
                 net.fc.weight.asnumpy(), np.array([during, len(pulls)]))
    print(f"worker {rank} done", flush=True)


if __name__ == "__main__":
    main()
