"""The parallel optimizer (``enable_parallel_optimizer=True``): a weight replicated over
some devices has its gradient ReduceScattered over those devices, its optimizer states
and update on 1/n slices, and the updated slices AllGathered back.

The oracle is the same program on one device with the same initial weights: SGD,
Momentum and Adam (with weight decay) over several steps, in semi_auto_parallel (two
tensor-parallel MatMuls whose weights are replicated over the other devices, a
replicated weight, a bias below the threshold), auto_parallel and data_parallel, in
PyNative and GRAPH_MODE, with and without ``gradients_mean``; then what CommReport
shows (byte counts from the ring formulas), the threshold and the shard size, the
memory of the states, fusion, checkpoints and the errors."""
import re

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel import CommReport, optimizer_memory
from dualmode.train import Model

from _devices import devices

N = 8
STEPS = 3
RNG = np.random.default_rng(30)
X = RNG.standard_normal((16, 32)).astype(np.float32)
Y = RNG.integers(0, 16, 16).astype(np.int32)
W = {"w1": (RNG.standard_normal((32, 64)) * 0.2).astype(np.float32),
     "w2": (RNG.standard_normal((64, 64)) * 0.2).astype(np.float32),
     "w3": (RNG.standard_normal((64, 16)) * 0.2).astype(np.float32),
     "b": (RNG.standard_normal(16) * 0.1).astype(np.float32)}
# 1 KB: w1 (8 KB), w2 (16 KB), w3 (4 KB) are sharded, the bias (64 B) is not
SMALL = {"parallel_optimizer_threshold": 1}


class Net(nn.Cell):
    """MatMul (2, 1) x (1, 4) (w1 split over 4 devices by columns, replicated over 2),
    MatMul (2, 4) x (4, 1) (w2 split by rows over 4, replicated over 2), then a plain
    MatMul (w3 replicated on every device) and a bias. `strategies=False`: no strategy
    (data parallel)."""

    def __init__(self, strategies=True):
        super().__init__()
        for name, value in W.items():
            setattr(self, name, Parameter(Tensor(value.copy()), name=name))
        s1, s2 = (((2, 1), (1, 4)), ((2, 4), (4, 1))) if strategies else (None, None)
        self.mm1 = ops.MatMul().shard(s1) if s1 else ops.MatMul()
        self.mm2 = ops.MatMul().shard(s2) if s2 else ops.MatMul()
        self.mm3 = ops.MatMul()
        self.relu = ops.ReLU()

    def construct(self, x):
        h = self.relu(self.mm1(x, self.w1))
        h = self.relu(self.mm2(h, self.w2))
        return self.mm3(h, self.w3) + self.b


OPTIMIZERS = {
    "sgd": lambda p, s: nn.SGD(p, 0.1, weight_decay=0.01, loss_scale=s),
    "momentum": lambda p, s: nn.Momentum(p, 0.1, 0.9, weight_decay=0.01, loss_scale=s),
    "adam": lambda p, s: nn.Adam(p, 0.01, weight_decay=0.01, loss_scale=s),
}


def _train(opt_name, entry="train_one_step", loss_scale=1.0, strategies=True, steps=STEPS):
    """`steps` steps in the current context: (losses, weights, optimizer, report). The
    report covers the steps and the read of the weights after them: a weight the
    parallel optimizer stores as its slices is gathered where it is read (the next
    step's forward pass, or here), so each of the `steps` updates gathers once."""
    net = Net(strategies)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = OPTIMIZERS[opt_name](net.trainable_params(), loss_scale)
    losses = []
    with CommReport() as report:
        if entry == "model":
            data = dm.dataset.NumpySlicesDataset({"x": X, "y": Y}, shuffle=False).batch(16)
            Model(net, loss_fn, opt).train(steps, data)
        elif entry == "opt_grads":
            grad_fn = dm.value_and_grad(lambda a, b: loss_fn(net(a), b), None, opt.parameters)
            for _ in range(steps):
                loss, grads = grad_fn(Tensor(X), Tensor(Y))
                opt(grads)
                losses.append(float(loss.asnumpy()))
        else:
            step = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), opt)
            losses = [float(step(Tensor(X), Tensor(Y)).asnumpy()) for _ in range(steps)]
        weights = {p.name: p.asnumpy() for p in net.trainable_params()}
    return losses, weights, opt, report


_SINGLE = {}


