"""A rank that never arrives: ``timeout_skip.py MODE`` on 2 ranks (4 for ``recv4``).

MODE ``allreduce``: rank 0 runs a MatMul whose strategy splits the contracted dim (its
output is summed over both ranks by an AllReduce); rank 1 skips it, as a branch on the
rank would, and stays busy elsewhere (sleeps). ``recv``: the two ranks are the two
stages of a pipeline; stage 1 waits for a message stage 0 never sends. ``recv4``: the
same on 4 ranks, stage 1 (ranks 2, 3) waiting for stage 0 (ranks 0, 1). ``send``:
stage 0 sends a 4 MiB buffer that stage 1 never receives, then waits for it to leave.

With ``DUALMODE_COMM_TIMEOUT`` short, the waiting rank raises a RuntimeError naming
what it waits for; the job is then ended (the launcher, or the abort of an uncaught
exception under plain mpiexec). Nothing here ends by itself: the sleeping rank would
sleep 120 s.
"""
import sys
import time

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication, ops
from dualmode.parallel import CommReport

mode = sys.argv[1]
communication.init()
dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                             device_num=communication.get_group_size())
communication.init()
rank = communication.get_rank()
backend = communication.get_backend()
print(f"rank {rank} ready", flush=True)

if mode == "allreduce":
    if rank == 0:
        matmul = ops.MatMul().shard(((1, 2), (2, 1)))
        x = Tensor(np.ones((4, 8), np.float32))
        w = Tensor(np.ones((8, 3), np.float32))
        with CommReport():                   # (the op of a collective is known to it)
            y = ops.Exp()(matmul(x, w))      # Exp needs the sum: an AllReduce
        print(y.asnumpy(), flush=True)      # never reached
    time.sleep(120)
elif mode in ("recv", "recv4"):
    view = backend.stage_view(2)
    if view.stage == 1:
        view.recv(0, 7)
    time.sleep(120)
elif mode == "send":
    view = backend.stage_view(2)
    if view.stage == 0:
        view.send(np.ones((1, 1 << 20), np.float32), 1, 3)
        view.wait_sends()
    time.sleep(120)
else:
    raise SystemExit(f"timeout_skip.py: unknown mode {mode!r}")
