"""Shared test setup: every test starts from default context settings and seed 0."""
import pytest

from dualmode import context


@pytest.fixture(autouse=True)
def _fresh_context():
    context.reset_context()
    context.set_seed(0)
    yield
    context.reset_context()


@pytest.fixture
def eight():
    """8 simulated devices under semi_auto_parallel for one test, reset afterwards."""
    import dualmode as dm
    from dualmode import communication
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    communication.init()
    yield
    dm.reset_auto_parallel_context()
    communication.init()


@pytest.fixture
def deferred_writes(monkeypatch):
    """A list that gets the shape of every deferred stack written
    (:class:`dualmode.communication.totals.DeferredShares`) during the test."""
    from dualmode.communication.totals import DeferredShares
    found = []
    real = DeferredShares._write

    def spy(self):
        found.append(self.shape)
        return real(self)

    monkeypatch.setattr(DeferredShares, "_write", spy)
    return found
