"""Communication fusion of the sharded weights' gradient moves in an EAGER optimizer
update (``comm_fusion["reducescatter"]`` / ``["allreduce"]``).

Two programs:

* a network whose weights are stored sharded (``parameter_plan``) inside an
  ``ops.shard`` block differentiated by eager code, the update eager: each gradient
  arrives pending over the 8 devices and is moved into its weight's layout by one
  ReduceScatter;
* a PyNative network of MatMuls splitting their weights' rows over one axis of a
  (2, 2) device matrix: each gradient arrives pending over the other axis and is
  resolved by an AllReduce over a group of 2 devices (a third, data-parallel weight is
  all-reduced over all 4).

Fused, each bucket is ONE collective of its members' bytes. Checked against the
single-device run (the oracle), per bucket against hand-computed counts, and against
the same program compiled: it reports the same gradient collectives eagerly and
compiled.
"""
import collections

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.communication import SimBackend
from dualmode.communication.backend import Backend, register_backend
from dualmode.parallel import CommReport
from dualmode.parallel.auto_parallel import AutoParallel
from dualmode.parallel.grad_reduce import (fuse_gradient_moves, fused_bucket,
                                           grouped_buckets, resolves_pending, single_step,
                                           step_group)
from dualmode.parallel.graph.ir import FUSED, FUSED_RS
from dualmode.parallel.redistribution import plan_redistribution
from dualmode.parallel.tensor_layout import TensorLayout

from _devices import devices
from _sharded_weights import ShardedWeights, sharded_weights_on
from _mpi import check_fusion_step_under_mpi
from _steps import mean_square_step


class PackedSim(SimBackend):
    """"sim" running the generic (packing) fused collectives of Backend, as MPI does."""
    _all_reduce_fused = Backend._all_reduce_fused
    _reduce_scatter_fused = Backend._reduce_scatter_fused


register_backend("eager-packed-sim", PackedSim)

STEPS = 3

# ------------------------------------------------------------------ program 1: ReduceScatters

N = 8
RNG = np.random.default_rng(11)
X = RNG.standard_normal((16, 16)).astype(np.float32)
#: gradient bytes per device before the ReduceScatter (float32, pending over all 8
#: devices, so whole on each): w0 2 KiB, w1 4 KiB, w2 1 KiB
W = {"w0": RNG.standard_normal((16, 32)).astype(np.float32) * 0.3,
     "w1": RNG.standard_normal((32, 32)).astype(np.float32) * 0.2,
     "w2": RNG.standard_normal((32, 8)).astype(np.float32) * 0.3}
PLAN = {"w0": (N, 1), "w1": (1, N), "w2": (N, 1)}
#: 5 KiB buckets: w0 alone (2 + 4 > 5), then w1 and w2 (4 + 1 <= 5)
SCATTERS = {"unfused": (None, [["w0"], ["w1"], ["w2"]]),
            "auto": ({"reducescatter": {"mode": "auto"}}, [["w0", "w1", "w2"]]),
            "size": ({"reducescatter": {"mode": "size", "config": 5 / 1024}},
                     [["w0"], ["w1", "w2"]]),
            "allreduce only": ({"allreduce": {"mode": "auto"}}, [["w0"], ["w1"], ["w2"]])}
KIB = {"w0": 2048, "w1": 4096, "w2": 1024}


def _gradient_records(rep):
    """The multiset of the gradient collectives: (kind, group size, groups, bytes)."""
    return collections.Counter((r.kind, r.group_size, r.num_groups, r.bytes_per_device)
                               for r in rep.records if r.reason == "gradient")


