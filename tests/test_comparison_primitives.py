"""The comparison primitives MindSpore scripts use (Equal, NotEqual, Greater,
GreaterEqual, Less, LessEqual): numpy's values on one device, and the same values
sharded with a strategy in PyNative mode, through ops.shard and in a GRAPH_MODE Cell."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, nn, ops

CASES = [("Equal", np.equal), ("NotEqual", np.not_equal), ("Greater", np.greater),
         ("GreaterEqual", np.greater_equal), ("Less", np.less),
         ("LessEqual", np.less_equal)]


def _inputs():
    rng = np.random.default_rng(3)
    x = rng.integers(-2, 3, (8, 12)).astype(np.float32)     # ties on purpose
    y = rng.integers(-2, 3, (8, 12)).astype(np.float32)
    return x, y


class _Net(nn.Cell):
    def __init__(self, name, strategy=None):
        super().__init__()
        self.op = getattr(ops, name)()
        if strategy is not None:
            self.op.shard(strategy)

    def construct(self, a, b):
        return ops.Cast()(self.op(a, b), dm.float32)


@pytest.mark.parametrize("name, ref", CASES)
def test_one_device_equals_numpy(name, ref):
    x, y = _inputs()
    out = getattr(ops, name)()(Tensor(x), Tensor(y))
    assert out.dtype == dm.bool_
    np.testing.assert_array_equal(out.asnumpy(), ref(x, y))
    from dualmode.ops import operations as P
    assert getattr(P, name) is getattr(ops, name)


@pytest.mark.parametrize("how", ["pynative", "ops.shard", "graph"])
@pytest.mark.parametrize("name, ref", CASES)
def test_sharded_equals_numpy(name, ref, how, sim_devices):
    sim_devices(8)
    x, y = _inputs()
    want = ref(x, y).astype(np.float32)
    if how == "ops.shard":
        out = dm.shard(_Net(name), in_strategy=((2, 4), (2, 4)))(Tensor(x), Tensor(y))
    else:
        net = _Net(name, ((2, 4), (2, 4)))
        if how == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)
        try:
            out = net(Tensor(x), Tensor(y))
        finally:
            dm.set_context(mode=dm.PYNATIVE_MODE)
    np.testing.assert_array_equal(out.asnumpy(), want)
    if how == "pynative":              # the op ran on shards: each device holds (4, 3)
        assert dm.parallel.local_shape(net.op(Tensor(x), Tensor(y))) == (4, 3)
