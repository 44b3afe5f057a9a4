"""A compiled train step owns its gradient communication: lowering puts each gradient's
AllReduce / redistribution before the optimizer update as IR, and the fusion pass packs
the data-parallel AllReduces into the buckets ``comm_fusion`` configures. Checked
against the single-device step (gradients_mean=True, a network with a sharded weight),
against the same data-parallel step run eagerly (same numbers and the same gradient
collectives, for every fusion setting and both gradients_mean values: in
semi_auto_parallel the update is the single device's either way, in data_parallel
without the mean the gradients are device_num times the single-device ones), and on the
lowered graph."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel import CommReport
from dualmode.parallel.auto_parallel import AutoParallel
from dualmode.parallel.graph.ir import CALL, FUSED, FUSED_AG, FUSED_RS, MOVE

from _devices import devices
from _steps import mean_square_step

RNG = np.random.default_rng(11)
X = RNG.standard_normal((16, 12)).astype(np.float32)
W = [RNG.standard_normal(s).astype(np.float32) * 0.3
     for s in [(12, 16), (16, 16), (16, 8), (8, 8)]]
B = RNG.standard_normal(8).astype(np.float32) * 0.1

FUSIONS = [None,
           {"allreduce": {"mode": "index", "config": [2]}},
           {"allreduce": {"mode": "size", "config": 32}}]


class _Net(nn.Cell):
    """w0, w2, w3, b data parallel; w1 sharded by its MatMul's strategy."""

    def __init__(self, sharded):
        super().__init__()
        for k, w in enumerate(W):
            setattr(self, f"w{k}", Parameter(Tensor(w.copy()), name=f"w{k}"))
        self.b = Parameter(Tensor(B.copy()), name="b")
        self.mm1 = ops.MatMul()
        if sharded:
            self.mm1.shard(((2, 1), (1, 4)))

    def construct(self, x):
        h = ops.tanh(ops.matmul(x, self.w0))
        h = ops.tanh(self.mm1(h, self.w1))
        h = ops.tanh(ops.matmul(h, self.w2))
        return ops.matmul(h, self.w3) + self.b


def _step(net, opt, compiled):
    """The train step (mean squared output), compiled with AutoParallel or eager."""
    step = mean_square_step(net, opt)
    return AutoParallel(step, parallel_mode="semi_auto") if compiled else step


def _train(n, compiled, fusion=None, mean=True, steps=2, sharded=True):
    settings = {"gradients_mean": mean} if n else {}
    with devices(n, **settings):
        if fusion is not None:
            dm.set_auto_parallel_context(comm_fusion=fusion)
        net = _Net(sharded=sharded and bool(n))
        opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
        run = _step(net, opt, compiled)
        losses = [float(run(Tensor(X)).asnumpy())]
        with CommReport() as report:
            losses.append(float(run(Tensor(X)).asnumpy()))
        for _ in range(steps - 2):
            losses.append(float(run(Tensor(X)).asnumpy()))
        weights = {p.name: p.asnumpy() for p in net.trainable_params()}
        graph = run.compiled.program.graph if compiled else None
        return losses, weights, report, graph


