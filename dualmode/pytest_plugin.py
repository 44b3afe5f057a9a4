"""dualmode's pytest plugin (registered through the ``pytest11`` entry point, so any
suite in an environment where dualmode is installed has these fixtures).

Fixtures
--------
``sim_devices``
    A factory: ``sim_devices(8, mode="semi_auto_parallel", **settings)`` configures
    ``n`` simulated devices (any other ``set_auto_parallel_context`` key may be given)
    and initialises the "sim" backend; ``sim_devices(None)`` goes stand-alone. The
    parallel context, run mode, seed and backend are restored when the test ends,
    whatever happened. Returns the backend.
``assert_sharded_equal``
    ``assert_sharded_equal(fn, *inputs, device_num=None, **kw)`` runs
    :func:`dualmode.parallel.check_equivalence` and fails the test with its table when
    the sharded run differs from the stand-alone one; returns the report.
``comm_report``
    A fresh :class:`dualmode.parallel.CommReport`:
    ``with comm_report as rep: step(); assert rep.count("AllReduce") == 2``.
"""
from __future__ import annotations

import pytest

from . import context
from .communication import get_backend
from .communication import init as _comm_init
from .parallel import CommReport, check_equivalence
from .parallel.check import parallel_settings

__all__ = ["sim_devices", "assert_sharded_equal", "comm_report"]


@pytest.fixture
def sim_devices():
    """``sim_devices(n=8, mode="semi_auto_parallel", **settings)``: n simulated devices
    for this test (restored afterwards)."""
    saved = parallel_settings()

    def setup(n=8, mode="semi_auto_parallel", **settings):
        if n is None:
            context.reset_auto_parallel_context()
            _comm_init()
            return None
        context.reset_auto_parallel_context()
        context.set_auto_parallel_context(parallel_mode=mode, device_num=n, **settings)
        _comm_init()
        return get_backend()

    try:
        yield setup
    finally:
        saved.restore()


@pytest.fixture
def assert_sharded_equal():
    """``assert_sharded_equal(fn, *inputs, **check_equivalence_kwargs)``: fail the test
    with check_equivalence's table unless the sharded run equals the stand-alone one."""

    def check(fn, *inputs, **kwargs):
        report = check_equivalence(fn, *inputs, **kwargs)
        if not report.ok:
            pytest.fail("sharded run differs from the stand-alone run\n" + str(report),
                        pytrace=False)
        return report

    return check


@pytest.fixture
def comm_report():
    """A fresh CommReport to use as ``with comm_report as rep: ...``."""
    return CommReport()
