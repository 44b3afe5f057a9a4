"""Checkpoint throughput of a sharded 1 GB model (four 8192x8192 float32 weights, each
split over 8 simulated devices), beside numpy writing and reading the same bytes in the
same run.

* save: ``save_checkpoint`` integrated (gather to global values, CRC-32 per chunk,
  temp file + fsync + rename) and sliced (each rank's slices, one file per rank) vs two
  baselines: ``np.save`` of the four global arrays into one file, which only copies
  them into the page cache (no fsync: not durable), and ``np.save`` + ``fsync``, which
  also waits for the disk as a durable save must (~1-3 s/GB on the shared disk, so the
  ratio to the plain ``np.save`` is bounded by the disk, not by dualmode). Both ratios
  are recorded (``extra_info["ratio_vs_np_save"]`` and ``["ratio_vs_np_save_fsync"]``).
  Every save round starts after ``os.sync()`` (untimed), so no round pays for the dirty
  pages of the one before. Goal: >= 0.8 of numpy's throughput (ratio of medians <= 1.25).
* load: ``load_checkpoint`` (read + verify every chunk) vs ``np.load`` of the same file;
  ``load_distributed_checkpoint`` of the sliced files into the sharded network (byte
  ranges per block, then the local shards) beside it.

Throughput in GB/s is in ``extra_info["GB_per_s"]``; the files live in pytest's tmp dir.
"""
import os

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops

pytestmark = pytest.mark.benchmark(group="checkpoint, sharded 1 GB model")

SIDE = 8192
N_WEIGHTS = 4
NBYTES = N_WEIGHTS * SIDE * SIDE * 4


class Big(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        for i in range(N_WEIGHTS):
            w = rng.standard_normal((SIDE, SIDE), dtype=np.float32)
            setattr(self, f"w{i}", Parameter(Tensor(w), name=f"w{i}"))
        self.mm = ops.MatMul().shard(((1, 8), (8, 1)))

    def construct(self, x):
        for i in range(N_WEIGHTS):
            x = self.mm(x, getattr(self, f"w{i}"))
        return x


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    communication.init()
    net = Big()
    net(Tensor(np.ones((8, SIDE), np.float32)))            # weights now live sharded
    assert net.w0.layout.local_shape == (SIDE // 8, SIDE)
    globals_ = [p.asnumpy() for p in net.get_parameters()]
    yield net, globals_, d
    dm.reset_auto_parallel_context()
    communication.init()


def _gbps(benchmark):
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        benchmark.extra_info["GB_per_s"] = NBYTES / stats.stats.median / 1e9


def _np_save(arrays, path):
    with open(path, "wb") as f:
        for a in arrays:
            np.save(f, a)


def _np_save_fsync(arrays, path):
    with open(path, "wb") as f:
        for a in arrays:
            np.save(f, a)
        f.flush()
        os.fsync(f.fileno())


def _settle():
    """Before each save round (untimed): flush every dirty page to the disk."""
    os.sync()


def _record_save(benchmark, record, key):
    base = record(benchmark, key, "ckpt_np_save", target=1.25)
    durable = record(benchmark, key, "ckpt_np_save_fsync", target=1.25)
    benchmark.extra_info.update(ratio_vs_np_save=base, ratio_vs_np_save_fsync=durable)


def _np_load(path):
    with open(path, "rb") as f:
        return [np.load(f) for _ in range(N_WEIGHTS)]


def test_save_numpy(benchmark, sharded, record):
    net, arrays, d = sharded
    path = str(d / "np.npy")
    benchmark.pedantic(_np_save, (arrays, path), setup=_settle, rounds=5, iterations=1)
    _gbps(benchmark)
    record(benchmark, "ckpt_np_save")


def test_save_numpy_fsync(benchmark, sharded, record):
    net, arrays, d = sharded
    path = str(d / "np_fsync.npy")
    benchmark.pedantic(_np_save_fsync, (arrays, path), setup=_settle, rounds=5, iterations=1)
    _gbps(benchmark)
    record(benchmark, "ckpt_np_save_fsync")


def test_save_integrated(benchmark, sharded, record):
    net, arrays, d = sharded
    path = str(d / "full.safetensors")
    benchmark.pedantic(dm.save_checkpoint, (net, path), setup=_settle, rounds=5, iterations=1)
    _gbps(benchmark)
    got = dm.load_checkpoint(path)
    benchmark.extra_info["correct"] = all(np.array_equal(got[f"w{i}"].asnumpy(), arrays[i])
                                          for i in range(N_WEIGHTS))
    _record_save(benchmark, record, "ckpt_save_integrated")


def test_save_sliced(benchmark, sharded, record):
    net, arrays, d = sharded
    path = str(d / "s.safetensors")
    benchmark.pedantic(dm.save_checkpoint, (net, path), {"integrated_save": False},
                       setup=_settle, rounds=5, iterations=1)
    _gbps(benchmark)
    got = [dm.load_checkpoint(str(d / f"rank_{r}" / "s.safetensors"))["w2"].asnumpy()
           for r in (0, 7)]
    benchmark.extra_info["correct"] = all(np.array_equal(g, arrays[2][r * (SIDE // 8):
                                                                      (r + 1) * (SIDE // 8)])
                                          for g, r in zip(got, (0, 7)))
    _record_save(benchmark, record, "ckpt_save_sliced")


def test_load_numpy(benchmark, sharded, record):
    net, arrays, d = sharded
    path = str(d / "np.npy")
    if not os.path.exists(path):
        _np_save(arrays, path)
    benchmark.pedantic(_np_load, (path,), rounds=5, iterations=1)
    _gbps(benchmark)
    record(benchmark, "ckpt_np_load")


def test_load_checkpoint(benchmark, sharded, record):
    net, arrays, d = sharded
    path = str(d / "full.safetensors")
    if not os.path.exists(path):
        dm.save_checkpoint(net, path)
    got = benchmark.pedantic(dm.load_checkpoint, (path,), rounds=5, iterations=1)
    _gbps(benchmark)
    benchmark.extra_info["correct"] = np.array_equal(got["w3"].asnumpy(), arrays[3])
    record(benchmark, "ckpt_load", "ckpt_np_load", target=1.25)


def test_load_distributed_checkpoint(benchmark, sharded, record):
    net, arrays, d = sharded
    path = str(d / "s.safetensors")
    files = [str(d / f"rank_{r}" / "s.safetensors") for r in range(8)]
    if not os.path.exists(files[0]):
        dm.save_checkpoint(net, path, integrated_save=False)
    benchmark.pedantic(dm.load_distributed_checkpoint, (net, files), rounds=5, iterations=1)
    _gbps(benchmark)
    benchmark.extra_info["correct"] = np.array_equal(net.w1.asnumpy(), arrays[1])
    record(benchmark, "ckpt_load_distributed", "ckpt_np_load", target=1.25)
