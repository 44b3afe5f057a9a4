"""Checkpoints (SPEC §7) against the single-device oracle: save / load / load_param_into_net
for stand-alone, data-parallel and sharded networks, optimizer state and resume ==
uninterrupted, integrated and sliced saves, strategy files, re-slicing for other
strategies and device counts, and every fault named and harmless."""
import json
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode._core import _checksum
from dualmode.parallel.tensor_layout import TensorLayout
from dualmode.train.reshard import SlicedCheckpoint
from dualmode.train.safetensors_io import (CheckpointError, CheckpointFile, chunk_crcs,
                                            chunk_crcs_reference, write_files)
from dualmode.train.strategy_file import (layout_entry, layout_from_entry, load_strategy_file,
                                          save_strategy_file)

from _devices import devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Net(nn.Cell):
    """Two MatMuls; strategies optional (None: data parallel / stand-alone)."""

    def __init__(self, s1=None, s2=None, seed=3):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.w1 = Parameter(Tensor((rng.standard_normal((16, 32)) * 0.3).astype(np.float32)),
                            name="w1")
        self.w2 = Parameter(Tensor((rng.standard_normal((32, 8)) * 0.3).astype(np.float32)),
                            name="w2")
        self.m1, self.m2, self.relu = ops.MatMul(), ops.MatMul(), ops.ReLU()
        if s1:
            self.m1.shard(s1)
        if s2:
            self.m2.shard(s2)

    def construct(self, x):
        return self.m2(self.relu(self.m1(x, self.w1)), self.w2)


SHARDED = (((2, 4), (4, 1)), ((1, 8), (8, 1)))      # w1 split (4, 1) over 8, repeated 2x


def _data(steps=6, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((16, 16)).astype(np.float32),
             rng.integers(0, 8, 16).astype(np.int32)) for _ in range(steps)]


OPTIMIZERS = {
    "momentum": lambda p: nn.Momentum(p, 0.05, 0.9),
    "adam": lambda p: nn.Adam(p, learning_rate=[0.01, 0.02, 0.005, 0.01], weight_decay=0.01),
}


def _train(net, opt, batches):
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    losses = []
    for x, y in batches:
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses


def _snapshot(net):
    return {p.name: (p._data.copy() if p._data is not None else None, p._layout)
            for p in net.get_parameters()}


def _assert_unchanged(net, snap):
    for p in net.get_parameters():
        data, lay = snap[p.name]
        assert p._layout == lay
        np.testing.assert_array_equal(p._data, data)


# ---------------------------------------------------------------------------------
# stand-alone round trip, the file format
# ---------------------------------------------------------------------------------
def test_save_load_stand_alone_round_trip(tmp_path):
    net = Net()
    path = str(tmp_path / "net.safetensors")
    dm.save_checkpoint(net, path)
    params = dm.load_checkpoint(path)
    assert list(params) == ["w1", "w2"]
    fresh = Net(seed=9)
    assert dm.load_param_into_net(fresh, params) == []
    for p, q in zip(net.get_parameters(), fresh.get_parameters()):
        np.testing.assert_array_equal(p.asnumpy(), q.asnumpy())


def test_checkpoint_files_are_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    net = Net()
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    path = str(tmp_path / "n.safetensors")
    dm.save_checkpoint([net, opt], path)
    tensors = st.load_file(path)
    assert set(tensors) == {"w1", "w2", "moments.w1", "moments.w2", "global_step"}
    np.testing.assert_array_equal(tensors["w1"], net.w1.asnumpy())
    with CheckpointFile(path) as f:
        assert f.meta["optimizer_states"] == {"moments": ["moments.w1", "moments.w2"]}
        assert f.meta["step"] == 0 and f.meta["kind"] == "integrated"


def test_load_checkpoint_filter_prefix_and_net(tmp_path):
    net = Net()
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    path = str(tmp_path / "n.safetensors")
    dm.save_checkpoint([net, opt], path, append_dict={"epoch_num": 3})
    params = dm.load_checkpoint(path, filter_prefix="moments.")
    assert sorted(params) == ["epoch_num", "global_step", "w1", "w2"]
    assert int(params["epoch_num"].asnumpy()) == 3
    fresh = Net(seed=5)
    dm.load_checkpoint(path, net=fresh)
    np.testing.assert_array_equal(fresh.w2.asnumpy(), net.w2.asnumpy())