def _single(opt_name, loss_scale=1.0):
    key = (opt_name, loss_scale)
    if key not in _SINGLE:
        with devices(None):
            _SINGLE[key] = _train(opt_name, loss_scale=loss_scale)[:2]
    return _SINGLE[key]


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_the_single_device_run_trains():
    """The oracle moves every weight (a test of equality to it could otherwise pass on
    an optimizer doing nothing)."""
    for name in OPTIMIZERS:
        losses, weights = _single(name)
        assert losses[-1] < losses[0]
        for k, w in W.items():
            assert np.abs(weights[k] - w).max() > 1e-3, (name, k)


# ---- numbers equal to the single device ------------------------------------------

@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_semi_auto_and_auto_equal_the_single_device(opt_name, mode, graph, mean):
    want_losses, want = _single(opt_name)
    with devices(N, mode, gradients_mean=mean, enable_parallel_optimizer=True,
                 parallel_optimizer_config=SMALL):
        if graph:
            dm.set_context(mode=dm.GRAPH_MODE)
        losses, got, opt, report = _train(opt_name)
        shards = optimizer_memory(opt).shards
    _assert_same(got, want)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert shards["b"] == 1                          # below the threshold
    if mode == "semi_auto_parallel":
        assert shards == {"w1": 2, "w2": 2, "w3": 8, "b": 1}
    assert report.count("ReduceScatter", reason="gradient", op="w3") == STEPS
    gathers = report.count("AllGather", reason="parallel_optimizer")
    # auto_parallel may split a weight over every device (nothing left to shard)
    assert gathers == 3 * STEPS if mode == "semi_auto_parallel" else gathers >= STEPS


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_data_parallel_equals_the_single_device(opt_name, graph):
    """gradients_mean=True: the single device; False: the sum of the 8 devices'
    gradients, i.e. the single device with its gradients times 8 (loss_scale 1/8)."""
    for mean, scale in ((True, 1.0), (False, 1.0 / N)):
        with devices(N, "data_parallel", gradients_mean=mean, enable_parallel_optimizer=True,
                     parallel_optimizer_config=SMALL):
            if graph:
                dm.set_context(mode=dm.GRAPH_MODE)
            _, got, opt, report = _train(opt_name, strategies=False)
            shards = optimizer_memory(opt).shards
        _assert_same(got, _single(opt_name, scale)[1])
        assert shards == {"w1": 8, "w2": 8, "w3": 8, "b": 1}
        assert report.count("ReduceScatter", reason="gradient") == 3 * STEPS
        assert report.count("AllReduce", reason="gradient") == STEPS       # the bias


@pytest.mark.parametrize("entry", ["opt_grads", "model"])
def test_other_entry_points(entry):
    """value_and_grad + opt(grads), and Model.train (PyNative and GRAPH_MODE)."""
    want = _single("momentum")[1]
    for graph in (False, True):
        with devices(N, enable_parallel_optimizer=True, parallel_optimizer_config=SMALL):
            if graph:
                dm.set_context(mode=dm.GRAPH_MODE)
            _, got, _, report = _train("momentum", entry)
        _assert_same(got, want)
        assert report.count("ReduceScatter", reason="gradient", op="w3") == STEPS


def test_lars_and_gradients_given_as_arrays():
    """LARS reduces the gradients itself (its norms need them whole), so the wrapped
    Momentum gets whole gradients: each device cuts its slices locally, the states are
    still split and the slices gathered. Gradients passed as numpy arrays likewise.
    Both equal the single device."""
    def lars_run(n, **settings):
        with devices(n, "data_parallel", gradients_mean=True, **settings):
            net = Net(False)
            opt = nn.LARS(nn.Momentum(net.trainable_params(), 0.1, 0.9))
            step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(
                sparse=True, reduction="mean")), opt)
            with CommReport() as report:
                for _ in range(STEPS):
                    step(Tensor(X), Tensor(Y))
                weights = {p.name: p.asnumpy() for p in net.trainable_params()}
            shards = optimizer_memory(opt.opt).shards
        return weights, report, shards

    want, _, _ = lars_run(None)
    got, report, shards = lars_run(N, enable_parallel_optimizer=True,
                                   parallel_optimizer_config=SMALL)
    _assert_same(got, want)
    assert shards == {"w1": 8, "w2": 8, "w3": 8, "b": 1}
    assert report.count("AllGather", reason="parallel_optimizer") == 3 * STEPS
    assert report.count("ReduceScatter") == 0

    grads = {k: np.full(v.shape, 0.5, np.float32) for k, v in W.items()}
    found = []
    for n in (None, N):
        settings = dict(enable_parallel_optimizer=True, parallel_optimizer_config=SMALL) \
            if n else {}
        with devices(n, "data_parallel", **settings):
            net = Net(False)
            opt = OPTIMIZERS["adam"](net.trainable_params(), 1.0)
            for _ in range(2):
                opt(tuple(grads[p.name] for p in opt.parameters))
            found.append({p.name: p.asnumpy() for p in net.trainable_params()})
            if n:
                assert optimizer_memory(opt).shards["w1"] == 8
    _assert_same(found[1], found[0])


