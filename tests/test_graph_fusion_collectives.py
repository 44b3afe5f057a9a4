"""AllGather and ReduceScatter fusion (``comm_fusion["allgather"]`` /
``["reducescatter"]``).

The backend: ``reduce_scatter_fused`` / ``all_gather_fused`` give, per stack, exactly
what ``reduce_scatter`` / ``all_gather`` give alone, as one recorded collective (on
"sim" without packing, and through the generic packed implementation every other
backend inherits).

A compiled train step whose weights are stored sharded (``parameter_plan``) and read
whole by data-parallel MatMuls gathers each weight before its use and reduce-scatters
each gradient into the weight's layout: fused, each bucket is one collective, hoisted to
where its first member is needed. Checked against the single-device step (the oracle),
per bucket against hand-computed counts, per fused buffer against the unfused program,
and for the errors and recompiles the settings imply.
"""

import contextlib

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.communication import SimBackend, fusion
from dualmode.communication.backend import Backend, register_backend
from dualmode.parallel import CommReport
from dualmode.parallel.graph.ir import CALL, FUSED_AG, FUSED_RS, MOVE
from dualmode.parallel.report import compiled_comm_times
from dualmode.parallel.tensor_layout import TensorLayout

from _devices import devices
from _sharded_weights import ShardedWeights, sharded_weights_on
from _mpi import check_fusion_step_under_mpi


class PackedSim(SimBackend):
    """"sim" running the generic (packing) fused collectives every other backend, MPI
    included, inherits from Backend."""
    _reduce_scatter_fused = Backend._reduce_scatter_fused
    _all_gather_fused = Backend._all_gather_fused


register_backend("packed-sim", PackedSim)


BACKENDS = [SimBackend, PackedSim]
N = 8
MESH = TensorLayout((2, 4), (), ())
GROUPS = {"world": None, "inner": MESH.group_members((1,)), "outer": MESH.group_members((0,))}


def _stacks(rng, shapes, replicated=()):
    out = []
    for k, shape in enumerate(shapes):
        if k in replicated:
            out.append(np.broadcast_to(rng.standard_normal(shape).astype(np.float32),
                                       (N,) + shape))
        else:
            out.append(rng.standard_normal((N,) + shape).astype(np.float32))
    return out


# ------------------------------------------------------------------ the backend

