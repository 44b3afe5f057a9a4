"""check_equivalence and the pytest plugin's assert_sharded_equal on hybrid parallel and on
user collectives.

* A layerwise weight given its slices by ``set_layerwise_slices(param, full, dim)`` is
  checked with no ``layerwise=`` argument: the stand-alone run uses the full weight (the
  current slices joined along ``dim``). MindSpore's hybrid-parallel layer (weight columns
  per device, MatMul, ReduceSum(-1), ops.AllReduce(), full_batch) is equivalent; without
  its AllReduce every device returns its partial sum, so ReduceSum is the first op whose
  output differs from the stand-alone one (the MatMul's column slices are the layerwise
  layout itself, the same with and without the AllReduce). The same under MPI, where each
  rank holds only its own slice.
* Every op the program calls takes part in the comparison, user collectives included: a
  stray ops.AllReduce on an activation that is already global (semi-auto parallel, eager
  or after an ops.shard block) is the first divergent op, not the op after it.
"""
import json

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.nn.optim import SGD
from dualmode.parallel import check_equivalence, set_layerwise_slices

from _mpi import run_mpi_script


class HybridParallelNet(nn.Cell):
    """MindSpore's hybrid-parallel layer: the weight's columns per device
    (layerwise_parallel), MatMul, ReduceSum(-1), then the AllReduce of the partial sums
    (left out when `allreduce` is False)."""

    def __init__(self, cols, allreduce=True):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((64, cols), np.float32)), name="weight",
                                layerwise_parallel=True)
        self.fc = ops.MatMul()
        self.reduce = ops.ReduceSum()
        self.allreduce = ops.AllReduce(op="sum") if allreduce else None

    def construct(self, x):
        x = self.fc(x, self.weight)
        x = self.reduce(x, -1)
        if self.allreduce is not None:
            x = self.allreduce(x)
        return x


