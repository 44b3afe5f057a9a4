"""In semi_auto_parallel and auto_parallel the program is written for the global batch:
the gradients are those of the global loss and the update equals the single device's
whatever ``gradients_mean`` says (a weight replicated on k devices is never moved k
times). ``gradients_mean`` chooses the mean or the sum of the devices' gradients only
where each device has a loss of its own (data_parallel, hybrid_parallel).

Every entry point of a train step — value_and_grad + ``opt(grads)``, TrainOneStepCell,
Model.train (PyNative and GRAPH_MODE), ``ops.shard`` and ``AutoParallel`` — on the
operator-parallel tutorial network (MatMul ((2, 4), (4, 1)), ReLU ((4, 1),), MatMul
((1, 8), (8, 1)), ReLU ((8, 1),), then a plain MatMul with a replicated weight) and on a
Conv2D whose input is cut along W over 8 devices (its weight replicated), against the
same program on one device (itself checked against numpy); and the rule on real MPI
ranks."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel.auto_parallel import AutoParallel
from dualmode.parallel.grad_reduce import replica_gradient_scale
from dualmode.train import Model

from _devices import devices
from _mpi import load_mpi_script, run_mpi_script

RNG = np.random.default_rng(28)
N = 8
LR = 0.1
STEPS = 2

# the tutorial network, small: 16 rows of 32 features, 10 classes
SEED_X = RNG.standard_normal((16, 32)).astype(np.float32)
SEED_Y = RNG.integers(0, 10, 16).astype(np.int32)
SEED_W = [(RNG.standard_normal(s) * 0.3).astype(np.float32)
          for s in [(32, 64), (64, 64), (64, 10)]]

# the convolution: NCHW input, W (16) cut over the 8 devices, the weight replicated
CONV_X = RNG.standard_normal((8, 3, 8, 16)).astype(np.float32)
CONV_Y = RNG.standard_normal((8, 8, 8, 16)).astype(np.float32)
CONV_W = (RNG.standard_normal((8, 3, 2, 2)) * 0.3).astype(np.float32)


class SeedNet(nn.Cell):
    """The operator-parallel tutorial network: two sharded MatMul-ReLU blocks, then a
    plain MatMul whose weight is replicated on every device."""

    def __init__(self):
        super().__init__()
        self.fc1_weight = Parameter(Tensor(SEED_W[0].copy()), name="fc1_weight")
        self.fc2_weight = Parameter(Tensor(SEED_W[1].copy()), name="fc2_weight")
        self.fc3_weight = Parameter(Tensor(SEED_W[2].copy()), name="fc3_weight")
        self.matmul1 = ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu1 = ops.ReLU().shard(((4, 1),))
        self.matmul2 = ops.MatMul().shard(((1, 8), (8, 1)))
        self.relu2 = ops.ReLU().shard(((8, 1),))
        self.matmul3 = ops.MatMul()

    def construct(self, x):
        x = self.relu1(self.matmul1(x, self.fc1_weight))
        x = self.relu2(self.matmul2(x, self.fc2_weight))
        return self.matmul3(x, self.fc3_weight)


class ConvNet(nn.Cell):
    """One Conv2D(8, 2, pad_mode="same") with its input cut along W over 8 devices."""

    def __init__(self):
        super().__init__()
        self.weight = Parameter(Tensor(CONV_W.copy()), name="weight")
        self.conv = ops.Conv2D(8, 2, pad_mode="same").shard(((1, 1, 1, 8), (1, 1, 1, 1)))

    def construct(self, x):
        return self.conv(x, self.weight)


CASES = {
    "seed": (SeedNet, lambda: nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
             SEED_X, SEED_Y),
    "conv": (ConvNet, nn.MSELoss, CONV_X, CONV_Y),
}


def _train(case, entry, lr=LR, steps=STEPS):
    """`steps` SGD steps of `case` through `entry` in the current context; the weights."""
    make_net, make_loss, x, y = CASES[case]
    net, loss_fn = make_net(), make_loss()
    opt = nn.SGD(net.trainable_params(), learning_rate=lr)

    def forward(a, b):
        return loss_fn(net(a), b)

    grad_fn = dm.value_and_grad(forward, None, opt.parameters)

    def train_step(a, b):
        loss, grads = grad_fn(a, b)
        opt(grads)
        return loss

    if entry == "model_train":
        data = dm.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False) \
            .batch(len(x))
        Model(net, loss_fn, opt).train(steps, data)
    else:
        if entry in ("opt_grads", "graph_mode_opt_grads"):
            run = train_step
        elif entry in ("train_one_step", "graph_mode_train_one_step"):
            run = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), opt)
        elif entry == "ops_shard":
            strategy = tuple((N,) + (1,) * (a.ndim - 1) for a in (x, y))
            run = ops.shard(train_step, in_strategy=strategy)
        else:
            assert entry == "auto_parallel", entry
            run = AutoParallel(train_step, parallel_mode="semi_auto")
        for _ in range(steps):
            run(Tensor(x), Tensor(y))
    return {p.name: p.asnumpy() for p in net.trainable_params()}


def _graph_mode(entry):
    return entry.startswith("graph_mode") or entry == "model_train_graph"


def _run(case, entry, n, mode="semi_auto_parallel", lr=LR, **settings):
    with devices(n, mode, **settings):
        if _graph_mode(entry):
            dm.set_context(mode=dm.GRAPH_MODE)
        return _train(case, "model_train" if entry == "model_train_graph" else entry, lr)


def _single(case, lr=LR):
    return _run(case, "opt_grads", None, lr=lr)


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


# ---- the single-device oracle itself, against numpy ---------------------------------

def _softmax_ce_grads(w1, w2, w3):
    x, y = SEED_X.astype(np.float64), SEED_Y
    h1 = x @ w1
    a1 = np.maximum(h1, 0)
    h2 = a1 @ w2
    a2 = np.maximum(h2, 0)
    z = a2 @ w3
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dz = p.copy()
    dz[np.arange(len(y)), y] -= 1
    dz /= len(y)
    g3 = a2.T @ dz
    da2 = dz @ w3.T * (h2 > 0)
    g2 = a1.T @ da2
    da1 = da2 @ w2.T * (h1 > 0)
    g1 = x.T @ da1
    return g1, g2, g3


def test_the_single_device_oracle_is_numpy_sgd():
    w = [a.astype(np.float64) for a in SEED_W]
    for _ in range(STEPS):
        w = [a - LR * g for a, g in zip(w, _softmax_ce_grads(*w))]
    got = _single("seed")
    for name, want in zip(["fc1_weight", "fc2_weight", "fc3_weight"], w):
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5, err_msg=name)


# ---- semi_auto_parallel / auto_parallel: the single device's update -----------------

ENTRIES = ["opt_grads", "train_one_step", "model_train", "graph_mode_train_one_step",
           "graph_mode_opt_grads", "model_train_graph", "ops_shard", "auto_parallel"]


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_semi_auto_update_equals_the_single_devices(case, entry, mean):
    want = _single(case)
    got = _run(case, entry, N, gradients_mean=mean)
    _assert_same(got, want)


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("entry", ["opt_grads", "train_one_step", "graph_mode_train_one_step"])
def test_auto_parallel_update_equals_the_single_devices(entry, mean):
    want = _single("seed")
    got = _run("seed", entry, N, "auto_parallel", gradients_mean=mean)
    _assert_same(got, want)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("mean", [False, True])
def test_a_replicated_conv_weight_moves_exactly_what_grad_gives(mean, graph):
    """SGD(lr=1), one TrainOneStepCell step: w_before - w_after is dm.grad's gradient
    (1.000x it, not 8x), with or without gradients_mean."""
    with devices(N, gradients_mean=mean):
        if graph:
            dm.set_context(mode=dm.GRAPH_MODE)
        net = ConvNet()
        loss_fn = nn.MSELoss()
        with_loss = nn.WithLossCell(net, loss_fn)
        grad = dm.grad(with_loss, None, net.trainable_params())(
            Tensor(CONV_X), Tensor(CONV_Y))[0].asnumpy()
        step = nn.TrainOneStepCell(with_loss, nn.SGD(net.trainable_params(), 1.0))
        step(Tensor(CONV_X), Tensor(CONV_Y))
        moved = CONV_W - net.weight.asnumpy()
    with devices(None):
        net = ConvNet()
        single = dm.grad(nn.WithLossCell(net, nn.MSELoss()), None, net.trainable_params())(
            Tensor(CONV_X), Tensor(CONV_Y))[0].asnumpy()
    np.testing.assert_allclose(grad, single, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(moved, grad, rtol=1e-5, atol=1e-6)


# ---- data_parallel / hybrid_parallel: each device's own loss, sum or mean ------------

DP_ENTRIES = ["opt_grads", "train_one_step", "model_train", "graph_mode_train_one_step"]


@pytest.mark.parametrize("mode", ["data_parallel", "hybrid_parallel"])
@pytest.mark.parametrize("entry", DP_ENTRIES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_per_device_losses_sum_or_average_the_gradients(case, entry, mode):
    """gradients_mean=True: the mean of the 8 devices' gradients, the single device's
    update; False: their sum, 8 times it (SGD: the single device at 8 times the
    learning rate)."""
    _assert_same(_run(case, entry, N, mode, gradients_mean=True), _single(case))
    _assert_same(_run(case, entry, N, mode, gradients_mean=False), _single(case, lr=N * LR))


def test_the_rule_names_the_modes():
    for mode in ("semi_auto_parallel", "auto_parallel", "stand_alone"):
        for mean in (False, True):
            assert replica_gradient_scale(8, mode, mean) is None
    for mode in ("data_parallel", "hybrid_parallel"):
        assert replica_gradient_scale(8, mode, True) is None
        assert replica_gradient_scale(8, mode, False) == 8
        assert replica_gradient_scale(1, mode, False) is None


# ---- the same rule on real MPI ranks ---------------------------------------------

def test_under_mpi_the_rule_is_the_same(tmp_path):
    """4 MPI ranks (one device each): semi_auto_parallel trains the replicated conv
    weight as one device with and without gradients_mean; data_parallel without it sums
    the 4 ranks' gradients (the single device at 4 times the learning rate)."""
    out = tmp_path / "out.npz"
    run_mpi_script("semi_auto_gradients_mean.py", [out], tmp_path, ranks=4)
    got = np.load(out)
    script = load_mpi_script("semi_auto_gradients_mean.py")
    single = script.train()
    for mode, mean in script.RUNS:
        want = script.train(lr=4 * script.LR) if mode == "data_parallel" else single
        np.testing.assert_allclose(got[f"{mode}-{mean}"], want, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{mode}, gradients_mean={mean}")
