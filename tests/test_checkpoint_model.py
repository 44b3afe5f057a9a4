"""Model and callbacks around checkpoints: infer_train_layout / infer_predict_layout
(compiled, no step run, weights untouched), ModelCheckpoint keeping the newest files and
resuming to the uninterrupted result, TimeMonitor, strategy files from the context,
Model without optimizer, errors naming epoch and step."""
import os

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.train import (CheckpointConfig, LossMonitor, Model, ModelCheckpoint,
                            TimeMonitor)
from dualmode.train.strategy_file import layout_from_entry, load_strategy_file

from _devices import devices
from test_checkpoint import SHARDED, Net


def _dataset(rows=32, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    y = rng.integers(0, 8, rows).astype(np.int32)
    return dm.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(batch)


def _model(net, lr=0.05):
    opt = nn.Momentum(net.trainable_params(), lr, 0.9)
    return Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True), opt), opt


def test_infer_train_layout_compiles_without_a_step():
    with devices(8, gradients_mean=True):
        net = Net(*SHARDED)
        model, opt = _model(net)
        before = [p.asnumpy().copy() for p in net.get_parameters()]
        layouts = model.infer_train_layout(_dataset())
        assert layouts["w1"] == [[2, 4], [0, -1], [4, 32], 0, True, ""]
        assert layouts["w2"] == [[8], [0, -1], [4, 8], 0, True, ""]
        assert layouts["moments.w1"] == layouts["w1"]
        for p, b in zip(net.get_parameters(), before):
            assert p.layout is None                 # not moved, not changed
            np.testing.assert_array_equal(p.asnumpy(), b)
        assert opt.global_step == 0
        # the layouts are those a real step gives
        model.train(1, _dataset(rows=8))
        assert layout_from_entry(layouts["w1"], (16, 32), "t") == net.w1.layout


def test_infer_predict_layout_feeds_load_distributed_checkpoint(tmp_path):
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    files = []
    with devices(8, gradients_mean=True):
        net = Net(*SHARDED)
        model, _ = _model(net)
        model.train(1, _dataset())
        out = net(Tensor(x)).asnumpy()
        dm.save_checkpoint(net, str(tmp_path / "n.safetensors"), integrated_save=False)
        files = [str(tmp_path / f"rank_{r}" / "n.safetensors") for r in range(8)]
    with devices(4, full_batch=True):
        net = Net(((1, 1), (1, 4)), ((1, 4), (4, 1)), seed=5)
        model = Model(net)
        layout = model.infer_predict_layout(Tensor(x))
        assert layout["w1"][:2] == [[4], [-1, 0]] and layout["w2"][:2] == [[4], [0, -1]]
        dm.load_distributed_checkpoint(net, files, layout)
        assert net.w1.layout.local_shape == (16, 8)
        np.testing.assert_allclose(model.predict(Tensor(x)).asnumpy(), out, rtol=1e-5,
                                   atol=1e-6)


def test_model_checkpoint_keeps_newest_and_resumes(tmp_path):
    with devices(None):
        ref_net = Net()
        ref_model, _ = _model(ref_net)
        mon = LossMonitor(0)
        ref_model.train(3, _dataset(), callbacks=[mon])
        ref_losses = mon.losses
    d = str(tmp_path / "ck")
    with devices(8, gradients_mean=True):
        net = Net(*SHARDED)
        model, opt = _model(net)
        ck = ModelCheckpoint("net", d, CheckpointConfig(save_checkpoint_steps=2,
                                                         keep_checkpoint_max=2))
        mon = LossMonitor(0)
        tm = TimeMonitor()
        model.train(2, _dataset(), callbacks=[mon, ck, tm])
        assert sorted(os.listdir(d)) == ["net-2_2.safetensors", "net-2_4.safetensors"]
        assert len(tm.epoch_times) == 2
        first = mon.losses
    with devices(8, gradients_mean=True):
        net = Net(*SHARDED, seed=77)
        model, opt = _model(net)
        params = dm.load_checkpoint(os.path.join(d, "net-2_4.safetensors"))
        dm.load_param_into_net(net, params)
        dm.load_param_into_net(opt, params)
        assert int(params["epoch_num"].asnumpy()) == 2 and opt.global_step == 8
        mon = LossMonitor(0)
        model.train(3, _dataset(), callbacks=[mon], initial_epoch=2)
    np.testing.assert_allclose(first + mon.losses, ref_losses, rtol=1e-4)


