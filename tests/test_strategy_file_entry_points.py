"""The strategy file keys at every entry point: ``strategy_ckpt_save_file`` is written
when parameters' layouts become fixed — at compile (ops.shard, Cell.shard, a GRAPH_MODE
Cell, AutoParallel), in PyNative mode as each sharded parameter gets its layout, by
Model.train — and ``strategy_ckpt_load_file`` makes a later run (fresh context, new
network) store every parameter the file names in its saved layout, whatever the new
network's strategies would choose, with the numbers of the single-device run."""
import json
import os

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel.auto_parallel import AutoParallel
from dualmode.train import Model
from dualmode.train.strategy_file import load_strategy_file

from _devices import devices
from _mpi import load_mpi_script, run_mpi_script

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((16, 32)).astype(np.float32)
W2 = RNG.standard_normal((32, 8)).astype(np.float32)
X = RNG.standard_normal((8, 16)).astype(np.float32)

# the strategies of the saving run, and others that would lay the weights out otherwise
S1, S2 = ((2, 1), (1, 4)), ((2, 4), (4, 1))
OTHER1, OTHER2 = ((2, 4), (4, 1)), ((8, 1), (1, 1))
# the file S1, S2 give on 8 devices (MindSpore's tensor map: -1 whole, axes from the last)
EXPECTED = {
    "w1": {"device_matrix": [2, 4], "tensor_map": [-1, 0], "shape": [16, 32],
           "slice_shape": [16, 8], "dtype": "float32"},
    "w2": {"device_matrix": [2, 4], "tensor_map": [0, -1], "shape": [32, 8],
           "slice_shape": [8, 8], "dtype": "float32"},
}
ENTRY_POINTS = ["eager", "graph_mode", "ops_shard", "cell_shard", "auto_parallel"]


class Net(nn.Cell):
    def __init__(self, s1=None, s2=None, w1=W1, w2=W2):
        super().__init__()
        self.w1 = Parameter(Tensor(w1), name="w1")
        self.w2 = Parameter(Tensor(w2), name="w2")
        self.mm1 = ops.MatMul()
        self.mm2 = ops.MatMul()
        self.relu = ops.ReLU()
        if s1:
            self.mm1.shard(s1)
        if s2:
            self.mm2.shard(s2)

    def construct(self, x):
        return self.mm2(self.relu(self.mm1(x, self.w1)), self.w2)


def _train(how, net, steps=3):
    """`steps` SGD steps of mean(net(x)^2), the network run as `how` says; the losses
    and the weights after."""
    if how == "graph_mode":
        dm.set_context(mode=dm.GRAPH_MODE)
    run = net
    if how == "ops_shard":
        run = ops.shard(net, in_strategy=((2, 1),))
    elif how == "cell_shard":
        run = net.shard(in_strategy=((2, 1),))
    params = [net.w1, net.w2]
    opt = nn.SGD(params, learning_rate=0.01)
    grad_fn = dm.value_and_grad(lambda x: ops.ReduceMean()(ops.Square()(run(x))), None,
                                params)

    def step(x):
        loss, grads = grad_fn(x)
        opt(grads)
        return loss

    if how == "auto_parallel":
        step = AutoParallel(step, "sharding_propagation")
    losses = [float(step(Tensor(X)).asnumpy()) for _ in range(steps)]
    return losses, [net.w1.asnumpy(), net.w2.asnumpy()]


def _train_single(steps=3):
    with devices(None):
        return _train("eager", Net(), steps)


def _assert_same_numbers(got, ref):
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-4)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _parameters(path):
    with open(path) as f:
        return json.load(f)["parameters"]


# ---------------------------------------------------------------------------------
# strategy_ckpt_save_file
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ENTRY_POINTS)
def test_save_file_written_at_each_entry_point(tmp_path, how):
    path = str(tmp_path / "strategy.json")
    mode = "auto_parallel" if how == "auto_parallel" else "semi_auto_parallel"
    with devices(8, mode, strategy_ckpt_save_file=path):
        net = Net(S1, S2)
        got = _train(how, net, steps=1)
        assert _parameters(path) == EXPECTED
        saved = load_strategy_file(path)
        assert saved["w1"] == net.w1.layout and saved["w2"] == net.w2.layout
    _assert_same_numbers(got, _train_single(1))


def test_ops_shard_writes_what_its_compile_planned(tmp_path):
    path = str(tmp_path / "new_folder" / "strategy.json")      # made as needed
    with devices(8, strategy_ckpt_save_file=path):
        f = ops.shard(Net(), in_strategy=((2, 1),), parameter_plan={"w1": (1, 4)})
        f(Tensor(X))
        planned = {p.name: lay for p, lay in f.compiled.parameter_layouts()
                   if lay is not None}
        assert "w1" in planned and load_strategy_file(path) == planned
        assert _parameters(path)["w1"]["slice_shape"] == [16, 8]


def test_eager_file_grows_as_parameters_get_layouts(tmp_path):
    path = str(tmp_path / "strategy.json")
    with devices(8, strategy_ckpt_save_file=path):
        net = Net(S1, S2)
        net.relu(Tensor(X))                         # nothing laid out: no file
        assert not os.path.exists(path)
        net.mm1(Tensor(X), net.w1)                  # w1 gets its layout
        assert _parameters(path) == {"w1": EXPECTED["w1"]}
        net(Tensor(X))                              # now w2 too
        assert _parameters(path) == EXPECTED
    # the key set again starts a new file: only what this run lays out
    with devices(8, strategy_ckpt_save_file=path):
        net = Net(None, S2)
        net(Tensor(X))
        assert _parameters(path) == {"w2": EXPECTED["w2"]}


