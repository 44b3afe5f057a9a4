"""Per-device ops on layouts with repeated calculation (device axes that split nothing):
they run once per set of replicas, and every device still holds its block, equal to the
single-device result."""
import numpy as np

import dualmode as dm
from dualmode import Tensor, ops
from dualmode.parallel import CommReport, TensorLayout
from dualmode.parallel import sharding
from dualmode.parallel.sharding import RULES, ShardPlan, shared_replicas




def test_elementwise_on_repeated_layout_runs_once_per_replica_set(eight, monkeypatch):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 12)).astype(np.float32)
    w = rng.standard_normal((12, 8)).astype(np.float32)
    seen = []
    orig = sharding._apply_once_per_replica_set
    monkeypatch.setattr(sharding, "_apply_once_per_replica_set",
                        lambda op, *args, **kw: seen.append(op.name) or orig(op, *args, **kw))
    h = ops.MatMul().shard(((2, 4), (4, 1)))(Tensor(a), Tensor(w))
    relu = ops.ReLU().shard(((4, 1),))            # (4, 1) on 8 devices: repeated twice
    with CommReport() as rep:
        out = relu(h)
    assert seen == ["ReLU"]
    lay = out.layout
    assert lay.device_matrix == (2, 4) and lay.replicated_axes == (0,)
    blocks = out._data.reshape((2, 4) + lay.local_shape)
    np.testing.assert_array_equal(blocks[0], blocks[1])
    np.testing.assert_allclose(out.asnumpy(), np.maximum(a @ w, 0), rtol=1e-5, atol=1e-5)
    assert [r.kind for r in rep.records] == ["AlltoAll", "ReduceScatter", "AllGather"]
    # a second per-device op on the same layout reads one replica of its input
    out2 = ops.Mul().shard(((4, 1), (4, 1)))(out, out)
    np.testing.assert_allclose(out2.asnumpy(), np.maximum(a @ w, 0) ** 2, rtol=1e-5,
                               atol=1e-5)


def testshared_replicas_needs_a_per_device_op_without_post_collectives(eight):
    dm8 = (2, 4)
    x = TensorLayout(dm8, ((1,), ()), (8, 4))
    plan = ShardPlan((x,), (x,), lambda attrs, stacks: stacks[0])
    relu, gather = RULES["ReLU"], RULES["Gather"]
    assert relu.per_device and not gather.per_device
    assert shared_replicas(relu, plan, dm8) == (0,)
    assert shared_replicas(gather, plan, dm8) == ()               # not a per-device op
    post = ShardPlan((x,), (x,), plan.local, (("max", (1,)),))
    assert shared_replicas(relu, post, dm8) == ()
    split = TensorLayout(dm8, ((0,), (1,)), (8, 4))
    assert shared_replicas(relu, ShardPlan((split,), (split,), plan.local), dm8) == ()


def _records(rep):
    return [(r.kind, r.group_size, r.num_groups, r.bytes_per_device) for r in rep.records]


def test_matmul_on_device_grids_equals_the_stack_path(eight, monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 24)).astype(np.float32)
    g = rng.standard_normal((16, 8)).astype(np.float32)
    h = ops.ReLU().shard(((4, 1),))                    # rows over 4, repeated over 2

    def grad_w():
        xt = dm.parallel.dtensor.distribute(Tensor(x), TensorLayout((2, 4), ((0,), (1,)),
                                                                    (16, 24)))
        gt = h(Tensor(g))                              # rows on axis 1, repeated on axis 0
        with CommReport() as rep:
            out = ops.MatMul(transpose_a=True)(xt, gt)  # needs g's rows on axis 0
        return out, rep

    calls = []
    orig = sharding._apply_on_grids
    monkeypatch.setattr(sharding, "_apply_on_grids",
                        lambda *a, **k: calls.append(1) or orig(*a, **k))
    out, rep = grad_w()
    assert calls == [1]
    np.testing.assert_allclose(out.asnumpy(), x.T @ np.maximum(g, 0), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(sharding, "wants_grids", lambda *a: False)
    monkeypatch.setattr(sharding, "_DECISIONS", {})     # decisions are cached per call
    out2, rep2 = grad_w()
    assert calls == [1]
    assert out2.layout == out.layout
    np.testing.assert_allclose(out._data, out2._data, rtol=1e-6, atol=1e-6)
    assert _records(rep) == _records(rep2)