# ---- what is communicated -------------------------------------------------------------

def _records(report, kind, name):
    return [r for r in report.records if r.kind == kind and r.op == name]


def test_report_reduce_scatter_and_all_gather_instead_of_all_reduce():
    """data_parallel, one SGD step: each sharded weight's gradient is one ReduceScatter
    over the 8 devices and its update one AllGather, each (n-1)/n of the weight's bytes
    per device (ring); the bias keeps its AllReduce, 2(n-1)/n of its bytes. Without the
    parallel optimizer every weight is AllReduced."""
    with devices(N, "data_parallel"):
        _, _, _, plain = _train("sgd", strategies=False, steps=1)
    assert plain.count("AllReduce", reason="gradient") == 4
    assert plain.count("ReduceScatter") == plain.count("AllGather") == 0
    with devices(N, "data_parallel", enable_parallel_optimizer=True,
                 parallel_optimizer_config=SMALL):
        _, _, _, report = _train("sgd", strategies=False, steps=1)
    for name in ("w1", "w2", "w3"):
        nbytes = W[name].nbytes
        rs, = _records(report, "ReduceScatter", name)
        ag, = _records(report, "AllGather", name)
        assert (rs.reason, rs.group_size, rs.num_groups) == ("gradient", N, 1)
        assert (ag.reason, ag.group_size, ag.num_groups) == ("parallel_optimizer", N, 1)
        assert rs.bytes_per_device == ag.bytes_per_device == (N - 1) / N * nbytes
        assert not _records(report, "AllReduce", name)
    ar, = _records(report, "AllReduce", "b")
    assert ar.reason == "gradient" and ar.bytes_per_device == 2 * (N - 1) / N * W["b"].nbytes
    assert report.count() == 7


def test_semi_auto_groups_are_the_replicas():
    """semi_auto_parallel: w1 and w2 are split over 4 devices and replicated over 2, so
    their AllGather runs in 4 groups of 2, over half of each device's quarter; w3
    (replicated on all 8) is gathered over one group of 8. No weight is AllReduced."""
    with devices(N, enable_parallel_optimizer=True, parallel_optimizer_config=SMALL):
        _, _, _, report = _train("sgd", steps=1)
    for name in ("w1", "w2"):
        local = W[name].nbytes / 4
        ag, = _records(report, "AllGather", name)
        assert (ag.group_size, ag.num_groups) == (2, 4)
        assert ag.bytes_per_device == local / 2
        assert report.count("ReduceScatter", reason="gradient", op=name) + \
            report.count("AlltoAll", reason="gradient", op=name) == 1
        assert not _records(report, "AllReduce", name)
    # w3's gradient arrives pending over the 2 rows of the device matrix, its columns
    # already split by the backward pass: one ReduceScatter over each column's 2 devices
    # finishes the 1/8 slices
    rs, = _records(report, "ReduceScatter", "w3")
    assert (rs.group_size, rs.num_groups, rs.reason) == (2, 4, "gradient")
    ag, = _records(report, "AllGather", "w3")
    assert (ag.group_size, ag.num_groups, ag.bytes_per_device) == \
        (N, 1, (N - 1) / N * W["w3"].nbytes)
    assert not _records(report, "AllReduce", "w3")


