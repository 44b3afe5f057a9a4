"""The parallel optimizer stores a split weight as its slices between steps: after an
update a device holds 1/n of the weight's block (``optimizer_shard.stored_slices``), and
the whole block is AllGathered where the weight is next read (once per
``comm_fusion["allgather"]`` bucket); the next update reads the slices as stored.

The oracle is the same program on one device: SGD, Momentum and Adam with weight decay,
semi_auto_parallel and data_parallel, PyNative, GRAPH_MODE and Model.train, a pipeline;
then what each read communicates (CommReport), the bytes stored (computed by hand from
the shapes), checkpoints, set_data, check_equivalence, copies, and the dry run's
figures against a real run's."""
import copy
import gc
import pickle

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.nn.utils import no_init_parameters
from dualmode.parallel import CommReport, local_shape, optimizer_memory
from dualmode.parallel.graph.api import AutoParallel
from dualmode.parallel.optimizer_shard import GatherOnRead, stored_slices
from dualmode.parallel.replicas import ReplicaBlocks
from dualmode.parallel.report import parameter_bytes_per_device
from dualmode.train import Model

from _devices import devices

N = 8
RNG = np.random.default_rng(41)
X = RNG.standard_normal((16, 32)).astype(np.float32)
Y = RNG.integers(0, 16, 16).astype(np.int32)
W = {"w1": (RNG.standard_normal((32, 64)) * 0.2).astype(np.float32),
     "w2": (RNG.standard_normal((64, 16)) * 0.2).astype(np.float32),
     "b": (RNG.standard_normal(16) * 0.1).astype(np.float32)}
# 1 KB: w1 (8 KB) and w2 (4 KB) are split, the bias (64 B) is not
SMALL = {"parallel_optimizer_threshold": 1}
FUSION = {"allgather": {"mode": "auto", "config": None},
          "reducescatter": {"mode": "auto", "config": None}}
# semi_auto: w1 split by columns over 4 devices, its blocks repeated on 2 (2 slices);
# w2 repeated on all 8 (8 slices). data_parallel: both repeated on all 8.
SLICES = {"semi_auto_parallel": {"w1": 2, "w2": 8}, "data_parallel": {"w1": 8, "w2": 8}}


class Net(nn.Cell):
    def __init__(self, strategies=True):
        super().__init__()
        for name, value in W.items():
            setattr(self, name, Parameter(Tensor(value.copy()), name=name))
        self.mm1 = ops.MatMul().shard(((2, 1), (1, 4))) if strategies else ops.MatMul()
        self.mm2 = ops.MatMul()
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.mm2(self.relu(self.mm1(x, self.w1)), self.w2) + self.b


OPTIMIZERS = {
    "sgd": lambda p: nn.SGD(p, 0.1, weight_decay=0.01),
    "momentum": lambda p: nn.Momentum(p, 0.1, 0.9, weight_decay=0.01),
    "adam": lambda p: nn.Adam(p, 0.01, weight_decay=0.01),
}


def _loss():
    return nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


def _build(opt_name="adam", strategies=True):
    net = Net(strategies)
    opt = OPTIMIZERS[opt_name](net.trainable_params())
    return net, opt, nn.TrainOneStepCell(nn.WithLossCell(net, _loss()), opt)


def _weights(net):
    return {p.name: p.asnumpy() for p in net.trainable_params()}


_SINGLE = {}


def _single(opt_name, steps):
    """(losses, weights after each step) of the same program on one device."""
    key = (opt_name, steps)
    if key not in _SINGLE:
        with devices(None):
            net, _, step = _build(opt_name)
            losses, weights = [], []
            for _ in range(steps):
                losses.append(float(step(Tensor(X), Tensor(Y)).asnumpy()))
                weights.append(_weights(net))
        _SINGLE[key] = losses, weights
    return _SINGLE[key]


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)


def _gathers(report, op=None):
    return report.count("AllGather", reason="parallel_optimizer", op=op)


def _parallel(mode="semi_auto_parallel", **extra):
    """N devices with the parallel optimizer (data_parallel: each device's batch slice
    gives the mean loss of the batch, the gradients averaged as on one device)."""
    return devices(N, mode, gradients_mean=True, enable_parallel_optimizer=True,
                   parallel_optimizer_config=SMALL, **extra)


def _block_bytes(p):
    return int(np.prod(local_shape(p))) * np.dtype(p.dtype).itemsize


