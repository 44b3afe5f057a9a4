"""Model(amp_level="O2"): Dense/Conv2d compute in float16 from float32 master weights,
BatchNorm in float32, a static loss scale; "O0" unchanged; other levels refused."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, nn, ops
from dualmode.dataset import NumpySlicesDataset
from dualmode.train import FixedLossScaleManager, Model

from _devices import devices


class _Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, has_bias=True)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc = nn.Dense(4 * 6 * 6, 3)
        self.seen = []

    def construct(self, x):
        y = self.conv(x)
        self.seen.append(("conv", y.dtype))
        y = self.bn(y)
        self.seen.append(("bn", y.dtype))
        out = self.fc(self.flatten(self.relu(y)))
        self.seen.append(("fc", out.dtype))
        return out


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 2, 6, 6)).astype(np.float32),
            rng.integers(0, 3, n).astype(np.int32))


def _train(amp_level, steps=3, scale=None, **ctx):
    x, y = _data()
    dm.set_seed(4)
    net = _Net()
    opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
    kw = {} if scale is None else {"loss_scale_manager": FixedLossScaleManager(scale)}
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
                  opt, amp_level=amp_level, **kw)
    ds = NumpySlicesDataset((x, y), ["x", "y"], shuffle=False).batch(8)
    losses = []

    class Keep(dm.train.Callback):
        def on_train_step_end(self, run_context):
            losses.append(float(run_context.original_args().net_outputs.asnumpy()))
    model.train(1, ds, callbacks=[Keep()])
    return losses[:steps], net


def test_o2_computes_in_float16_with_float32_master_weights():
    ref, _ = _train("O0")
    got, net = _train("O2")
    assert ("conv", np.float16) in net.seen and ("fc", np.float16) in net.seen
    assert ("bn", np.float16) in net.seen        # BN statistics in float32, y back in fp16
    assert all(p.dtype == np.float32 for p in net.get_parameters())
    # float16 products (11-bit mantissa) against the float32 run of the same steps
    np.testing.assert_allclose(got, ref, rtol=5e-3)


def test_o0_is_float32_and_the_default():
    _, net = _train("O0")
    assert {d for _, d in net.seen} == {np.dtype(np.float32)}


def test_loss_scale_does_not_change_the_step():
    a, _ = _train("O2", scale=1.0)
    b, _ = _train("O2", scale=1024.0)
    np.testing.assert_allclose(a, b, rtol=5e-3)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")      # the overflow itself
def test_overflowing_step_is_skipped():
    # a scale of 1e30 overflows the float16 gradients: every update is dropped
    _, net = _train("O2", scale=1e30)
    dm.set_seed(4)
    fresh = _Net()
    for p, q in zip(net.trainable_params(), fresh.trainable_params()):
        np.testing.assert_array_equal(p.asnumpy(), q.asnumpy())


def test_o2_data_parallel_equals_stand_alone():
    ref, _ = _train("O2")
    with devices(8, parallel_mode="data_parallel", gradients_mean=True):
        got, _ = _train("O2")
    np.testing.assert_allclose(got, ref, rtol=1e-3)   # float16 sums reordered


@pytest.mark.parametrize("kw, err, match", [
    (dict(amp_level="O1"), ValueError,
     r"Model: amp_level='O1' is not supported; expected one of 'O0', 'O2'"),
    (dict(amp_level="O3"), ValueError, r"amp_level='O3' is not supported"),
    (dict(amp_level="O2", loss_scale_manager=2.0), TypeError,
     r"Model: loss_scale_manager must be a FixedLossScaleManager, got float"),
])
def test_bad_amp_arguments_are_named(kw, err, match):
    net = _Net()
    with pytest.raises(err, match=match):
        Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.1), **kw)
    assert "amp_dtype" not in net.fc.__dict__           # nothing changed


def test_bad_loss_scale_is_named():
    with pytest.raises(ValueError, match=r"FixedLossScaleManager: loss_scale=0.5 must be a "
                                         r"finite number >= 1"):
        FixedLossScaleManager(0.5)