class _TwoSizes(nn.Cell):
    """x @ big (128 x 128 float32: 64 KB) @ small.T (64 x 128: 32 KB)."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(3)
        self.big = Parameter(Tensor((rng.standard_normal((128, 128)) * 0.1)
                                    .astype(np.float32)), name="big")
        self.small = Parameter(Tensor((rng.standard_normal((64, 128)) * 0.1)
                                      .astype(np.float32)), name="small")
        self.mm = ops.MatMul()
        self.mm_t = ops.MatMul(transpose_b=True)

    def construct(self, x):
        return self.mm_t(self.mm(x, self.big), self.small)


def _two_sizes(**settings):
    x = np.random.default_rng(4).standard_normal((16, 128)).astype(np.float32)
    y = np.zeros((16, 64), np.float32)
    with devices(N if settings else None, "data_parallel", gradients_mean=True, **settings):
        net = _TwoSizes()
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()),
                                   nn.Momentum(net.trainable_params(), 0.1, 0.9))
        with CommReport() as report:
            for _ in range(2):
                step(Tensor(x), Tensor(y))
            weights = {p.name: p.asnumpy() for p in net.trainable_params()}
    return weights, report


def test_default_threshold_is_64_kb():
    """By default a weight of exactly 64 KB is sharded and one of 32 KB keeps its
    AllReduce; a threshold of 0 shards both. Numbers equal the single device."""
    want, _ = _two_sizes()
    got, report = _two_sizes(enable_parallel_optimizer=True)
    _assert_same(got, want)
    assert report.count("ReduceScatter", op="big") == report.count("AllGather", op="big") == 2
    assert report.count("AllReduce", op="big") == 0
    assert report.count("AllReduce", reason="gradient", op="small") == 2
    assert report.count("ReduceScatter", op="small") == 0
    got, report = _two_sizes(enable_parallel_optimizer=True,
                             parallel_optimizer_config={"parallel_optimizer_threshold": 0})
    _assert_same(got, want)
    assert report.count("ReduceScatter", op="small") == 2
    assert report.count("AllReduce") == 0


def test_shard_size_smaller_than_the_replicas():
    """optimizer_weight_shard_size=2 on 8 data-parallel devices: groups of 2
    consecutive ranks. The gradient is ReduceScattered in 4 groups of 2 then its halves
    AllReduced over the 4 groups; the AllGather runs in 4 groups of 2. Numbers equal the
    single device."""
    want = _single("adam")[1]
    with devices(N, "data_parallel", gradients_mean=True, enable_parallel_optimizer=True,
                 parallel_optimizer_config=dict(SMALL, optimizer_weight_shard_size=2)):
        _, got, opt, report = _train("adam", strategies=False)
        mem = optimizer_memory(opt)
        m1 = opt.moment1[0]
        groups = m1.layout.group_members(m1.layout.tensor_map[0])
    _assert_same(got, want)
    assert mem.shards == {"w1": 2, "w2": 2, "w3": 2, "b": 1}
    np.testing.assert_array_equal(groups, np.arange(N).reshape(4, 2))
    nbytes = W["w1"].nbytes
    rs = _records(report, "ReduceScatter", "w1")
    ar = _records(report, "AllReduce", "w1")
    ag = _records(report, "AllGather", "w1")
    assert len(rs) == len(ar) == len(ag) == STEPS
    assert (rs[0].group_size, rs[0].num_groups, rs[0].bytes_per_device) == (2, 4, nbytes / 2)
    assert (ar[0].group_size, ar[0].num_groups, ar[0].reason) == (4, 2, "gradient")
    assert ar[0].bytes_per_device == 2 * 3 / 4 * nbytes / 2
    assert (ag[0].group_size, ag[0].num_groups, ag[0].bytes_per_device) == (2, 4, nbytes / 2)


@pytest.mark.parametrize("graph", [False, True])
def test_fused_per_bucket(graph):
    """comm_fusion "reducescatter" and "allgather" (auto: 64 MB buckets): the three
    sharded weights' ReduceScatters are one collective, their AllGathers one, with the
    summed bytes; numbers unchanged."""
    want = _single("sgd")[1]
    fusion = {"reducescatter": {"mode": "auto", "config": None},
              "allgather": {"mode": "auto", "config": None}}
    with devices(N, "data_parallel" if not graph else "semi_auto_parallel",
                 gradients_mean=True, enable_parallel_optimizer=True,
                 parallel_optimizer_config={"parallel_optimizer_threshold": 0},
                 comm_fusion=fusion):
        if graph:
            dm.set_context(mode=dm.GRAPH_MODE)
        _, got, _, report = _train("sgd", strategies=False)
    _assert_same(got, want)
    total = sum(W[k].nbytes for k in W)          # with the threshold 0 the bias too
    ags = [r for r in report.records if r.reason == "parallel_optimizer"]
    rss = [r for r in report.records if r.kind == "ReduceScatter" and r.reason == "gradient"]
    assert len(ags) == len(rss) == STEPS
    for r in ags + rss:
        assert r.bytes_per_device == (N - 1) / N * total


class _Wide(nn.Cell):
    """One MatMul (1, 4) x (4, 1): its 256 x 256 weight split over 4 devices by rows and
    replicated over 2, a stack large enough to be stored once per distinct block."""

    def __init__(self):
        super().__init__()
        w = np.random.default_rng(6).standard_normal((256, 256)) * 0.05
        self.w = Parameter(Tensor(w.astype(np.float32)), name="w")
        self.mm = ops.MatMul().shard(((1, 4), (4, 1)))

    def construct(self, x):
        return self.mm(x, self.w)


def test_weight_stored_once_per_distinct_block():
    """A weight whose replicas are stored once (one block per row split) is updated on
    its optimizer slices like any other: equal to the single device."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    y = rng.standard_normal((16, 256)).astype(np.float32)
    found = []
    for settings in ({}, {"enable_parallel_optimizer": True}):
        with devices(N if settings else None, **settings):
            net = _Wide()
            step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()),
                                       nn.Momentum(net.trainable_params(), 0.1, 0.9))
            with CommReport() as report:
                for _ in range(3):
                    step(Tensor(x), Tensor(y))
            found.append(net.w.asnumpy())
    np.testing.assert_allclose(found[1], found[0], rtol=1e-4, atol=1e-6)
    ag, = _records(report, "AllGather", "w")[:1]
    assert (ag.group_size, ag.num_groups, ag.reason) == (2, 4, "parallel_optimizer")


