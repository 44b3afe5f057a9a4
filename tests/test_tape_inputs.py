"""What the tape keeps of an op's inputs: an op whose backward does not read their
values (``OpDef.reads_inputs`` False: BiasAdd, ReLU, Sigmoid, Tanh, and the ops whose
backward reads only shapes and dtypes: Add, Sub, Reshape, Cast, the sums ...) keeps
only their nodes, shapes, dtypes and layouts, so a step frees its activations as a
single-device numpy step does; ``KEEPING_INPUTS`` keeps them all (check_equivalence
reads them).

Oracles: the gradients of a Dense-BiasAdd-activation network written by hand in numpy,
the same with and without the stand-ins; central differences of a float64 numpy
program of the shape-only ops."""
import weakref

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, ops
from dualmode._core._tensor import KEEPING_INPUTS
from dualmode.ops._registry import get_op
from dualmode.parallel.inputs import distribute_inputs

RNG = np.random.default_rng(3)
X = RNG.standard_normal((6, 4)).astype(np.float32)
W = RNG.standard_normal((4, 5)).astype(np.float32)
B = RNG.standard_normal((5,)).astype(np.float32)


def _numpy_grads(act):
    h = X @ W + B
    if act == "relu":
        y, dh = np.maximum(h, 0), (h > 0).astype(np.float32)
    elif act == "sigmoid":
        y = 1 / (1 + np.exp(-h))
        dh = y * (1 - y)
    else:
        y = np.tanh(h)
        dh = 1 - y * y
    # loss = sum(y * y): dloss/dy = 2y
    g = 2 * y * dh
    return float((y * y).sum()), X.T @ g, g.sum(axis=0)


def _run(act, keep, dp=False):
    w, b = Parameter(Tensor(W.copy()), name="w"), Parameter(Tensor(B.copy()), name="b")
    seen = {}
    fn = {"relu": ops.relu, "sigmoid": ops.sigmoid, "tanh": ops.tanh}[act]

    def loss(x):
        h = ops.matmul(x, w)
        seen["h"] = weakref.ref(h._data)
        z = ops.bias_add(h, b)
        seen["z"] = z
        y = fn(z)
        seen["y"] = y
        return ops.reduce_sum(y * y)

    grad_fn = dm.value_and_grad(loss, None, [w, b])
    x = distribute_inputs((Tensor(X),))[0] if dp else Tensor(X)     # a batch split
    if keep:
        with KEEPING_INPUTS:
            value, grads = grad_fn(x)
    else:
        value, grads = grad_fn(x)
    return value, grads, seen


@pytest.mark.parametrize("act", ["relu", "sigmoid", "tanh"])
@pytest.mark.parametrize("keep", [False, True])
def test_gradients_equal_numpy_with_and_without_the_inputs_kept(act, keep):
    value, (gw, gb), _ = _run(act, keep)
    want_value, want_w, want_b = _numpy_grads(act)
    np.testing.assert_allclose(value.asnumpy(), want_value, rtol=1e-5)
    np.testing.assert_allclose(gw.asnumpy(), want_w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gb.asnumpy(), want_b, rtol=1e-5, atol=1e-5)


def test_the_tape_does_not_hold_the_input_of_an_op_that_does_not_read_it():
    _, _, seen = _run("relu", keep=False)
    kept = seen["z"]._node.inputs[0]                 # BiasAdd's input: MatMul's output
    assert kept.shape == (6, 5) and kept.dtype == np.float32
    assert kept._node is not None                    # still linked to MatMul's node
    assert seen["h"]() is None                       # the array itself was freed
    with pytest.raises(RuntimeError, match="BiasAdd: the tape does not keep the values"):
        kept._data
    relu_in = seen["y"]._node.inputs[0]              # ReLU reads its output, not its input
    with pytest.raises(RuntimeError, match="ReLU: the tape does not keep"):
        relu_in.asnumpy()
    np.testing.assert_array_equal(seen["y"]._node.outputs[0].asnumpy(),
                                  np.maximum(X @ W + B, 0))


def test_keeping_inputs_keeps_them_all():
    _, _, seen = _run("relu", keep=True)
    kept = seen["z"]._node.inputs[0]
    np.testing.assert_allclose(kept.asnumpy(), X @ W, rtol=1e-6)
    assert seen["h"]() is not None


