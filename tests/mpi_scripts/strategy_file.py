"""The strategy file keys on real ranks: every rank writes ``strategy_ckpt_save_file``
(the same path, the same content, each through its own temporary file), then a fresh
context loads it into a network whose strategies would lay the weights out otherwise.
Run under mpiexec with backend "mpi" (``strategy_file.py DIR OUT``), or in-process on
"sim" with the same device count (tests/test_strategy_file_entry_points.py compares)."""
import os
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops

RNG = np.random.default_rng(3)
W1 = RNG.standard_normal((16, 32)).astype(np.float32) * 0.3
W2 = RNG.standard_normal((32, 8)).astype(np.float32) * 0.3
X = RNG.standard_normal((8, 16)).astype(np.float32)


class Net(nn.Cell):
    def __init__(self, s1=None, s2=None):
        super().__init__()
        self.w1 = Parameter(Tensor(W1), name="w1")
        self.w2 = Parameter(Tensor(W2), name="w2")
        self.mm1 = ops.MatMul()
        self.mm2 = ops.MatMul()
        if s1:
            self.mm1.shard(s1)
        if s2:
            self.mm2.shard(s2)

    def construct(self, x):
        return self.mm2(ops.relu(self.mm1(x, self.w1)), self.w2)


def _context(backend, n, **keys):
    dm.reset_auto_parallel_context()
    if backend == "mpi":
        communication.init("mpi")
        n = communication.get_group_size()
    if n > 1:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n, **keys)
    if backend == "sim":
        communication.init("sim")
    return n


def _train(net, steps=2):
    params = [net.w1, net.w2]
    opt = nn.SGD(params, learning_rate=0.05)
    grad_fn = dm.value_and_grad(lambda x: ops.ReduceMean()(ops.Square()(net(x))), None,
                                params)
    losses = []
    for _ in range(steps):
        loss, grads = grad_fn(Tensor(X))
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, [net.w1.asnumpy(), net.w2.asnumpy()]


def run(directory, backend, n=2):
    """Save (eager), then load into other strategies: ``(file text, layouts kept,
    losses, weights)`` of the loading run."""
    path = os.path.join(directory, "strategy.json")
    n = _context(backend, n, strategy_ckpt_save_file=path)
    _train(Net(((1, 1), (1, n)), ((1, n), (n, 1))))
    if backend == "mpi":
        communication.get_backend().barrier()
    with open(path) as f:
        text = f.read()
    _context(backend, n, strategy_ckpt_load_file=path)
    net = Net(((1, n), (n, 1)), ((n, 1), (1, 1)))
    losses, weights = _train(net)
    kept = [net.w1.layout, net.w2.layout]
    dm.reset_auto_parallel_context()
    return text, kept, losses, weights


if __name__ == "__main__":
    directory, out = sys.argv[1], sys.argv[2]
    text, kept, losses, weights = run(directory, "mpi")
    from dualmode.train.strategy_file import load_strategy_file
    saved = load_strategy_file(os.path.join(directory, "strategy.json"))
    assert kept == [saved["w1"], saved["w2"]], (kept, saved)
    if communication.get_rank() == 0:
        np.savez(out, text=np.array(text), losses=np.array(losses), w1=weights[0],
                 w2=weights[1])