class _TwoReplicaAxes(nn.Cell):
    """On 12 devices as (a=2, b=3, c=2): x split by a, w (24 x 8) split by c, so w is
    replicated over a and b (6 replicas; b the inner replica axis)."""

    def __init__(self):
        super().__init__()
        w = np.random.default_rng(8).standard_normal((24, 8)) * 0.1
        self.w = Parameter(Tensor(w.astype(np.float32)), name="w")
        layout = dm.parallel.Layout((2, 3, 2), ("a", "b", "c"))
        self.mm = ops.MatMul().shard(in_strategy=(layout("a", "None"), layout("None", "c")))

    def construct(self, x):
        return self.mm(x, self.w)


def _two_replica_axes(**settings):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((12, 24)).astype(np.float32)
    y = rng.standard_normal((12, 8)).astype(np.float32)
    with devices(12 if settings else None, **settings):
        net = _TwoReplicaAxes()
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()),
                                   nn.Momentum(net.trainable_params(), 0.1, 0.9))
        with CommReport() as report:
            for _ in range(2):
                step(Tensor(x), Tensor(y))
    return net.w.asnumpy(), [(r.kind, r.group_size, r.num_groups)
                             for r in report.records if r.op == "w"][:2]


@pytest.mark.parametrize("size, records", [
    # the gradient is pending over a only (b's replicas computed the same values): one
    # ReduceScatter over a, the slice over b cut locally; gathered over all 6
    (-1, [("ReduceScatter", 2, 6), ("AllGather", 6, 2)]),
    (6, [("ReduceScatter", 2, 6), ("AllGather", 6, 2)]),
    # groups of 3 along b: the gradient AllReduced over a (the groups' other replicas)
    (3, [("AllReduce", 2, 6), ("AllGather", 3, 4)]),
])
def test_two_replica_axes(size, records):
    want, _ = _two_replica_axes()
    got, found = _two_replica_axes(enable_parallel_optimizer=True, parallel_optimizer_config={
        "parallel_optimizer_threshold": 0, "optimizer_weight_shard_size": size})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert found == records


def test_shard_size_across_replica_axes_is_refused():
    """Groups of 2 consecutive replicas would straddle the b axis (3 devices): refused
    naming the key and the parameter."""
    with pytest.raises(ValueError, match=re.escape(
            "parallel_optimizer_config['optimizer_weight_shard_size']=2 cannot be cut from "
            "the replica axes (2, 3) of parameter 'w'")):
        _two_replica_axes(enable_parallel_optimizer=True, parallel_optimizer_config={
            "parallel_optimizer_threshold": 0, "optimizer_weight_shard_size": 2})


