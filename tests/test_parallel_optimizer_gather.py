"""The parallel optimizer's AllGather of the updated slices when this process holds every
device: a weight whose layout repeats its blocks is gathered into a grid of its distinct
blocks (a ``ReplicaBlocks`` made on the first read: no replica written, and the readers
that take grids read it as it is); other weights (whole values, fused buckets) into
their stacks. Either way the gathered value is an array of its own, never a view of the
slices the next update writes in place.

The oracle is the same program on one device (SGD, Momentum, Adam with weight decay,
three steps, PyNative and GRAPH_MODE); the records of the gathers are computed by hand
from the shapes, and the grid path gives the very numbers (bit for bit) and records of
the stack path."""
import copy
import pickle

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel import CommReport, optimizer_memory
from dualmode.parallel import optimizer_shard
from dualmode.parallel.optimizer_shard import GatherOnRead, stored_slices
from dualmode.parallel.replicas import ReplicaBlocks, replica_blocks
from dualmode.parallel.report import parameter_bytes_per_device

from _devices import devices

N = 8
RNG = np.random.default_rng(27)
X = RNG.standard_normal((16, 64)).astype(np.float32)
Y = RNG.integers(0, 32, 16).astype(np.int32)
W = {"w1": (RNG.standard_normal((64, 256)) * 0.1).astype(np.float32),
     "v1": (RNG.standard_normal((64, 256)) * 0.1).astype(np.float32),
     "w2": (RNG.standard_normal((256, 32)) * 0.1).astype(np.float32),
     "b": (RNG.standard_normal(32) * 0.1).astype(np.float32)}
# semi_auto: w1 and v1 split by columns over 4 devices, each block (64, 64) repeated on
# 2 (one device group: one fused bucket with comm_fusion); w2 split by rows over 2, each
# block (128, 32) repeated on 4. The bias (128 B) stays below the 1 KB threshold.
# data_parallel: the weights whole, repeated on all 8.
BLOCK = {"w1": (64, 64), "v1": (64, 64), "w2": (128, 32)}
COPIES = {"w1": 2, "v1": 2, "w2": 4}
SPLIT = ("w1", "v1", "w2")
FUSION = {"allgather": {"mode": "auto", "config": None},
          "reducescatter": {"mode": "auto", "config": None}}
OPTIMIZERS = {
    "sgd": lambda p: nn.SGD(p, 0.1, weight_decay=0.01),
    "momentum": lambda p: nn.Momentum(p, 0.1, 0.9, weight_decay=0.01),
    # eps well above the rounding of the near-zero gradients of dead ReLUs (which
    # Adam divides by their square roots)
    "adam": lambda p: nn.Adam(p, 0.01, eps=1e-4, weight_decay=0.01),
}


class Net(nn.Cell):
    def __init__(self, strategies=True):
        super().__init__()
        for name, value in W.items():
            setattr(self, name, Parameter(Tensor(value.copy()), name=name))
        self.mm1 = ops.MatMul().shard(((2, 1), (1, 4))) if strategies else ops.MatMul()
        self.mv1 = ops.MatMul().shard(((2, 1), (1, 4))) if strategies else ops.MatMul()
        self.mm2 = ops.MatMul().shard(((4, 2), (2, 1))) if strategies else ops.MatMul()
        self.relu = ops.ReLU()

    def construct(self, x):
        h = self.relu(self.mm1(x, self.w1) + self.mv1(x, self.v1))
        return self.mm2(h, self.w2) + self.b


def _loss():
    return nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


def _build(opt_name="adam", strategies=True):
    net = Net(strategies)
    opt = OPTIMIZERS[opt_name](net.trainable_params())
    return net, opt, nn.TrainOneStepCell(nn.WithLossCell(net, _loss()), opt)


def _weights(net):
    return {p.name: p.asnumpy() for p in net.trainable_params()}


def _parallel(mode="semi_auto_parallel", shard_size=-1, **extra):
    config = {"parallel_optimizer_threshold": 1, "optimizer_weight_shard_size": shard_size}
    return devices(N, mode, gradients_mean=True, enable_parallel_optimizer=True,
                   parallel_optimizer_config=config, **extra)


_SINGLE = {}


def _single(opt_name, steps, new_w1=None):
    """(losses, weights after each step) of the same program on one device (`new_w1`:
    w1 set to it after the first step)."""
    key = (opt_name, steps, new_w1 is not None)
    if key not in _SINGLE:
        with devices(None):
            net, _, step = _build(opt_name)
            losses, weights = [], []
            for k in range(steps):
                losses.append(float(step(Tensor(X), Tensor(Y)).asnumpy()))
                weights.append(_weights(net))
                if k == 0 and new_w1 is not None:
                    net.w1.set_data(Tensor(new_w1.copy()))
        _SINGLE[key] = losses, weights
    return _SINGLE[key]


