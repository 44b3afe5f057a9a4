"""Hybrid parallel (MindSpore's manual mode): layerwise_parallel parameters hold one slice
per device, ops run per device on them, and the user's ops.AllReduce & co. combine them.
Every result is compared with a single-device run or a hand-computed numpy oracle."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import (CommReport, DeviceLocalLayout, TensorLayout,
                               device_local_tensor, set_layerwise_slices)
from dualmode.parallel.dtensor import distribute


@pytest.fixture
def ctx():
    """ctx(n, **kw): a hybrid_parallel context of n devices (full batch); reset after."""
    def setup(n, **kw):
        dm.reset_auto_parallel_context()
        dm.set_auto_parallel_context(parallel_mode="hybrid_parallel", device_num=n,
                                     dataset_strategy="full_batch", **kw)
        communication.init()
    yield setup
    dm.reset_auto_parallel_context()
    communication.init()


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------
# seed 004: HybridParallelNet
# ---------------------------------------------------------------------------
class HybridParallelNet(nn.Cell):
    """The seed's network: the weight is sliced on its second dim (one slice per device),
    MatMul and ReduceSum run per device, AllReduce sums the devices' partial results."""

    def __init__(self, cols, scale=False):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((512, cols), np.float32)), name="weight",
                                layerwise_parallel=True)
        self.scale = Parameter(Tensor(np.float32(1.5)), name="scale") if scale else None
        self.fc = ops.MatMul()
        self.reduce = ops.ReduceSum()
        self.allreduce = ops.AllReduce(op="sum")

    def construct(self, x):
        x = self.fc(x, self.weight)
        if self.scale is not None:
            x = x * self.scale          # a replicated parameter used on every device
        x = self.reduce(x, -1)
        return self.allreduce(x)


def _loss_fn(net):
    return lambda x: ops.reduce_sum(ops.square(net(x)))


def _single_device(W, x, scale=False, lr=None):
    """The same program on one device with the whole weight (AllReduce is the identity)."""
    dm.reset_auto_parallel_context()
    communication.init()
    net = HybridParallelNet(W.shape[1], scale)
    net.weight.set_data(W)
    out = net(Tensor(x)).asnumpy()
    params = net.trainable_params()
    _, (gx, gw) = dm.value_and_grad(_loss_fn(net), 0, params)(Tensor(x))
    res = {"out": out, "gx": gx.asnumpy(), "gw": [g.asnumpy() for g in gw]}
    if lr is not None:
        nn.SGD(params, learning_rate=lr)(gw)
        res["after"] = [p.asnumpy() for p in params]
    return res


