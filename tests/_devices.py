"""Simulated devices for one block of a test: ``with devices(8, gradients_mean=True):``
runs the block under ``semi_auto_parallel`` (or the given mode) on 8 simulated devices;
``devices(None)`` runs it stand-alone. PyNative mode and the default parallel context
are restored afterwards, whatever happens inside."""
import contextlib

import dualmode as dm
from dualmode import communication


def set_devices(n, parallel_mode="semi_auto_parallel", **settings):
    """Run the rest of the test under `parallel_mode` on `n` simulated devices (None:
    stand-alone); the test's autouse fixture resets the context afterwards."""
    dm.reset_auto_parallel_context()
    communication.init()
    if n:
        dm.set_auto_parallel_context(parallel_mode=parallel_mode, device_num=n, **settings)
        communication.init()


@contextlib.contextmanager
def devices(n=8, parallel_mode="semi_auto_parallel", **settings):
    dm.set_context(mode=dm.PYNATIVE_MODE)
    set_devices(n, parallel_mode, **settings)
    try:
        yield
    finally:
        dm.set_context(mode=dm.PYNATIVE_MODE)
        dm.reset_auto_parallel_context()
        communication.init()
