"""``argv[1]`` > 0: set device_num to it, then init(); prints the world size on rank 0."""
import sys

import dualmode as dm
import dualmode.communication as comm

if int(sys.argv[1]) > 0:
    dm.set_auto_parallel_context(device_num=int(sys.argv[1]))
comm.init()
if comm.get_rank() == 0:
    print(f"world {comm.get_group_size()}", flush=True)
