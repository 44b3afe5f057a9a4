"""The GPT example (examples/gpt_model.py, examples/gpt_3d.py): training on 8 simulated
devices gives the stand-alone losses and weights -- tensor parallel (dp x mp, PyNative
and GRAPH_MODE) and in three dimensions (dp x mp x pp with the parallel optimizer and
pipeline stages); ``check_equivalence`` passes on the 3-D step (and names the op when
one is wrong); the script prints the same losses under ``python -m dualmode.run
--worker_num 8`` as real MPI ranks."""
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import dualmode as dm
from dualmode import communication, nn, ops

from _devices import devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import gpt_3d  # noqa: E402
from gpt_model import GPT, GPTConfig, causal_mask, synthetic_batch  # noqa: E402

TRAIN_RTOL = 1e-4


def _losses(out):
    """[(sharded, one device)] from the script's output."""
    return [(float(a), float(b)) for a, b in
            re.findall(r"loss is (\S+)\s+\(one device: (\S+)\)", out)]


# ---------------------------------------------------------------------------
# the model itself
# ---------------------------------------------------------------------------
def _np_gpt_loss(net, ids, labels, cfg):
    """The stand-alone GPT's loss in numpy (float64) from its parameters."""
    p = {q.name: q.asnumpy().astype(np.float64) for q in net.trainable_params()}
    B, S, H, nh = ids.shape[0], cfg.seq_length, cfg.hidden_size, cfg.num_heads
    hd = H // nh

    def ln(x, name):
        m = x.mean(-1, keepdims=True)
        v = x.var(-1, keepdims=True)
        return (x - m) / np.sqrt(v + cfg.layer_norm_eps) * p[f"{name}.gamma"] + \
            p[f"{name}.beta"]

    def lin(x, name):
        return x @ p[f"{name}.weight"] + p[f"{name}.bias"]

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    x = (p["embedding.embedding_table"][ids] + p["embedding.position_embedding"])
    x = x.reshape(B * S, H)
    for i in range(cfg.num_layers):
        b = f"blocks.{i}"
        h = ln(x, f"{b}.ln1")
        q, k, v = (lin(h, f"{b}.attention.{n}").reshape(B, S, nh, hd).transpose(0, 2, 1, 3)
                   for n in ("query", "key", "value"))
        s = np.where(causal_mask(S), q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd), -1e9)
        e = np.exp(s - s.max(-1, keepdims=True))
        ctx = (e / e.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(B * S, H)
        x = x + lin(ctx, f"{b}.attention.projection")
        x = x + lin(gelu(lin(ln(x, f"{b}.ln2"), f"{b}.mlp.mapping")), f"{b}.mlp.projection")
    logits = ln(x, "head.ln_f") @ p["embedding.embedding_table"].T
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -logp[np.arange(B * S), labels.reshape(-1)].mean()


def test_gpt_stand_alone_loss_equals_numpy():
    cfg = GPTConfig()
    with devices(None):
        dm.set_seed(1)
        net = GPT(cfg)
        ids, labels = synthetic_batch(cfg, np.random.default_rng(0))
        loss = net(dm.Tensor(ids), dm.Tensor(labels))
        want = _np_gpt_loss(net, ids, labels, cfg)
    np.testing.assert_allclose(float(loss.asnumpy()), want, rtol=1e-5)
    # the untrained model is close to uniform over the vocabulary
    assert abs(want - np.log(cfg.vocab_size)) < 0.2


def test_gpt_config_errors():
    with pytest.raises(ValueError, match=r"GPTConfig: num_heads: mp=3 must divide "
                                         r"num_heads=4"):
        GPTConfig(mp=3)
    with pytest.raises(ValueError, match=r"GPTConfig: vocab_size: mp=8 must divide "
                                         r"vocab_size=60"):
        GPTConfig(vocab_size=60, num_heads=8, mp=8)
    with pytest.raises(ValueError, match=r"GPTConfig: batch_size: dp \* micro_size = 16 "
                                         r"must divide batch_size=8"):
        GPTConfig(dp=4, micro_size=4)
    with pytest.raises(ValueError, match=r"GPTConfig: dp=0 must be an int >= 1"):
        GPTConfig(dp=0)


def _train(cfg, n, steps, graph=False, parallel_optimizer=False):
    """Losses and final weights of `steps` Momentum steps on n devices (1:
    stand-alone)."""
    try:
        losses, net, _, report = gpt_3d.train(cfg, n, steps, parallel_optimizer,
                                              graph=graph)
        weights = {p.name: p.asnumpy() for p in net.trainable_params()}
    finally:
        dm.set_context(mode=dm.PYNATIVE_MODE)
        dm.reset_auto_parallel_context()
        communication.init()
    return losses, weights, report


@pytest.mark.parametrize("dp,mp", [(2, 4), (4, 2), (1, 8), (8, 1)])
def test_gpt_trains_on_8_devices_as_on_one(dp, mp):
    cfg = GPTConfig(dp=dp, mp=mp, num_heads=8, vocab_size=64, batch_size=8)
    ref, ref_w, _ = _train(cfg, 1, 3)
    losses, w, report = _train(cfg, 8, 3)
    np.testing.assert_allclose(losses, ref, rtol=TRAIN_RTOL)
    assert ref[-1] < ref[0]
    for name in ref_w:
        np.testing.assert_allclose(w[name], ref_w[name], rtol=TRAIN_RTOL, atol=1e-6,
                                   err_msg=name)
    if mp > 1:
        # Megatron's forward: one AllReduce of the activations per row-parallel layer
        # (2 a block) and one for the vocabulary-parallel embedding, each over mp
        resolves = [r for r in report.records if r.kind == "AllReduce" and
                    r.reason in ("forward", "redistribution") and r.op in ("MatMul", "Gather")]
        assert len(resolves) == 3 * (2 * cfg.num_layers + 1)
        assert {r.group_size for r in resolves} == {mp}


def test_gpt_trains_in_graph_mode_as_on_one_device():
    cfg = GPTConfig(dp=2, mp=4)
    ref, ref_w, _ = _train(cfg, 1, 3)
    losses, w, _ = _train(cfg, 8, 3, graph=True)
    np.testing.assert_allclose(losses, ref, rtol=TRAIN_RTOL)
    for name in ref_w:
        np.testing.assert_allclose(w[name], ref_w[name], rtol=TRAIN_RTOL, atol=1e-6,
                                   err_msg=name)


# ---------------------------------------------------------------------------
# three dimensions: dp x mp x pp with the parallel optimizer
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dp,mp,pp,micro,layers", [(2, 2, 2, 2, 2), (1, 2, 4, 2, 4),
                                                   (2, 1, 4, 4, 4), (2, 2, 2, 1, 3)])