def _train_scatters(n, fusion=None, compiled=False, backend=None):
    """(losses, weights, report of the optimizer's collectives in step 1, the compiled
    graph or None). Eager: the network is an ops.shard block, the gradient and the
    update eager; `compiled`: the whole step is one ops.shard program."""
    with sharded_weights_on(n, W, fusion, backend) as (net, opt):
        f = ops.shard(net, in_strategy=((n, 1),), parameter_plan=PLAN) \
            if n and not compiled else net
        step = mean_square_step(f, opt)
        run = ops.shard(step, in_strategy=((n, 1),), parameter_plan=PLAN) \
            if compiled else step
        losses, report = [], None
        for k in range(STEPS):
            with CommReport() as rep:
                losses.append(float(run(Tensor(X)).asnumpy()))
            if k == 1:
                report = rep
        weights = {p.name: p.asnumpy() for p in net.trainable_params()}
        return losses, weights, report, run.compiled.program.graph if compiled else None


def _check_oracle(got, want):
    (losses, weights), (ref_losses, ref_weights) = got, want
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name in ref_weights:
        np.testing.assert_allclose(weights[name], ref_weights[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.fixture(scope="module")
def scatter_oracle():
    losses, weights, _, _ = _train_scatters(None)
    return losses, weights


@pytest.mark.parametrize("fusion", list(SCATTERS))
def test_eager_scatters_equal_single_device_and_are_bucketed(fusion, scatter_oracle):
    config, buckets = SCATTERS[fusion]
    losses, weights, rep, _ = _train_scatters(N, config)
    _check_oracle((losses, weights), scatter_oracle)
    gradient = [r for r in rep.records if r.reason == "gradient"]
    assert [r.kind for r in gradient] == ["ReduceScatter"] * len(buckets)
    # one collective per bucket, named after its weights, with its members' bytes
    assert sorted((r.op, r.buffer_bytes) for r in gradient) == sorted(
        (", ".join(b), float(sum(KIB[w] for w in b))) for b in buckets)
    assert all(r.group_size == N and r.num_groups == 1 for r in gradient)
    # the same bytes in total as one ReduceScatter per weight: (n-1)/n of each input
    assert rep.bytes(reason="gradient") == pytest.approx(sum(KIB.values()) * (N - 1) / N)


def test_eager_scatters_on_the_packing_backend_equal_single_device(scatter_oracle):
    losses, weights, rep, _ = _train_scatters(N, SCATTERS["size"][0],
                                              backend="eager-packed-sim")
    assert isinstance(communication.get_backend(), SimBackend)
    _check_oracle((losses, weights), scatter_oracle)
    assert rep.count("ReduceScatter", "gradient") == 2


@pytest.mark.parametrize("fusion", ["unfused", "auto", "size"])
def test_eager_and_compiled_report_the_same_gradient_scatters(fusion, scatter_oracle):
    config, buckets = SCATTERS[fusion]
    eager = _train_scatters(N, config)
    compiled = _train_scatters(N, config, compiled=True)
    _check_oracle(compiled[:2], scatter_oracle)
    assert _gradient_records(eager[2]) == _gradient_records(compiled[2])
    assert sum(_gradient_records(eager[2]).values()) == len(buckets)
    fused = [n for n in compiled[3].nodes if n.op == FUSED_RS]
    assert len(fused) == sum(len(b) > 1 for b in buckets)


# ------------------------------------------------------------------ program 2: AllReduces

M = 4
R2 = np.random.default_rng(3)
X2 = R2.standard_normal((8, 16)).astype(np.float32)
W2 = {"v0": R2.standard_normal((16, 16)).astype(np.float32) * 0.3,
      "v1": R2.standard_normal((16, 8)).astype(np.float32) * 0.3,
      "v2": R2.standard_normal((8, 8)).astype(np.float32) * 0.3}
#: v0, v1: rows split over axis 1 of (2, 2), gradients pending over axis 0 (groups of
#: 2): 512 and 256 bytes per device; v2 data parallel (its AllReduce over all 4 is
#: bucketed apart, by reduce_gradients, and alone here). Limits: 768 B holds v0 + v1,
#: 716 B does not.
REDUCES = {"unfused": (None, [["v0"], ["v1"]]),
           "auto": ({"allreduce": {"mode": "auto"}}, [["v0", "v1"]]),
           "size fits": ({"allreduce": {"mode": "size", "config": 0.75 / 1024}},
                         [["v0", "v1"]]),
           "size splits": ({"allreduce": {"mode": "size", "config": 0.7 / 1024}},
                           [["v0"], ["v1"]]),
           "reducescatter only": ({"reducescatter": {"mode": "auto"}}, [["v0"], ["v1"]])}
SUB_BYTES = {"v0": 512, "v1": 256}


class RowSplit(nn.Cell):
    def __init__(self, n):
        super().__init__()
        for name, w in W2.items():
            setattr(self, name, Parameter(Tensor(w.copy()), name=name))
        self.mm0, self.mm1, self.mm2 = ops.MatMul(), ops.MatMul(), ops.MatMul()
        if n:
            self.mm0.shard(((2, 2), (2, 1)))
            self.mm1.shard(((2, 2), (2, 1)))
            self.mm2.shard(((4, 1), (1, 1)))

    def construct(self, x):
        h = ops.tanh(self.mm1(ops.tanh(self.mm0(x, self.v0)), self.v1))
        return self.mm2(h, self.v2)


def _train_reduces(n, fusion=None, compiled=False):
    with devices(n, gradients_mean=True):
        if fusion is not None:
            dm.set_auto_parallel_context(comm_fusion=fusion)
        net = RowSplit(n)
        opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
        step = mean_square_step(net, opt)
        run = AutoParallel(step, parallel_mode="semi_auto") if compiled else step
        losses, report = [], None
        for k in range(STEPS):
            with CommReport() as rep:
                losses.append(float(run(Tensor(X2)).asnumpy()))
            if k == 1:
                report = rep
        weights = {p.name: p.asnumpy() for p in net.trainable_params()}
        return losses, weights, report, run.compiled.program.graph if compiled else None


@pytest.fixture(scope="module")
def reduce_oracle():
    losses, weights, _, _ = _train_reduces(None)
    return losses, weights


@pytest.mark.parametrize("fusion", list(REDUCES))
def test_eager_sub_group_reduces_equal_single_device_and_are_bucketed(fusion,
                                                                      reduce_oracle):
    config, buckets = REDUCES[fusion]
    losses, weights, rep, _ = _train_reduces(M, config)
    _check_oracle((losses, weights), reduce_oracle)
    sub = [r for r in rep.records if r.reason == "gradient" and r.group_size == 2]
    assert [r.kind for r in sub] == ["AllReduce"] * len(buckets)
    assert all(r.num_groups == 2 for r in sub)
    assert sorted((r.op, r.buffer_bytes) for r in sub) == sorted(
        (", ".join(b), float(sum(SUB_BYTES[w] for w in b))) for b in buckets)
    # the data-parallel weight: one AllReduce over all 4 devices, as before
    assert [(r.kind, r.op) for r in rep.records if r.reason == "gradient" and
            r.group_size == M] == [("AllReduce", "v2")]
    # an AllReduce over 2 devices moves its input bytes per device: the same in total
    assert sum(r.bytes_per_device for r in sub) == pytest.approx(sum(SUB_BYTES.values()))


@pytest.mark.parametrize("fusion", ["unfused", "auto", "size splits"])
def test_eager_and_compiled_report_the_same_gradient_reduces(fusion, reduce_oracle):
    config, buckets = REDUCES[fusion]
    eager = _train_reduces(M, config)
    compiled = _train_reduces(M, config, compiled=True)
    _check_oracle(compiled[:2], reduce_oracle)
    assert _gradient_records(eager[2]) == _gradient_records(compiled[2])
    assert sum(_gradient_records(eager[2]).values()) == len(buckets) + 1
    fused = [n for n in compiled[3].nodes if n.op == FUSED]
    assert len(fused) == sum(len(b) > 1 for b in buckets)


# ------------------------------------------------------------------ the shared helpers

def test_single_step_recognizes_exactly_one_collective_of_a_kind():
    mesh = (2, 4)
    pending = TensorLayout(mesh, ((), ()), (16, 8), partial=(1,))
    rs = plan_redistribution(pending, TensorLayout(mesh, ((1,), ()), (16, 8)), 4)
    step = single_step(rs, "ReduceScatter")
    assert step is not None and step.dim == 0 and single_step(rs, "AllGather") is None
    key, members = step_group(rs, step, np.float32)
    np.testing.assert_array_equal(members, [[0, 1, 2, 3], [4, 5, 6, 7]])  # axis 1 groups
    assert key[2] == np.dtype(np.float32).str and step_group(rs, step, np.float64)[0] != key
    # pending over axis 0 but split over axis 1: an AllReduce and a slice, not fused as a
    # ReduceScatter
    two = plan_redistribution(TensorLayout(mesh, ((), ()), (16, 8), partial=(0,)),
                              TensorLayout(mesh, ((1,), ()), (16, 8)), 4)
    assert [s.kind for s in two] != ["ReduceScatter"]
    assert single_step(two, "ReduceScatter") is None and single_step(None, "AllGather") is None


def test_resolves_pending_is_exactly_an_allreduce_of_the_pending_sums():
    """The one check the eager fusion and the graph lowering share, against the
    redistribution planner: where it says yes, the plan is that one AllReduce."""
    mesh = (2, 4)
    pending = TensorLayout(mesh, ((1,), ()), (16, 8), partial=(0,))
    assert resolves_pending(pending, pending.without_partial())
    plan = plan_redistribution(pending, pending.without_partial(), 4)
    assert [s.kind for s in plan] == ["AllReduce"]
    whole = TensorLayout(mesh, ((), ()), (16, 8), partial=(0, 1))
    assert resolves_pending(whole, None)              # splits nothing: a whole value
    assert not resolves_pending(pending, None)         # split rows: a gather too
    assert not resolves_pending(pending.without_partial(), pending.without_partial())
    split_other = TensorLayout(mesh, ((0,), ()), (16, 8), partial=(1,))
    assert not resolves_pending(split_other, pending.without_partial())
    assert not resolves_pending(whole, TensorLayout(mesh, ((1,), ()), (16, 8)))


def test_grouped_buckets_bucket_each_key_apart_in_order_of_first_appearance():
    keys, sizes = ["a", None, "b", "a", "a", "b"], [3, 99, 1, 3, 3, 1]
    assert grouped_buckets(keys, sizes, "allreduce") == [[0], [3], [4], [2], [5]]
    with devices(4):
        dm.set_auto_parallel_context(comm_fusion={"reducescatter": {
            "mode": "size", "config": 6 / 1024 / 1024}})
        assert grouped_buckets(keys, sizes, "reducescatter") == [[0, 3], [4], [2, 5]]
        assert grouped_buckets(keys, sizes, "allreduce") == [[0], [3], [4], [2], [5]]
    assert fused_bucket([np.float32] * 2) and not fused_bucket([np.float32])
    assert not fused_bucket([np.float32, np.float64])


def test_without_settings_the_gradients_are_returned_unchanged():
    with devices(N):
        net = ShardedWeights(W, N)
        f = ops.shard(net, in_strategy=((N, 1),), parameter_plan=PLAN)
        params = net.trainable_params()
        _, grads = dm.value_and_grad(lambda x: ops.reduce_sum(f(x)), None, params)(Tensor(X))
        with CommReport() as rep:
            out = fuse_gradient_moves(grads, params)
        assert all(a is b for a, b in zip(out, grads)) and not rep.records
        dm.set_auto_parallel_context(comm_fusion={"reducescatter": {"mode": "auto"}})
        with CommReport() as rep:
            out = fuse_gradient_moves(grads, params)
        assert rep.count("ReduceScatter", "gradient") == 1 and len(rep.records) == 1
        for g, p in zip(out, params):
            assert g._layout == p._layout       # moved into the weight's layout


# ------------------------------------------------------------------ under MPI

def test_eager_fused_scatters_under_mpi_equal_stand_alone(tmp_path):
    """2 ranks, backend "mpi": unfused and fused (one ReduceScatter a step instead of
    two) eager updates give the stand-alone run's numbers."""
    check_fusion_step_under_mpi(tmp_path, "eager", [(0, 2), (0, 1)])
