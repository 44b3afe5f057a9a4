"""Times the seed network's 8-device train step with graph mode's buffer pool on and off,
beside the numpy step, in a fresh process whose glibc malloc is either left as it is
("default") or kept steady ("steady", what bench/conftest.py sets for every other
bench). Run by bench/test_bench_arena.py:

    python bench/arena_step.py default|steady BATCH HIDDEN ROUNDS [STEP,STEP...]

Each round runs every step once, in turn (paired), timed with perf_counter, in CPU time
of the process (user + system, getrusage: less disturbed by other processes on a busy
machine, and it includes the kernel's page-fault work) and counted in minor page faults
(ru_minflt). Prints JSON: for each step its median seconds, CPU seconds and page faults
per step, and whether its first loss matched numpy's.
The numpy step always runs; the others are all of them, or the ones named (glibc's
state, hence the page faults of the default malloc, depends on everything the process
allocated before: a process running one step beside numpy is what a user runs).
Steps: ``numpy``; ``numpy-pooled`` (the same inside the pool); ``graph-pool`` and
``graph-nopool`` (the compiled step, pool on / off: ``set_buffer_pool(enabled=...)``
before each call); ``eager-pool`` and ``eager-nopool`` (the PyNative sharded step, the
same switch: its distributed ops run in the pool).
"""
import ctypes
import ctypes.util
import json
import resource
import sys
import time

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication
from dualmode.parallel import buffers
from dualmode.parallel.auto_parallel import AutoParallel

from test_bench_operator_parallel import NumpySeed, _data, _dualmode_step


def steady_malloc():
    """bench/conftest.py's setting: glibc keeps freed memory (no mmap for big blocks)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 31)


def _pooled(step, on):
    """`step` with the buffer pool switched on or off for its call."""
    def run(*args):
        buffers.set_buffer_pool(enabled=on)
        return step(*args)
    return run


def _inside_pool(step):
    def run(*args):
        with buffers.pooled():
            return step(*args)
    return run


STEPS = ("numpy-pooled", "graph-pool", "graph-nopool", "eager-pool", "eager-nopool")


def steps(batch, hidden, names=STEPS):
    """name -> (no-argument step, first loss) for numpy and the steps `names`."""
    x, y, ws = _data(batch, hidden)
    xt, yt = Tensor(x), Tensor(y)
    out = {}
    buffers.set_buffer_pool(enabled=True)
    for name, wrap in (("numpy", None), ("numpy-pooled", _inside_pool)):
        if name != "numpy" and name not in names:
            continue
        model = NumpySeed(ws)
        step = model.step if wrap is None else wrap(model.step)
        out[name] = (lambda s=step: s(x, y), float(step(x, y)))
    for name, graph, on in (("graph-pool", True, True), ("graph-nopool", True, False),
                            ("eager-pool", False, True), ("eager-nopool", False, False)):
        if name not in names:
            continue
        _, step = _dualmode_step(ws)
        if graph:
            step = AutoParallel(step, parallel_mode="semi_auto")
        step = _pooled(step, on)
        out[name] = (lambda s=step: s(xt, yt), float(step(xt, yt).asnumpy()))
    return out


def measure(batch, hidden, rounds, names=STEPS):
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                                 gradients_mean=True)
    communication.init()
    made = steps(batch, hidden, names)
    ref = made["numpy"][1]
    times = {name: [] for name in made}
    cpu = {name: [] for name in made}
    faults = {name: [] for name in made}
    for _ in range(2):                                  # warm-up
        for run, _ in made.values():
            run()
    for _ in range(rounds):
        for name, (run, _) in made.items():
            r = resource.getrusage(resource.RUSAGE_SELF)
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
            r2 = resource.getrusage(resource.RUSAGE_SELF)
            cpu[name].append(r2.ru_utime + r2.ru_stime - r.ru_utime - r.ru_stime)
            faults[name].append(r2.ru_minflt - r.ru_minflt)
    buffers.set_buffer_pool(enabled=True)
    return {name: {"median_s": float(np.median(times[name])),
                   "cpu_s": float(np.median(cpu[name])),
                   "minflt": float(np.median(faults[name])),
                   "correct": bool(np.isclose(made[name][1], ref, rtol=1e-4))}
            for name in made} | {"pool": buffers.buffer_pool_stats()}


if __name__ == "__main__":
    malloc, batch, hidden, rounds = sys.argv[1], *map(int, sys.argv[2:5])
    names = tuple(sys.argv[5].split(",")) if len(sys.argv) > 5 else STEPS
    unknown = set(names) - set(STEPS)
    if unknown:
        raise SystemExit(f"arena_step.py: unknown step {sorted(unknown)[0]!r}; "
                         f"steps: {', '.join(STEPS)}")
    if malloc == "steady":
        steady_malloc()
    elif malloc != "default":
        raise SystemExit(f"arena_step.py: malloc must be 'default' or 'steady', got {malloc!r}")
    print(json.dumps(measure(batch, hidden, rounds, names)))
