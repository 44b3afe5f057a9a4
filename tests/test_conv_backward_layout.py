"""Layouts the convolution and pooling backward ops derive from their gradient's split.

A pooling strategy that splits H (or W) of a stride-2 convolution's output makes that
split reach the convolution's input gradient, whose H (9) may not divide by the parts;
the split is then dropped (the dim gathered) and every gradient equals the stand-alone
run's, in PyNative and GRAPH_MODE."""
import math

import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, nn, ops
from dualmode.parallel.rules.conv import _halo_sizes
from dualmode.parallel.sharding import plan_for
from dualmode.parallel.tensor_layout import TensorLayout
from dualmode.ops._registry import REGISTRY

from _devices import devices

RTOL = 1e-5


class _Net(nn.Cell):
    """Conv2d(1, 2, 3) "same", Conv2d(2, 2, 3, stride 2, "valid"), a 2x2 pool whose
    strategy splits the pooled map; the sum of the pooled map."""

    def __init__(self, pool_cls, strategy):
        super().__init__()
        self.c1 = nn.Conv2d(1, 2, 3)
        self.c2 = nn.Conv2d(2, 2, 3, stride=2, pad_mode="valid")
        self.pool = pool_cls(2, 2)
        self.pool.pool.shard(strategy)

    def construct(self, x):
        y = self.pool(self.c2(self.c1(x)))
        return ops.reduce_sum(ops.mul(y, y))


def _run(pool_cls, strategy, mode, shape=(8, 1, 9, 9)):
    dm.set_seed(0)
    net = _Net(pool_cls, strategy)
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    f = dm.value_and_grad(net, 0, net.trainable_params())
    with devices(None):
        ref = f(Tensor(x))
    with devices(8, full_batch=True):
        dm.set_context(mode=mode)
        got = f(Tensor(x))
    np.testing.assert_allclose(got[0].asnumpy(), ref[0].asnumpy(), rtol=RTOL)
    (gx, gw), (rx, rw) = got[1], ref[1]
    np.testing.assert_allclose(gx.asnumpy(), rx.asnumpy(), rtol=RTOL, atol=1e-6,
                               err_msg="input gradient")
    assert len(gw) == len(rw) == 2
    for i, (a, b) in enumerate(zip(gw, rw)):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=RTOL, atol=1e-6,
                                   err_msg=f"weight gradient {i}")


@pytest.mark.parametrize("mode", [dm.PYNATIVE_MODE, dm.GRAPH_MODE], ids=["eager", "graph"])
@pytest.mark.parametrize("pool_cls, strategy", [
    (nn.MaxPool2d, ((1, 1, 2, 1),)),          # the pooled H of 4 split in 2
    (nn.MaxPool2d, ((1, 1, 1, 2),)),          # W instead of H
    (nn.MaxPool2d, ((2, 1, 2, 2),)),          # batch, H and W
    (nn.AvgPool2d, ((1, 1, 2, 1),)),
    (nn.AvgPool2d, ((1, 2, 1, 2),)),          # channels and W
], ids=["max-H", "max-W", "max-NHW", "avg-H", "avg-CW"])
def test_pool_split_reaching_a_stride2_conv_backward(pool_cls, strategy, mode):
    _run(pool_cls, strategy, mode)


def test_divisible_but_misaligned_split_is_gathered():
    """A 10x10 input: 10 rows divide in 2, but the blocks (5 input rows per device) do
    not line up with the stride-2 windows of 2 output rows per device, so the split is
    gathered too."""
    _run(nn.MaxPool2d, ((1, 1, 2, 1),), dm.PYNATIVE_MODE, shape=(8, 1, 10, 10))


def test_input_gradient_rule_gathers_an_indivisible_dim():
    """The rule of Conv2DBackpropInput given dy (8, 2, 4, 4) split on H over 2 devices
    for an input of H 9: the input gradient's layout splits no H (9 rows do not divide
    in 2), and dy is asked for whole along H."""
    op = REGISTRY["Conv2DBackpropInput"]
    attrs = {"out_channel": 2, "kernel_size": (3, 3), "stride": (2, 2), "dilation": (1, 1),
             "group": 1, "pads": (0, 0, 0, 0), "in_hw": (9, 9)}
    dy = TensorLayout.from_strategy((1, 1, 2, 1), (8, 2, 4, 4), 2)
    plan, *_ = plan_for(op, attrs, [dy, (2, 2, 3, 3)], [np.float32, np.float32])
    need_dy, _ = plan.inputs
    (out,) = plan.outputs
    assert out.shape == (8, 2, 9, 9)
    assert out.tensor_map[2] == () and need_dy.tensor_map[2] == ()
    assert _halo_sizes(9, 4, 2, 3, 2, 1, 0) is None
    # 8 rows padded by 1 line up: 4 rows per device, 2 output rows, 1 row of halo before
    assert _halo_sizes(8, 4, 2, 3, 2, 1, 1) == (1, 0)