SHAPE_ONLY = ("BiasAdd", "ReLU", "Sigmoid", "Tanh", "Add", "Sub", "Neg", "Cast", "Reshape",
              "Transpose", "GetItem", "IndexAdd", "Concat", "Split", "StopGradient",
              "ReduceSum", "ReduceMean", "BroadcastTo")


def test_which_ops_declare_it():
    assert [get_op(n).reads_inputs for n in SHAPE_ONLY] == [False] * len(SHAPE_ONLY)
    assert all(get_op(n).reads_inputs for n in ("MatMul", "Mul", "Square", "Log", "Gather",
                                                "ReduceMax", "RealDiv"))


A = RNG.standard_normal((4, 6))
V = RNG.standard_normal((6,))


def _shape_ops_forward(a, v, xp):
    """A program of the shape-only ops (and Mul for a loss that reads values): `xp` is
    numpy (float64, the oracle) or dualmode's ops."""
    if xp is np:
        h = a * 2.0
        t = np.transpose(np.reshape(h, (6, 4)), (1, 0)) + v - (-v)
        c = np.concatenate([t, a.astype(np.float64)], 1)
        left, right = np.split(c, 2, 1)
        m = np.mean(left - right, 0) + np.sum(c, 0)[:6]
        r = np.broadcast_to(m, (3, 6))[1:3]
        return float(np.sum(r * r))
    h = a * 2.0
    t = ops.add(ops.transpose(ops.reshape(h, (6, 4)), (1, 0)), v) - ops.neg(v)
    c = ops.concat((t, ops.cast(a, np.float32)), 1)
    left, right = ops.split(c, 1, 2)
    m = ops.reduce_mean(left - right, 0) + ops.reduce_sum(c, 0)[:6]
    r = ops.broadcast_to(m, (3, 6))[1:3]
    return ops.reduce_sum(r * r), h


def test_shape_only_ops_gradients_equal_finite_differences_and_free_their_inputs():
    """The gradients of a program of every other shape-only op, recorded with stand-ins,
    equal central differences of the same program in float64 numpy; the array of an
    intermediate only shape-only ops read (h = a * 2, read by Reshape) is freed."""
    a = Parameter(Tensor(A.astype(np.float32)), name="a")
    v = Parameter(Tensor(V.astype(np.float32)), name="v")
    seen = {}

    def loss(a, v):
        out, h = _shape_ops_forward(a, v, ops)
        seen["h"] = weakref.ref(h._data)
        return out

    value, (ga, gv) = dm.value_and_grad(loss, (0, 1))(a, v)
    assert seen["h"]() is None
    np.testing.assert_allclose(value.asnumpy(), _shape_ops_forward(A, V, np), rtol=1e-5)
    eps = 1e-6
    for arr, got in ((A, ga), (V, gv)):
        want = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            up, down = arr.copy(), arr.copy()
            up[i] += eps
            down[i] -= eps
            args = (up, V) if arr is A else (A, up)
            args_down = (down, V) if arr is A else (A, down)
            want[i] = (_shape_ops_forward(*args, np) - _shape_ops_forward(*args_down, np)) \
                / (2 * eps)
        np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-4, atol=1e-4)


def test_data_parallel_step_with_stand_ins_equals_single_device():
    """Distributed inputs keep their layouts in the tape; the step equals numpy."""
    dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=2,
                                 gradients_mean=True)
    communication.init()
    try:
        value, (gw, gb), seen = _run("relu", keep=False, dp=True)
        kept = seen["z"]._node.inputs[0]
        assert kept._layout is not None and kept._layout == seen["z"]._layout
    finally:
        dm.reset_auto_parallel_context()
        communication.init()
    want_value, want_w, want_b = _numpy_grads("relu")
    np.testing.assert_allclose(value.asnumpy(), want_value, rtol=1e-5)
    np.testing.assert_allclose(gw.asnumpy(), want_w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gb.asnumpy(), want_b, rtol=1e-5, atol=1e-5)


def test_the_switches_nest_and_a_new_one_is_refused():
    from dualmode._core._tensor import DEFERRING, Nesting, deferral_on
    with DEFERRING:
        with DEFERRING:
            assert deferral_on()
        assert deferral_on()
    assert not deferral_on()
    with KEEPING_INPUTS:
        with KEEPING_INPUTS:
            pass
        _, _, seen = _run("relu", keep=False)          # still inside one: kept
    assert seen["h"]() is not None
    with pytest.raises(RuntimeError, match="Nesting: use the module's instances"):
        with Nesting():
            pass