def _assert_same(got, want, rtol=1e-4):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=1e-6, err_msg=name)


def _records(report):
    return [(r.kind, r.reason, r.op, r.group_size, r.num_groups, r.bytes_per_device)
            for r in report.records]


def _stack_path(monkeypatch):
    """Every weight gathered into its stack (the path of weights that cannot be
    gathered into a grid), for comparing the two."""
    monkeypatch.setattr(optimizer_shard, "_as_grid", lambda *args: False)


# ---- values -------------------------------------------------------------------------

@pytest.mark.parametrize("fusion", [False, True], ids=["alone", "fused"])
@pytest.mark.parametrize("shard_size", [-1, 2])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_steps_equal_one_device(opt_name, shard_size, fusion):
    """Three steps with dp x mp layouts (w2 cut into 2 slices of its 4 copies with
    ``optimizer_weight_shard_size=2``): losses and weights equal the single device's.
    Alone or in a fused bucket (w1 and v1 with comm_fusion), the weights are stored as
    grids of their distinct blocks made on the first read, their slices kept."""
    want_losses, want = _single(opt_name, 3)
    extra = {"comm_fusion": FUSION} if fusion else {}
    with _parallel(shard_size=shard_size, **extra):
        net, opt, step = _build(opt_name)
        losses, kinds = [], []
        for _ in range(3):
            losses.append(float(step(Tensor(X), Tensor(Y)).asnumpy()))
            kinds.append({p.name: type(p._lazy) for p in (net.w1, net.v1, net.w2)})
            assert all(stored_slices(getattr(net, n)) is not None for n in SPLIT)
        got = _weights(net)
    assert kinds == [{"w1": ReplicaBlocks, "v1": ReplicaBlocks, "w2": ReplicaBlocks}] * 3
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _assert_same(got, want[-1])


@pytest.mark.parametrize("opt_name", ["momentum", "adam"])
def test_graph_mode_steps_equal_one_device(opt_name):
    """A compiled step reads the grids as the eager one does: three steps equal the
    single device's, each gathering each split weight once."""
    want_losses, want = _single(opt_name, 3)
    with _parallel():
        dm.set_context(mode=dm.GRAPH_MODE)
        net, _, step = _build(opt_name)
        losses, gathers = [], []
        for _ in range(3):
            with CommReport() as report:
                losses.append(float(step(Tensor(X), Tensor(Y)).asnumpy()))
            gathers.append(sorted(r.op for r in report.records
                                  if r.reason == "parallel_optimizer"))
            assert type(net.w1._lazy) is ReplicaBlocks
        dm.set_context(mode=dm.PYNATIVE_MODE)
        got = _weights(net)
    assert gathers == [[], ["v1", "w1", "w2"], ["v1", "w1", "w2"]]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _assert_same(got, want[-1])


@pytest.mark.parametrize("fusion", [False, True], ids=["alone", "fused"])
@pytest.mark.parametrize("mode", ["semi_auto_parallel", "data_parallel"])
def test_the_grid_path_gives_the_stack_paths_numbers_bit_for_bit(mode, fusion, monkeypatch):
    """The same three Adam steps gathering into grids and into stacks: equal losses and
    weights, bit for bit (a gather only copies). data_parallel's whole weights are
    gathered into values (in one fused bucket with comm_fusion) either way."""
    extra = {"comm_fusion": FUSION} if fusion else {}

    def run():
        with _parallel(mode, **extra):
            net, _, step = _build(strategies=mode != "data_parallel")
            losses = [float(step(Tensor(X), Tensor(Y)).asnumpy()) for _ in range(3)]
            kinds = {type(getattr(net, n)._lazy) for n in SPLIT}
            return losses, _weights(net), kinds

    grid_losses, grid_weights, kinds = run()
    assert kinds == {GatherOnRead if mode == "data_parallel" else ReplicaBlocks}
    _stack_path(monkeypatch)
    stack_losses, stack_weights, kinds = run()
    assert kinds == {GatherOnRead}
    assert grid_losses == stack_losses
    for name in W:
        np.testing.assert_array_equal(grid_weights[name], stack_weights[name], err_msg=name)


# ---- what is communicated --------------------------------------------------------------