def _hybrid(sim_devices, n, allreduce=True):
    sim_devices(n, mode="hybrid_parallel", dataset_strategy="full_batch")
    net = HybridParallelNet(32 // n, allreduce)
    full = np.random.default_rng(2).random((64, 32), dtype=np.float32)
    set_layerwise_slices(net.weight, full, dim=1)
    x = Tensor(np.random.default_rng(3).random((4, 64), dtype=np.float32))
    return net, x, full


def _single(full, x):
    return (x.asnumpy() @ full).sum(-1)


# ---------------------------------------------------------------------------- layerwise

@pytest.mark.parametrize("n", [2, 4])
def test_hybrid_layer_with_its_allreduce_is_equivalent_without_layerwise_argument(
        sim_devices, n):
    net, x, full = _hybrid(sim_devices, n)
    stack = net.weight.asnumpy().copy()
    rep = check_equivalence(net, x)
    assert rep.ok and rep.first_divergent_op is None, str(rep)
    assert [(op.name, op.relation) for op in rep.ops] == [
        ("MatMul", "device slices along dim 1"), ("ReduceSum", "per-device partial sums"),
        ("AllReduce", "equal")]
    assert rep.values[-1].name == "d/d weight"
    assert rep.values[-1].note == "per-device slices along dim 1"
    assert rep.values[-1].shape == (64, 32)          # the full weight's gradient
    np.testing.assert_array_equal(net.weight.asnumpy(), stack)     # still the slices
    assert net.weight.shape == (64, 32 // n)
    np.testing.assert_allclose(net(x).asnumpy(), _single(full, x), rtol=1e-5)


@pytest.mark.parametrize("n", [2, 4])
def test_hybrid_layer_without_its_allreduce_names_reducesum(sim_devices, n):
    net, x, _ = _hybrid(sim_devices, n, allreduce=False)
    rep = check_equivalence(net, x)
    assert not rep.ok
    assert rep.first_divergent_op == "ReduceSum"
    assert "an AllReduce is missing after it" in rep.note
    assert rep.values[0].note == "devices hold per-device partial sums"
    assert "first divergent op: ReduceSum" in str(rep)


def test_full_weight_is_the_current_slices_after_training(sim_devices):
    net, x, full = _hybrid(sim_devices, 2)
    opt = SGD(net.trainable_params(), learning_rate=1e-5)
    step = dm.value_and_grad(lambda x: ops.reduce_sum(net(x) ** 2), None,
                             net.trainable_params())
    _, grads = step(x)
    opt(grads)
    moved = np.concatenate(list(net.weight.asnumpy()), axis=1)
    assert np.abs(moved - full).max() > 1e-3
    seen = []

    def prog(x):
        seen.append(net.weight.asnumpy().copy())        # sharded: the slices; then whole
        return net(x)

    rep = check_equivalence(prog, x, weights=net.trainable_params())
    assert rep.ok, str(rep)
    assert [w.shape for w in seen] == [(2, 64, 16), (64, 32)]
    np.testing.assert_array_equal(seen[1], moved)        # the trained full weight
    np.testing.assert_array_equal(np.concatenate(list(seen[0]), axis=1), moved)


def test_layerwise_argument_still_names_the_dim_of_slices_given_as_a_stack(sim_devices):
    sim_devices(2, mode="hybrid_parallel", dataset_strategy="full_batch")
    net = HybridParallelNet(16)
    full = np.random.default_rng(4).random((64, 32), dtype=np.float32)
    set_layerwise_slices(net.weight, np.stack([full[:, :16], full[:, 16:]]))
    x = Tensor(np.random.default_rng(5).random((4, 64), dtype=np.float32))
    with pytest.raises(ValueError, match=r"check_equivalence: Parameter 'weight' is "
                                         r"layerwise_parallel with per-device slices given as "
                                         r"a stack, so the full weight for the stand-alone "
                                         r"run is not known; pass layerwise=\{'weight': dim\}"):
        check_equivalence(net, x)
    rep = check_equivalence(net, x, layerwise={"weight": 1})
    assert rep.ok, str(rep)


def test_slices_given_again_as_a_stack_forget_the_recorded_dim(sim_devices):
    net, x, full = _hybrid(sim_devices, 2)
    assert check_equivalence(net, x).ok
    set_layerwise_slices(net.weight, net.weight.asnumpy())
    with pytest.raises(ValueError, match=r"pass layerwise=\{'weight': dim\}"):
        check_equivalence(net, x)


def test_layerwise_argument_contradicting_the_recorded_dim_is_named(sim_devices):
    net, x, _ = _hybrid(sim_devices, 2)
    with pytest.raises(ValueError, match=r"check_equivalence: layerwise\['weight'\]=0 but "
                                         r"set_layerwise_slices cut Parameter 'weight''s "
                                         r"slices from its full weight along dim 1"):
        check_equivalence(net, x, layerwise={"weight": 0})
    assert check_equivalence(net, x, layerwise={"weight": -1}).ok     # the same dim
    with pytest.raises(TypeError, match=r"check_equivalence: layerwise must be a dict "
                                        r"\{parameter name: dim\}, got list"):
        check_equivalence(net, x, layerwise=[1])
    with pytest.raises(ValueError, match=r"check_equivalence: layerwise names 'wieght', "
                                         r"which is not a weight holding per-device slices "
                                         r"among the weights compared; layerwise_parallel "
                                         r"weights with slices: \['weight'\]"):
        check_equivalence(net, x, layerwise={"wieght": 1})


def test_assert_sharded_equal_on_the_hybrid_layer(sim_devices, assert_sharded_equal):
    net, x, _ = _hybrid(sim_devices, 2)
    rep = assert_sharded_equal(net, x)
    assert rep.ok and [op.name for op in rep.ops][-1] == "AllReduce"
    bad, x, _ = _hybrid(sim_devices, 2, allreduce=False)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)sharded run differs from the "
                                                    r"stand-alone run.*first divergent op: "
                                                    r"ReduceSum"):
        assert_sharded_equal(bad, x)


@pytest.mark.parametrize("ranks", [2, 4])
def test_hybrid_layer_under_mpi(tmp_path, ranks):
    """Real ranks: each holds its own slice; the stand-alone run joins every rank's."""
    proc = run_mpi_script("check_equivalence_hybrid.py", [], tmp_path, ranks=ranks)
    got = {r["case"]: r for r in map(json.loads, proc.stdout.strip().splitlines())}
    assert set(got) == {"full+allreduce", "full", "own+allreduce"}, proc.stdout
    for case in ("full+allreduce", "own+allreduce"):
        assert got[case]["ok"] and got[case]["first"] is None, got[case]
        assert got[case]["ops"] == ["MatMul", "ReduceSum", "AllReduce"]
        assert got[case]["grad_shape"] == [64, 32]
    assert not got["full"]["ok"] and got["full"]["first"] == "ReduceSum"