# ---- what a device stores between steps -----------------------------------------------

def _held(p):
    """What the Parameter holds between steps: its deferred value, or, for a weight the
    gather will write as a grid of its distinct blocks (those of 64 KiB or more on
    simulated devices), the deferred gather behind that grid."""
    lazy = p._lazy
    return lazy.source if type(lazy) is ReplicaBlocks and lazy.source is not None else lazy


@pytest.mark.parametrize("mode", ["semi_auto_parallel", "data_parallel"])
def test_between_steps_a_split_weight_is_stored_as_its_slices(mode):
    """After a step each split weight holds its optimizer slices only: per device 1/n of
    the block the forward pass reads (n = its copies), nothing gathered; the bias
    (below the threshold) holds its value. Parameter storage, optimizer_memory and the
    layouts say so, and none of these reads communicates."""
    with _parallel(mode):
        net, opt, step = _build(strategies=mode != "data_parallel")
        step(Tensor(X), Tensor(Y))
        with CommReport() as report:
            stored = {}
            for p in (net.w1, net.w2):
                n = SLICES[mode][p.name]
                block = _block_bytes(p)
                layout, stack = stored_slices(p)
                assert p._arr is None and isinstance(_held(p), GatherOnRead)
                assert layout.local_shape[0] * n == local_shape(p)[0]
                assert layout.local_shape[1:] == local_shape(p)[1:]
                assert stack.shape == (N,) + tuple(layout.local_shape)      # every device
                assert stack.nbytes // N * n == block                       # 1/n each
                stored[p.name] = block // n
            assert stored_slices(net.b) is None
            mem = optimizer_memory(opt)
            want = stored["w1"] + stored["w2"] + W["b"].nbytes
            assert parameter_bytes_per_device([net.w1, net.w2, net.b]) == want
            assert mem.weights == want and mem.gathered == 0
            assert mem.shards == dict(SLICES[mode], b=1)
        assert report.count() == 0
        assert report.parameter_memory >= want       # every live Parameter, the states too


def test_reading_shape_dtype_name_or_layout_gathers_nothing():
    """Readers of a split weight's metadata (shape, dtype, name, layout, local shape, its
    repr, the memory figures) leave it stored as its slices and communicate nothing."""
    with _parallel():
        net, opt, step = _build()
        step(Tensor(X), Tensor(Y))
        w = net.w1
        with CommReport() as report:
            assert tuple(w.shape) == (32, 64) and w.ndim == 2 and w.size == 32 * 64
            assert w.dtype == np.float32 and w.name == "w1"
            assert w.layout is not None and local_shape(w) == (32, 16)
            assert "w1" in repr(w) and w.requires_grad and not w.has_init
            optimizer_memory(opt)
            parameter_bytes_per_device()
        assert report.count() == 0
        assert stored_slices(w) is not None and stored_slices(net.w2) is not None


def test_a_read_gathers_its_weight_once():
    """Without fusion each weight gathers alone, at its first read only: asnumpy of w1
    gathers w1 (over w1's 4 groups of 2 copies), not w2; a second read gathers nothing;
    printing w2 gathers w2. The values are the single device's."""
    want = _single("adam", 1)[1][0]
    with _parallel():
        net, _, step = _build()
        step(Tensor(X), Tensor(Y))
        with CommReport() as report:
            w1 = net.w1.asnumpy()
        ag, = [r for r in report.records if r.reason == "parallel_optimizer"]
        assert (ag.kind, ag.op, ag.group_size, ag.num_groups) == ("AllGather", "w1", 2, 4)
        assert report.count() == 1
        assert stored_slices(net.w1) is None and stored_slices(net.w2) is not None
        with CommReport() as report:
            again = net.w1.asnumpy()
            text = str(net.w2)
        assert _gathers(report) == _gathers(report, "w2") == 1
        np.testing.assert_array_equal(again, w1)
        w2 = net.w2.asnumpy()
        assert text == str(w2)
    _assert_same({"w1": w1, "w2": w2, "b": net.b.asnumpy()}, want)


