"""Rank ``argv[1]`` raises while the other ranks wait in an AllReduce."""
import sys
import time

import numpy as np

import dualmode.communication as comm

comm.init()
if comm.get_rank() == int(sys.argv[1]):
    time.sleep(0.5)
    raise ValueError(f"bad value on rank {comm.get_rank()}")
comm.get_backend().all_reduce(np.ones((1, 3)))
time.sleep(60)                      # never reached: the job is aborted