# ---------------------------------------------------------------------------- collectives

class StrayAllReduceNet(nn.Cell):
    """Semi-auto parallel: the first MatMul's partial sums are resolved by the framework,
    so the activation is already global; the ops.AllReduce ported from per-device code
    then sums the devices' copies of it."""

    def __init__(self, stray=True, n=2):
        super().__init__()
        rng = np.random.default_rng(0)
        self.w1 = Parameter(Tensor(rng.standard_normal((16, 8)).astype(np.float32)),
                            name="w1")
        self.w2 = Parameter(Tensor(rng.standard_normal((8, 4)).astype(np.float32)),
                            name="w2")
        self.mm1 = ops.MatMul().shard(((1, n), (n, 1)))
        self.relu = ops.ReLU()
        self.allreduce = ops.AllReduce() if stray else None
        self.mm2 = ops.MatMul()

    def construct(self, x):
        h = self.relu(self.mm1(x, self.w1))
        if self.allreduce is not None:
            h = self.allreduce(h)
        return self.mm2(h, self.w2)


def _x():
    return Tensor(np.random.default_rng(3).standard_normal((8, 16)).astype(np.float32))


@pytest.mark.parametrize("n", [2, 4])
def test_stray_allreduce_on_a_global_activation_is_the_first_divergent_op(sim_devices, n):
    sim_devices(n)
    rep = check_equivalence(StrayAllReduceNet(n=n), _x())
    assert not rep.ok
    assert rep.first_divergent_op == "AllReduce"
    names = [op.name for op in rep.ops]
    assert names == ["MatMul", "ReLU", "AllReduce", "MatMul"]        # program order
    assert [op.relation for op in rep.ops[:2]] == ["equal", "equal"]
    assert rep.values[0].max_rel_diff == pytest.approx(n - 1, rel=1e-4)   # n copies summed
    assert "AllReduce's input (from ReLU) equals the stand-alone value" in rep.note
    assert "first divergent op: AllReduce" in str(rep)
    assert check_equivalence(StrayAllReduceNet(stray=False, n=n), _x()).ok


def test_stray_allreduce_after_a_compiled_block_is_named(sim_devices):
    sim_devices(2)
    rng = np.random.default_rng(1)
    w1 = Parameter(Tensor(rng.standard_normal((16, 8)).astype(np.float32)), name="w1")
    w2 = Parameter(Tensor(rng.standard_normal((8, 4)).astype(np.float32)), name="w2")
    block = ops.shard(lambda x: ops.relu(ops.matmul(x, w1)), in_strategy=((1, 2),),
                      out_strategy=((1, 1),), parameter_plan={"w1": (2, 1)})
    allreduce = ops.AllReduce()

    def prog(x):
        return ops.matmul(allreduce(block(x)), w2)

    rep = check_equivalence(prog, _x(), weights=[w1, w2])
    assert not rep.ok and rep.first_divergent_op == "AllReduce", str(rep)
    assert [op.name for op in rep.ops] == ["AllReduce", "MatMul"]

    def right(x):
        return ops.matmul(block(x), w2)

    assert check_equivalence(right, _x(), weights=[w1, w2]).ok


def test_stray_allreduce_in_the_plugin_fixture(sim_devices, assert_sharded_equal):
    sim_devices(2)
    with pytest.raises(pytest.fail.Exception, match=r"first divergent op: AllReduce"):
        assert_sharded_equal(StrayAllReduceNet(), _x())
    assert assert_sharded_equal(StrayAllReduceNet(stray=False), _x()).ok


def test_user_collectives_in_a_graph_mode_cell_are_refused_by_name(sim_devices):
    """Compiled graphs place no user collective: check_equivalence reports the error of
    the program itself, naming the op and the way out."""
    sim_devices(2)
    dm.set_context(mode=dm.GRAPH_MODE)
    try:
        with pytest.raises(ValueError, match=r"AllReduce: op AllReduce has no sharding rule.*"
                                             r"call it outside the compiled function"):
            check_equivalence(StrayAllReduceNet(), _x())
        assert check_equivalence(StrayAllReduceNet(stray=False), _x()).ok
    finally:
        dm.set_context(mode=dm.PYNATIVE_MODE)


