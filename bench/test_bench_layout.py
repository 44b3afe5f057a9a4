"""Layouts at scale: every device's slice of a (4096, 1024, 3) tensor laid out over a
(8, 8, 8, 8) device matrix on 4,096 devices, beside numpy building the same 4,096 block
offsets (one np.indices call over the block grid) in the same run."""
import numpy as np
import pytest

from dualmode.parallel import Layout

pytestmark = pytest.mark.benchmark(group="layout slices, 4096 devices")


def _layout():
    lay = Layout((8, 8, 8, 8), ("pp", "dp", "sp", "mp"))
    return lay(("dp", "pp"), "mp", "None").bind((4096, 1024, 3))


def test_numpy_block_offsets(benchmark, record):
    def offsets():
        idx = np.indices((8, 8, 8, 8)).reshape(4, -1)
        return np.stack([(idx[1] * 8 + idx[0]) * 64, idx[3] * 128, np.zeros_like(idx[0])], 1)
    out = benchmark(offsets)
    assert out.shape == (4096, 3)
    record(benchmark, "numpy 4096 block offsets")


def test_device_slices_4096(benchmark, record):
    t = _layout()
    sl = benchmark(t.device_slices)
    assert len(sl) == 4096
    record(benchmark, "device_slices 4096 devices", "numpy 4096 block offsets")