@pytest.mark.parametrize("fusion", FUSIONS, ids=["unfused", "index", "size"])
def test_compiled_step_equals_single_device(fusion):
    ref_losses, ref_w, _, _ = _train(None, compiled=False, steps=3)
    losses, got_w, _, _ = _train(8, compiled=True, fusion=fusion, steps=3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name in ref_w:
        np.testing.assert_allclose(got_w[name], ref_w[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("fusion", FUSIONS, ids=["unfused", "index", "size"])
def test_data_parallel_compiled_step_makes_the_eager_steps_collectives(fusion, mean):
    e_losses, e_w, e_rep, _ = _train(8, compiled=False, fusion=fusion, mean=mean,
                                     sharded=False)
    g_losses, g_w, g_rep, _ = _train(8, compiled=True, fusion=fusion, mean=mean,
                                     sharded=False)
    np.testing.assert_allclose(g_losses, e_losses, rtol=1e-5)
    for name in e_w:
        np.testing.assert_allclose(g_w[name], e_w[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert g_rep.count("AllReduce", reason="gradient") == \
        e_rep.count("AllReduce", reason="gradient")
    assert g_rep.bytes(reason="gradient") == e_rep.bytes(reason="gradient")
    if mean:
        ref_losses, ref_w, _, _ = _train(None, compiled=False)
        np.testing.assert_allclose(g_losses, ref_losses, rtol=1e-5)


@pytest.mark.parametrize("mean", [True, False])
def test_the_update_is_the_single_devices_whatever_gradients_mean(mean):
    """SGD, one step: the program is written for the global batch, so in
    semi_auto_parallel the update is the single device's, w - lr * g, with or without
    gradients_mean (a replicated weight is never moved device_num times; data_parallel's
    sum is tested in test_semi_auto_gradients_mean.py)."""
    def first_step(n, compiled):
        settings = {"gradients_mean": mean} if n else {}
        with devices(n, **settings):
            net = _Net(sharded=False)
            opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
            _step(net, opt, compiled)(Tensor(X))
            return {p.name: p.asnumpy() for p in net.trainable_params()}
    ref, got = first_step(None, False), first_step(8, True)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_buckets_are_fused_nodes_and_the_update_reads_no_pending_sum():
    fusion = {"allreduce": {"mode": "index", "config": [2]}}
    *_, unfused_rep, _ = _train(8, compiled=True, sharded=False)
    *_, fused_rep, graph = _train(8, compiled=True, fusion=fusion, sharded=False)
    fused = [n for n in graph.nodes if n.op == FUSED]
    # data-parallel gradients in parameter order: w0 w1 w2 w3 b -> [w0, w1], [w2, w3, b]
    assert [n.attrs["cause"] for n in fused] == ["w0, w1", "w2, w3, b"]
    assert unfused_rep.count("AllReduce", reason="gradient") == 5
    assert fused_rep.count("AllReduce", reason="gradient") == 2
    update = next(n for n in graph.nodes if n.op == CALL)
    lays = graph.meta["layouts"]
    for x in update.inputs:
        lay = lays.get(x.id)
        assert lay is None or not lay.partial          # every gradient resolved before
    assert not [n for n in graph.nodes if n.op == MOVE and n.attrs["reason"] == "gradient"]


def test_a_sharded_weights_gradient_moves_into_its_layout_before_the_update():
    *_, graph = _train(8, compiled=True)
    moves = {n.attrs["cause"]: n for n in graph.nodes
             if n.op == MOVE and n.attrs["reason"] == "gradient"}
    w1 = next(v.id for p, v in graph.params if p.name == "w1")
    assert moves["w1"].attrs["dst"] == graph.meta["params"][w1].layout


def test_changing_fusion_or_gradients_mean_recompiles():
    with devices(8, gradients_mean=True):
        net = _Net(sharded=False)
        run = _step(net, nn.SGD(net.trainable_params(), learning_rate=0.05), compiled=True)
        run(Tensor(X))
        first = run.compiled
        dm.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "index",
                                                                "config": [2]}})
        run(Tensor(X))
        assert run.compiled is not first
        assert any(n.op == FUSED for n in run.compiled.program.graph.nodes)
        second = run.compiled
        dm.set_auto_parallel_context(gradients_mean=False)
        run(Tensor(X))
        assert run.compiled is not second


def test_a_sharded_networks_gradient_all_reduces_fuse_per_device_group():
    """With the sharded weight, the gradients of w1 (column split), w3 and b are pending
    over the same 4 groups of 2 devices, w0's over all 8, and w2's (its rows split like
    the column-parallel output it multiplies) is summed over those groups and gathered
    whole: fused, the three AllReduces of whole gradients of one device group become
    one, the bytes unchanged."""
    fusion = {"allreduce": {"mode": "size", "config": 32}}
    *_, unfused_rep, _ = _train(8, compiled=True)
    *_, fused_rep, graph = _train(8, compiled=True, fusion=fusion)

    def gradient_reduces(rep):
        return sorted((r.group_size, r.num_groups) for r in rep.records
                      if r.kind == "AllReduce" and r.reason == "gradient")
    assert gradient_reduces(unfused_rep) == [(2, 4)] * 4 + [(8, 1)]
    assert gradient_reduces(fused_rep) == [(2, 4)] * 2 + [(8, 1)]
    assert fused_rep.bytes("AllReduce", reason="gradient") == \
        unfused_rep.bytes("AllReduce", reason="gradient")
    assert [n.attrs["cause"] for n in graph.nodes if n.op == FUSED] == ["w1, w3, b"]


def test_gather_and_scatter_fusion_leave_the_all_reduce_buckets_alone():
    """Adding allgather / reducescatter fusion changes no gradient AllReduce and no
    number, adds no AllGather, and a parameter read whole is gathered once."""
    only = {"allreduce": {"mode": "size", "config": 32}}
    every = dict(only, allgather={"mode": "auto"}, reducescatter={"mode": "auto"})
    losses, w, rep, graph = _train(8, compiled=True, fusion=only)
    e_losses, e_w, e_rep, e_graph = _train(8, compiled=True, fusion=every)

    def records(r, kind):
        return [(x.kind, x.op, x.group_size, x.bytes_per_device) for x in r.records
                if x.kind == kind]
    assert records(e_rep, "AllReduce") == records(rep, "AllReduce")
    assert e_rep.count("AllGather") <= rep.count("AllGather")
    names = {p.name for p in _Net(sharded=True).trainable_params()}
    gathered = [x.op for x in e_rep.records if x.kind == "AllGather" and x.op in names]
    assert len(gathered) == len(set(gathered))
    assert not [n for n in e_graph.nodes if n.op in (FUSED_AG, FUSED_RS)]
    np.testing.assert_allclose(e_losses, losses, rtol=1e-6)
    ref_losses, ref_w, _, _ = _train(None, compiled=False)
    np.testing.assert_allclose(e_losses, ref_losses, rtol=1e-5)
    for name in ref_w:
        np.testing.assert_allclose(e_w[name], ref_w[name], rtol=1e-5, atol=1e-6)