def test_model_train_still_writes_the_file(tmp_path):
    path = str(tmp_path / "strategy.json")
    with devices(8, strategy_ckpt_save_file=path):
        net = Net(S1, S2)
        model = Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.01))
        data = dm.dataset.NumpySlicesDataset(
            {"x": X, "y": np.zeros((8, 8), np.float32)}, shuffle=False).batch(8)
        model.train(1, data)
    assert _parameters(path) == EXPECTED


# ---------------------------------------------------------------------------------
# strategy_ckpt_load_file
# ---------------------------------------------------------------------------------
def _saved_file(tmp_path):
    """The file S1, S2 give, written by hand (the saving runs are tested above)."""
    path = str(tmp_path / "saved.json")
    with open(path, "w") as f:
        json.dump({"format": "dualmode-strategy", "version": 1, "parameters": EXPECTED}, f)
    return path


def _loading_net(how):
    # eager and GRAPH_MODE: strategies that would lay both weights out otherwise (w1
    # split by rows, w2 whole); the compiled entry points: no strategy at all, so
    # propagation would choose
    return Net(OTHER1, OTHER2) if how in ("eager", "graph_mode") else Net()


@pytest.mark.parametrize("how", ENTRY_POINTS)
def test_load_file_lays_parameters_out_at_each_entry_point(tmp_path, how):
    path = _saved_file(tmp_path)
    saved = load_strategy_file(path)
    again = str(tmp_path / "again.json")
    mode = "auto_parallel" if how == "auto_parallel" else "semi_auto_parallel"
    with devices(8, mode, strategy_ckpt_load_file=path, strategy_ckpt_save_file=again):
        net = _loading_net(how)
        got = _train(how, net)
        assert net.w1.layout == saved["w1"] and net.w2.layout == saved["w2"]
    _assert_same_numbers(got, _train_single())
    # what this run fixed is what it loaded
    assert _parameters(again) == EXPECTED


def test_load_file_before_the_first_step_of_model_train(tmp_path):
    path = _saved_file(tmp_path)
    saved = load_strategy_file(path)
    y = np.zeros((8, 8), np.float32)

    def train(n, **settings):
        with devices(n, **settings):
            net = Net()
            model = Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.01))
            data = dm.dataset.NumpySlicesDataset({"x": X, "y": y}, shuffle=False).batch(8)
            model.train(2, data)
            return net.w1.layout, net.w2.layout, net.w1.asnumpy(), net.w2.asnumpy()

    got = train(8, strategy_ckpt_load_file=path)
    ref = train(None)
    assert got[:2] == (saved["w1"], saved["w2"])
    for a, b in zip(got[2:], ref[2:]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_parameters_the_file_does_not_name_get_their_layouts_as_usual(tmp_path):
    path = str(tmp_path / "only_w1.json")
    with open(path, "w") as f:
        json.dump({"format": "dualmode-strategy", "version": 1,
                   "parameters": {"w1": EXPECTED["w1"]}}, f)
    with devices(8, strategy_ckpt_load_file=path):
        net = Net(OTHER1, S2)
        net(Tensor(X))
        assert net.w1.layout == load_strategy_file(path)["w1"]
        stored_by_op = Net(None, S2)
        stored_by_op(Tensor(X))
        assert net.w2.layout == stored_by_op.w2.layout is not None


@pytest.mark.parametrize("how", ["eager", "graph_mode", "ops_shard", "auto_parallel"])
def test_a_file_that_does_not_fit_the_network_names_file_and_parameter(tmp_path, how):
    path = _saved_file(tmp_path)
    mode = "auto_parallel" if how == "auto_parallel" else "semi_auto_parallel"
    with devices(8, mode, strategy_ckpt_load_file=path):
        net = Net(S1, S2, w1=np.ones((16, 64), np.float32), w2=np.ones((64, 8), np.float32))
        with pytest.raises(ValueError, match=r"strategy_ckpt_load_file '.*saved\.json' lays "
                                             r"parameter 'w1' out .*shape \(16, 32\).* but it "
                                             r"has shape \(16, 64\)"):
            _train(how, net, steps=1)
    with devices(4, mode, strategy_ckpt_load_file=path):
        with pytest.raises(ValueError, match=r"strategy_ckpt_load_file '.*saved\.json' lays "
                                             r"parameter 'w1' out .*8 devices\) .*4 devices "
                                             r"are running"):
            _train(how, Net(((2, 1), (1, 2)), ((2, 2), (2, 1))), steps=1)


# ---------------------------------------------------------------------------------
# real ranks
# ---------------------------------------------------------------------------------
def test_ranks_share_one_file_and_load_it_under_mpi(tmp_path):
    out = tmp_path / "out.npz"
    run_mpi_script("strategy_file.py", [tmp_path, out], tmp_path)
    data = np.load(out)
    mod = load_mpi_script("strategy_file.py")
    (tmp_path / "sim").mkdir()
    try:
        text, _, _, _ = mod.run(str(tmp_path / "sim"), "sim")
        mod._context("sim", 1)
        ref = mod._train(mod.Net())
    finally:
        dm.reset_auto_parallel_context()
        communication.init("sim")
    # both ranks wrote the path: one whole file, what "sim" writes, no temporary left
    assert str(data["text"]) == text
    assert sorted(os.listdir(tmp_path)) == ["out.npz", "sim", "strategy.json"]
    np.testing.assert_allclose(data["losses"], ref[0], rtol=1e-4)
    np.testing.assert_allclose(data["w1"], ref[1][0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(data["w2"], ref[1][1], rtol=1e-4, atol=1e-5)
