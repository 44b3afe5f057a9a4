"""Times the seed network's train step on the current backend (run under mpiexec for
"mpi"; imported by bench/test_bench_mpi.py for "sim"). Prints the median step time of
rank 0 as JSON: {"median_s": ...}."""
import json
import sys
import time

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication

from test_bench_operator_parallel import _data, _dualmode_step

#: the seed network's strategies scaled to 4 devices
STRATEGIES_4 = (((2, 2), (2, 1)), ((2, 1),), ((1, 4), (4, 1)), ((4, 1),))


def make_step(batch, hidden, devices=None):
    """A no-argument train step of the seed network on the current backend."""
    dm.reset_auto_parallel_context()
    communication.init()
    n = devices or communication.get_group_size()
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n,
                                 gradients_mean=True)
    communication.init()
    x, y, ws = _data(batch, hidden)
    _, step = _dualmode_step(ws, STRATEGIES_4)
    xt, yt = Tensor(x), Tensor(y)
    return lambda: step(xt, yt)


def median_step(step, rounds):
    step()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


if __name__ == "__main__":
    batch, hidden, rounds = map(int, sys.argv[1:4])
    med = median_step(make_step(batch, hidden), rounds)
    if communication.get_rank() == 0:
        print(json.dumps({"median_s": med}))