@pytest.mark.parametrize("mode", ["data_parallel", "semi_auto_parallel"])
def test_turned_off_between_steps_keeps_the_states(mode):
    """One Adam step with the parallel optimizer, then two without it (or with a
    threshold above every weight): the moments come back whole (or in their weights'
    layouts) with their values, and the three steps equal the single device's."""
    want = _single("adam")[1]
    for later in ({"enable_parallel_optimizer": False},
                  {"parallel_optimizer_config": {"parallel_optimizer_threshold": 1024}}):
        with devices(N, mode, gradients_mean=True, enable_parallel_optimizer=True,
                     parallel_optimizer_config=SMALL):
            net = Net(mode != "data_parallel")
            opt = OPTIMIZERS["adam"](net.trainable_params(), 1.0)
            step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(
                sparse=True, reduction="mean")), opt)
            step(Tensor(X), Tensor(Y))
            assert optimizer_memory(opt).states < 2 * sum(w.nbytes for w in W.values()) // 2
            dm.set_auto_parallel_context(**later)
            for _ in range(STEPS - 1):
                step(Tensor(X), Tensor(Y))
            assert set(optimizer_memory(opt).shards.values()) == {1}
            layouts = [(m.layout, p.layout) for m, p in zip(opt.moment1, opt.parameters)]
            got = {p.name: p.asnumpy() for p in net.trainable_params()}
        assert all(m == p for m, p in layouts)
        _assert_same(got, want)


# ---- memory ----------------------------------------------------------------------------

def test_memory_of_states_and_updated_slices_drops_by_the_shard_count():
    """Adam on 8 data-parallel devices: each device stores 1/8 of each sharded weight's
    two moments (the stacks hold (8, rows / 8, cols): one slice per device) and updates
    1/8 of the weight; the bias (not sharded) keeps whole ones."""
    sizes = {k: v.nbytes for k, v in W.items()}
    with devices(N, "data_parallel"):
        _, _, opt, _ = _train("adam", strategies=False, steps=1)
        plain = optimizer_memory(opt)
    with devices(N, "data_parallel", enable_parallel_optimizer=True,
                 parallel_optimizer_config=SMALL):
        _, _, opt, report = _train("adam", strategies=False, steps=1)
        sharded = optimizer_memory(opt)
        shapes = {p.name: (m.asnumpy().shape, m._data.shape, dm.parallel.local_shape(m))
                  for p, m in zip(opt.parameters, opt.moment1)}
    assert plain.states == 2 * sum(sizes.values())
    assert plain.weights == sum(sizes.values())
    assert sharded.states == 2 * (sum(sizes[k] for k in ("w1", "w2", "w3")) // N + sizes["b"])
    assert sharded.weights == sum(sizes[k] for k in ("w1", "w2", "w3")) // N + sizes["b"]
    assert shapes["w1"] == ((32, 64), (N, 4, 64), (4, 64))
    assert shapes["w3"] == ((64, 16), (N, 8, 16), (8, 16))
    assert shapes["b"][2] == (16,)


# ---- checkpoints -------------------------------------------------------------------------

def test_checkpoint_saves_whole_weights_and_states(tmp_path):
    """save_checkpoint of a network and its optimizer trained with the parallel
    optimizer writes the whole weights and the whole moments: equal to the stand-alone
    run's, and loadable into a stand-alone network."""
    with devices(None):
        net0 = Net()
        opt0 = OPTIMIZERS["adam"](net0.trainable_params(), 1.0)
        step0 = nn.TrainOneStepCell(nn.WithLossCell(net0, nn.SoftmaxCrossEntropyWithLogits(
            sparse=True, reduction="mean")), opt0)
        for _ in range(2):
            step0(Tensor(X), Tensor(Y))
        want = {p.name: p.asnumpy() for p in opt0.moment1 + opt0.moment2}
        want.update({p.name: p.asnumpy() for p in net0.trainable_params()})
    path = str(tmp_path / "po.ckpt")
    with devices(N, enable_parallel_optimizer=True, parallel_optimizer_config=SMALL):
        net = Net()
        opt = OPTIMIZERS["adam"](net.trainable_params(), 1.0)
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(
            sparse=True, reduction="mean")), opt)
        for _ in range(2):
            step(Tensor(X), Tensor(Y))
        assert optimizer_memory(opt).shards["w3"] == 8
        dm.save_checkpoint(step, path)
    saved = dm.load_checkpoint(path)
    for name, value in want.items():
        np.testing.assert_allclose(saved[name].asnumpy(), value, rtol=1e-4, atol=1e-6,
                                   err_msg=name)
    with devices(None):
        fresh = Net()
        dm.load_param_into_net(fresh, saved)
        for p in fresh.trainable_params():
            np.testing.assert_allclose(p.asnumpy(), want[p.name], rtol=1e-4, atol=1e-6)