def test_gpt_trains_in_three_dimensions_as_on_one_device(dp, mp, pp, micro, layers):
    cfg = GPTConfig(dp=dp, mp=mp, pp=pp, micro_size=micro, num_layers=layers)
    ref, ref_w, _ = _train(cfg, 1, 3)
    losses, w, report = _train(cfg, 8, 3, parallel_optimizer=dp > 1)
    np.testing.assert_allclose(losses, ref, rtol=TRAIN_RTOL)
    assert ref[-1] < ref[0]
    for name in ref_w:
        np.testing.assert_allclose(w[name], ref_w[name], rtol=TRAIN_RTOL, atol=1e-6,
                                   err_msg=name)
    # activations forward and their gradients back, per stage boundary and micro-batch,
    # and once a step the tied embedding table (stage 0's weight read by the last
    # stage's logits) forward and its gradient back
    assert report.count("Send", "pipeline") == 3 * (2 * micro * (pp - 1) + 2)
    tied = [r for r in report.records if r.kind == "Send" and r.op == "head"]
    assert len(tied) == 3 * 2
    assert report.count("Receive", "pipeline") == report.count("Send", "pipeline")
    if dp > 1:
        # the parallel optimizer: gradients ReduceScattered over dp, every weight's
        # updated slices AllGathered back; no gradient AllReduce is left
        n = len(ref_w)
        assert report.count("ReduceScatter", "gradient") == 3 * n
        assert report.count("AllGather", "parallel_optimizer") == 3 * n
        assert report.count("AllReduce", "gradient") == 0


def _three_d_context():
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                                 full_batch=True, pipeline_stages=2,
                                 enable_parallel_optimizer=True,
                                 parallel_optimizer_config={"parallel_optimizer_threshold": 0})
    communication.init()


# ---------------------------------------------------------------------------
# check_equivalence on the parallel step
# ---------------------------------------------------------------------------
def test_check_equivalence_on_the_gpt_step():
    cfg = GPTConfig(dp=2, mp=4)
    ids, labels = synthetic_batch(cfg, np.random.default_rng(0))
    with devices(8, full_batch=True):
        dm.set_seed(1)
        net = GPT(cfg)
        rep = dm.parallel.check_equivalence(net, dm.Tensor(ids), dm.Tensor(labels),
                                            device_num=8)
    assert rep.ok, str(rep)
    assert rep.first_divergent_op is None
    assert rep.max_abs_diff < 1e-5