@pytest.mark.parametrize("fusion", [False, True], ids=["alone", "fused"])
def test_each_gather_is_recorded_as_computed_by_hand(fusion, monkeypatch):
    """The second step's records: each split weight's AllGather once (reason
    "parallel_optimizer", under its name; w1 and v1 as one collective in a fused
    bucket), a device sending its slice to the n - 1 others of its group: w1 and v1
    (64 x 64 blocks, 2 copies) 1 x 32 x 64 x 4 B each in 4 groups of 2, w2 (128 x 32
    blocks, 4 copies) 3 x 32 x 32 x 4 B in 2 groups of 4. Every record of the step
    (gradients too) equals the stack path's."""
    def second_step():
        with _parallel(**({"comm_fusion": FUSION} if fusion else {})):
            net, _, step = _build()
            step(Tensor(X), Tensor(Y))
            with CommReport() as report:
                step(Tensor(X), Tensor(Y))
        return report

    report = second_step()
    gathers = sorted(r for r in _records(report) if r[1] == "parallel_optimizer")
    one = 1 * 32 * 64 * 4
    first = [("AllGather", "parallel_optimizer", "w1, v1", 2, 4, 2 * one)] if fusion else \
        [("AllGather", "parallel_optimizer", "v1", 2, 4, one),
         ("AllGather", "parallel_optimizer", "w1", 2, 4, one)]
    assert gathers == first + [("AllGather", "parallel_optimizer", "w2", 4, 2, 3 * 32 * 32 * 4)]
    _stack_path(monkeypatch)
    assert _records(second_step()) == _records(report)