@pytest.mark.parametrize("n", [2, 8])
def test_seed_hybrid_parallel_net_equals_single_device(ctx, n):
    W, x = _rand(512, 128, seed=1), _rand(6, 512, seed=2)
    ref = _single_device(W, x)
    np.testing.assert_allclose(ref["out"], (x @ W).sum(-1), rtol=1e-5, atol=1e-3)

    ctx(n)
    net = HybridParallelNet(128 // n)
    set_layerwise_slices(net.weight, W, dim=1)
    assert net.weight.shape == (512, 128 // n)
    assert dm.parallel.local_shape(net.weight) == (512, 128 // n)
    assert net.weight.layout == DeviceLocalLayout(n, (512, 128 // n))
    np.testing.assert_array_equal(net.weight.asnumpy(), np.stack(np.split(W, n, axis=1)))

    with CommReport() as rep:
        out = net(Tensor(x))
    assert out.layout is None and out.shape == (6,)
    # the partial sums are added in another order than on one device
    np.testing.assert_allclose(out.asnumpy(), ref["out"], rtol=1e-5, atol=1e-3)
    assert rep.count() == rep.count("AllReduce", reason="user") == 1

    with CommReport() as rep:
        _, (gx, gw) = dm.value_and_grad(_loss_fn(net), 0, net.trainable_params())(Tensor(x))
    np.testing.assert_allclose(gx.asnumpy(), ref["gx"], rtol=1e-4, atol=1e-2)
    # the layerwise gradient: device d's slice of the single-device gradient of W
    assert gw[0].layout == DeviceLocalLayout(n, (512, 128 // n))
    np.testing.assert_allclose(gw[0].asnumpy(), np.stack(np.split(ref["gw"][0], n, axis=1)),
                               rtol=1e-4, atol=1e-2)
    assert rep.count("AllReduce", reason="user") == 1       # the forward's; backward: none
    assert rep.count(reason="gradient") == 0


@pytest.mark.parametrize("n", [2, 8])
def test_sgd_step_updates_each_slice_and_skips_gradient_allreduce(ctx, n):
    W, x, lr = _rand(512, 128, seed=3), _rand(4, 512, seed=4), 0.01
    ref = _single_device(W, x, scale=True, lr=lr)

    ctx(n, gradients_mean=True)
    net = HybridParallelNet(128 // n, scale=True)
    set_layerwise_slices(net.weight, W, dim=1)
    params = net.trainable_params()
    opt = nn.SGD(params, learning_rate=lr)
    with CommReport() as rep:
        _, grads = dm.value_and_grad(_loss_fn(net), None, params)(Tensor(x))
        opt(grads)
    # the replicated scale gets the data-parallel gradient AllReduce, the layerwise weight not
    grad_ars = [r for r in rep.records if r.reason == "gradient"]
    assert [(r.kind, r.op) for r in grad_ars] == [("AllReduce", "scale")]
    w_after, s_after = ref["after"]
    np.testing.assert_allclose(net.weight.asnumpy(), np.stack(np.split(w_after, n, axis=1)),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(net.scale.asnumpy(), s_after, rtol=1e-4)
    assert net.weight.layout == DeviceLocalLayout(n, (512, 128 // n))   # still per device


@pytest.mark.parametrize("opt_name", ["Momentum", "Adam"])
def test_stateful_optimizers_keep_per_device_states(ctx, opt_name):
    W, x, lr = _rand(512, 16, seed=5), _rand(4, 512, seed=6), 1e-5

    def make(params):
        return nn.Momentum(params, lr, 0.9) if opt_name == "Momentum" else \
            nn.Adam(params, learning_rate=lr)

    dm.reset_auto_parallel_context()
    communication.init()
    ref_net = HybridParallelNet(16)
    ref_net.weight.set_data(W)
    ref_opt = make(ref_net.trainable_params())
    ctx(2, gradients_mean=True)
    net = HybridParallelNet(8)
    opt = make(net.trainable_params())          # built before the slices are set
    set_layerwise_slices(net.weight, W, dim=1)
    for _ in range(2):
        _, g = dm.value_and_grad(_loss_fn(net), None, net.trainable_params())(Tensor(x))
        opt(g)
    communication_ctx = dm.get_auto_parallel_context("device_num")
    dm.reset_auto_parallel_context()
    communication.init()
    for _ in range(2):
        _, g = dm.value_and_grad(_loss_fn(ref_net), None, ref_net.trainable_params())(
            Tensor(x))
        ref_opt(g)
    assert communication_ctx == 2
    np.testing.assert_allclose(net.weight.asnumpy(),
                               np.stack(np.split(ref_net.weight.asnumpy(), 2, axis=1)),
                               rtol=1e-4, atol=1e-5)


def test_layerwise_only_net_issues_no_gradient_allreduce(ctx):
    ctx(4)
    net = HybridParallelNet(32)
    set_layerwise_slices(net.weight, _rand(4, 512, 32, seed=5))
    before = net.weight.asnumpy()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    with CommReport() as rep:
        _, grads = dm.value_and_grad(_loss_fn(net), None, opt.parameters)(
            Tensor(_rand(2, 512, seed=6)))
        opt(grads)
    assert rep.count(reason="gradient") == 0
    np.testing.assert_allclose(net.weight.asnumpy(), before - 0.1 * grads[0].asnumpy(),
                               rtol=1e-6)


def test_column_then_row_parallel_mlp_equals_single_device(ctx):
    """Megatron-style hand-written tensor parallelism: column-parallel W1, row-parallel
    W2 + AllReduce, column-parallel W3 + AllGather. The gradient of y (plain, consumed
    per device) arrives as a partial sum, which AllReduce's backward resolves."""
    n = 4
    # float64: the two runs sum in different orders, and the gradients of this chain
    # (ReLU, Tanh, two sums) differ by about 1e-5 in float32 on some BLAS builds
    f64 = np.float64
    W1, W2, W3 = (_rand(8, 16, seed=50).astype(f64), _rand(16, 8, seed=51).astype(f64),
                  _rand(8, 12, seed=52).astype(f64))
    x = _rand(5, 8, seed=53).astype(f64)

    def program(n_dev):
        w1 = Parameter(Tensor(np.zeros((8, 16 // n_dev), f64)), name="w1",
                       layerwise_parallel=True)
        w2 = Parameter(Tensor(np.zeros((16 // n_dev, 8), f64)), name="w2",
                       layerwise_parallel=True)
        w3 = Parameter(Tensor(np.zeros((8, 12 // n_dev), f64)), name="w3",
                       layerwise_parallel=True)
        for w, full, dim in ((w1, W1, 1), (w2, W2, 0), (w3, W3, 1)):
            set_layerwise_slices(w, full, dim=dim)

        def f(x):
            h = ops.relu(ops.matmul(x, w1))                    # per device: (5, 16/n)
            y = ops.AllReduce()(ops.matmul(h, w2))             # plain (5, 8)
            z = ops.tanh(ops.matmul(y, w3))                    # per device: (5, 12/n)
            zt = ops.AllGather()(ops.transpose(z, (1, 0)))     # plain (12, 5)
            return ops.reduce_sum(zt * zt)
        loss, (gx, gw) = dm.value_and_grad(f, 0, [w1, w2, w3])(Tensor(x))
        return loss.asnumpy(), gx.asnumpy(), [g.asnumpy() for g in gw]

    dm.reset_auto_parallel_context()
    communication.init()
    ref_loss, ref_gx, ref_gw = program(1)
    ctx(n)
    with CommReport() as rep:
        loss, gx, gw = program(n)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(gx, ref_gx, rtol=1e-4, atol=1e-5)
    for g, ref, dim in zip(gw, ref_gw, (1, 0, 1)):
        np.testing.assert_allclose(g, np.stack(np.split(ref, n, axis=dim)), rtol=1e-4,
                                   atol=1e-5)
    kinds = [(r.kind, r.op, r.reason) for r in rep.records]
    assert kinds == [("AllReduce", "AllReduce", "user"), ("AllGather", "AllGather", "user"),
                     ("AllReduce", "AllReduce", "backward")]


# ---------------------------------------------------------------------------
# ops on device-local values: per device, like a loop over the devices
# ---------------------------------------------------------------------------
_OPS = {
    "elementwise": (lambda a, b: ops.tanh(a) * b + ops.exp(-a) / 3.0 - ops.relu(b)),
    "broadcast_plain_higher_rank": (lambda a, b: a[0] + Tensor(_rand(2, 3, 4, seed=9)) * b),
    "matmul": (lambda a, b: ops.matmul(a, b, transpose_b=True)),
    "matmul_plain": (lambda a, b: ops.matmul(Tensor(_rand(2, 3, seed=8)), a)
                     * ops.reduce_mean(b)),
    "batch_matmul": (lambda a, b: ops.BatchMatMul(transpose_a=True)(
        ops.reshape(a, (1, 3, 4)), Tensor(_rand(5, 3, 2, seed=7))) * ops.reduce_max(b)),
    "bias_add": (lambda a, b: ops.bias_add(ops.reshape(a, (3, 4, 1)), b[0, :4])),
    "reductions": (lambda a, b: ops.reduce_sum(a, 1) + ops.reduce_max(b, 1)
                   + ops.reduce_mean(a, -1) - ops.reduce_min(b, (1,))),
    "reduce_all": (lambda a, b: ops.reduce_mean(a * b)),
    "reshape_transpose": (lambda a, b: ops.transpose(ops.reshape(a - b, (2, 6)), (1, 0))),
    "broadcast_to": (lambda a, b: ops.broadcast_to(a[:, :1], (2, 3, 4)) * b[0]),
    "softmax": (lambda a, b: ops.softmax(a, 0) + ops.log_softmax(b, -1)),
    "concat_split": (lambda a, b: ops.split(ops.concat((a, b, Tensor(_rand(3, 4, seed=6))), 1),
                                            1, 3)[1] * 2.0),
    "getitem": (lambda a, b: a[1:, ::2] * b[None, 0, 1:3] + b[..., -1][:, None, None]),
    "cast": (lambda a, b: ops.cast(ops.cast(a, dm.float64) * 2.0, dm.float32) + b),
    "gather": (lambda a, b: ops.gather(a + b, Tensor(np.array([[2, 0], [1, 1]], np.int32)), 1)),
}


@pytest.mark.parametrize("name", sorted(_OPS))
def test_ops_on_device_local_values_equal_per_device_runs(ctx, name):
    fn = _OPS[name]
    n = 3
    A, B = _rand(n, 3, 4, seed=10), _rand(n, 3, 4, seed=11)
    R = None
    ctx(n)
    # oracle: the same function on each device's plain values, one device at a time
    outs, grads = [], []
    for d in range(n):
        out = fn(Tensor(A[d]), Tensor(B[d]))
        if R is None:
            R = _rand(n, *out.shape, seed=12)
        outs.append(out.asnumpy())
        grads.append([g.asnumpy() for g in dm.grad(
            lambda a, b: ops.reduce_sum(fn(a, b) * Tensor(R[d])), (0, 1))(
                Tensor(A[d]), Tensor(B[d]))])
    a, b = device_local_tensor(A), device_local_tensor(B)
    out = fn(a, b)
    assert isinstance(out.layout, DeviceLocalLayout)
    np.testing.assert_allclose(out.asnumpy(), np.stack(outs), rtol=1e-5, atol=1e-6)
    r = device_local_tensor(R)
    ga, gb = dm.grad(lambda a, b: ops.reduce_sum(fn(a, b) * r), (0, 1))(a, b)
    np.testing.assert_allclose(ga.asnumpy(), np.stack([g[0] for g in grads]), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(gb.asnumpy(), np.stack([g[1] for g in grads]), rtol=1e-5,
                               atol=1e-6)


def test_plain_input_gradient_is_the_sum_over_devices(ctx):
    ctx(4)
    W = _rand(4, 5, 3, seed=20)
    w = device_local_tensor(W)
    x = _rand(2, 5, seed=21)
    gx = dm.grad(lambda x: ops.reduce_sum(ops.tanh(ops.matmul(x, w))))(Tensor(x))
    want = sum((1 - np.tanh(x @ W[d]) ** 2) @ W[d].T for d in range(4))
    np.testing.assert_allclose(gx.asnumpy(), want, rtol=1e-5, atol=1e-6)


def test_device_local_tensor_basics(ctx):
    ctx(2)
    t = device_local_tensor(_rand(2, 3, 4))
    assert t.shape == (3, 4) and t.ndim == 2
    assert t.asnumpy().shape == (2, 3, 4)
    assert dm.parallel.local_shape(t) == (3, 4)
    lay = t.layout
    assert lay.device_matrix == (2,) and lay.tensor_map == ((), ()) and lay.partial == ()
    assert lay.local_shape == lay.shape == (3, 4) and lay.split_axes == ()
    assert hash(lay) == hash(DeviceLocalLayout(2, (3, 4)))
    assert lay.assemble(t._data) is t._data
    with pytest.raises(AttributeError, match="immutable"):
        lay.shape = (1,)


def test_unlisted_layerwise_parameter_becomes_per_device_on_first_use(ctx):
    # made before the hybrid-parallel context: plain until it meets a device-local value
    w_plain = Parameter(Tensor(_rand(3, 3, seed=1)), name="w2", layerwise_parallel=True)
    ctx(2)
    a = device_local_tensor(_rand(2, 3, seed=2))
    out = a * w_plain[0]           # GetItem runs plain; Mul meets a device-local value
    assert w_plain.layout is None
    out = ops.matmul(ops.reshape(a, (1, 3)), w_plain)
    assert w_plain.layout == DeviceLocalLayout(2, (3, 3))
    np.testing.assert_array_equal(w_plain.asnumpy()[0], w_plain.asnumpy()[1])
    assert out.shape == (1, 3)


# ---------------------------------------------------------------------------
# collectives: forward and gradient against numpy
# ---------------------------------------------------------------------------
def _check_collective(prim, X, fw, bw, local_out):
    """fw(X) -> output (a plain array, or a per-device stack when local_out); bw(X, R)
    -> the gradient of sum(out * R) w.r.t. the per-device inputs."""
    n = X.shape[0]
    x = device_local_tensor(X)
    with CommReport() as rep:
        out = prim(x)
    want = fw(X)
    assert isinstance(out.layout, DeviceLocalLayout) == local_out
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-5, atol=1e-6)
    assert rep.count(reason="user") == 1 and rep.records[0].kind == prim.name
    assert rep.records[0].op == prim.name and rep.records[0].group_size == n
    R = _rand(*want.shape, seed=30)
    r = device_local_tensor(R) if local_out else Tensor(R)
    g = dm.grad(lambda x: ops.reduce_sum(prim(x) * r))(x)
    assert isinstance(g.layout, DeviceLocalLayout)
    np.testing.assert_allclose(g.asnumpy(), bw(X, R), rtol=1e-5, atol=1e-6)


def _excl_prod(X):
    return np.stack([np.prod(np.delete(X, d, axis=0), axis=0) for d in range(len(X))])


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
def test_all_reduce(ctx, op):
    n = 4
    ctx(n)
    X = _rand(n, 3, 2, seed=31)
    red = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op]

    def bw(X, R):
        if op == "sum":
            return np.broadcast_to(R, X.shape)
        if op == "mean":
            return np.broadcast_to(R / n, X.shape)
        if op == "prod":
            return R * _excl_prod(X)
        return R * (X == red(X, axis=0))
    _check_collective(ops.AllReduce(op), X, lambda X: red(X, axis=0), bw, False)


def test_all_gather(ctx):
    n = 4
    ctx(n)
    X = _rand(n, 2, 3, seed=32)
    _check_collective(ops.AllGather(), X, lambda X: np.concatenate(list(X), axis=0),
                      lambda X, R: R.reshape(X.shape), False)


def test_all_gather_gradient_from_per_device_consumers_is_a_reduce_scatter(ctx):
    n = 4
    ctx(n)
    X, V = _rand(n, 2, 3, seed=36), _rand(n, 2 * n, 3, seed=37)
    x, v = device_local_tensor(X), device_local_tensor(V)
    with CommReport() as rep:
        g = dm.grad(lambda x: ops.reduce_sum(ops.AllReduce()(
            ops.reduce_sum(ops.AllGather()(x) * v))))(x)
    np.testing.assert_allclose(g.asnumpy(), V.sum(0).reshape(n, 2, 3), rtol=1e-5)
    assert [(r.kind, r.reason) for r in rep.records] == [
        ("AllGather", "user"), ("AllReduce", "user"), ("ReduceScatter", "backward")]


def test_reduce_scatter(ctx):
    n = 4
    ctx(n)
    X = _rand(n, 8, 3, seed=33)
    _check_collective(ops.ReduceScatter(), X, lambda X: X.sum(0).reshape(n, 2, 3),
                      lambda X, R: np.broadcast_to(R.reshape(8, 3), X.shape), True)


def test_broadcast(ctx):
    n, root = 4, 2
    ctx(n)
    X = _rand(n, 3, seed=34)

    def bw(X, R):
        g = np.zeros_like(X)
        g[root] = R
        return g
    _check_collective(ops.Broadcast(root), X, lambda X: X[root], bw, False)
    x = device_local_tensor(X)
    out = ops.Broadcast(root)((x, x))          # MindSpore's tuple form
    assert isinstance(out, tuple) and len(out) == 2
    np.testing.assert_array_equal(out[1].asnumpy(), X[root])


def _alltoall_np(X, sd, cd):
    n = X.shape[0]
    chunks = [np.split(X[d], n, axis=sd) for d in range(n)]
    return np.stack([np.concatenate([chunks[d][j] for d in range(n)], axis=cd)
                     for j in range(n)])


@pytest.mark.parametrize("sd,cd", [(0, 1), (1, 0), (1, 1)])
def test_all_to_all(ctx, sd, cd):
    n = 4
    ctx(n)
    X = _rand(n, 4, 8, seed=35)
    _check_collective(ops.AlltoAll(n, sd, cd), X, lambda X: _alltoall_np(X, sd, cd),
                      lambda X, R: _alltoall_np(R, cd, sd), True)


def test_collectives_on_plain_values(ctx):
    n = 4
    ctx(n)
    x = _rand(2, 4, seed=40)
    assert np.allclose(ops.AllReduce()(Tensor(x)).asnumpy(), n * x)
    for op in ("mean", "max", "min"):
        np.testing.assert_allclose(ops.AllReduce(op)(Tensor(x)).asnumpy(), x, rtol=1e-6)
    np.testing.assert_allclose(ops.AllReduce("prod")(Tensor(x)).asnumpy(), x ** n, rtol=1e-5)
    np.testing.assert_array_equal(ops.AllGather()(Tensor(x)).asnumpy(),
                                  np.concatenate([x] * n))
    np.testing.assert_array_equal(ops.Broadcast(3)(Tensor(x)).asnumpy(), x)
    rs = ops.ReduceScatter()(Tensor(_rand(8, 2, seed=41)))
    np.testing.assert_allclose(rs.asnumpy(), n * _rand(8, 2, seed=41).reshape(n, 2, 2),
                               rtol=1e-6)
    # gradients: d(n x)/dx = n, d(x ** n)/dx = n x ** (n - 1)
    g = dm.grad(lambda t: ops.reduce_sum(ops.AllReduce()(t)))(Tensor(x))
    np.testing.assert_allclose(g.asnumpy(), np.full_like(x, n))
    g = dm.grad(lambda t: ops.reduce_sum(ops.AllReduce("prod")(t)))(Tensor(x))
    np.testing.assert_allclose(g.asnumpy(), n * x ** (n - 1), rtol=1e-5)
    g = dm.grad(lambda t: ops.reduce_sum(ops.AllGather()(t)))(Tensor(x))
    np.testing.assert_allclose(g.asnumpy(), np.full_like(x, n))


def test_all_reduce_of_batch_split_value_reduces_the_shards(ctx):
    n = 4
    ctx(n)
    x = _rand(8, 3, seed=42)
    t = distribute(Tensor(x), TensorLayout.batch_split((8, 3), n))
    out = ops.AllReduce()(t)
    assert out.layout is None and out.shape == (2, 3)
    np.testing.assert_allclose(out.asnumpy(), x.reshape(n, 2, 3).sum(0), rtol=1e-6)
    R = _rand(2, 3, seed=43)
    leaf = t
    g = dm.grad(lambda v: ops.reduce_sum(ops.AllReduce()(v) * Tensor(R)))(leaf)
    np.testing.assert_allclose(g.asnumpy(), np.tile(R, (n, 1)), rtol=1e-6)


def test_all_reduce_over_a_created_group(ctx):
    n = 4
    ctx(n)
    communication.create_group("pair01", [0, 1])
    communication.create_group("everyone", [3, 2, 1, 0])
    X = _rand(n, 3, seed=44)
    x = device_local_tensor(X)
    out = ops.AllReduce(group="pair01")(x)       # non-members keep their values
    want = X.copy()
    want[[0, 1]] = X[[0, 1]].sum(0)
    assert isinstance(out.layout, DeviceLocalLayout)
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-6)
    R = _rand(n, 3, seed=45)
    r = device_local_tensor(R)
    for op in ("sum", "mean", "max"):
        g = dm.grad(lambda x: ops.reduce_sum(ops.AllReduce(op, group="pair01")(x) * r))(x)
        gw = R.copy()
        pair = R[[0, 1]].sum(0)
        gw[[0, 1]] = {"sum": pair, "mean": pair / 2,
                      "max": pair * (X[[0, 1]] == X[[0, 1]].max(0))}[op]
        np.testing.assert_allclose(g.asnumpy(), gw, rtol=1e-6, err_msg=op)
    # Broadcast within the group: members get the root's value (root_rank 1 of the group)
    out = ops.Broadcast(1, group="pair01")(x)
    want = X.copy()
    want[0] = X[1]
    np.testing.assert_array_equal(out.asnumpy(), want)
    with CommReport() as rep:
        g = dm.grad(lambda x: ops.reduce_sum(ops.Broadcast(1, group="pair01")(x) * r))(x)
    gw = R.copy()
    gw[1], gw[0] = R[0] + R[1], 0
    np.testing.assert_allclose(g.asnumpy(), gw, rtol=1e-6)
    assert [(rec.kind, rec.reason, rec.group_size) for rec in rep.records] == [
        ("Broadcast", "user", 2), ("Reduce", "backward", 2)]
    # a group of every device in another order: AllGather concatenates in group order
    np.testing.assert_array_equal(ops.AllGather(group="everyone")(x).asnumpy(),
                                  X[::-1].reshape(-1))
    np.testing.assert_array_equal(ops.Broadcast(0, group="everyone")(x).asnumpy(), X[3])


def test_collectives_outside_a_parallel_context_are_the_identity():
    dm.reset_auto_parallel_context()
    communication.init()
    x = Tensor(_rand(4, 2, seed=46))
    for prim in (ops.AllReduce(), ops.AllGather(), ops.ReduceScatter(), ops.Broadcast(0),
                 ops.AlltoAll(1, 0, 1)):
        np.testing.assert_array_equal(prim(x).asnumpy(), x.asnumpy())


def test_user_collectives_in_backward_are_reported_as_backward(ctx):
    n = 4
    ctx(n)
    x = device_local_tensor(_rand(n, 8, 2, seed=47))
    with CommReport() as rep:
        dm.grad(lambda x: ops.reduce_sum(ops.ReduceScatter()(x) * 2.0))(x)
    assert [(r.kind, r.reason) for r in rep.records] == [("ReduceScatter", "user"),
                                                         ("AllGather", "backward")]


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------
def test_sparse_cross_entropy_on_device_local_logits_is_per_device(ctx):
    """Any op whose sharding rule is a per-device map runs on per-device values (the
    rule's local computation with every input whole): each device's loss of its own
    logits, and the gradient each device gets for its own logits."""
    n = 2
    ctx(n)
    logits = _rand(n, 4, 3, seed=5)
    labels = np.array([0, 1, 2, 0], np.int32)
    a = device_local_tensor(logits)
    loss = ops.sparse_softmax_cross_entropy(a, Tensor(labels))
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    expected = -logp[:, np.arange(4), labels]                     # (n, 4): per device
    assert isinstance(loss.layout, DeviceLocalLayout)
    np.testing.assert_allclose(loss._data, expected, rtol=1e-5, atol=1e-6)
    g = dm.grad(lambda x: ops.reduce_sum(ops.sparse_softmax_cross_entropy(x, Tensor(labels)))
                * 1.0)(a)
    onehot = np.eye(3, dtype=np.float32)[labels]
    np.testing.assert_allclose(g._data, np.exp(logp) - onehot, rtol=1e-5, atol=1e-6)


def test_unsupported_op_on_device_local_value_raises(ctx):
    ctx(2)
    a = device_local_tensor(_rand(2, 4, 3))
    with pytest.raises(RuntimeError, match=r"^Dropout: not supported on layerwise_parallel "
                                           r".*draws random numbers"):
        ops.dropout(a, 0.5)
    with pytest.raises(RuntimeError, match=r"^GetItem: not supported on layerwise_parallel "
                                           r".*needs communication .*integer or bool arr"):
        a[np.array([0, 2])]


def test_set_layerwise_slices_errors(ctx):
    ctx(4)
    w = Parameter(Tensor(np.zeros((8, 3), np.float32)), name="fc.weight",
                  layerwise_parallel=True)
    with pytest.raises(ValueError, match=r"Parameter 'fc.weight' has shape \(8, 3\) but "
                                         r"splitting the full weight of shape \(8, 16\) on "
                                         r"dim 1 over 4 devices gives slices of shape \(8, 4\)"):
        set_layerwise_slices(w, np.zeros((8, 16)), dim=1)
    with pytest.raises(ValueError, match=r"dim 1 \(size 10\) .* 'fc.weight' does not split "
                                         r"evenly over 4 devices"):
        set_layerwise_slices(w, np.zeros((8, 10)), dim=1)
    with pytest.raises(ValueError, match=r"'fc.weight' have shape \(2, 8, 3\); expected the "
                                         r"stack .* shape \(4, 8, 3\)"):
        set_layerwise_slices(w, np.zeros((2, 8, 3)))
    with pytest.raises(ValueError, match=r"dim=2 is out of range"):
        set_layerwise_slices(w, np.zeros((8, 12)), dim=2)
    plain = Parameter(Tensor(np.zeros((8, 3), np.float32)), name="b")
    with pytest.raises(ValueError, match=r"Parameter 'b' is not layerwise_parallel"):
        set_layerwise_slices(plain, np.zeros((4, 8, 3)))
    with pytest.raises(TypeError, match=r"param must be a Parameter"):
        set_layerwise_slices(Tensor(np.zeros(3)), np.zeros((4, 3)))
    set_layerwise_slices(w, np.arange(96, dtype=np.float64).reshape(8, 12), dim=1)
    assert w.dtype == np.float32 and w.asnumpy().shape == (4, 8, 3)
    np.testing.assert_array_equal(w.asnumpy()[1], np.arange(96).reshape(8, 12)[:, 3:6])


def test_collective_errors(ctx):
    ctx(4)
    communication.create_group("pair", [0, 1])
    x = device_local_tensor(_rand(4, 8, 2))
    with pytest.raises(ValueError, match=r"AlltoAll: split_count=2 must equal the number of "
                                         r"devices in group 'hccl_world_group' \(4\)"):
        ops.AlltoAll(2, 0, 1)(x)
    with pytest.raises(ValueError, match=r"AlltoAll: dim 1 \(split_dim, size 2\)"):
        ops.AlltoAll(4, 1, 0)(x)
    with pytest.raises(ValueError, match=r"Broadcast: root_rank=4 is out of range for group "
                                         r"'hccl_world_group' of 4 devices"):
        ops.Broadcast(4)(x)
    with pytest.raises(RuntimeError, match=r"AllGather: group 'pair' \(ranks \[0, 1\]\) does "
                                           r"not contain every one of the 4 devices"):
        ops.AllGather(group="pair")(x)
    with pytest.raises(ValueError, match=r"AllReduce: group 'nope' is not valid"):
        ops.AllReduce(group="nope")(x)
    with pytest.raises(ValueError, match=r"ReduceScatter: dim 0 \(size 6\)"):
        ops.ReduceScatter()(device_local_tensor(_rand(4, 6)))
    with pytest.raises(TypeError, match=r"AllReduce: op='mean' needs a floating dtype"):
        ops.AllReduce("mean")(device_local_tensor(np.ones((4, 2), np.int32)))
    with pytest.raises(ValueError, match=r"AllReduce: op='avg' is not valid"):
        ops.AllReduce("avg")
    with pytest.raises(ValueError, match=r"device_local_tensor: values have shape \(3, 2\)"):
        device_local_tensor(np.zeros((3, 2)))


def test_device_local_values_from_another_context_are_refused(ctx):
    ctx(4)
    a = device_local_tensor(_rand(4, 3))
    ctx(2)
    with pytest.raises(RuntimeError, match=r"^Exp: an input holds per-device .* of 4 devices "
                                           r"but the current parallel context has 2"):
        ops.exp(a)