@pytest.mark.parametrize("mode", ["data_parallel", "semi_auto_parallel"])
def test_the_first_read_of_a_bucket_gathers_the_bucket(mode):
    """With comm_fusion "allgather": the first read of either weight gathers both in one
    fused AllGather when they share a device group (data_parallel: all 8), w1 and w2
    each alone when they do not (semi_auto: w1's groups of 2, w2's group of 8); the
    second weight's read then communicates nothing. Values equal the single device."""
    want = _single("adam", 1)[1][0]
    with _parallel(mode, comm_fusion=FUSION):
        net, _, step = _build(strategies=mode != "data_parallel")
        step(Tensor(X), Tensor(Y))
        with CommReport() as report:
            w2 = net.w2.asnumpy()
        with CommReport() as later:
            w1 = net.w1.asnumpy()
        got = {"w1": w1, "w2": w2, "b": net.b.asnumpy()}
    if mode == "data_parallel":
        ag, = report.records
        assert (ag.op, ag.group_size, ag.num_groups) == ("w1, w2", N, 1)
        assert ag.bytes_per_device == (N - 1) / N * (W["w1"].nbytes + W["w2"].nbytes)
        assert later.count() == 0
    else:
        assert [r.op for r in report.records] == ["w2"]
        assert [r.op for r in later.records] == ["w1"]
    _assert_same(got, want)


# ---- steps after steps ----------------------------------------------------------------

@pytest.mark.parametrize("entry", ["pynative", "graph", "model"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_later_steps_read_the_gathered_copy_and_update_the_slices(opt_name, entry):
    """Three steps: each step after the first gathers each split weight exactly once
    (its forward pass reads the gathered copy; GRAPH_MODE and Model.train alike), the
    update writes the stored slices in place (the same arrays step after step: no cut,
    no copy), and losses and weights equal the single device's."""
    want_losses, want = _single(opt_name, 3)
    with _parallel():
        if entry == "graph":
            dm.set_context(mode=dm.GRAPH_MODE)
        net, opt, step = _build(opt_name)
        reports, losses, stacks = [], [], []
        data = dm.dataset.NumpySlicesDataset({"x": X, "y": Y}, shuffle=False).batch(16)
        model = Model(net, _loss(), opt) if entry == "model" else None
        for k in range(3):
            with CommReport() as report:
                if model is not None:
                    model.train(1, data)
                else:
                    losses.append(float(step(Tensor(X), Tensor(Y)).asnumpy()))
            reports.append(report)
            stacks.append(stored_slices(net.w1)[1])
        dm.set_context(mode=dm.PYNATIVE_MODE)
        got = _weights(net)
    assert [_gathers(r) for r in reports] == [0, 2, 2]
    assert all(_gathers(r, "w1") == _gathers(r, "w2") == 1 for r in reports[1:])
    assert stacks[1] is stacks[0] and stacks[2] is stacks[0]
    if model is None:
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _assert_same(got, want[-1])


def test_data_parallel_steps_equal_the_single_device():
    """data_parallel (every weight repeated on all 8 devices, whole values): three
    Momentum steps, the second and third each gathering both weights once."""
    want_losses, want = _single("momentum", 3)
    with _parallel("data_parallel"):
        net, _, step = _build("momentum", strategies=False)
        step(Tensor(X), Tensor(Y))
        with CommReport() as report:
            losses = [float(step(Tensor(X), Tensor(Y)).asnumpy()) for _ in range(2)]
        got = _weights(net)
    assert _gathers(report) == 4
    np.testing.assert_allclose(losses, want_losses[1:], rtol=1e-5)
    _assert_same(got, want[-1])


D = 16


class _Block(nn.Cell):
    def __init__(self, seed):
        super().__init__()
        w = np.random.default_rng(seed).standard_normal((D, D)) * 0.4
        self.w = Parameter(Tensor(w.astype(np.float32)), name="w")
        self.b = Parameter(Tensor(np.full((D,), 0.1, np.float32)), name="b")
        self.mm = ops.MatMul()

    def construct(self, x):
        return ops.relu(self.mm(x, self.w) + self.b)


def _pipeline(parallel, micro=4, steps=3):
    """Adam over PipelineCell(two blocks, one per stage, `micro` micro-batches):
    (losses, weights, the reports of each step)."""
    settings = dict(pipeline_stages=2, enable_parallel_optimizer=True,
                    parallel_optimizer_config={"parallel_optimizer_threshold": 0}) \
        if parallel else {}
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, D)).astype(np.float32)
    y = rng.standard_normal((16, D)).astype(np.float32)
    with devices(N if parallel else None, **settings):
        net = nn.SequentialCell([_Block(1), _Block(2)])
        for k, cell in enumerate(net):
            cell.pipeline_stage = k
        model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), micro)
        opt = nn.Adam(net.trainable_params(), learning_rate=0.01, weight_decay=0.01)
        grad_fn = dm.value_and_grad(model, None, opt.parameters)
        losses, reports = [], []
        for _ in range(steps):
            with CommReport() as report:
                loss, grads = grad_fn(Tensor(x), Tensor(y))
                opt(grads)
            losses.append(float(loss.asnumpy()))
            reports.append(report)
        return losses, [p.asnumpy() for p in net.trainable_params()], reports


