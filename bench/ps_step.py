"""One timed program for bench/test_bench_ps.py (prints a JSON line from worker 0).

    ps_step.py allreduce STEPS   # under mpiexec -n W: data parallel, AllReduce
    ps_step.py ps STEPS          # under dualmode.run --ps: every weight on the servers
    ps_step.py pushpull STEPS    # under dualmode.run --ps (1 server, 1 worker): only the
                                 # optimizer call (push the gradients, pull the weights)
"""
import json
import sys
import time

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication, nn

IN, HID, OUT, BATCH = 256, 512, 10, 64          # BATCH rows per worker


def main():
    mode, steps = sys.argv[1], int(sys.argv[2])
    if mode == "allreduce":
        dm.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    else:
        dm.set_ps_context(enable_ps=True)
    communication.init()
    rank, n = communication.get_rank(), communication.get_group_size()
    dm.set_seed(1)
    if mode == "pushpull":
        net = nn.Dense(1024, 1024)
    else:
        net = nn.SequentialCell([nn.Dense(IN, HID), nn.ReLU(), nn.Dense(HID, OUT)])
    if mode != "allreduce":
        net.set_param_ps()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    rows = BATCH * n if mode == "allreduce" else BATCH      # MPI data parallel splits it
    x = Tensor(rng.standard_normal((rows, IN)).astype(np.float32))
    y = Tensor(rng.integers(0, OUT, rows).astype(np.int32))
    grads = tuple(Tensor(np.zeros(p.shape, np.float32)) for p in opt.parameters)
    times = []
    for _ in range(steps + 2):
        t = time.perf_counter()
        if mode == "pushpull":
            opt(grads)
        else:
            _, g = grad_fn(x, y)
            opt(g)
        times.append(time.perf_counter() - t)
    nbytes = sum(p.asnumpy().nbytes for p in opt.parameters)
    if rank == 0:
        print(json.dumps({"median_s": float(np.median(times[2:])), "bytes": nbytes}),
              flush=True)


if __name__ == "__main__":
    main()