def test_model_checkpoint_sliced_keeps_newest_per_rank(tmp_path):
    d = str(tmp_path / "ck")
    with devices(8, gradients_mean=True):
        model, _ = _model(Net(*SHARDED))
        ck = ModelCheckpoint("s", d, CheckpointConfig(1, 1, integrated_save=False))
        model.train(1, _dataset(), callbacks=[ck])
    assert sorted(os.listdir(d)) == [f"rank_{r}" for r in range(8)] + ["strategy.json"]
    for r in range(8):
        assert os.listdir(os.path.join(d, f"rank_{r}")) == ["s-1_4.safetensors"]


def test_strategy_ckpt_save_and_load_file(tmp_path):
    path = str(tmp_path / "strategy.json")
    with devices(8, gradients_mean=True, strategy_ckpt_save_file=path):
        model, _ = _model(Net(*SHARDED))
        model.train(1, _dataset(rows=8))
    saved = load_strategy_file(path)
    assert saved["w1"].device_matrix == (2, 4) and saved["w2"].tensor_map == ((0,), ())
    # loading: parameters are stored in the saved layouts before the first step
    with devices(8, gradients_mean=True, strategy_ckpt_load_file=path):
        net = Net(*SHARDED)
        model, _ = _model(net)
        model.infer_train_layout(_dataset(rows=8))
        assert net.w1.layout == saved["w1"] and net.w2.layout == saved["w2"]
    bad = str(tmp_path / "bad.json")
    with devices(4, gradients_mean=True, strategy_ckpt_load_file=path):
        net = Net()
        model, _ = _model(net)
        with pytest.raises(ValueError, match=r"strategy_ckpt_load_file .*strategy\.json.* "
                                             r"parameter 'w1'.*8 devices.*4 devices are running"):
            model.train(1, _dataset(rows=8))
        assert net.w1.layout is None and net.w2.layout is None
    with devices(8, strategy_ckpt_load_file=bad):
        with pytest.raises(FileNotFoundError, match=r"strategy file .*bad\.json.* does not exist"):
            _model(Net())[0].train(1, _dataset(rows=8))


def test_model_without_optimizer_evaluates_and_predicts():
    net = Net()
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True), metrics={"accuracy"})
    acc = model.eval(_dataset())["accuracy"]
    assert 0.0 <= acc <= 1.0
    x = np.ones((2, 16), np.float32)
    np.testing.assert_allclose(model.predict(Tensor(x)).asnumpy(), net(Tensor(x)).asnumpy())
    with pytest.raises(RuntimeError, match=r"Model.train: the Model has no optimizer"):
        model.train(1, _dataset())


def test_error_in_a_step_names_epoch_and_step():
    class Bad(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.ones((16, 8), np.float32)), name="w")
            self.calls = 0

        def construct(self, x):
            self.calls += 1
            if self.calls == 6:
                raise ValueError("boom in construct")
            return ops.matmul(x, self.w)

    model, _ = _model(Bad())
    with pytest.raises(ValueError, match=r"Model.train: error in epoch: 2 step: 2: boom in "
                                         r"construct"):
        model.train(3, _dataset())


def test_callback_arguments_are_checked():
    with pytest.raises(ValueError, match=r"CheckpointConfig: save_checkpoint_steps=0 must be an "
                                         r"int >= 1"):
        CheckpointConfig(save_checkpoint_steps=0)
    with pytest.raises(TypeError, match=r"CheckpointConfig: integrated_save must be a bool"):
        CheckpointConfig(integrated_save=1)
    with pytest.raises(TypeError, match=r"ModelCheckpoint: config must be a CheckpointConfig, "
                                        r"got dict"):
        ModelCheckpoint("p", ".", config={})
    with pytest.raises(ValueError, match=r"TimeMonitor: data_size=-1 must be an int >= 1"):
        TimeMonitor(-1)
