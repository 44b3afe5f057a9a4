"""Invalid attributes and arguments get a named ValueError/TypeError (issue 11 item 6):
never a raw Python error from deep inside, never acceptance. Shape errors beside
sharded inputs name the op and both global shapes."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import Layout

X = np.ones((4, 4), np.float32)
IDX = np.array([0, 1], np.int32)


@pytest.mark.parametrize("call,error,message", [
    (lambda: ops.StridedSlice(begin_mask=None)(Tensor(X), (0, 0), (2, 2), (1, 1)), TypeError,
     r"StridedSlice: begin_mask=None must be an int >= 0"),
    (lambda: ops.StridedSlice(shrink_axis_mask=1.0)(Tensor(X), (0, 0), (2, 2), (1, 1)),
     TypeError, r"StridedSlice: shrink_axis_mask=1.0 must be an int >= 0"),
    (lambda: ops.StridedSlice()(Tensor(X), (0.5, 0), (2, 2), (1, 1)), TypeError,
     r"StridedSlice: begin=\(0.5, 0\) must be a tuple of ints"),
    (lambda: ops.StridedSlice()(Tensor(X), (0, 0), None, (1, 1)), TypeError,
     r"StridedSlice: end=None must be a tuple of ints"),
    (lambda: ops.OneHot(axis=None), TypeError, r"OneHot: axis=None must be an int"),
    (lambda: ops.OneHot(axis=1.0), TypeError, r"OneHot: axis=1.0 must be an int"),
    (lambda: ops.one_hot(Tensor(IDX), 3, 1.0, 0.0, axis=None), TypeError,
     r"OneHot: axis=None must be an int in \[-2, 1\]"),
    (lambda: ops.Reshape()(Tensor(X), None), TypeError,
     r"Reshape: shape must be a tuple of ints \(one -1 allowed\), got None"),
    (lambda: ops.reshape(Tensor(X), "16"), TypeError, r"Reshape: shape must be a tuple"),
    (lambda: Layout((2, 4), ("a", "b"))("a", "b").device_slices(None), TypeError,
     r"Layout: shape must be a tuple of ints \(the tensor's global shape\), got None"),
])
def test_invalid_op_attribute_is_refused_by_name(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("make", [
    lambda p, lr: nn.SGD(p, learning_rate=lr),
    lambda p, lr: nn.Momentum(p, learning_rate=lr, momentum=0.9),
    lambda p, lr: nn.Adam(p, learning_rate=lr),
])
@pytest.mark.parametrize("lr", [float("nan"), float("inf"), [0.1, float("nan")]])
def test_non_finite_learning_rate_is_refused(make, lr):
    p = [Parameter(Tensor(X), name="p")]
    with pytest.raises(ValueError, match=r"learning_rate.* (must be a finite float|non-finite)"):
        make(p, lr)


@pytest.mark.parametrize("key,value", [("momentum", float("nan")), ("weight_decay", float("inf")),
                                       ("loss_scale", float("nan"))])
def test_non_finite_optimizer_hyperparameter_is_refused(key, value):
    p = [Parameter(Tensor(X), name="p")]
    with pytest.raises(ValueError, match=rf"{key}={value} must be a finite float"):
        nn.Momentum(p, learning_rate=0.1, **{"momentum": 0.9, key: value})


@pytest.mark.parametrize("config", [float("inf"), float("nan"), 0, -1])
def test_comm_fusion_size_must_be_a_positive_finite_number(config):
    before = dm.get_auto_parallel_context("comm_fusion")
    with pytest.raises(ValueError, match=r"comm_fusion\['allreduce'\]\['config'\]=.* is not "
                                         r"valid; expected a positive number of MB"):
        dm.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "size",
                                                                "config": config}})
    assert dm.get_auto_parallel_context("comm_fusion") == before       # nothing changed


def test_shape_error_beside_sharded_inputs_names_the_global_shapes(eight):
    class Net(nn.Cell):
        def construct(self, x, y):
            return ops.Sub()(x, y)

    with pytest.raises(ValueError, match=r"Sub: input 0 has shape \(16, 1\) but input 1 has "
                                         r"shape \(8, 1\)"):
        Net()(Tensor(np.ones((16, 1), np.float32)), Tensor(np.ones((8, 1), np.float32)))
    h = ops.ReLU().shard(((8, 1),))(Tensor(np.ones((16, 4), np.float32)))
    with pytest.raises(ValueError, match=r"Add: input 0 has shape \(16, 4\) but input 1 has "
                                         r"shape \(8, 4\)"):
        ops.Add()(h, Tensor(np.ones((8, 4), np.float32)))
    with pytest.raises(ValueError, match=r"MatMul: input 0 has shape \(16, 4\) but input 1 "
                                         r"has shape \(8, 4\)"):
        ops.MatMul()(h, Tensor(np.ones((8, 4), np.float32)))