@pytest.mark.parametrize("prim", [ops.AllReduce(), ops.AllReduce("mean"), ops.AllGather(),
                                  ops.ReduceScatter(), ops.Broadcast(0), ops.AlltoAll()])
def test_one_device_collective_is_taped_as_the_identity(sim_devices, prim):
    """On one device a collective is the identity and its gradient too; it is recorded
    under its own name, so the stand-alone run of a check holds it."""
    sim_devices(1, mode="stand_alone")
    x = Tensor(np.arange(6, dtype=np.float32).reshape(3, 2))
    seen = []

    def f(x):
        y = prim(x * 2.0)
        seen.append(y._node.op.name if y._node is not None else None)
        return ops.reduce_sum(y * y)

    val, g = dm.value_and_grad(f)(x)
    assert seen == [prim.name]
    np.testing.assert_allclose(val.asnumpy(), (4 * x.asnumpy() ** 2).sum(), rtol=1e-6)
    np.testing.assert_allclose(g.asnumpy(), 8 * x.asnumpy(), rtol=1e-6)
    assert prim(x) is x                     # nothing recorded: the input itself


# ---------------------------------------------------------------------------- compiled

class ScaledNet(nn.Cell):
    """Semi-auto parallel; `wrong` multiplies the activation by the device count (a
    "mean" ported from per-device code)."""

    def __init__(self, wrong):
        super().__init__()
        rng = np.random.default_rng(0)
        self.w1 = Parameter(Tensor(rng.standard_normal((16, 8)).astype(np.float32)),
                            name="w1")
        self.w2 = Parameter(Tensor(rng.standard_normal((8, 4)).astype(np.float32)),
                            name="w2")
        self.mm1 = ops.MatMul().shard(((1, 2), (2, 1)))
        self.mm2 = ops.MatMul()
        self.wrong = wrong

    def construct(self, x):
        h = ops.relu(self.mm1(x, self.w1))
        if self.wrong:
            h = h * communication.get_group_size()
        return self.mm2(h, self.w2)


def test_graph_mode_cell_names_the_op_inside_it(sim_devices, assert_sharded_equal):
    sim_devices(2)
    dm.set_context(mode=dm.GRAPH_MODE)
    try:
        assert_sharded_equal(ScaledNet(False), _x())
        net = ScaledNet(True)
        rep = check_equivalence(net, _x())
        assert not rep.ok and rep.first_divergent_op == "Mul", str(rep)
        assert [op.name for op in rep.ops] == ["MatMul", "ReLU", "Mul", "MatMul"]
        assert rep.values[0].max_rel_diff == pytest.approx(1.0, rel=1e-4)     # 2x
        assert "GRAPH_MODE runs the cell as one compiled op" in rep.note
        assert dm.get_context("mode") == dm.GRAPH_MODE            # restored

        def loss(x):                     # the op after the compiled cell is not blamed
            return ops.reduce_sum(ops.square(net(x)))

        rep = check_equivalence(loss, _x(), weights=net.trainable_params())
        assert rep.first_divergent_op == "Mul", str(rep)
        with pytest.raises(pytest.fail.Exception, match=r"first divergent op: Mul"):
            assert_sharded_equal(net, _x())
    finally:
        dm.set_context(mode=dm.PYNATIVE_MODE)


def test_ops_shard_block_that_differs_says_its_ops_are_not_compared(sim_devices):
    sim_devices(2)
    w = Parameter(Tensor(np.random.default_rng(1).standard_normal((16, 8))
                         .astype(np.float32)), name="w")
    block = ops.shard(lambda x: ops.relu(ops.matmul(x, w)) * communication.get_group_size(),
                      in_strategy=((1, 2),), parameter_plan={"w": (2, 1)})
    rep = check_equivalence(block, _x(), weights=[w])
    assert not rep.ok
    assert "runs as one op: the ops inside are not compared" in rep.note, str(rep)
    fine = ops.shard(lambda x: ops.relu(ops.matmul(x, w)), in_strategy=((1, 2),),
                     parameter_plan={"w": (2, 1)})
    assert check_equivalence(fine, _x(), weights=[w]).ok