def test_load_param_into_net_returns_names_not_loaded(tmp_path):
    net = Net()
    params = {"w1": Parameter(Tensor(np.ones((16, 32), np.float32)), name="w1")}
    assert dm.load_param_into_net(net, params) == ["w2"]
    np.testing.assert_array_equal(net.w1.asnumpy(), np.ones((16, 32), np.float32))


# ---------------------------------------------------------------------------------
# sharded and data-parallel networks
# ---------------------------------------------------------------------------------
def test_sharded_integrated_save_loads_stand_alone(tmp_path):
    x = _data(1)[0][0]
    path = str(tmp_path / "full.safetensors")
    with devices(8, gradients_mean=True):
        net = Net(*SHARDED)
        opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
        _train(net, opt, _data(2))
        assert net.w1.layout.device_matrix == (2, 4)
        out = net(Tensor(x)).asnumpy()
        dm.save_checkpoint([net, opt], path)
    with devices(None):
        fresh = Net(seed=11)
        dm.load_param_into_net(fresh, dm.load_checkpoint(path))
        np.testing.assert_allclose(fresh(Tensor(x)).asnumpy(), out, rtol=1e-5, atol=1e-6)


def test_load_into_sharded_net_keeps_layout_and_local_shards(tmp_path):
    x = _data(1)[0][0]
    ref = Net(seed=4)
    path = str(tmp_path / "w.safetensors")
    dm.save_checkpoint(ref, path)
    out = ref(Tensor(x)).asnumpy()
    with devices(8):
        net = Net(*SHARDED)
        net(Tensor(x))                                   # weights now stored sharded
        lay = net.w1.layout
        dm.load_param_into_net(net, dm.load_checkpoint(path))
        assert net.w1.layout == lay and net.w1._data.shape == (8,) + lay.local_shape
        np.testing.assert_allclose(net(Tensor(x)).asnumpy(), out, rtol=1e-5, atol=1e-6)


def test_data_parallel_save_load(tmp_path):
    batches = _data(4)
    with devices(None):
        ref_net = Net()
        ref = _train(ref_net, nn.Momentum(ref_net.trainable_params(), 0.05, 0.9), batches)
    path = str(tmp_path / "dp.safetensors")
    with devices(8, "data_parallel", gradients_mean=True):
        net = Net()
        opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
        first = _train(net, opt, batches[:2])
        dm.save_checkpoint([net, opt], path)
        net2 = Net(seed=8)
        opt2 = nn.Momentum(net2.trainable_params(), 0.05, 0.9)
        dm.load_param_into_net(opt2, dm.load_checkpoint(path))
        second = _train(net2, opt2, batches[2:])
    np.testing.assert_allclose(first + second, ref, rtol=1e-4)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("n", [None, 8])
def test_resume_equals_uninterrupted(name, n, tmp_path):
    """Resumed with a fresh network and optimizer from a checkpoint of network and
    optimizer: the losses and weights of the uninterrupted run (and stand-alone's)."""
    batches = _data(6)
    strategies = SHARDED if n else (None, None)
    with devices(None):
        ref_net = Net()
        ref = _train(ref_net, OPTIMIZERS[name](ref_net.trainable_params()), batches)
    path = str(tmp_path / "ck.safetensors")
    with devices(n, gradients_mean=True):
        net = Net(*strategies)
        opt = OPTIMIZERS[name](net.trainable_params())
        first = _train(net, opt, batches[:3])
        dm.save_checkpoint([net, opt], path)
    with devices(n, gradients_mean=True):
        net = Net(*strategies, seed=99)
        opt = OPTIMIZERS[name](net.trainable_params())
        params = dm.load_checkpoint(path)
        assert dm.load_param_into_net(net, params) == []
        assert dm.load_param_into_net(opt, params) == []
        assert opt.global_step == 3
        second = _train(net, opt, batches[3:])
        weights = [p.asnumpy() for p in net.get_parameters()]
    np.testing.assert_allclose(first + second, ref, rtol=1e-4)
    for w, r in zip(weights, ref_net.get_parameters()):
        np.testing.assert_allclose(w, r.asnumpy(), rtol=1e-4, atol=1e-6)


