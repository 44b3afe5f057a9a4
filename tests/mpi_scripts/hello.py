"""Prints its rank and environment, then all-reduces its rank (the sum is checked)."""
import os
import sys

import numpy as np

import dualmode.communication as comm

comm.init()
rank, size = comm.get_rank(), comm.get_group_size()
out = comm.get_backend().all_reduce(np.full((1, 2), float(rank)), op="sum")
assert np.array_equal(out, np.full((1, 2), size * (size - 1) / 2)), out
print(f"hello from rank {rank} of {size} RANK_ID={os.environ['RANK_ID']} "
      f"RANK_SIZE={os.environ['RANK_SIZE']} DEVICE_ID={os.environ['DEVICE_ID']} "
      f"args={sys.argv[1:]} backend={comm.GlobalComm.BACKEND}", flush=True)
print(f"stderr line of rank {rank}", file=sys.stderr)