def test_the_grid_is_read_without_writing_the_replicas():
    """Between steps each split weight holds its slice only (1/n of its block per
    device, no value gathered; reading the memory figures gathers nothing). The forward
    pass gathers it into one grid of its distinct blocks, which the MatMuls read as it
    is: the replicas' stack is never written. The grid equals the single device's weight
    cut into its blocks."""
    want = _single("momentum", 1)[1][0]
    with _parallel():
        net, opt, step = _build("momentum")
        step(Tensor(X), Tensor(Y))
        params = [net.w1, net.v1, net.w2, net.b]
        with CommReport() as quiet:
            held = parameter_bytes_per_device(params)
            mem = optimizer_memory(opt)
        assert quiet.count() == 0
        slice_bytes = sum(int(np.prod(BLOCK[n])) * 4 // COPIES[n] for n in SPLIT)
        assert held == slice_bytes + W["b"].nbytes
        assert mem.gathered == 0 and mem.shards == dict(COPIES, b=1)
        with CommReport() as report:
            net(Tensor(X))                                          # reads the weights
        assert sorted(r.op for r in report.records if r.reason == "parallel_optimizer") \
            == ["v1", "w1", "w2"]
        grids = {}
        for p in params[:3]:
            assert type(p._lazy) is ReplicaBlocks and not p._lazy._written
            assert p._arr is None and stored_slices(p) is None      # gathered now
            grids[p.name] = replica_blocks(p)
        assert optimizer_memory(opt).gathered == sum(int(np.prod(BLOCK[n])) * 4 for n in BLOCK)
    # w1: device axes (2 repeat, 4 split the columns); w2: (4 repeat, 2 split the rows)
    assert grids["w1"].shape == (1, 4, 64, 64) and grids["w2"].shape == (1, 2, 128, 32)
    for j in range(4):
        np.testing.assert_allclose(grids["w1"][0, j], want["w1"][:, 64 * j:64 * (j + 1)],
                                   rtol=1e-5, atol=1e-7)
    for j in range(2):
        np.testing.assert_allclose(grids["w2"][0, j], want["w2"][128 * j:128 * (j + 1)],
                                   rtol=1e-5, atol=1e-7)


# ---- the gathered value is an array of its own ------------------------------------------

@pytest.mark.parametrize("mode", ["semi_auto_parallel", "data_parallel"])
def test_the_gathered_value_does_not_alias_the_slices(mode):
    """The value a read gathers (a grid of blocks, a stack, or a whole value) shares no
    memory with the slices, so the next update, which writes the slices in place,
    leaves a value read before it as it was; and writing into that value in place
    leaves the slices (the weight the next update starts from) as they were."""
    with _parallel(mode):
        net, opt, step = _build(strategies=mode != "data_parallel")
        step(Tensor(X), Tensor(Y))
        slices = {p.name: stored_slices(p)[1] for p in (net.w1, net.w2)}
        kept = {n: s.copy() for n, s in slices.items()}
        read = {}
        for p in (net.w1, net.w2):
            value = replica_blocks(p) if mode == "semi_auto_parallel" else p._data
            assert value is not None
            assert not np.shares_memory(value, slices[p.name]), p.name
            read[p.name] = (value, value.copy())
        for name, (value, _) in read.items():
            value += 1.0                                    # written in place
            np.testing.assert_array_equal(slices[name], kept[name], err_msg=name)
            value -= 1.0
        for name in read:
            read[name] = (read[name][0], read[name][0].copy())
        step(Tensor(X), Tensor(Y))                          # writes the slices in place
        assert stored_slices(net.w1)[1] is slices["w1"]     # the same arrays, updated
        assert not np.array_equal(slices["w1"], kept["w1"])
        for name, (value, before) in read.items():
            np.testing.assert_array_equal(value, before, err_msg=name)


# ---- copies, pickles, new values ------------------------------------------------------

def test_a_copy_between_steps_trains_as_the_original():
    """A deep copy of the network and optimizer taken between steps (the weights still
    slices, gathered for the copy) trains on alone: both reach the single device's
    weights after three steps, and the copy's arrays are its own."""
    want = _single("momentum", 3)[1]
    with _parallel():
        net, opt, step = _build("momentum")
        step(Tensor(X), Tensor(Y))
        net2, opt2 = copy.deepcopy((net, opt))
        assert type(net.w1._lazy) is ReplicaBlocks
        _assert_same(_weights(net2), want[0], rtol=1e-5)
        grid, grid2 = replica_blocks(net.w1), replica_blocks(net2.w1)
        assert grid2 is not None and not np.shares_memory(grid, grid2)
        step2 = nn.TrainOneStepCell(nn.WithLossCell(net2, _loss()), opt2)
        for _ in range(2):
            step(Tensor(X), Tensor(Y))
            step2(Tensor(X), Tensor(Y))
        got, got2 = _weights(net), _weights(net2)
    _assert_same(got, want[-1])
    _assert_same(got2, want[-1])


def test_a_weight_pickles_its_global_value_between_steps():
    want = _single("sgd", 1)[1][0]
    with _parallel():
        net, _, step = _build("sgd")
        step(Tensor(X), Tensor(Y))
        c = pickle.loads(pickle.dumps(net.w1))
    assert c._layout is None and c.shape == (64, 256)
    np.testing.assert_allclose(c.asnumpy(), want["w1"], rtol=1e-5, atol=1e-7)


def test_a_value_set_between_steps_is_the_one_the_next_update_starts_from():
    """set_data between steps replaces the stored slices: the next update cuts its
    slices from the new value, as the single device updates it."""
    new = (np.random.default_rng(5).standard_normal((64, 256)) * 0.1).astype(np.float32)
    want_losses, want = _single("adam", 3, new_w1=new)
    with _parallel():
        net, _, step = _build("adam")
        losses = [float(step(Tensor(X), Tensor(Y)).asnumpy())]
        net.w1.set_data(Tensor(new.copy()))
        assert stored_slices(net.w1) is None
        losses += [float(step(Tensor(X), Tensor(Y)).asnumpy()) for _ in range(2)]
        got = _weights(net)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _assert_same(got, want[-1])


# ---- errors -------------------------------------------------------------------------

def test_replica_blocks_need_a_grid_or_a_source():
    from dualmode.parallel.tensor_layout import TensorLayout
    lay = TensorLayout((2, 4), ((), (1,)), (64, 256))
    with pytest.raises(ValueError, match="ReplicaBlocks: give the grid, or a source"):
        ReplicaBlocks(None, lay)


def test_a_grid_gather_needs_every_device_in_this_process():
    """The grid of blocks is made from every device's slices: a process holding some
    devices only (one rank of an MPI job) is refused, naming the parameter."""
    import types
    from dualmode.parallel.redistribution.planner import plan_redistribution
    from dualmode.parallel.tensor_layout import TensorLayout
    src = TensorLayout((2, 4), ((0,), (1,)), (64, 256))
    dst = TensorLayout((2, 4), ((), (1,)), (64, 256))
    plan_ = plan_redistribution(src, dst, 4)
    rank = types.SimpleNamespace(world_size=8, local_ranks=range(1))
    stack = np.zeros((1,) + src.local_shape, np.float32)
    with pytest.raises(RuntimeError, match="cannot gather parameter 'w1' as a grid.*does "
                                           "not hold every device"):
        optimizer_shard._grid(plan_, stack, rank, "w1")