def test_check_equivalence_on_the_three_dimensional_step():
    """dp=2 x mp=2 x pp=2, 2 micro-batches, the parallel optimizer: the pipelined
    network's loss and every weight's gradient equal the stand-alone run's."""
    cfg = GPTConfig(dp=2, mp=2, pp=2, micro_size=2)
    ids, labels = synthetic_batch(cfg, np.random.default_rng(0))
    with devices(None):
        _three_d_context()
        dm.set_seed(1)
        net = GPT(cfg)
        model = nn.PipelineCell(net, cfg.micro_size)
        rep = dm.parallel.check_equivalence(model, dm.Tensor(ids), dm.Tensor(labels),
                                            device_num=8)
        assert dm.get_auto_parallel_context("pipeline_stages") == 2     # restored
    assert rep.ok, str(rep)
    assert rep.max_abs_diff < 1e-5
    grads = [v for v in rep.values if v.kind == "gradient"]
    assert len(grads) == len(net.trainable_params()) and all(v.ok for v in grads)
    assert rep.device_num == 8 and "PipelineTransfer" in rep.only_sharded


def test_check_equivalence_names_a_wrong_op_in_the_gpt_step():
    """A bug planted in one op (the attention's Softmax squares its input on the sharded
    run only) is found: the Softmax is named as the first op whose output differs."""
    cfg = GPTConfig(dp=2, mp=4, num_layers=1)
    ids, labels = synthetic_batch(cfg, np.random.default_rng(0))
    with devices(8, full_batch=True):
        dm.set_seed(1)
        net = GPT(cfg)
        attn = net.blocks[0].attention
        real = attn.softmax

        class Wrong(ops.Softmax):
            def construct(self, x):
                if communication.get_group_size() > 1 and \
                        dm.get_auto_parallel_context("parallel_mode") != "stand_alone":
                    x = ops.square(x)
                return super().construct(x)
        wrong = Wrong(-1).shard(real.in_strategy)
        attn.softmax = wrong
        rep = dm.parallel.check_equivalence(net, dm.Tensor(ids), dm.Tensor(labels),
                                            device_num=8)
    assert not rep.ok
    assert rep.first_divergent_op == "Softmax", str(rep)


# ---------------------------------------------------------------------------
# the script, simulated and under MPI
# ---------------------------------------------------------------------------
def test_gpt_3d_script_prints_equal_losses(capsys):
    losses, ref, report = gpt_3d.main(["--steps", "3"])
    out = capsys.readouterr().out
    pairs = _losses(out)
    assert len(pairs) == 3
    np.testing.assert_allclose(losses, ref, rtol=TRAIN_RTOL)
    np.testing.assert_allclose([a for a, _ in pairs], [b for _, b in pairs], rtol=TRAIN_RTOL)
    assert "8 devices as dp=2 x mp=2 x pp=2, parallel optimizer on" in out
    assert "blocks.0.attention.query.matmul (MatMul)" in out
    assert "blocks on [0, 1], the head and loss on stage 1" in out
    assert re.search(r"blocks\.0\.mlp\.mapping\.weight\s+\(32, 128\)\s+-> \(32, 64\)", out)
    assert "stage 0 F0 F1 .  B0 .  B1" in out          # the 1F1B table
    for reason in ("pipeline", "gradient", "parallel_optimizer"):
        assert re.search(rf"\n  {reason}\s+\d+ x", out), reason
    assert report.count("Send", "pipeline") == 3 * (2 * 2 + 2)
    assert report.count("AllGather", "parallel_optimizer") > 0
    state = re.search(r"Momentum state per device: (\S+) KiB, weight slices it updates: "
                      r"(\S+) KiB \(one device: (\S+) and (\S+) KiB\)", out)
    assert state and float(state.group(1)) < float(state.group(3)) / 2, out


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
@pytest.mark.parametrize("args,shape", [([], "dp=2 x mp=2 x pp=2"),
                                        (["--pp", "1"], "dp=4 x mp=2 x pp=1")],
                         ids=["3d", "dp-mp"])
def test_gpt_3d_script_under_mpi_prints_the_simulated_losses(tmp_path, capsys, args, shape):
    """8 real ranks (the parallel optimizer on; in 3-D each rank runs its pipeline stage,
    activations sent between ranks) print the simulated run's losses, which are the
    stand-alone run's."""
    pytest.importorskip("mpi4py")
    gpt_3d.main(["--steps", "3", *args])
    sim = _losses(capsys.readouterr().out)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "dualmode.run", "--worker_num", "8",
                           "--timeout", "120", "--log_dir", str(tmp_path / "logs"),
                           os.path.join(EXAMPLES, "gpt_3d.py"), "--steps", "3", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mpi = _losses(proc.stdout)
    assert len(mpi) == 3, proc.stdout
    np.testing.assert_allclose([a for a, _ in mpi], [a for a, _ in sim], rtol=TRAIN_RTOL)
    np.testing.assert_allclose([b for _, b in mpi], [b for _, b in sim], rtol=TRAIN_RTOL)
    np.testing.assert_allclose([a for a, _ in mpi], [b for _, b in mpi], rtol=TRAIN_RTOL)
    assert f"8 devices as {shape}, parallel optimizer on" in proc.stdout