def test_a_pipeline_gathers_once_a_step_not_per_micro_batch():
    """Two pipeline stages, 4 micro-batches, every weight split over its stage's 4
    copies: each step after the first gathers each of the 4 weights once, though every
    micro-batch reads them; numbers equal the single device."""
    want_losses, want, _ = _pipeline(False)
    losses, got, reports = _pipeline(True)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    assert [_gathers(r) for r in reports] == [0, 4, 4]
    for r in reports[1:]:
        assert {rec.group_size for rec in r.records if rec.reason == "parallel_optimizer"} \
            == {4}


# ---- values replaced, saved, copied ------------------------------------------------------

def test_checkpoint_round_trip(tmp_path):
    """Two steps; save_checkpoint (it reads the weights: gathers each once) writes the
    single device's weights and moments; loaded back into the same network and
    optimizer (replacing the stored slices), one more step equals the single device's
    three steps; the states are split again and the weights stored as slices again."""
    _, want = _single("adam", 3)
    path = str(tmp_path / "po.ckpt")
    with _parallel():
        net, opt, step = _build()
        for _ in range(2):
            step(Tensor(X), Tensor(Y))
        with CommReport() as report:
            dm.save_checkpoint([net, opt], path)
        assert _gathers(report) == 2
        saved = dm.load_checkpoint(path)
        _assert_same({k: saved[k].asnumpy() for k in W}, want[1])
        # a different value first, so that the load must replace it
        net.w1.set_data(np.zeros_like(W["w1"]))
        dm.load_param_into_net(net, saved)
        dm.load_param_into_net(opt, saved)
        assert stored_slices(net.w1) is None and stored_slices(net.w2) is None
        step(Tensor(X), Tensor(Y))
        assert stored_slices(net.w1) is not None
        got = _weights(net)
    _assert_same(got, want[2])
    assert not list(tmp_path.glob("*.tmp"))


def test_set_data_between_steps_replaces_the_slices():
    """set_data on a weight stored as its slices: the next update cuts its slices from
    the new value (equal to the single device given the same value)."""
    value = (np.random.default_rng(9).standard_normal((32, 64)) * 0.1).astype(np.float32)
    found = []
    for n in (None, N):
        ctx = _parallel() if n else devices(None)
        with ctx:
            net, _, step = _build("momentum")
            step(Tensor(X), Tensor(Y))
            net.w1.set_data(value)
            step(Tensor(X), Tensor(Y))
            step(Tensor(X), Tensor(Y))
            found.append(_weights(net))
    _assert_same(found[1], found[0])


def test_check_equivalence_copies_and_pickles_read_the_gathered_value():
    """check_equivalence, copy.deepcopy and pickle of a network whose weights are
    stored as slices see the weights' values; training goes on equal to the single
    device."""
    want_losses, want = _single("sgd", 2)
    with _parallel():
        net, _, step = _build("sgd")
        step(Tensor(X), Tensor(Y))
        twin = copy.deepcopy(net.w2)
        loaded = pickle.loads(pickle.dumps(net.w1))
        _assert_same({"w1": loaded.asnumpy(), "w2": twin.asnumpy()},
                     {"w1": want[0]["w1"], "w2": want[0]["w2"]})
        rep = dm.parallel.check_equivalence(nn.WithLossCell(net, _loss()), Tensor(X),
                                            Tensor(Y))
        assert rep.ok, rep
        loss = float(step(Tensor(X), Tensor(Y)).asnumpy())
        got = _weights(net)
    np.testing.assert_allclose(loss, want_losses[1], rtol=1e-5)
    _assert_same(got, want[1])


def test_turned_off_after_a_step_gives_the_weight_its_value_back():
    """The parallel optimizer turned off after a step: the next update (not split)
    gathers each weight stored as slices into a value of its own and updates it as
    usual; equal to the single device."""
    _, want = _single("momentum", 2)
    with _parallel():
        net, _, step = _build("momentum")
        step(Tensor(X), Tensor(Y))
        dm.set_auto_parallel_context(enable_parallel_optimizer=False)
        step(Tensor(X), Tensor(Y))
        assert stored_slices(net.w1) is None and not isinstance(_held(net.w1), GatherOnRead)
        got = _weights(net)
    _assert_same(got, want[1])


