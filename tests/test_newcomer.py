"""What a new user meets first: the calls the README and MindSpore's tutorials show, the
messages of common mistakes, examples that clean up after themselves and visibly train,
and user-facing texts that say what they mean instead of citing internal documents."""
import gzip
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, nn, ops
from dualmode.dataset.vision import MnistDataset

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _example(name):
    spec = importlib.util.spec_from_file_location(f"newcomer_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_initializer_is_callable_from_the_top_level():
    t = dm.initializer("normal", [2, 2], dm.float32)
    assert tuple(t.shape) == (2, 2) and t.dtype == dm.float32
    assert np.isfinite(t.asnumpy()).all()
    # the module stays where MindSpore keeps it
    from dualmode.common.initializer import Normal, initializer
    assert dm.initializer is initializer and Normal is dm.common.initializer.Normal


def test_reduce_op_names(sim_devices):
    assert (ops.ReduceOp.SUM, ops.ReduceOp.MAX, ops.ReduceOp.MIN, ops.ReduceOp.PROD) == \
        ("sum", "max", "min", "prod")
    sim_devices(4, mode="hybrid_parallel")
    x = Tensor(np.array([1.0, -2.0, 3.0], np.float32))
    np.testing.assert_array_equal(ops.AllReduce(ops.ReduceOp.SUM)(x).asnumpy(),
                                  [4.0, -8.0, 12.0])
    np.testing.assert_array_equal(ops.AllReduce(ops.ReduceOp.MAX)(x).asnumpy(),
                                  [1.0, -2.0, 3.0])
    with pytest.raises(ValueError, match=r"AllReduce: op='avg' is not valid; expected one of"):
        ops.AllReduce("avg")


def test_cross_entropy_with_float_class_indices_says_integers_are_expected():
    logits = Tensor(np.zeros((4, 3), np.float32))
    with pytest.raises(TypeError, match=r"CrossEntropyLoss: labels of shape \(4,\) and float "
                                        r"dtype float32: class indices must be integers"):
        nn.CrossEntropyLoss()(logits, Tensor(np.array([0.0, 1, 2, 1], np.float32)))
    # integer indices of that shape are what it takes
    loss = nn.CrossEntropyLoss()(logits, Tensor(np.array([0, 1, 2, 1], np.int32)))
    assert float(loss.asnumpy()) == pytest.approx(np.log(3.0), rel=1e-6)


def test_mnist_reader_says_to_decompress_gz_files(tmp_path):
    lenet = _example("lenet_mnist")
    plain = lenet.write_synthetic_mnist(str(tmp_path / "plain"), n=8)
    packed = tmp_path / "packed"
    packed.mkdir()
    for name in os.listdir(plain):
        with open(os.path.join(plain, name), "rb") as f, \
                gzip.open(packed / (name + ".gz"), "wb") as g:
            g.write(f.read())
    assert len(MnistDataset(plain, usage="train").create_tuple_iterator().__next__()) == 2
    with pytest.raises(ValueError, match=r"MnistDataset: file .*train-images-idx3-ubyte' is "
                                         r"missing but .*\.gz' is there: decompress it first"):
        MnistDataset(str(packed), usage="train")
    with pytest.raises(ValueError, match=r"MnistDataset: file .* is missing \(expected the "
                                         r"standard Mnist file names"):
        MnistDataset(str(tmp_path), usage="train")


def test_lenet_example_removes_its_temporary_data(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    single, sharded = _example("lenet_mnist").main(["--steps", "1", "--batch", "16",
                                                    "--device_num", "2"])
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    assert list(tmp_path.iterdir()) == []


def test_operator_parallel_example_visibly_trains():
    losses, ref, _ = _example("operator_parallel").main(["--steps", "8", "--devices", "4"])
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert losses[-1] < 0.5 * losses[0], losses


# what a user reads: docs, examples, messages and docstrings of the package
_USER_TEXTS = ([ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
               + sorted(EXAMPLES.glob("*.py"))
               + sorted(p for ext in ("py", "pyx", "pyi")
                        for p in (ROOT / "dualmode").rglob(f"*.{ext}")))
_CITATION = re.compile(r"\b[Ss]eeds?[ /]?0\d\d\b|\bSPEC\b|§|\b[Ii]ssues? #?\d+\b")


def test_user_texts_do_not_cite_internal_documents():
    bad = []
    for path in _USER_TEXTS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _CITATION.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "texts that cite documents a user does not have:\n" + "\n".join(bad)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
def test_train_example_prints_losses_on_rank_0_only_under_plain_mpiexec(tmp_path):
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = str(EXAMPLES / "train.py")
    mpi = subprocess.run([shutil.which("mpiexec"), "-n", "2", sys.executable, script,
                          "--epochs", "1"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=150)
    assert mpi.returncode == 0, mpi.stdout[-2000:] + mpi.stderr[-2000:]
    sim = subprocess.run([sys.executable, script, "--epochs", "1", "--device_num", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert sim.returncode == 0, sim.stdout[-2000:] + sim.stderr[-2000:]
    lines = [re.findall(r"^epoch: \d+ step: \d+, loss is .*$", p.stdout, re.M)
             for p in (mpi, sim)]
    assert len(lines[1]) >= 2
    assert len(lines[0]) == len(lines[1]), mpi.stdout
    assert mpi.stdout.count("final loss") == 1