@pytest.mark.parametrize("backend", BACKENDS, ids=["sim", "packed"])
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter_fused_equals_each_alone(backend, group, op):
    b = backend(N)
    shapes, axes = [(8, 3), (5, 16), (24,), (2, 4, 8)], [0, 1, 0, 2]
    stacks = _stacks(np.random.default_rng(0), shapes, replicated=(2,))
    members = GROUPS[group]
    with CommReport() as rep:
        fused = b.reduce_scatter_fused(stacks, members, axes, op)
    assert rep.count("ReduceScatter") == 1 and len(rep.records) == 1
    with CommReport() as alone_rep:
        alone = [b.reduce_scatter(s, members, a, op) for s, a in zip(stacks, axes)]
    assert rep.bytes() == alone_rep.bytes()
    for f, a in zip(fused, alone):
        assert f.shape == a.shape and f.dtype == a.dtype
        if op == "max":
            np.testing.assert_array_equal(f, a)
        else:               # the packed buffer may be summed in another order
            np.testing.assert_allclose(f, a, rtol=1e-6, atol=1e-6)
    # and the reduction itself, by numpy: device d of group g gets part j of the sum
    groups = np.arange(N)[None] if members is None else members
    for s, f, ax in zip(stacks, fused, axes):
        for row in groups:
            red = s[row].sum(axis=0) if op == "sum" else s[row].max(axis=0)
            for j, d in enumerate(row):
                want = np.split(red, len(row), axis=ax)[j]
                np.testing.assert_allclose(f[d], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS, ids=["sim", "packed"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_all_gather_fused_equals_each_alone(backend, group):
    b = backend(N)
    shapes, axes = [(2, 3), (5, 1), (7,), (1, 2, 3)], [0, 1, 0, 2]
    stacks = _stacks(np.random.default_rng(1), shapes, replicated=(1,))
    members = GROUPS[group]
    with CommReport() as rep:
        fused = b.all_gather_fused(stacks, members, axes)
    assert rep.count("AllGather") == 1 and len(rep.records) == 1
    with CommReport() as alone_rep:
        alone = [b.all_gather(s, members, a) for s, a in zip(stacks, axes)]
    assert rep.bytes() == alone_rep.bytes()
    groups = np.arange(N)[None] if members is None else members
    for s, f, a, ax in zip(stacks, fused, alone, axes):
        assert f.shape == a.shape
        np.testing.assert_array_equal(f, a)
        for row in groups:
            want = np.concatenate([s[d] for d in row], axis=ax)
            for d in row:
                np.testing.assert_array_equal(f[d], want)


def test_fused_collectives_take_one_axis_for_all_and_no_stacks():
    b = SimBackend(4)
    stacks = [np.ones((4, 4, 2), np.float32), np.ones((4, 8), np.float32)]
    out = b.reduce_scatter_fused(stacks)
    assert [o.shape for o in out] == [(4, 1, 2), (4, 2)]
    np.testing.assert_array_equal(out[1], np.full((4, 2), 4, np.float32))
    assert [o.shape for o in b.all_gather_fused(out)] == [(4, 4, 2), (4, 8)]
    assert b.reduce_scatter_fused([]) == [] and b.all_gather_fused([]) == []


@pytest.mark.parametrize("call, args, match", [
    ("reduce_scatter_fused", ([np.ones((4, 4), np.float32), np.ones((4, 4), np.int32)],),
     r"fused_reduce_scatter: stacks\[1\] has dtype int32"),
    ("reduce_scatter_fused", ([np.ones((4, 4), np.float32), np.ones((4, 6), np.float32)],),
     r"fused_reduce_scatter: dim 0 .* \(size 6.*axis\[1\]=0\) is not divisible by the "
     r"group size 4"),
    ("reduce_scatter_fused", ([np.ones((4, 4), np.float32)], None, [0, 1]),
     r"fused_reduce_scatter: axis has 2 entries for 1 stacks"),
    ("all_gather_fused", ([np.ones((4, 4), np.float32)], None, [1]),
     r"fused_all_gather: axis\[0\]=1 is out of range"),
    ("all_gather_fused", ([np.ones((3, 4), np.float32)],),
     r"fused_all_gather: stacks\[0\] has shape \(3, 4\); .* leading \(device\) dim 4"),
    ("reduce_scatter_fused", ([np.ones((4, 4), np.float32)], None, 0, "avg"),
     r"fused_reduce_scatter: op='avg' is not valid"),
])
def test_fused_collectives_reject_bad_arguments_by_name(call, args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        getattr(SimBackend(4), call)(*args)


# ------------------------------------------------------------------ compiled train steps

RNG = np.random.default_rng(5)
X = RNG.standard_normal((16, 16)).astype(np.float32)
#: weights gathered bytes per device (float32): w0 2 KiB, w1 4 KiB, w2 1 KiB
W = {"w0": RNG.standard_normal((16, 32)).astype(np.float32) * 0.3,
     "w1": RNG.standard_normal((32, 32)).astype(np.float32) * 0.2,
     "w2": RNG.standard_normal((32, 8)).astype(np.float32) * 0.3}
#: where each weight lives: w1 split on dim 1 (gathered and reduce-scattered along it)
PLAN = {"w0": (8, 1), "w1": (1, 8), "w2": (8, 1)}
BOTH = {"allgather": {"mode": "auto"}, "reducescatter": {"mode": "auto"}}
#: 5 KiB: w0 alone (2 + 4 > 5), then w1 and w2 (4 + 1 <= 5)
SIZED = {"allgather": {"mode": "size", "config": 5 / 1024},
         "reducescatter": {"mode": "size", "config": 5 / 1024}}
FUSIONS = {"unfused": None, "auto": BOTH, "size": SIZED,
           "allgather only": {"allgather": {"mode": "auto"}},
           "reducescatter only": {"reducescatter": {"mode": "size", "config": 64}}}


def _step(net, opt, n, after=False):
    """The train step; `after`: it returns the network's output after the update too."""
    grad_fn = dm.value_and_grad(lambda x: ops.reduce_mean(ops.square(net(x))), None,
                                opt.parameters)

    def step(x):
        loss, grads = grad_fn(x)
        opt(grads)
        return (loss, net(x)) if after else loss
    if not n:
        return step
    return ops.shard(step, in_strategy=((n, 1),), parameter_plan=PLAN)


def _train(n, fusion=None, steps=3, after=False, backend=None):
    with sharded_weights_on(n, W, fusion, backend) as (net, opt):
        run = _step(net, opt, n, after)
        outs, report = [], None
        for k in range(steps):
            if k == 1:
                with CommReport() as report:
                    outs.append(run(Tensor(X)))
            else:
                outs.append(run(Tensor(X)))
        outs = [tuple(o.asnumpy() for o in out) if after else out.asnumpy() for out in outs]
        weights = {p.name: p.asnumpy() for p in net.trainable_params()}
        graph = run.compiled.program.graph if n else None
        return outs, weights, report, graph


def _close(got, want):
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_fused_step_equals_single_device(fusion):
    ref_out, ref_w, _, _ = _train(None)
    out, w, _, _ = _train(8, FUSIONS[fusion])
    _close(out, ref_out)
    for name in ref_w:
        np.testing.assert_allclose(w[name], ref_w[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_fused_step_on_the_packing_backend_equals_single_device():
    ref_out, ref_w, _, _ = _train(None)
    out, w, rep, graph = _train(8, SIZED, backend="packed-sim")
    assert isinstance(communication.get_backend(), SimBackend)
    _close(out, ref_out)
    for name in ref_w:
        np.testing.assert_allclose(w[name], ref_w[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert rep.count("AllGather") == 2 and rep.count("ReduceScatter") == 2


def _counts(rep):
    return (rep.count("AllGather"), rep.count("ReduceScatter"), rep.count("AllReduce"))


def test_each_bucket_is_one_collective_with_the_members_bytes():
    _, _, unfused, graph0 = _train(8)
    # unfused: one AllGather per weight before its MatMul (the backward reuses it),
    # one ReduceScatter per gradient into its weight's layout, no AllReduce
    assert _counts(unfused) == (3, 3, 0)
    assert not [n for n in graph0.nodes if n.op in (FUSED_AG, FUSED_RS)]
    _, _, auto, graph = _train(8, BOTH)
    assert _counts(auto) == (1, 1, 0)
    _, _, sized, graph2 = _train(8, SIZED)
    assert _counts(sized) == (2, 2, 0)                   # [w0], [w1, w2] both ways
    for rep in (auto, sized):
        for kind in ("AllGather", "ReduceScatter"):
            assert rep.bytes(kind) == unfused.bytes(kind)
    assert [(n.op, n.attrs["cause"]) for n in graph2.nodes if n.op in (FUSED_AG, FUSED_RS)] \
        == [(FUSED_AG, "w1, w2"), (FUSED_RS, "w1, w2")]
    ag = next(n for n in graph2.nodes if n.op == FUSED_AG)
    assert ag.attrs["axes"] == (1, 0)                    # w1 on dim 1, w2 on dim 0
    # the reasons stay those of the unfused moves
    assert {r.reason for r in sized.records if r.kind == "AllGather"} == {"redistribution"}
    assert {r.reason for r in sized.records if r.kind == "ReduceScatter"} == {"gradient"}
    _, _, only, _ = _train(8, FUSIONS["allgather only"])
    assert _counts(only) == (1, 3, 0)


def test_a_fused_gather_is_hoisted_to_its_first_member_and_not_past_an_update():
    """The bucket's gathers run where the first one did; gathers after the optimizer
    update (the step's second forward) read the updated weights, so they fuse among
    themselves, after the update."""
    ref_out, ref_w, _, _ = _train(None, after=True)
    out, w, rep, graph = _train(8, BOTH, after=True)
    for got, want in zip(out, ref_out):
        _close(got, want)
    for name in ref_w:
        np.testing.assert_allclose(w[name], ref_w[name], rtol=1e-5, atol=1e-6)
    ops_order = [n.op for n in graph.nodes if n.op in (FUSED_AG, CALL)]
    assert ops_order == [FUSED_AG, CALL, FUSED_AG]
    first_matmul = next(k for k, n in enumerate(graph.nodes) if n.op_name == "MatMul")
    assert next(k for k, n in enumerate(graph.nodes) if n.op == FUSED_AG) < first_matmul
    assert rep.count("AllGather") == 2


@contextlib.contextmanager
def _stepped(fusion):
    """On 8 devices with `fusion` as comm_fusion: the compiled train step of
    ShardedWeights after its first call (compiled; the weights updated once)."""
    with devices(8, gradients_mean=True):
        if fusion:
            dm.set_auto_parallel_context(comm_fusion=fusion)
        net = ShardedWeights(W, 8)
        run = _step(net, nn.SGD(net.trainable_params(), learning_rate=0.1), 8)
        run(Tensor(X))
        yield run


def test_fused_buffers_equal_the_unfused_ones_per_member():
    """Both programs run from the same weights: every value a fused node computes is the
    value the unfused program's move computed (a fused node keeps its members' values)."""
    envs, graphs = [], []
    for config in (None, SIZED):
        with _stepped(config) as run:
            prog = run.compiled.program
            envs.append(prog.run(prog.bind([Tensor(X)]), keep=True))
            graphs.append(prog.graph)
    fused_nodes = [n for n in graphs[1].nodes if n.op in (FUSED_AG, FUSED_RS)]
    assert len(fused_nodes) == 2
    unfused_moves = {n.outputs[0].id: n for n in graphs[0].nodes if n.op == MOVE}
    for node in fused_nodes:
        for v in node.outputs:
            assert v.id in unfused_moves
            np.testing.assert_allclose(np.asarray(envs[1][v.id]), np.asarray(envs[0][v.id]),
                                       rtol=1e-6, atol=1e-7)


def test_a_parameter_gathered_twice_is_gathered_once_when_fused():
    """w0 read whole by two MatMuls: two moves unfused, one gather in the bucket."""
    class Twice(nn.Cell):
        def __init__(self, n):
            super().__init__()
            self.w0 = Parameter(Tensor(W["w1"].copy()), name="w0")
            self.a, self.b = ops.MatMul(), ops.MatMul()
            if n:
                self.a.shard(((n, 1), (1, 1)))
                self.b.shard(((n, 1), (1, 1)))

        def construct(self, x):
            return ops.tanh(self.a(x, self.w0)) + self.b(ops.tanh(x), self.w0)

    x = RNG.standard_normal((16, 32)).astype(np.float32)

    def run(n, fusion=None):
        with devices(n):
            if fusion:
                dm.set_auto_parallel_context(comm_fusion=fusion)
            net = Twice(n)
            f = ops.shard(net, in_strategy=((n, 1),), parameter_plan={"w0": (n, 1)}) if n \
                else net
            f(Tensor(x))
            with CommReport() as rep:
                out = f(Tensor(x)).asnumpy()
            return out, rep
    ref, _ = run(None)
    plain, unfused = run(8)
    fused_out, fused = run(8, {"allgather": {"mode": "auto"}})
    np.testing.assert_allclose(plain, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused_out, ref, rtol=1e-5, atol=1e-6)
    assert unfused.count("AllGather") == 2 and fused.count("AllGather") == 1
    assert fused.bytes("AllGather") * 2 == unfused.bytes("AllGather")


def test_compiled_comm_times_count_a_bucket_once():
    def times(fusion):
        with _stepped(fusion) as run:
            return compiled_comm_times(run, link="10GbE")

    def collectives(t, kind):
        return [c for entry in t.values() for c in entry["collectives"] if c[0] == kind]
    unfused, fused = times(None), times(BOTH)
    for kind in ("AllGather", "ReduceScatter"):
        assert len(collectives(unfused, kind)) == 3 and len(collectives(fused, kind)) == 1
        # the one collective carries the three buffers: n is their sum
        assert collectives(fused, kind)[0][2] == sum(c[2] for c in collectives(unfused, kind))
    total = sum(e["time"] for e in fused.values())
    assert total < sum(e["time"] for e in unfused.values())     # fewer latencies


@pytest.mark.parametrize("setting, match", [
    ({"allgather": {"mode": "index", "config": [1]}},
     r"comm_fusion\['allgather'\]\['mode'\]"),
    ({"reducescatter": {"mode": "size", "config": -1}},
     r"comm_fusion\['reducescatter'\]\['config'\]"),
    ({"reducescatter": {"mode": "size"}}, r"comm_fusion\['reducescatter'\]\['config'\]"),
    ({"allgather": {"mode": "auto", "config": 8}}, r"comm_fusion\['allgather'\]\['config'\]"),
    ({"allgather": {"size": 8}}, r"comm_fusion\['allgather'\] has unknown key 'size'"),
    ({"alltoall": {"mode": "auto"}}, r"comm_fusion has unknown key 'alltoall'"),
])
def test_bad_fusion_settings_are_rejected_by_name(setting, match):
    with devices(8):
        with pytest.raises((ValueError, TypeError), match=match):
            dm.set_auto_parallel_context(comm_fusion=setting)


def test_changing_the_gather_or_scatter_fusion_recompiles():
    with devices(8, gradients_mean=True):
        net = ShardedWeights(W, 8)
        run = _step(net, nn.SGD(net.trainable_params(), learning_rate=0.05), 8)
        run(Tensor(X))
        first = run.compiled
        assert not [n for n in first.program.graph.nodes if n.op in (FUSED_AG, FUSED_RS)]
        dm.set_auto_parallel_context(comm_fusion={"reducescatter": {"mode": "auto"}})
        run(Tensor(X))
        second = run.compiled
        assert second is not first
        assert [n.op for n in second.program.graph.nodes if n.op in (FUSED_AG, FUSED_RS)] \
            == [FUSED_RS]
        dm.set_auto_parallel_context(comm_fusion={"allgather": {"mode": "size",
                                                                "config": 1}})
        run(Tensor(X))
        assert run.compiled is not second
        assert {n.op for n in run.compiled.program.graph.nodes
                if n.op in (FUSED_AG, FUSED_RS)} == {FUSED_AG, FUSED_RS}


# ------------------------------------------------------------------ under MPI

def test_fused_step_under_mpi_equals_stand_alone(tmp_path):
    """2 ranks, backend "mpi": unfused and fused (one AllGather and one ReduceScatter a
    step instead of two each) give the stand-alone step's numbers."""
    check_fusion_step_under_mpi(tmp_path, "compiled", [(2, 2), (1, 1)])


def test_module_functions_use_the_live_backend():
    with devices(4):
        stacks = [np.arange(32, dtype=np.float32).reshape(4, 8), np.ones((4, 4), np.float32)]
        rs = fusion.fused_reduce_scatter(stacks)
        np.testing.assert_array_equal(rs[1], np.full((4, 1), 4, np.float32))
        np.testing.assert_array_equal(rs[0][1], stacks[0].sum(axis=0)[2:4])
        ag = fusion.fused_all_gather(rs, axis=[0, 0])
        np.testing.assert_array_equal(ag[0][3], stacks[0].sum(axis=0))


def test_dump_and_strategies_show_the_fused_collectives():
    """dump() draws one node per bucket; strategies() still charges each MatMul the
    redistribution of its own weight, so the planned costs do not change with fusion."""
    def compiled(fusion):
        with _stepped(fusion) as run:
            return run.dump(), run.strategies()
    dot, fused = compiled(SIZED)
    assert dot.count("fused AllGather of 2 parameters") == 1
    assert dot.count("fused ReduceScatter of 2 gradients") == 1
    _, unfused = compiled(None)
    assert fused.keys() == unfused.keys()
    for name in unfused:
        assert fused[name]["cost"] == pytest.approx(unfused[name]["cost"]), name
    assert any(entry["cost"] > 0 for entry in fused.values())


def test_a_block_differentiated_eagerly_fuses_its_parameter_gathers():
    """ops.shard over the network only, the gradient and the update eager: the block's
    forward and backward program gathers each sharded weight twice (forward, backward)
    unfused, once and in one bucket fused."""
    def train(n, fusion=None):
        with devices(n, gradients_mean=True):
            if fusion:
                dm.set_auto_parallel_context(comm_fusion=fusion)
            net = ShardedWeights(W, n)
            f = ops.shard(net, in_strategy=((n, 1),), parameter_plan=PLAN) if n else net
            opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
            grad_fn = dm.value_and_grad(lambda x: ops.reduce_mean(ops.square(f(x))), None,
                                        opt.parameters)
            losses = []
            for k in range(2):
                with CommReport() as rep:
                    loss, grads = grad_fn(Tensor(X))
                opt(grads)
                losses.append(float(loss.asnumpy()))
            return losses, {p.name: p.asnumpy() for p in net.trainable_params()}, rep
    ref_losses, ref_w, _ = train(None)
    for config, gathers in ((None, 6), ({"allgather": {"mode": "auto"}}, 1)):
        losses, w, rep = train(8, config)
        assert rep.count("AllGather", reason="redistribution") == gathers
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for name in ref_w:
            np.testing.assert_allclose(w[name], ref_w[name], rtol=1e-5, atol=1e-6)
