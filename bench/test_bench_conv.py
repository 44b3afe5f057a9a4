"""Conv2D forward + backward of a ResNet block's 3x3 convolution against the same
computation in plain numpy (im2col + one matmul forward, the two gradient GEMMs and
col2im backward), and a data-parallel ResNet step on 8 simulated devices against the
single-device step.

Targets: conv fwd+bwd <= 1.2x numpy; 8-device DP ResNet step <= 1.3x one device.

Both sides run the same three GEMMs (OpenBLAS, threaded): the difference is the data
movement around them (dualmode: channels-last Cython kernels; numpy: strided NCHW copies
and a col2im of kh * kw strided adds). On a shared machine OpenBLAS's threads make single
timings swing several-fold; compare the ratios of several runs.
"""
import os
import sys
import time

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import dualmode as dm
from dualmode import Tensor, communication, nn, ops

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import resnet_cifar10  # noqa: E402

SHAPES = [(32, 64, 32, 32), (64, 128, 16, 16)]        # (N, C, H, W), C_out = C, 3x3 same


def numpy_conv_fwd_bwd(x, w, g):
    """y = conv(x, w) (3x3, stride 1, pad 1) and its gradients for the cotangent g."""
    n, c, h, wd = x.shape
    co = w.shape[0]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    win = sliding_window_view(xp, (3, 3), axis=(2, 3))            # N C H W 3 3
    cols = np.ascontiguousarray(win.transpose(0, 2, 3, 1, 4, 5)).reshape(n * h * wd, -1)
    wm = w.reshape(co, -1)
    y = (cols @ wm.T).reshape(n, h, wd, co).transpose(0, 3, 1, 2)
    gm = np.ascontiguousarray(g.transpose(0, 2, 3, 1)).reshape(-1, co)
    dw = (gm.T @ cols).reshape(w.shape)
    dcols = (gm @ wm).reshape(n, h, wd, c, 3, 3)
    dxp = np.zeros_like(xp)
    for i in range(3):
        for j in range(3):
            dxp[:, :, i:i + h, j:j + wd] += dcols[..., i, j].transpose(0, 3, 1, 2)
    return np.ascontiguousarray(y), dxp[:, :, 1:-1, 1:-1], dw


def _inputs(shape):
    rng = np.random.default_rng(0)
    n, c, h, wd = shape
    return (rng.normal(size=shape).astype(np.float32),
            rng.normal(size=(c, c, 3, 3)).astype(np.float32) * 0.05,
            rng.normal(size=shape).astype(np.float32))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("impl", ["numpy", "dualmode"])
def test_conv_fwd_bwd(benchmark, record, shape, impl):
    benchmark.group = f"Conv2D 3x3 fwd+bwd {shape}"
    x, w, g = _inputs(shape)
    key = f"conv fwd+bwd {'x'.join(map(str, shape))}"
    if impl == "numpy":
        benchmark.pedantic(numpy_conv_fwd_bwd, args=(x, w, g), rounds=5, warmup_rounds=1)
        record(benchmark, key + " (numpy)")
        return
    gt = Tensor(g)
    conv = ops.Conv2D(shape[1], 3, pad_mode="same")
    step = dm.value_and_grad(lambda a, b: ops.reduce_sum(ops.mul(conv(a, b), gt)),
                             grad_position=(0, 1))
    xt, wt = Tensor(x), Tensor(w)
    _, (dx, dw) = step(xt, wt)
    _, dx0, dw0 = numpy_conv_fwd_bwd(x, w, g)
    benchmark.extra_info["correct"] = bool(
        np.allclose(dx.asnumpy(), dx0, rtol=1e-4, atol=1e-3)
        and np.allclose(dw.asnumpy(), dw0, rtol=1e-4, atol=1e-2))
    benchmark.pedantic(step, args=(xt, wt), rounds=5, warmup_rounds=1)
    record(benchmark, key, key + " (numpy)", target=1.2)


def _context(devices):
    dm.reset_auto_parallel_context()
    if devices:
        dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=devices,
                                     gradients_mean=True)
    communication.init()


def _resnet_step(devices, x, y):
    _context(devices)
    dm.set_seed(1)
    net = resnet_cifar10.ResNet(8, 10, 16)
    net.set_train()
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    loss = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True,
                                                                  reduction="mean"))
    grad_fn = dm.value_and_grad(loss, None, opt.parameters)
    xt, yt = Tensor(x), Tensor(y)

    def step():
        value, grads = grad_fn(xt, yt)
        opt(grads)
        return value
    return step


def test_resnet_dp_step(benchmark, record_value):
    """The 1-device and the 8-device data-parallel steps alternate round by round (each
    under its own context), so both see the same machine; the ratio is of the medians
    (pytest-benchmark times the 8-device step; the pairing is done here)."""
    benchmark.group = "ResNet depth 8 width 16 train step, batch 64"
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)
    steps = {d: _resnet_step(d, x, y) for d in (None, 8)}
    times = {None: [], 8: []}
    try:
        first = {}
        for d, step in steps.items():          # the first step from the same weights
            _context(d)
            first[d] = float(step().asnumpy())
        benchmark.extra_info["correct"] = bool(np.isclose(first[8], first[None], rtol=1e-5))
        for _ in range(12):
            for d, step in steps.items():
                _context(d)
                t = time.perf_counter()
                step()
                times[d].append(time.perf_counter() - t)
        _context(8)
        benchmark.pedantic(steps[8], rounds=3, warmup_rounds=0)
    finally:
        dm.reset_auto_parallel_context()
        communication.init()
    one, eight = float(np.median(times[None])), float(np.median(times[8]))
    benchmark.extra_info["median_1dev_s"] = one
    benchmark.extra_info["median_8dev_s"] = eight
    record_value("resnet8 step 1 device", one)
    record_value("resnet8 dp step 8 devices", eight, "resnet8 step 1 device", target=1.3)