def test_resume_in_a_new_process(tmp_path):
    """The second half runs in a fresh interpreter from the checkpoint alone."""
    batches = _data(6)
    with devices(None):
        ref_net = Net()
        ref = _train(ref_net, OPTIMIZERS["adam"](ref_net.trainable_params()), batches)
    path = str(tmp_path / "ck.safetensors")
    with devices(8, gradients_mean=True):
        net = Net(*SHARDED)
        opt = OPTIMIZERS["adam"](net.trainable_params())
        first = _train(net, opt, batches[:3])
        dm.save_checkpoint([net, opt], path)
    script = f"""
import sys, json
sys.path[:0] = [{os.path.join(ROOT, 'tests')!r}, {ROOT!r}]
import dualmode as dm
from test_checkpoint import Net, OPTIMIZERS, SHARDED, _data, _train
from _devices import devices
with devices(8, gradients_mean=True):
    net = Net(*SHARDED, seed=42)
    opt = OPTIMIZERS["adam"](net.trainable_params())
    dm.load_checkpoint({path!r}, net=[net, opt][0])
    dm.load_param_into_net(opt, dm.load_checkpoint({path!r}))
    print(json.dumps(_train(net, opt, _data(6)[3:])))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(first + second, ref, rtol=1e-4)


# ---------------------------------------------------------------------------------
# sliced saves, strategy files, re-slicing
# ---------------------------------------------------------------------------------
def _sliced_run(tmp_path):
    """Train on 8 devices with strategy (2, 4), save slices; returns (files, x, output)."""
    x = _data(1)[0][0]
    base = str(tmp_path / "n.safetensors")
    with devices(8, gradients_mean=True):
        net = Net(*SHARDED)
        opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
        _train(net, opt, _data(2))
        out = net(Tensor(x)).asnumpy()
        dm.save_checkpoint([net, opt], base, integrated_save=False)
        dm.save_checkpoint([net, opt], str(tmp_path / "full.safetensors"))
    return [str(tmp_path / f"rank_{r}" / "n.safetensors") for r in range(8)], x, out


def test_sliced_save_writes_each_rank_its_slices(tmp_path):
    files, _, _ = _sliced_run(tmp_path)
    full = dm.load_checkpoint(str(tmp_path / "full.safetensors"))
    lay = load_strategy_file(str(tmp_path / "strategy.json"))["w1"]
    assert lay.device_matrix == (2, 4) and lay.local_shape == (4, 32)
    for r, path in enumerate(files):
        with CheckpointFile(path) as f:
            assert f.meta["rank"] == r and f.meta["kind"] == "slice"
            np.testing.assert_array_equal(f.read("w1"),
                                          full["w1"].asnumpy()[lay.device_slices()[r]])
            np.testing.assert_array_equal(f.read("moments.w1"),
                                          full["moments.w1"].asnumpy()[lay.device_slices()[r]])


def test_load_distributed_checkpoint_other_strategy_and_device_counts(tmp_path):
    files, x, out = _sliced_run(tmp_path)
    with devices(4):
        net = Net(((4, 1), (1, 1)), ((1, 4), (4, 1)), seed=7)
        net(Tensor(x))                               # w2 now split (4, 1) over 4 devices
        assert dm.load_distributed_checkpoint(net, files) == []
        assert net.w2.layout.device_num == 4
        np.testing.assert_allclose(net(Tensor(x)).asnumpy(), out, rtol=1e-5, atol=1e-6)
    with devices(4):                                 # the layouts given, nothing run yet
        net = Net(((1, 1), (1, 4)), ((1, 1), (1, 1)), seed=7)
        predict = {"w1": [[4], [-1, 0], [16, 8]]}
        dm.load_distributed_checkpoint(net, files, predict,
                                       str(tmp_path / "strategy.json"))
        assert net.w1.layout.local_shape == (16, 8)
        np.testing.assert_allclose(net(Tensor(x)).asnumpy(), out, rtol=1e-5, atol=1e-6)
    with devices(None):
        net = Net(seed=7)
        dm.load_distributed_checkpoint(net, files)
        np.testing.assert_allclose(net(Tensor(x)).asnumpy(), out, rtol=1e-5, atol=1e-6)


def test_merge_sliced_checkpoints_equals_integrated_save(tmp_path):
    files, _, _ = _sliced_run(tmp_path)
    merged = str(tmp_path / "merged.safetensors")
    dm.merge_sliced_checkpoints(files, str(tmp_path / "strategy.json"), merged)
    a = dm.load_checkpoint(merged)
    b = dm.load_checkpoint(str(tmp_path / "full.safetensors"))
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k].asnumpy(), b[k].asnumpy())


def test_transform_checkpoints_to_four_devices(tmp_path):
    files, x, out = _sliced_run(tmp_path)
    dst_strategy = str(tmp_path / "dst.json")
    save_strategy_file(dst_strategy, {
        "w1": TensorLayout((4,), ((0,), ()), (16, 32)),
        "w2": TensorLayout((2, 2), ((1,), (0,)), (32, 8)),
        "moments.w1": TensorLayout((4,), ((), (0,)), (16, 32))})
    dst = str(tmp_path / "out")
    dm.transform_checkpoints(str(tmp_path), dst, str(tmp_path / "strategy.json"), dst_strategy)
    assert sorted(os.listdir(dst)) == ["rank_0", "rank_1", "rank_2", "rank_3", "strategy.json"]
    full = dm.load_checkpoint(str(tmp_path / "full.safetensors"))
    with CheckpointFile(os.path.join(dst, "rank_3", "n.safetensors")) as f:
        np.testing.assert_array_equal(f.read("moments.w1"), full["moments.w1"].asnumpy()[:, 24:])
        np.testing.assert_array_equal(f.read("w2"), full["w2"].asnumpy()[16:32, 4:8])
    with devices(None):
        net = Net(seed=7)
        dm.load_distributed_checkpoint(net, [os.path.join(dst, f"rank_{r}", "n.safetensors")
                                             for r in range(4)])
        np.testing.assert_allclose(net(Tensor(x)).asnumpy(), out, rtol=1e-5, atol=1e-6)
    merged_dir = str(tmp_path / "merged")
    dm.transform_checkpoints(dst, merged_dir)
    m = dm.load_checkpoint(os.path.join(merged_dir, "n.safetensors"))
    for k in full:
        np.testing.assert_array_equal(m[k].asnumpy(), full[k].asnumpy())


def test_reading_a_block_reads_only_its_bytes(tmp_path, monkeypatch):
    """A device that needs a quarter of a weight reads a quarter of its bytes."""
    monkeypatch.setattr("dualmode.train.safetensors_io.CHUNK", 1 << 10)
    big = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    lay = TensorLayout((2,), ((0,), ()), big.shape)
    paths = []
    for r in range(2):
        p = tmp_path / f"rank_{r}" / "b.safetensors"
        p.parent.mkdir()
        dm.train.safetensors_io.write_file(str(p), [("w", big[lay.device_slices()[r]])],
                                           {"kind": "slice", "rank": r, "layouts": {
                                               "w": dm.train.strategy_file.layout_to_dict(lay)}})
        paths.append(str(p))
    with SlicedCheckpoint(paths) as src:
        part = src.read("w", (slice(64, 128), slice(0, 64)))     # a quarter, in rank 0's block
        np.testing.assert_array_equal(part, big[64:128])
        assert src.bytes_read == big.nbytes // 4
        cols = src.read("w", (slice(0, 256), slice(16, 32)))
        np.testing.assert_array_equal(cols, big[:, 16:32])


def test_strategy_file_layouts_round_trip(tmp_path):
    lay = TensorLayout((2, 2, 2), ((2,), (1, 0)), (8, 8))
    path = str(tmp_path / "s.json")
    save_strategy_file(path, {"w": lay})
    doc = json.loads(open(path).read())
    assert doc["parameters"]["w"] == {"device_matrix": [2, 2, 2], "tensor_map": [0, [1, 2]],
                                      "shape": [8, 8], "slice_shape": [4, 2]}
    assert load_strategy_file(path)["w"] == lay
    assert layout_from_entry(layout_entry(lay), (8, 8), "t") == lay


def test_strategy_ckpt_save_file_written_with_sliced_save(tmp_path):
    target = str(tmp_path / "train_strategy.json")
    with devices(8, gradients_mean=True, strategy_ckpt_save_file=target):
        net = Net(*SHARDED)
        net(Tensor(_data(1)[0][0]))
        dm.save_checkpoint(net, str(tmp_path / "n.safetensors"), integrated_save=False)
    layouts = load_strategy_file(target)
    assert layouts["w1"].device_matrix == (2, 4) and layouts["w2"].device_matrix == (8,)


# ---------------------------------------------------------------------------------
# faults: named, and the network untouched
# ---------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    net = Net()
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    path = str(tmp_path / "good.safetensors")
    dm.save_checkpoint([net, opt], path)
    return path


def _target():
    net = Net(seed=21)
    return net, _snapshot(net)


def test_truncated_file_is_named_and_changes_nothing(saved, tmp_path):
    data = open(saved, "rb").read()
    bad = tmp_path / "trunc.safetensors"
    bad.write_bytes(data[:-100])
    net, snap = _target()
    with pytest.raises(CheckpointError, match=r"trunc\.safetensors.*parameter 'moments\.w2'.*"
                                              r"truncated"):
        dm.load_checkpoint(str(bad), net=net)
    bad.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"trunc\.safetensors.*truncated"):
        dm.load_checkpoint(str(bad))
    _assert_unchanged(net, snap)


def test_flipped_byte_fails_the_checksum(saved, tmp_path):
    data = bytearray(open(saved, "rb").read())
    data[-40] ^= 0x10                          # inside the data of the last tensors
    bad = tmp_path / "flip.safetensors"
    bad.write_bytes(bytes(data))
    net, snap = _target()
    with pytest.raises(CheckpointError, match=r"flip\.safetensors.*parameter 'moments\.w2'.*"
                                              r"checksum mismatch"):
        dm.load_checkpoint(str(bad), net=net)
    _assert_unchanged(net, snap)


def test_flipped_header_byte_fails_the_header_checksum(saved, tmp_path):
    data = bytearray(open(saved, "rb").read())
    i = data.index(b'"shape": [16, 32]') + len('"shape": [1')
    data[i] = ord("7")                          # 16 -> 17 rows: still valid JSON
    bad = tmp_path / "head.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"head\.safetensors.*header checksum mismatch"):
        dm.load_checkpoint(str(bad))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors.*does not exist"):
        dm.load_checkpoint(str(tmp_path / "nope.safetensors"))
    (tmp_path / "rank_0").mkdir()
    dm.save_checkpoint(Net(), str(tmp_path / "rank_0" / "x"))
    with pytest.raises(FileNotFoundError, match=r"rank_1.*does not exist"):
        dm.load_distributed_checkpoint(Net(), [str(tmp_path / "rank_0" / "x"),
                                               str(tmp_path / "rank_1" / "x")])


def test_strict_load_unknown_name_changes_nothing(saved):
    net, snap = _target()
    params = dm.load_checkpoint(saved)
    with pytest.raises(ValueError, match=r"strict_load=True.*\['moments\.w1', 'moments\.w2', "
                                         r"'global_step'\].*does not have"):
        dm.load_param_into_net(net, params, strict_load=True)
    _assert_unchanged(net, snap)
    del params["w2"]
    with pytest.raises(ValueError, match=r"strict_load=True.*\['w2'\] are not in the checkpoint"):
        dm.load_param_into_net(net, {"w1": params["w1"]}, strict_load=True)
    _assert_unchanged(net, snap)


def test_shape_or_dtype_mismatch_changes_nothing(saved):
    net, snap = _target()
    params = dm.load_checkpoint(saved)
    params["w2"] = Parameter(Tensor(np.zeros((32, 9), np.float32)), name="w2")
    with pytest.raises(ValueError, match=r"parameter 'w2' has shape \(32, 9\) in the checkpoint "
                                         r"but \(32, 8\) in the network"):
        dm.load_param_into_net(net, params)
    params["w2"] = Parameter(Tensor(np.zeros((32, 8), np.float64)), name="w2")
    with pytest.raises(TypeError, match=r"parameter 'w2' has dtype float64 in the checkpoint but "
                                        r"float32"):
        dm.load_param_into_net(net, params)
    _assert_unchanged(net, snap)        # w1 came first and was valid: still not loaded


def test_sharded_load_failure_changes_nothing(tmp_path):
    files, x, _ = _sliced_run(tmp_path)
    data = bytearray(open(files[5], "rb").read())
    data[-712] ^= 1          # in its block of w2 (then moments.w1, moments.w2, the step)
    open(files[5], "wb").write(bytes(data))
    with devices(4):
        net = Net(((4, 1), (1, 1)), ((1, 4), (4, 1)), seed=7)
        net(Tensor(x))
        snap = _snapshot(net)
        with pytest.raises(CheckpointError, match=r"rank_5.*checksum mismatch"):
            dm.load_distributed_checkpoint(net, files)
        _assert_unchanged(net, snap)


def test_wrong_file_order_and_count_are_named(tmp_path):
    files, _, _ = _sliced_run(tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoint_filenames\[0\]=.*rank_1.*slices of "
                                              r"rank 1.*rank order"):
        dm.load_distributed_checkpoint(Net(), files[1:] + files[:1])
    with pytest.raises(CheckpointError, match=r"'w1' was sliced over 8 devices .* but 4 files"):
        dm.merge_sliced_checkpoints(files[:4], str(tmp_path / "strategy.json"),
                                    str(tmp_path / "m.safetensors"))


def test_interrupted_save_leaves_previous_checkpoint(saved, monkeypatch, tmp_path):
    before = open(saved, "rb").read()
    net = Net(seed=30)

    def boom(*a, **k):
        raise KeyboardInterrupt("killed")
    monkeypatch.setattr("dualmode.train.safetensors_io.os.fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        dm.save_checkpoint(net, saved)
    assert open(saved, "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["good.safetensors"]       # no temporary left


def test_killed_process_leaves_previous_checkpoint(saved, tmp_path):
    """A process SIGKILLed while writing a large checkpoint over the good one."""
    before = open(saved, "rb").read()
    script = f"""