# ---------------------------------------------------------------------------
# every layout the image rules derive is valid, whatever split reaches them
# ---------------------------------------------------------------------------
def _splits(shape, n=4):
    """Strategies splitting H, W or both of an NCHW shape in 2 or 4 (dims that divide),
    with the batch split in 2 sometimes too."""
    out = []
    for sh, sw in [(2, 1), (1, 2), (4, 1), (1, 4), (2, 2)]:
        for sn in (1, 2):
            st = (sn, 1, sh, sw)
            if sn * sh * sw <= n and all(d % p == 0 for d, p in zip(shape, st)):
                out.append(st)
    return out


def _conv_attrs(k, s, pad):
    return {"out_channel": 2, "kernel_size": (k, k), "stride": (s, s), "dilation": (1, 1),
            "group": 1, "pads": (pad,) * 4}


def _pool_attrs(k, s, pad):
    return {"kernel_size": (k, k), "strides": (s, s), "pads": (0, pad, 0, pad)}


GEOMETRIES = [(h, k, s, pad) for h in (7, 8, 9, 10, 12) for k in (1, 2, 3) for s in (1, 2, 3)
              for pad in (0, 1) if k <= h and pad < k]


@pytest.mark.parametrize("h, k, s, pad", GEOMETRIES,
                         ids=[f"h{h}-k{k}-s{s}-p{p}" for h, k, s, p in GEOMETRIES])
def test_image_rules_derive_divisible_layouts(h, k, s, pad):
    """Conv2D, its two backward ops and the pools with their backward ops, given x or dy
    split on H/W in every way that divides it (the other input whole): no rule derives
    a layout whose blocks would be unequal (each is built with TensorLayout's checks)."""
    from dualmode.ops import _conv as C
    f32 = [np.float32] * 2
    x_shape = (4, 2, h, h)
    w_shape = (2, 2, k, k)
    conv, pool = _conv_attrs(k, s, pad), _pool_attrs(k, s, pad)
    y_hw = C._out_hw("Conv2D", (h, h), (k, k), (s, s), (1, 1), conv["pads"])
    p_hw = C._out_hw("Pool", (h, h), (k, k), (s, s), (1, 1), pool["pads"])
    y_shape, p_shape = (4, 2) + y_hw, (4, 2) + p_hw

    def lay(st, shape):
        return TensorLayout.from_strategy(st, shape, 4)

    cases = []
    for st in _splits(x_shape):
        cases += [("Conv2D", conv, [lay(st, x_shape), w_shape]),
                  ("Conv2DBackpropFilter", conv, [y_shape, lay(st, x_shape)]),
                  ("MaxPool", pool, [lay(st, x_shape)]),
                  ("AvgPool", pool, [lay(st, x_shape)]),
                  ("MaxPoolGrad", pool, [lay(st, x_shape), p_shape]),
                  ("AvgPoolGrad", pool, [lay(st, x_shape), p_shape])]
    for st in _splits(y_shape):
        cases += [("Conv2DBackpropInput", dict(conv, in_hw=(h, h)), [lay(st, y_shape), w_shape]),
                  ("Conv2DBackpropFilter", conv, [lay(st, y_shape), x_shape])]
    for st in _splits(p_shape):
        cases += [("MaxPoolGrad", pool, [x_shape, lay(st, p_shape)]),
                  ("AvgPoolGrad", pool, [x_shape, lay(st, p_shape)])]
    for name, attrs, specs in cases:
        found = plan_for(REGISTRY[name], attrs, specs, f32[:len(specs)])
        assert found is not None, name
        for out in found[0].outputs + tuple(i for i in found[0].inputs if i is not None):
            assert all(d % p == 0 for d, p in zip(out.shape, (
                math.prod(out.device_matrix[a] for a in axes) for axes in out.tensor_map))), \
                (name, out)
