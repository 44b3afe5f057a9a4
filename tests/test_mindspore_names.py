"""Names and module paths MindSpore scripts import: Primitive.add_prim_attr / attrs,
the ``ops.operations`` (P) namespace, ``ops.composite.GradOperation``, ParameterTuple,
``parallel.shard.Layout``, ``dm.shard`` / ``dm.reshard``, and the context keys
``auto_parallel_search_mode`` and ``comm_fusion={"openstate": ...}``. Numbers are
checked against numpy (the single device)."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import GRAPH_MODE, PYNATIVE_MODE, Parameter, Tensor, nn, ops
from dualmode.parallel import CommReport

RNG = np.random.default_rng(11)


# ----------------------------------------------------------------- Primitive attrs
def test_add_prim_attr_is_stored_and_readable():
    mm = ops.MatMul(transpose_b=True)
    assert mm.add_prim_attr("fusion", 2) is mm
    mm.add_prim_attr("primitive_target", "CPU")
    assert mm.attrs == {"transpose_a": False, "transpose_b": True, "fusion": 2,
                        "primitive_target": "CPU"}
    mm.attrs["fusion"] = 5                      # a copy
    assert mm.attrs["fusion"] == 2
    a, b = RNG.standard_normal((4, 3)).astype(np.float32), \
        RNG.standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_allclose(mm(Tensor(a), Tensor(b)).asnumpy(), a @ b.T, rtol=1e-6)


def test_prim_attrs_with_a_parallel_meaning_are_checked_by_name():
    with pytest.raises(ValueError, match=r"Gather: add_prim_attr\('manual_split', \(3, 5\)\) "
                                         r"is not supported"):
        ops.Gather().add_prim_attr("manual_split", (3, 5))
    with pytest.raises(ValueError, match=r"MatMul: add_prim_attr\('primitive_target', 'TPU'\) "
                                         r"is not valid; expected 'CPU', 'GPU' or 'Ascend'"):
        ops.MatMul().add_prim_attr("primitive_target", "TPU")
    with pytest.raises(TypeError, match=r"ReLU: add_prim_attr name must be a non-empty str"):
        ops.ReLU().add_prim_attr(3, 1)
    g = ops.Gather()
    with pytest.raises(ValueError):
        g.add_prim_attr("manual_split", (3, 5))
    assert "manual_split" not in g.attrs        # nothing stored


# ------------------------------------------------------------------- P namespace
def test_operations_namespace_holds_every_primitive_and_collective():
    from dualmode.ops import operations as P
    for name in ("MatMul", "BatchMatMul", "ReLU", "Softmax", "OneHot", "Gather", "Conv2D",
                 "AllReduce", "AllGather", "ReduceScatter", "Broadcast", "AlltoAll",
                 "SoftmaxCrossEntropyWithLogits", "ReduceSum", "Reshape", "ReduceOp"):
        assert name in P.__all__ and getattr(P, name) is getattr(ops, name), name
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_allclose(P.ReLU()(Tensor(x)).asnumpy(), np.maximum(x, 0))


# ----------------------------------------------------------------- GradOperation
class _Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(RNG.standard_normal((3, 2)).astype(np.float32)), name="w")
        self.mm = ops.MatMul()

    def construct(self, x, y):
        return ops.ReduceSum()(self.mm(x, self.w) * y)


def _net_and_inputs():
    net = _Net()
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    y = RNG.standard_normal((4, 2)).astype(np.float32)
    return net, x, y


def test_grad_operation_forms_equal_numpy():
    from dualmode.ops.composite import GradOperation
    net, x, y = _net_and_inputs()
    w = net.w.asnumpy()
    dx, dy, dw = y @ w.T, x @ w, x.T @ y
    g = GradOperation()(net)(Tensor(x), Tensor(y))
    np.testing.assert_allclose(g.asnumpy(), dx, rtol=1e-5)
    gx, gy = GradOperation(get_all=True)(net)(Tensor(x), Tensor(y))
    np.testing.assert_allclose(gx.asnumpy(), dx, rtol=1e-5)
    np.testing.assert_allclose(gy.asnumpy(), dy, rtol=1e-5)
    params = dm.ParameterTuple(net.trainable_params())
    (gw,) = GradOperation(get_by_list=True)(net, params)(Tensor(x), Tensor(y))
    np.testing.assert_allclose(gw.asnumpy(), dw, rtol=1e-5)
    (ax, ay), (aw,) = GradOperation(get_all=True, get_by_list=True)(net, params)(
        Tensor(x), Tensor(y))
    for got, want in ((ax, dx), (ay, dy), (aw, dw)):
        np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-5)


def test_grad_operation_sens_param_and_integer_inputs():
    from dualmode.ops.composite import GradOperation
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    sens = RNG.standard_normal((4, 3)).astype(np.float32)
    g = GradOperation(sens_param=True)(lambda a: a * a)(Tensor(x), Tensor(sens))
    np.testing.assert_allclose(g.asnumpy(), 2 * x * sens, rtol=1e-6)
    idx = Tensor(np.array([1, 0, 2], np.int32))
    gx, gi = GradOperation(get_all=True)(lambda a, i: ops.ReduceSum()(ops.Gather()(a, i, 0)))(
        Tensor(x), idx)
    want = np.zeros_like(x)
    np.add.at(want, [1, 0, 2], 1.0)
    np.testing.assert_allclose(gx.asnumpy(), want)
    assert gi.dtype == dm.int32 and not gi.asnumpy().any()


def test_grad_operation_bad_use_is_named():
    from dualmode.ops.composite import GradOperation
    net, _, _ = _net_and_inputs()
    with pytest.raises(TypeError, match=r"GradOperation: get_by_list=True needs the weights"):
        GradOperation(get_by_list=True)(net)
    with pytest.raises(ValueError, match=r"GradOperation: weights were given but "
                                         r"get_by_list=False"):
        GradOperation()(net, dm.ParameterTuple(net.trainable_params()))
    with pytest.raises(TypeError, match=r"GradOperation: get_all must be a bool, got 1"):
        GradOperation(get_all=1)
    with pytest.raises(TypeError, match=r"ParameterTuple: item 1 is a Tensor"):
        dm.ParameterTuple([net.w, Tensor(np.ones(2, np.float32))])


# ------------------------------------------------------------- shard and reshard
def test_layout_module_path_and_function_forms():
    from dualmode.parallel.shard import Layout
    assert Layout is dm.parallel.Layout
    assert dm.shard is ops.shard and dm.parallel.shard is ops.shard
    assert dm.reshard is dm.parallel.reshard


def _reshard_program(layout):
    mm = ops.MatMul()

    def f(x, w):
        h = dm.reshard(mm(x, w), layout("dp", "None"))
        return ops.ReduceSum()(ops.Square()(h))
    return f


def _numpy_loss_and_grads(x, w):
    h = x @ w
    return np.sum(h * h), (2 * h) @ w.T, x.T @ (2 * h)


def test_reshard_moves_a_tensor_eagerly_and_gradients_flow(sim_devices):
    from dualmode.parallel.shard import Layout
    sim_devices(8)
    layout = Layout((2, 4), ("dp", "mp"))
    x = RNG.standard_normal((8, 4)).astype(np.float32)
    with CommReport() as rep:
        y = dm.reshard(Tensor(x), layout("dp", "mp"))
    assert dm.parallel.local_shape(y) == (4, 1)
    np.testing.assert_array_equal(y.asnumpy(), x)
    assert rep.count() == 0                      # a replicated value is sliced locally
    w = RNG.standard_normal((4, 6)).astype(np.float32)
    loss, (gx, gw) = dm.value_and_grad(_reshard_program(layout), (0, 1))(Tensor(x), Tensor(w))
    ref, rx, rw = _numpy_loss_and_grads(x, w)
    np.testing.assert_allclose(float(loss.asnumpy()), ref, rtol=1e-5)
    np.testing.assert_allclose(gx.asnumpy(), rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw.asnumpy(), rw, rtol=1e-5, atol=1e-5)


class _ReshardNet(nn.Cell):
    def __init__(self, layout, w):
        super().__init__()
        self.w = Parameter(Tensor(w), name="w")
        self.f = _reshard_program(layout)

    def construct(self, x):
        return self.f(x, self.w)


@pytest.mark.parametrize("how", ["ops.shard", "graph_mode"])
def test_reshard_in_a_compiled_graph_equals_numpy(sim_devices, how):
    from dualmode.parallel.shard import Layout
    sim_devices(8)
    layout = Layout((2, 4), ("dp", "mp"))
    x = RNG.standard_normal((8, 4)).astype(np.float32)
    w = RNG.standard_normal((4, 8)).astype(np.float32)
    net = _ReshardNet(layout, w)
    if how == "ops.shard":
        fn = dm.shard(net, in_strategy=((2, 1),), parameter_plan={"w": (1, 4)})
        loss, (gx, (gw,)) = dm.value_and_grad(fn, 0, net.trainable_params())(Tensor(x))
        # the compiled graph holds the move into the layout reshard asked for
        assert "Redistribute-0" in str(fn.strategies())
    else:
        dm.set_context(mode=GRAPH_MODE)
        try:
            loss, (gx, (gw,)) = dm.value_and_grad(net, 0, net.trainable_params())(Tensor(x))
        finally:
            dm.set_context(mode=PYNATIVE_MODE)
    ref, rx, rw = _numpy_loss_and_grads(x, w)
    np.testing.assert_allclose(float(loss.asnumpy()), ref, rtol=1e-5)
    np.testing.assert_allclose(gx.asnumpy(), rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw.asnumpy(), rw, rtol=1e-5, atol=1e-5)


def test_reshard_stand_alone_is_the_tensor_and_bad_layouts_are_named(sim_devices):
    from dualmode.parallel.shard import Layout
    sim_devices(None)
    x = Tensor(np.ones((4, 4), np.float32))
    assert dm.reshard(x, Layout((2, 4), ("dp", "mp"))("dp", "mp")) is x
    with pytest.raises(TypeError, match=r"reshard: tensor must be a Tensor, got ndarray"):
        dm.reshard(np.ones(3), (1,))
    with pytest.raises(TypeError, match=r"reshard: layout must be a Layout applied"):
        dm.reshard(x, "dp")
    sim_devices(8)
    with pytest.raises(ValueError, match=r"reshard: out_strategy\[0\]"):
        dm.reshard(x, (3, 1))


# ------------------------------------------------------------------ context keys
def test_auto_parallel_search_mode_is_search_mode():
    try:
        dm.set_auto_parallel_context(auto_parallel_search_mode="recursive_programming")
        assert dm.get_auto_parallel_context("search_mode") == "recursive_programming"
        assert dm.get_auto_parallel_context("auto_parallel_search_mode") == \
            "recursive_programming"
        with pytest.raises(ValueError, match=r"auto_parallel_search_mode='dynamic_programming'"
                                             r" contradicts search_mode='sharding_propagation'"):
            dm.set_auto_parallel_context(search_mode="sharding_propagation",
                                         auto_parallel_search_mode="dynamic_programming")
        assert dm.get_auto_parallel_context("search_mode") == "recursive_programming"
        with pytest.raises(ValueError, match=r"auto_parallel_search_mode='greedy' is not valid"):
            dm.set_auto_parallel_context(auto_parallel_search_mode="greedy")
    finally:
        dm.reset_auto_parallel_context()


def test_comm_fusion_openstate():
    try:
        dm.set_auto_parallel_context(comm_fusion={"openstate": True,
                                                  "allreduce": {"mode": "size", "config": 32}},
                                     all_reduce_fusion_config=[2, 4])
        assert dm.get_auto_parallel_context("comm_fusion") == {
            "allreduce": {"mode": "size", "config": 32}}
        dm.set_auto_parallel_context(comm_fusion={"openstate": False})
        assert dm.get_auto_parallel_context("comm_fusion") == {}
        assert dm.get_auto_parallel_context("all_reduce_fusion_config") is None
        with pytest.raises(TypeError, match=r"comm_fusion\['openstate'\]"):
            dm.set_auto_parallel_context(comm_fusion={"openstate": "yes"})
        with pytest.raises(ValueError, match=r"comm_fusion has unknown key 'open'; expected "
                                             r"keys among 'openstate', 'allreduce'"):
            dm.set_auto_parallel_context(comm_fusion={"open": True})
    finally:
        dm.reset_auto_parallel_context()


def test_sharding_propagation_key_is_search_mode():
    try:
        dm.set_auto_parallel_context(search_mode="recursive_programming")
        dm.set_auto_parallel_context(sharding_propagation=True)
        assert dm.get_auto_parallel_context("search_mode") == "sharding_propagation"
        assert dm.get_auto_parallel_context("sharding_propagation") is True
        dm.set_auto_parallel_context(sharding_propagation=False)
        assert dm.get_auto_parallel_context("search_mode") == "dynamic_programming"
        assert dm.get_auto_parallel_context("sharding_propagation") is False
        with pytest.raises(ValueError, match=r"sharding_propagation=True contradicts "
                                             r"search_mode='dynamic_programming'"):
            dm.set_auto_parallel_context(sharding_propagation=True,
                                         search_mode="dynamic_programming")
        with pytest.raises(TypeError, match=r"sharding_propagation"):
            dm.set_auto_parallel_context(sharding_propagation="yes")
        assert dm.get_auto_parallel_context("search_mode") == "dynamic_programming"
    finally:
        dm.reset_auto_parallel_context()


def test_softmax_cross_entropy_cell_holds_mindspores_inner_primitives(sim_devices):
    """``loss.softmax_cross_entropy.shard(...)`` as MindSpore scripts write it: the loss
    runs on the primitives it holds, so their strategies take effect; every reduction
    equals numpy."""
    sim_devices(8)
    logits = RNG.standard_normal((8, 5)).astype(np.float32)
    labels = np.array([0, 3, 1, 4, 2, 2, 0, 1], np.int32)
    lse = np.log(np.exp(logits).sum(1)) - logits[np.arange(8), labels]
    for sparse in (True, False):
        for red, want in (("mean", lse.mean()), ("sum", lse.sum()), ("none", lse)):
            loss = nn.SoftmaxCrossEntropyWithLogits(sparse=sparse, reduction=red)
            loss.softmax_cross_entropy.shard(((8, 1), (8, 1)))
            loss.sparse_softmax_cross_entropy.shard(((8, 1), (8,)))
            loss.one_hot.shard(((8, 1), (), ()))
            y = labels if sparse else np.eye(5, dtype=np.float32)[labels]
            got = loss(Tensor(logits), Tensor(y))
            np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-5, atol=1e-6)
    inner = nn.SoftmaxCrossEntropyWithLogits(reduction="none")
    inner.softmax_cross_entropy.shard(((8, 1), (8, 1)))
    assert dm.parallel.local_shape(inner(Tensor(logits), Tensor(
        np.eye(5, dtype=np.float32)[labels]))) == (1,)