# ---- the dry run -----------------------------------------------------------------------

def test_dry_run_between_steps_and_during_a_step():
    """The dry run of a compiled step: ``stored_parameter_bytes`` (split weights as
    their slices) equals what a real run stores between steps, ``parameter_bytes`` (the
    blocks the step reads, the gathered copies) what it holds during a step; its
    records equal the real step's, in order (the gathers where the weights are first
    read)."""
    settings = dict(enable_parallel_optimizer=True, parallel_optimizer_config=SMALL)
    with devices(N, **settings):
        with no_init_parameters():
            net = Net()
            opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
        grad_fn = dm.value_and_grad(lambda a, b: _loss()(net(a), b), None, opt.parameters)

        def train_step(a, b):
            loss, grads = grad_fn(a, b)
            opt(grads)
            return loss

        compiled = AutoParallel(train_step, "semi_auto")
        dry = dm.parallel.dry_run(compiled, dm.parallel.abstract(X.shape, dm.float32),
                                  dm.parallel.abstract(Y.shape, dm.int32), device_num=N)
        compiled(Tensor(X), Tensor(Y))
        gc.collect()
        with CommReport() as real:
            compiled(Tensor(X), Tensor(Y))
        params = [net.w1, net.w2, net.b]
        between = parameter_bytes_per_device(params)
        assert stored_slices(net.w1) is not None
        blocks = sum(_block_bytes(p) for p in params)
    assert dry.records == real.records
    assert dry.count("AllGather", reason="parallel_optimizer") == 2
    assert dry.stored_parameter_bytes == between == 32 * 16 * 4 // 2 + 64 * 16 * 4 // 8 + 64
    assert dry.parameter_bytes == blocks == 32 * 16 * 4 + 64 * 16 * 4 + 64
    assert "between steps" in dry.summary()


def test_a_copied_network_and_optimizer_train_as_the_original():
    """copy.deepcopy of the training step (network and optimizer) while the weights
    are stored as slices: the copy's next update cuts its slices from its own weights;
    both go on equal to the single device."""
    _, want = _single("adam", 2)
    with _parallel():
        net, _, step = _build("adam")
        step(Tensor(X), Tensor(Y))
        twin = copy.deepcopy(step)
        twin(Tensor(X), Tensor(Y))
        step(Tensor(X), Tensor(Y))
        _assert_same(_weights(net), want[1])
        _assert_same({p.name: p.asnumpy() for p in twin.trainable_params()}, want[1])


# ---- real ranks ---------------------------------------------------------------------------

@pytest.mark.parametrize("ranks", [2, 4])
def test_real_ranks_store_their_own_slices(tmp_path, ranks):
    """data_parallel on 2 and 4 MPI ranks: between steps each rank stores one slice of
    each weight (1/ranks of its rows: the stack of its one device), reading the weights
    on every rank in the same order gathers each once, and the losses and weights equal
    the simulated devices' and the stand-alone run's."""
    from _mpi import load_mpi_script, run_mpi_script
    run_mpi_script("parallel_optimizer_slices.py", [tmp_path], tmp_path, ranks=ranks,
                   timeout=600)
    script = load_mpi_script("parallel_optimizer_slices.py")
    try:
        sim = script.train(ranks, "sim")
        single = script.train()
    finally:
        dm.reset_auto_parallel_context()
        dm.communication.init()
    for r in range(ranks):
        got = np.load(tmp_path / f"rank_{r}.npz")
        for name, value in script.W.items():
            rows, cols = value.shape
            assert tuple(got[f"{name}-slices"]) == (1, rows // ranks, cols), (r, name)
            assert tuple(got[f"{name}-slice-layout"]) == (rows // ranks, cols)
            assert tuple(sim[f"{name}-slices"]) == (ranks, rows // ranks, cols)
            np.testing.assert_allclose(got[name], sim[name], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got[name], single[name], rtol=1e-4, atol=1e-6)
        assert int(got["stored"]) == sum(v.nbytes for v in script.W.values()) // ranks
        assert int(got["gathers"]) == int(sim["gathers"]) == 2
        np.testing.assert_allclose(got["losses"], single["losses"], rtol=1e-5)