import os, signal, sys, threading
sys.path.insert(0, {ROOT!r})
import numpy as np
import dualmode as dm
import dualmode.train.safetensors_io as io
real = io._AtomicFile.commit
def commit(self):
    os.kill(os.getpid(), signal.SIGKILL)      # dies after writing, before the rename
io._AtomicFile.commit = commit
dm.save_checkpoint({{"w1": np.ones((512, 512), np.float32)}}, {saved!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -9
    assert open(saved, "rb").read() == before
    dm.load_checkpoint(saved)


def test_bad_arguments_are_named(tmp_path):
    net = Net()
    with pytest.raises(TypeError, match=r"save_checkpoint: save_obj must be a Cell.*got int"):
        dm.save_checkpoint(3, str(tmp_path / "a"))
    with pytest.raises(TypeError, match=r"integrated_save must be a bool, got 'yes'"):
        dm.save_checkpoint(net, str(tmp_path / "a"), integrated_save="yes")
    with pytest.raises(FileNotFoundError, match=r"directory of .*nodir.* does not exist"):
        dm.save_checkpoint(net, str(tmp_path / "nodir" / "a"))
    with pytest.raises(TypeError, match=r"load_param_into_net: parameter_dict must be a dict"):
        dm.load_param_into_net(net, [1])
    with pytest.raises(TypeError, match=r"checkpoint_filenames must be a non-empty list"):
        dm.load_distributed_checkpoint(net, str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"predict_strategy\['w1'\].*tensor_map entry 5"):
        dm.save_checkpoint(net, str(tmp_path / "a"))
        dm.load_distributed_checkpoint(net, [str(tmp_path / "a")], {"w1": [[4], [5, -1]]})


# ---------------------------------------------------------------------------------
# the CRC-32 kernel and the direct reads
# ---------------------------------------------------------------------------------
def test_crc32_kernel_matches_zlib():
    """Every folding width the CPU has (256-bit, 128-bit, bytewise), every length class
    (below one fold, around the 64/128-byte steps, a 16-byte tail), unaligned starts and
    a carried-on value, against zlib."""
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 5000, dtype=np.uint8)
    widths = [w for w in (256, 128, 0) if w <= _checksum.FOLD_BITS]
    best = _checksum.FOLD_BITS
    try:
        for bits in widths:
            _checksum._set_fold_bits(bits)
            for n in list(range(0, 300)) + [1023, 1024, 1025, 4096 + 13, 5000]:
                for start in (0, 1, 7):
                    buf = data[start:start + n]
                    for value in (0, 0x1234567, 0xFFFFFFFF):
                        assert _checksum.crc32(buf, value) == zlib.crc32(buf, value), \
                            (bits, n, start, value)
            assert _checksum.crc32(b"123456789") == 0xCBF43926
            assert _checksum.crc32(data[3000:], _checksum.crc32(data[:3000])) == \
                zlib.crc32(data)
    finally:
        _checksum._set_fold_bits(best)
    with pytest.raises(ValueError, match=r"_set_fold_bits: bits must be 0, 128 or 256, got 64"):
        _checksum._set_fold_bits(64)


def test_chunk_crcs_match_reference():
    data = np.random.default_rng(6).integers(0, 256, 10_007, dtype=np.uint8)
    for chunk in (1, 7, 64, 1000, 10_007, 20_000):
        np.testing.assert_array_equal(chunk_crcs(data, chunk), chunk_crcs_reference(data, chunk))
    out = np.empty(3, np.uint32)
    with pytest.raises(ValueError, match=r"chunk_crcs: out has 3 entries, 10007 bytes in chunks "
                                         r"of 1000 need 11"):
        _checksum.chunk_crcs(data, 1000, out)
    with pytest.raises(ValueError, match=r"chunk must be positive, got 0"):
        _checksum.chunk_crcs(data, 0, out)


def test_read_into_fills_the_given_array(tmp_path, monkeypatch):
    monkeypatch.setattr("dualmode.train.safetensors_io.CHUNK", 1 << 10)
    w = np.arange(40 * 33, dtype=np.float32).reshape(40, 33)      # 5280 bytes: 5 chunks + 160
    path = str(tmp_path / "w.safetensors")
    dm.save_checkpoint({"w": w}, path)
    stack = np.zeros((2, 40, 33), np.float32)
    with CheckpointFile(path) as f:
        assert f.read_into("w", stack[1]) is not None
        np.testing.assert_array_equal(stack[1], w)
        assert not stack[0].any()
        with pytest.raises(ValueError, match=r"read_into: out must be a writable C-contiguous "
                                             r"array of shape \(40, 33\) and dtype float32 "
                                             r"\(tensor 'w'"):
            f.read_into("w", stack[:, :, 0])
        region = np.zeros((8, 5), np.float32)
        f.read_region("w", (slice(30, 38), slice(2, 7)), region)
        np.testing.assert_array_equal(region, w[30:38, 2:7])


def test_load_distributed_checkpoint_into_replicated_blocks(tmp_path):
    """Each device's slot of the new stack is its block of the global value, also where
    several devices hold the same block (replicas) and blocks straddle source blocks."""
    files, x, out = _sliced_run(tmp_path)
    full = dm.load_checkpoint(str(tmp_path / "full.safetensors"))["w1"].asnumpy()
    with devices(8):
        net = Net(seed=7)
        dm.load_distributed_checkpoint(net, files, {"w1": [[2, 4], [-1, 0], [16, 8]]})
        lay = net.w1.layout
        assert lay.local_shape == (16, 8)
        for r, box in enumerate(lay.device_slices()):
            np.testing.assert_array_equal(net.w1._data[r], full[box])
        np.testing.assert_allclose(net(Tensor(x)).asnumpy(), out, rtol=1e-5, atol=1e-6)


def test_write_files_failure_leaves_no_file(tmp_path):
    good = str(tmp_path / "a.safetensors")
    with pytest.raises(FileNotFoundError, match=r"directory .*nodir.* does not exist"):
        write_files([(good, [("w", np.ones(3, np.float32))], None),
                     (str(tmp_path / "nodir" / "b.safetensors"), [("w", np.ones(3))], None)])
    assert os.listdir(tmp_path) == []


def test_copy_chunk_crcs_match_reference():
    data = np.random.default_rng(7).integers(0, 256, 30_011, dtype=np.uint8)
    best = _checksum.FOLD_BITS
    try:
        for bits in [w for w in (256, 128, 0) if w <= best]:
            _checksum._set_fold_bits(bits)
            for n in list(range(0, 300, 7)) + [4096, 30_000]:
                for chunk in (64, 1000, 4096):
                    src = data[3:3 + n]
                    dst = np.zeros(n, np.uint8)
                    out = np.empty(-(-n // chunk), np.uint32)
                    _checksum.copy_chunk_crcs(src, dst, chunk, out)
                    np.testing.assert_array_equal(dst, src)
                    np.testing.assert_array_equal(out, chunk_crcs_reference(src, chunk))
    finally:
        _checksum._set_fold_bits(best)
    with pytest.raises(ValueError, match=r"copy_chunk_crcs: dst has 5 bytes but src has 30011"):
        _checksum.copy_chunk_crcs(data, np.zeros(5, np.uint8), 64, np.empty(1, np.uint32))


@pytest.mark.parametrize("path_kind", ["mapped", "read"])
def test_both_read_paths_verify_and_name_faults(tmp_path, monkeypatch, path_kind):
    """Large ranges are copied from a mapping by the checksumming kernel, small ones read
    and then checked: both give the saved bytes, and both name a flipped byte and a file
    that shrank after it was opened."""
    if path_kind == "mapped" and _checksum.FOLD_BITS != 256:
        pytest.skip("the mapped path needs the 256-bit kernel")
    monkeypatch.setattr("dualmode.train.safetensors_io.CHUNK", 1 << 10)
    monkeypatch.setattr("dualmode.train.safetensors_io._MAP_MIN",
                        0 if path_kind == "mapped" else 1 << 62)
    w = np.random.default_rng(8).standard_normal((300, 41)).astype(np.float32)   # 48 chunks
    path = tmp_path / "w.safetensors"
    dm.save_checkpoint({"w": w, "b": np.arange(3.0)}, str(path))
    with CheckpointFile(str(path)) as f:
        np.testing.assert_array_equal(f.read("w"), w)
        np.testing.assert_array_equal(f.read_region("w", (slice(100, 200), slice(3, 9))),
                                      w[100:200, 3:9])
    data = bytearray(path.read_bytes())
    start = len(data) - w.nbytes - 24
    data[start + 20 * 1024 + 5] ^= 1                        # in chunk 20 of w
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"bad\.safetensors.*parameter 'w'.*checksum "
                                              r"mismatch in bytes 20480\.\.21504"):
        dm.load_checkpoint(str(bad))
    with CheckpointFile(str(path)) as f:
        os.truncate(str(path), start + 5000)               # shrinks after it was opened
        with pytest.raises(CheckpointError, match=r"w\.safetensors.*parameter 'w'.*truncated "
                                                  r"while reading"):
            f.read("w")


def test_header_written_last_into_reserved_room(tmp_path, monkeypatch):
    """The header goes in after the data, padded with spaces to the room reserved for
    the widest CRC-32s: still a safetensors file, data 8-byte aligned, every chunk
    verified."""
    st = pytest.importorskip("safetensors.numpy")
    monkeypatch.setattr("dualmode.train.safetensors_io.CHUNK", 64)
    tensors = {"a": np.arange(1000, dtype=np.float32).reshape(40, 25),
               "b": np.ones(3, np.int64), "c": np.zeros((0, 4), np.float32)}
    path = str(tmp_path / "h.safetensors")
    dm.save_checkpoint(tensors, path)
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and raw[8:8 + n].rstrip(b" ").endswith(b"}")
    got = st.load_file(path)
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v)
    with CheckpointFile(path) as f:
        assert len(f._entries["a"][4]) == 4000 // 64 + 1
        np.testing.assert_array_equal(f.read("a"), tensors["a"])


def test_failed_sync_of_a_sliced_save_replaces_no_rank_file(tmp_path, monkeypatch):
    """The rank files are fsynced together before any is renamed: one failed fsync
    leaves every previous rank file as it was and no temporary file behind."""
    files, _, _ = _sliced_run(tmp_path)
    before = [open(f, "rb").read() for f in files]
    calls = []
    real = os.fsync

    def flaky(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return real(fd)
    monkeypatch.setattr("dualmode.train.safetensors_io.os.fsync", flaky)
    with devices(8, gradients_mean=True):
        net = Net(*SHARDED, seed=40)
        net(Tensor(_data(1)[0][0]))
        with pytest.raises(OSError, match=r"Input/output error"):
            dm.save_checkpoint(net, str(tmp_path / "n.safetensors"), integrated_save=False)
    assert [open(f, "rb").read() for f in files] == before
    for r in range(8):
        assert os.listdir(tmp_path / f"rank_{r}") == ["n.safetensors"]
