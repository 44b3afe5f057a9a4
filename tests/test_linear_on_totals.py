"""An op linear in a pending sum whose totals are known (the grouped MatMul's shares)
runs once per group of devices on the group's total (sharding._linear_on_totals),
instead of on every device's share: the values equal the single-device program's, the
outputs stay pending over the same devices (so the AllReduce that resolves them, and
its CommReport record, are those of the share-by-share run), and the shares are not
written. A compiled graph's "rule" nodes take the same route."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.communication.totals import DeferredShares, stored
from dualmode.parallel import CommReport
from dualmode.parallel import sharding
from dualmode.parallel.graph import executor

from _devices import devices

RNG = np.random.default_rng(11)
X = RNG.standard_normal((128, 512)).astype(np.float32)
W = RNG.standard_normal((512, 64)).astype(np.float32)
G = RNG.standard_normal((64,)).astype(np.float32)


def _pending(strategy=((2, 4), (4, 1))):
    """X @ W with its contracted dim split over 4 of 8 devices: pending over them
    (large enough for the grouped MatMul, which knows the totals)."""
    h = ops.MatMul().shard(strategy)(Tensor(X), Tensor(W))
    assert h._layout.partial
    return h


def _chain(h):
    """Mul by a replicated vector, Sub of a row mean, a row sum (the LayerNorm backward's
    kind of chain: every op linear in the pending sum)."""
    y = h * Tensor(G)
    y = y - ops.ReduceMean(keep_dims=True)(y, -1)
    return y, ops.ReduceSum()(y, 0)


def _reference():
    y = (X @ W) * G
    y = y - y.mean(-1, keepdims=True)
    return y, y.sum(0)


def test_chain_runs_on_totals_and_equals_one_device():
    with devices(8):
        h = _pending()
        assert type(stored(h)) is DeferredShares
        y, s = _chain(h)
        # the chain stayed pending over the MatMul's devices, its shares unwritten
        assert y._layout.partial == h._layout.partial
        assert type(stored(y)) is DeferredShares
        assert s._layout.partial                      # the row sum: pending over more
        # the MatMul's shares were never written (Tensor operators read the dtype only)
        assert type(stored(h)) is DeferredShares
        ref_y, ref_s = _reference()
        np.testing.assert_allclose(y.asnumpy(), ref_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(s.asnumpy(), ref_s, rtol=1e-5, atol=1e-4)
        # every device holds an equal share of its group's total
        shares = y._data.reshape(2, 4, 64, 64)
        np.testing.assert_allclose(shares * 4, np.broadcast_to(
            ref_y.reshape(2, 1, 64, 64), shares.shape), rtol=1e-5, atol=1e-5)


def test_same_values_and_records_as_the_share_by_share_run(monkeypatch):
    def run():
        with devices(8):
            with CommReport() as rep:
                y, s = _chain(_pending())
                out = (ops.ReLU()(y).asnumpy(), ops.ReLU()(s).asnumpy())
            return out, [(r.kind, r.group_size, r.num_groups, r.bytes_per_device, r.op,
                          r.resolved_by, r.reason) for r in rep.records]

    fast, fast_records = run()
    monkeypatch.setattr(sharding, "_linear_on_totals", lambda *a: None)
    slow, slow_records = run()
    assert fast_records == slow_records and fast_records
    for a, b in zip(fast, slow):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    ref_y, ref_s = _reference()
    np.testing.assert_allclose(fast[0], np.maximum(ref_y, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fast[1], np.maximum(ref_s, 0), rtol=1e-5, atol=1e-4)


def test_shares_without_known_totals_run_share_by_share():
    """A pending sum whose shares are not equal (each device's own product) is not
    read as totals: the op runs on every share, values still the single device's."""
    with devices(8):
        h = _pending()
        h._data = np.array(h._data)                   # written shares, totals forgotten
        h._data[:, 0, 0] += np.arange(8, dtype=np.float32) - 3.5
        y, _ = _chain(h)
        assert type(stored(y)) is not DeferredShares
        ref = X @ W
        offsets = (np.arange(8) - 3.5).reshape(2, 4).sum(1)   # per group of 4 devices
        ref[[0, 64], 0] += offsets                     # each group's first local row
        want = ref * G
        want = want - want.mean(-1, keepdims=True)
        np.testing.assert_allclose(y.asnumpy(), want, rtol=1e-5, atol=1e-4)


class Chain(nn.Cell):
    """MatMul((2, 4), (4, 1)) then the linear chain, resolved by ReLU."""

    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(W), name="w")
        self.g = Parameter(Tensor(G), name="g")
        self.mm = ops.MatMul().shard(((2, 4), (4, 1)))

    def construct(self, x):
        y = self.mm(x, self.w) * self.g
        y = y - ops.ReduceMean(keep_dims=True)(y, -1)
        return ops.ReLU()(y), ops.ReLU()(ops.ReduceSum()(y, 0))


def _run_cell(mode):
    with devices(8, full_batch=True):
        dm.set_context(mode=dm.GRAPH_MODE if mode == "graph" else dm.PYNATIVE_MODE)
        net = Chain()
        net(Tensor(X))                                    # compiles in GRAPH_MODE
        with CommReport() as rep:
            out = [o.asnumpy() for o in net(Tensor(X))]
    return out, [(r.kind, r.group_size, r.num_groups, r.bytes_per_device, r.op,
                  r.resolved_by, r.reason) for r in rep.records]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_compiled_and_eager_cells_take_it_with_the_same_records(mode, monkeypatch):
    calls = []
    real = sharding.linear_on_totals

    def counting(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(sharding, "linear_on_totals", counting)
    monkeypatch.setattr(executor, "linear_on_totals", counting)
    fast, fast_records = _run_cell(mode)
    assert sum(calls) >= 4                            # Mul, ReduceMean, Sub, ReduceSum
    monkeypatch.setattr(sharding, "linear_on_totals", lambda *a: None)
    monkeypatch.setattr(executor, "linear_on_totals", lambda *a: None)
    slow, slow_records = _run_cell(mode)
    assert fast_records == slow_records and len(fast_records) == 2
    ref_y, ref_s = _reference()
    for got, other, want in zip(fast, slow, (ref_y, ref_s)):
        np.testing.assert_allclose(got, np.maximum(want, 0), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got, other, rtol=1e-5, atol=1e-4)