def _adam_step():
    net = Net()
    opt = OPTIMIZERS["adam"](net.trainable_params(), 1.0)
    return net, opt, nn.TrainOneStepCell(nn.WithLossCell(
        net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")), opt)


def test_resume_from_a_checkpoint_and_sliced_saves(tmp_path):
    """Two steps, save, load into a fresh network and optimizer (states split again at
    their first update), one more step: the three uninterrupted steps of one device.
    A sliced save (each device's blocks, states as optimizer slices) merges into the
    integrated save's values."""
    with devices(None):
        _, _, step0 = _adam_step()
        for _ in range(3):
            step0(Tensor(X), Tensor(Y))
        want = {p.name: p.asnumpy() for p in step0.trainable_params()}
    (tmp_path / "ck").mkdir()
    with devices(N, enable_parallel_optimizer=True, parallel_optimizer_config=SMALL):
        net, opt, step = _adam_step()
        for _ in range(2):
            step(Tensor(X), Tensor(Y))
        dm.save_checkpoint([net, opt], str(tmp_path / "whole.safetensors"))
        dm.save_checkpoint([net, opt], str(tmp_path / "ck" / "s.safetensors"),
                           integrated_save=False)
        net2, opt2, step2 = _adam_step()
        saved = dm.load_checkpoint(str(tmp_path / "whole.safetensors"))
        dm.load_param_into_net(net2, saved)
        dm.load_param_into_net(opt2, saved)
        step2(Tensor(X), Tensor(Y))
        got = {p.name: p.asnumpy() for p in net2.trainable_params()}
        assert optimizer_memory(opt2).shards["w3"] == 8
        dm.merge_sliced_checkpoints(
            [str(tmp_path / "ck" / f"rank_{r}" / "s.safetensors") for r in range(N)],
            str(tmp_path / "ck" / "strategy.json"), str(tmp_path / "merged.safetensors"))
    _assert_same(got, want)
    merged = dm.load_checkpoint(str(tmp_path / "merged.safetensors"))
    assert sorted(merged) == sorted(saved)
    for name in saved:
        np.testing.assert_array_equal(merged[name].asnumpy(), saved[name].asnumpy(),
                                      err_msg=name)


# ---- the keys and their errors --------------------------------------------------------------

def test_keys_read_back_and_merge():
    with devices(N, enable_parallel_optimizer=True,
                 parallel_optimizer_config={"parallel_optimizer_threshold": 8}):
        assert dm.get_auto_parallel_context("enable_parallel_optimizer") is True
        dm.set_auto_parallel_context(parallel_optimizer_config={
            "optimizer_weight_shard_size": 4, "gradient_accumulation_shard": False})
        assert dm.get_auto_parallel_context("parallel_optimizer_config") == {
            "parallel_optimizer_threshold": 8, "optimizer_weight_shard_size": 4,
            "gradient_accumulation_shard": False}
    assert dm.get_auto_parallel_context("enable_parallel_optimizer") is False
    assert dm.get_auto_parallel_context("parallel_optimizer_config") == {}


@pytest.mark.parametrize("config, error, message", [
    ({"optimizer_weight_shard_size": 3}, ValueError,
     "parallel_optimizer_config['optimizer_weight_shard_size']=3 does not divide the 8 "
     "devices (the data-parallel size of a replicated weight); valid values: "
     "[-1, 2, 4, 8]"),
    ({"optimizer_weight_shard_size": 1}, ValueError,
     "parallel_optimizer_config['optimizer_weight_shard_size']=1 is not valid"),
    ({"optimizer_weight_shard_size": 2.0}, TypeError,
     "parallel_optimizer_config['optimizer_weight_shard_size']=2.0 has type float"),
    ({"parallel_optimizer_threshold": -1}, ValueError,
     "parallel_optimizer_config['parallel_optimizer_threshold']=-1 is not valid"),
    ({"parallel_optimizer_threshold": "64"}, TypeError,
     "parallel_optimizer_config['parallel_optimizer_threshold']='64' has type str"),
    ({"gradient_accumulation_shard": True}, ValueError,
     "parallel_optimizer_config['gradient_accumulation_shard']=True is not supported"),
    ({"optimizer_level": "level2"}, ValueError,
     "parallel_optimizer_config has unknown key 'optimizer_level'; valid keys are "
     "parallel_optimizer_threshold, optimizer_weight_shard_size, "
     "gradient_accumulation_shard"),
    ([("optimizer_weight_shard_size", 2)], TypeError, "parallel_optimizer_config=["),
])
def test_bad_config_is_refused_by_name_and_changes_nothing(config, error, message):
    with devices(N, enable_parallel_optimizer=True,
                 parallel_optimizer_config={"parallel_optimizer_threshold": 8}):
        with pytest.raises(error, match=re.escape(message)):
            dm.set_auto_parallel_context(enable_parallel_optimizer=False,
                                         parallel_optimizer_config=config)
        assert dm.get_auto_parallel_context("enable_parallel_optimizer") is True
        assert dm.get_auto_parallel_context("parallel_optimizer_config") == {
            "parallel_optimizer_threshold": 8}


def test_top_level_shard_size_is_the_same_setting():
    """MindSpore's older top-level optimizer_weight_shard_size sets the same value;
    contradicting values in one call are refused."""
    with devices(N):
        dm.set_auto_parallel_context(optimizer_weight_shard_size=4)
        assert dm.get_auto_parallel_context("parallel_optimizer_config") == {
            "optimizer_weight_shard_size": 4}
        assert dm.get_auto_parallel_context("optimizer_weight_shard_size") == 4
        with pytest.raises(ValueError, match=re.escape(
                "optimizer_weight_shard_size=2 contradicts parallel_optimizer_config"
                "['optimizer_weight_shard_size']=8")):
            dm.set_auto_parallel_context(optimizer_weight_shard_size=2,
                                         parallel_optimizer_config={
                                             "optimizer_weight_shard_size": 8})
        with pytest.raises(ValueError, match=re.escape(
                "set_auto_parallel_context: optimizer_weight_shard_size=0 is not valid")):
            dm.set_auto_parallel_context(optimizer_weight_shard_size=0)
        with pytest.raises(ValueError, match=re.escape("=3 does not divide the 8 devices")):
            dm.set_auto_parallel_context(optimizer_weight_shard_size=3)
        assert dm.get_auto_parallel_context("optimizer_weight_shard_size") == 4


def test_device_num_that_the_shard_size_does_not_divide_is_refused():
    with devices(N, parallel_optimizer_config={"optimizer_weight_shard_size": 4}):
        with pytest.raises(ValueError, match=re.escape(
                "optimizer_weight_shard_size']=4 does not divide the 6 devices")):
            dm.set_auto_parallel_context(device_num=6)
        assert dm.get_auto_parallel_context("device_num") == N


def test_hybrid_parallel_is_refused():
    with devices(N, "hybrid_parallel"):
        with pytest.raises(ValueError, match=re.escape(
                "enable_parallel_optimizer=True is not supported with "
                "parallel_mode='hybrid_parallel'")):
            dm.set_auto_parallel_context(enable_parallel_optimizer=True)
        assert dm.get_auto_parallel_context("enable_parallel_optimizer") is False


@pytest.mark.parametrize("graph", [False, True])
def test_shard_size_not_dividing_a_weights_replicas_is_refused_before_any_change(graph):
    """Shard size 4 while w1 and w2 have 2 replicas each (semi_auto_parallel): the
    update (or the compile) raises naming the key, the parameter and the valid values;
    no weight, state or step counter changed."""
    with devices(N, enable_parallel_optimizer=True,
                 parallel_optimizer_config=dict(SMALL, optimizer_weight_shard_size=4)):
        if graph:
            dm.set_context(mode=dm.GRAPH_MODE)
        net = Net()
        opt = OPTIMIZERS["momentum"](net.trainable_params(), 1.0)
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(
            sparse=True, reduction="mean")), opt)
        with pytest.raises(ValueError, match=re.escape(
                "parallel_optimizer_config['optimizer_weight_shard_size']=4 does not "
                "divide the 2 data-parallel replicas of parameter 'w1'")) as info:
            step(Tensor(X), Tensor(Y))
        assert "valid values for it: [-1, 2]" in str(info.value)
        assert opt.global_step == 0
        for p in net.trainable_params():
            np.testing.assert_array_equal(p.asnumpy(), W[p.name])
        for m in opt.moments:
            assert not m.asnumpy().any()


def test_not_applied_in_stand_alone():
    """One device: nothing to shard; the run is the plain one."""
    with devices(None):
        dm.set_auto_parallel_context(enable_parallel_optimizer=True)
        _, got, opt, report = _train("sgd")
        assert set(optimizer_memory(opt).shards.values()) == {1}
    _assert_same(got, _single("sgd")[1])
    assert report.count() == 0
