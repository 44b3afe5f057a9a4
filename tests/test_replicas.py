"""A sharded Parameter whose replicas are stored once (dualmode.parallel.replicas): a
weight split over some device axes and repeated over the others keeps one copy of each
distinct block (when its stack would take 64 KiB or more); sharded ops and the
optimizer use that grid, anything else that reads the stack writes it once and then
uses it. Every train step equals the same step done by hand in numpy."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel.replicas import ReplicaBlocks, replica_blocks
from dualmode.train.serialization import load_checkpoint, save_checkpoint

from _steps import mean_square_step

RNG = np.random.default_rng(5)
LR = 0.1
#: x (2, 4) @ W (4, 1) on 8 devices: W's 4 row blocks, each held by 2 devices
STRATEGY = ((2, 4), (4, 1))


def _numpy_steps(x, w, steps, lr=LR, momentum=0.0):
    """Loss mean(relu(x @ w)^2) and SGD (with momentum) on w, by hand."""
    w, v, losses = w.copy(), np.zeros_like(w), []
    for k in range(steps):
        h = x @ w
        a = np.maximum(h, 0)
        losses.append(float(np.mean(a * a)))
        g = x.T @ (2.0 * a * (h > 0) / a.size)
        v = g if k == 0 else momentum * v + g
        w -= lr * (v if momentum else g)
    return losses, w


def _setup(momentum=0.0, rows=16, k=256, n=96):
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    w0 = (RNG.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    w = Parameter(Tensor(w0.copy()), name="w")
    mm, relu = ops.MatMul().shard(STRATEGY), ops.ReLU()
    opt = nn.SGD([w], learning_rate=LR, momentum=momentum)
    step = mean_square_step(lambda t: relu(mm(t, w)), opt)
    return x, w0, w, step, opt


def test_the_replicas_are_stored_once_and_read_as_every_devices_block(eight):
    x, w0, w, step, opt = _setup()
    step(Tensor(x))
    grid = replica_blocks(w)
    assert isinstance(w._lazy, ReplicaBlocks) and w._arr is None
    assert grid.shape == (1, 4, 64, 96) and grid.flags.writeable    # one copy per block
    _, w1 = _numpy_steps(x, w0, 1)
    np.testing.assert_allclose(w.asnumpy(), w1, rtol=1e-5, atol=1e-6)
    assert isinstance(w._lazy, ReplicaBlocks)                      # asnumpy read the grid
    stack = w._data                                                # written: 8 devices
    assert stack.shape == (8, 64, 96) and w._lazy is None
    for rank in range(8):                 # device (i, j) holds row block j, for i = 0, 1
        j = rank % 4
        np.testing.assert_allclose(stack[rank], w1[64 * j:64 * (j + 1)], rtol=1e-5,
                                   atol=1e-6)


def test_train_steps_update_each_block_once_and_equal_numpy(eight):
    x, w0, w, step, opt = _setup()
    losses = [float(step(Tensor(x)).asnumpy()) for _ in range(4)]
    assert isinstance(w._lazy, ReplicaBlocks)          # never written during the steps
    ref_losses, ref_w = _numpy_steps(x, w0, 4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(w.asnumpy(), ref_w, rtol=1e-5, atol=1e-6)


def test_a_compiled_train_step_keeps_the_replicas_once_and_equals_numpy(eight):
    """A product large enough to run as one GEMM per group of devices, on grids (a
    small one runs per device: its graph has the stack written, then updates it)."""
    from dualmode.parallel.auto_parallel import AutoParallel
    x, w0, w, step, opt = _setup(rows=128, k=256, n=128)
    compiled = AutoParallel(step, parallel_mode="semi_auto")
    losses = [float(compiled(Tensor(x)).asnumpy()) for _ in range(3)]
    assert isinstance(w._lazy, ReplicaBlocks) and w._arr is None
    ref_losses, ref_w = _numpy_steps(x, w0, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(w.asnumpy(), ref_w, rtol=1e-5, atol=1e-6)


def test_a_stack_read_between_steps_becomes_the_storage(eight):
    x, w0, w, step, opt = _setup()
    step(Tensor(x))
    lazy = w._lazy
    stack = w._data                                   # e.g. a user reading the shards
    assert lazy.current_grid(w._layout) is None       # the grid is no longer the value
    for _ in range(2):
        step(Tensor(x))
    assert w._data is stack                           # updated in place, one array
    _, ref_w = _numpy_steps(x, w0, 3)
    np.testing.assert_allclose(w.asnumpy(), ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stack[4], stack[0])    # the replicas stayed equal


def test_an_optimizer_with_states_keeps_them_once_and_equals_numpy(eight):
    x, w0, w, step, opt = _setup(momentum=0.9)
    losses = [float(step(Tensor(x)).asnumpy()) for _ in range(3)]
    ref_losses, ref_w = _numpy_steps(x, w0, 3, momentum=0.9)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(w.asnumpy(), ref_w, rtol=1e-5, atol=1e-6)
    assert isinstance(w._lazy, ReplicaBlocks)
    assert isinstance(opt.accum[0]._lazy, ReplicaBlocks)   # the momentum: once per block


def _numpy_adam_float32(x, w0, steps, lr=0.01, b1=0.9, b2=0.999, eps=1e-8):
    """mean(relu(x @ w)^2) trained with Adam by hand, in float32 and with the sums in the
    order the sharded step makes them (x @ w as 4 partial products over blocks of the
    contracted dim, the weight gradient as 2 over the row blocks): Adam's step
    m / sqrt(v) amplifies a rounding difference in a gradient near zero, so a float64
    or differently ordered reference is ~2e-5 off any float32 Adam."""
    w = w0.copy()
    m, v = np.zeros_like(w), np.zeros_like(w)
    kb, rb = x.shape[1] // STRATEGY[0][1], x.shape[0] // STRATEGY[0][0]
    for t in range(1, steps + 1):
        h = sum(x[:, j:j + kb] @ w[j:j + kb] for j in range(0, x.shape[1], kb))
        a = np.maximum(h, 0)
        dh = np.float32(2.0) * a * (h > 0) / np.float32(a.size)
        g = sum(x[i:i + rb].T @ dh[i:i + rb] for i in range(0, x.shape[0], rb))
        m = np.float32(b1) * m + np.float32(1 - b1) * g
        v = np.float32(b2) * v + np.float32(1 - b2) * g * g
        lr_t = np.float32(lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t))
        w = w - lr_t * m / (np.sqrt(v) + np.float32(eps))
    assert w.dtype == m.dtype == np.float32
    return w, m


def test_adam_on_a_weight_stored_once_equals_numpy(eight):
    x = RNG.standard_normal((16, 256)).astype(np.float32)
    w0 = (RNG.standard_normal((256, 96)) / 16).astype(np.float32)
    w = Parameter(Tensor(w0.copy()), name="w")
    mm, relu = ops.MatMul().shard(STRATEGY), ops.ReLU()
    opt = nn.Adam([w], learning_rate=0.01)
    step = mean_square_step(lambda t: relu(mm(t, w)), opt)
    for _ in range(3):
        step(Tensor(x))
    ref, m = _numpy_adam_float32(x, w0, 3)
    assert isinstance(w._lazy, ReplicaBlocks)
    assert isinstance(opt.moment1[0]._lazy, ReplicaBlocks)
    np.testing.assert_allclose(w.asnumpy(), ref, rtol=1e-4, atol=1e-5)
    # the states' values read back as every device's block
    np.testing.assert_allclose(opt.moment1[0].asnumpy(), m, rtol=1e-4, atol=1e-6)


def test_a_checkpoint_of_a_weight_stored_once_round_trips(eight, tmp_path):
    x, w0, w, step, opt = _setup()
    step(Tensor(x))
    path = str(tmp_path / "w.ckpt")
    save_checkpoint([w], path)
    _, w1 = _numpy_steps(x, w0, 1)
    np.testing.assert_allclose(load_checkpoint(path)["w"].asnumpy(), w1, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("dtype", [np.int32])
def test_integer_weights_keep_a_stack(eight, dtype):
    """Only float weights (the ones an optimizer updates) are stored once."""
    w = Parameter(Tensor(np.arange(256 * 96, dtype=dtype).reshape(256, 96) % 7), name="w",
                  requires_grad=False)
    x = Tensor(np.ones((16, 256), dtype))
    out = ops.MatMul().shard(STRATEGY)(x, w)
    assert w._lazy is None and w._data.shape == (8, 64, 96)
    np.testing.assert_array_equal(out.asnumpy(), np.ones((16, 256), dtype) @ w.asnumpy())


def test_a_small_weight_keeps_a_stack(eight):
    """Under 64 KiB of stack the replicas are written (the grid path of a small op
    costs more than it saves), and the step still equals numpy."""
    x, w0, w, step, opt = _setup(k=32, n=24)
    step(Tensor(x))
    assert w._lazy is None and w._data.shape == (8, 8, 24)
    _, w1 = _numpy_steps(x, w0, 1)
    np.testing.assert_allclose(w.asnumpy(), w1, rtol=1e-5, atol=1e-6)


def test_a_bias_whose_gradient_comes_as_a_full_grid_equals_numpy(eight):
    """The gradient may reach the optimizer with every replica's block (a full device
    grid, here from a layout over another device matrix): each distinct block of the
    weight is still updated once, from the first."""
    x = RNG.uniform(-0.1, 0.1, (8, 4096)).astype(np.float32)    # b's stack: 64 KiB
    b0 = RNG.uniform(-0.05, 0.05, 4096).astype(np.float32)
    b = Parameter(Tensor(b0.copy()), name="b")
    add = ops.BiasAdd().shard(((1, 2), (2,)))
    rsum = ops.ReduceSum(keep_dims=True).shard(((4, 1),))

    def f(t):
        h = add(t, b)
        h = h * rsum(h, 1)
        return ops.ReduceSum()(ops.Square()(h))

    grad_fn = dm.value_and_grad(f, 0, [b])
    lr = 1e-6      # small enough that three steps stay finite (the loss is quartic in b)
    opt = nn.SGD([b], learning_rate=lr)
    ref = b0.copy()
    for _ in range(3):
        loss, (_, grads) = grad_fn(Tensor(x))
        opt(grads)
        h = x + ref
        s = h.sum(axis=1, keepdims=True)
        z = h * s
        assert float(loss.asnumpy()) == pytest.approx(float(np.sum(z * z)), rel=1e-5)
        dz = 2.0 * z                                # d sum(z^2) / dz
        dh = dz * s + (dz * h).sum(axis=1, keepdims=True)
        ref -= lr * dh.sum(axis=0)
    assert isinstance(b._lazy, ReplicaBlocks)
    assert np.isfinite(ref).all() and np.abs(ref - b0).max() > 1e-4   # it moved
    np.testing.assert_allclose(b.asnumpy(), ref, rtol=1e-5, atol=1e-6)
