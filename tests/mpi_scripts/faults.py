"""One rank misbehaves while the others wait in an AllReduce: ``faults.py MODE RANK``.

MODE: ``kill`` (SIGKILL itself), ``exit0`` (sys.exit(0)), ``exit3`` (os._exit(3)),
``hang`` (sleeps for an hour inside ``stuck_here``), ``none`` (every rank hangs in its
AllReduce only after printing its environment: for the SIGTERM test, rank RANK sleeps).
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
print("env " + " ".join(f"{k}={os.environ.get(k)}" for k in
                        ("RANK_ID", "RANK", "RANK_SIZE", "WORLD_SIZE", "LOCAL_RANK",
                         "DEVICE_ID")), flush=True)


def stuck_here():
    time.sleep(3600)


if rank == bad:
    time.sleep(0.3)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "exit0":
        sys.exit(0)
    elif mode == "exit3":
        os._exit(3)
    elif mode in ("hang", "none"):
        stuck_here()
comm.get_backend().all_reduce(np.ones((1, 3)))
time.sleep(3600 if mode == "none" else 0)
print("finished", flush=True)
