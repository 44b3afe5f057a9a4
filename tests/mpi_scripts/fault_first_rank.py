"""One rank ends first, the others are busy: ``fault_first_rank.py MODE RANK``.

MODE ``exit7``: every rank runs AllReduces in a loop; rank RANK calls ``os._exit(7)``
after a few, while the others wait for it inside the next one. ``kill``: rank RANK
SIGKILLs itself while the others sleep. The launcher must name rank RANK, however
mpiexec then kills the others.
"""
import os
import signal
import sys
import time

import numpy as np

import dualmode.communication as comm

mode, bad = sys.argv[1], int(sys.argv[2])
comm.init()
rank = comm.get_rank()
backend = comm.get_backend()
if mode == "exit7":
    for i in range(200):
        if rank == bad and i == 5:
            os._exit(7)
        backend.all_reduce(np.ones((1, 64)))
elif mode == "kill":
    if rank == bad:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
print("finished", flush=True)
