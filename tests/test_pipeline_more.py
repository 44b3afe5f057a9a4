"""Pipeline parallelism, more: the tied embedding table's gradient goes back to the first
stage in the pieces the table was sent in (CommReport bytes against a hand count, the
numbers against one device), the layout rule behind it, and that a stage boundary
copies no activation (the next stage reads the sent buffer itself)."""
import os
import sys

import numpy as np
import pytest

import dualmode as dm
from dualmode import communication, nn
from dualmode.parallel import CommReport
from dualmode.parallel.pipeline import gradient_layout
from dualmode.parallel.tensor_layout import TensorLayout

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
from gpt_model import GPT, GPTConfig, synthetic_batch  # noqa: E402


def _gpt_steps(cfg, devices, scheduler="1f1b", steps=2, watch=None, opt="sgd",
               after=None):
    """Losses, weights by name and the CommReport of `steps` SGD (or Momentum) steps of
    the GPT in a PipelineCell: on `devices` simulated devices with cfg.pp stages, or
    stand-alone (devices None). `watch(net)` runs before, `after(net, optimizer)`
    after the steps."""
    dm.reset_auto_parallel_context()
    communication.init()
    if devices:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=devices,
                                     pipeline_stages=cfg.pp,
                                     pipeline_config={"pipeline_scheduler": scheduler})
        communication.init()
    try:
        dm.set_seed(0)
        net = GPT(cfg)
        if watch is not None:
            watch(net)
        model = nn.PipelineCell(net, cfg.micro_size)
        opt = nn.SGD(net.trainable_params(), 0.5) if opt == "sgd" else \
            nn.Momentum(net.trainable_params(), 0.1, 0.9)
        grad_fn = dm.value_and_grad(model, None, opt.parameters)
        ids, labels = synthetic_batch(cfg, np.random.default_rng(0))
        losses = []
        with CommReport() as report:
            for _ in range(steps):
                loss, grads = grad_fn(dm.Tensor(ids), dm.Tensor(labels))
                opt(grads)
                losses.append(float(loss.asnumpy()))
        if after is not None:
            after(net, opt)
        return np.array(losses), {p.name: p.asnumpy().copy()
                                  for p in net.trainable_params()}, report
    finally:
        dm.reset_auto_parallel_context()
        communication.init()


@pytest.mark.parametrize("scheduler", ["1f1b", "gpipe"])
def test_tied_table_gradient_goes_back_in_the_slices_it_was_sent_in(scheduler):
    """GPT dp 2 x mp 2 x pp 2, 2 micro-batches: the embedding table (vocabulary 64 x
    hidden 32, its rows split over mp on the first stage) goes to the head on the last
    stage once a step as each device's half (32 x 32 floats), and its gradient, which the
    head's MatMul makes whole on every device (a pending sum over dp), comes back once a
    step as the same half of each device's share: 4 KiB, not the whole table's 8 KiB.
    The weights still equal one device's."""
    cfg = GPTConfig(dp=2, mp=2, pp=2, micro_size=2)
    ref_losses, ref_w, _ = _gpt_steps(GPTConfig(micro_size=2), None)
    losses, w, report = _gpt_steps(cfg, 8, scheduler)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, want in ref_w.items():
        np.testing.assert_allclose(w[name], want, rtol=1e-4, atol=1e-6, err_msg=name)
    steps, micro = 2, 2
    half_table = (64 // 2) * 32 * 4                       # bytes per device
    head = [r for r in report.records if r.reason == "pipeline" and r.op == "head"]
    assert [(r.kind, r.bytes_per_device) for r in head] == \
        [("Send", half_table), ("Receive", half_table)] * 2 * steps
    # per micro-batch one activation into blocks.1 and its gradient back: 2 sequences
    # (8 / 2 micro-batches / 2 over dp) of 8 tokens of hidden 32 per device
    act = 2 * 8 * 32 * 4
    assert report.count("Send", "pipeline") == steps * (2 * micro + 2)
    assert report.bytes("Send", "pipeline") == steps * (2 * micro * act + 2 * half_table)
    assert report.bytes("Send") == report.bytes("Send", "pipeline")


def test_gradient_layout_keeps_the_sent_pieces_without_communication():
    dm_, shape = (2, 2), (64, 32)
    rows = TensorLayout(dm_, ((1,), ()), shape)             # rows split over axis 1
    whole_dp = TensorLayout(dm_, ((), ()), shape, partial=(0,))   # pending over axis 0
    got = gradient_layout(rows, whole_dp)
    assert got == TensorLayout(dm_, ((1,), ()), shape, partial=(0,))
    assert got.local_shape == (32, 32)
    # pending over the axis that splits the sent rows: cutting would need a collective
    whole_mp = TensorLayout(dm_, ((), ()), shape, partial=(1,))
    assert gradient_layout(rows, whole_mp) is whole_mp
    # already as small: kept as it arrives
    cols = TensorLayout(dm_, ((), (1,)), shape, partial=(0,))
    assert gradient_layout(rows, cols) is cols
    same = TensorLayout(dm_, ((1,), ()), shape, partial=(0,))
    assert gradient_layout(rows, same) is same
    # nothing known about the sent value, or a whole one: kept
    assert gradient_layout(None, whole_dp) is whole_dp
    whole = TensorLayout(dm_, ((), ()), shape)
    assert gradient_layout(whole, whole_dp) is whole_dp
    # a whole value on every device (no layout): each keeps its rows
    assert gradient_layout(rows, None) == rows
    assert gradient_layout(whole, None) is None


def test_a_stage_boundary_copies_no_activation():
    """Simulated devices: block 1 (the second stage) reads block 0's output buffer itself,
    forward, for every micro-batch; what is sent per device is exactly that activation's
    bytes (no padding, nothing else with it)."""
    seen = []

    def watch(net):
        blocks = net.blocks
        first, second = type(blocks[0]), type(blocks[1])

        class In(second):
            def construct(self, x):
                seen.append(("in", x))
                return super().construct(x)

        class Out(first):
            def construct(self, x):
                out = super().construct(x)
                seen.append(("out", out))
                return out

        blocks[0].__class__, blocks[1].__class__ = Out, In

    cfg = GPTConfig(dp=2, mp=2, pp=2, micro_size=2)
    _, _, report = _gpt_steps(cfg, 8, steps=1, watch=watch)
    outs = [x for kind, x in seen if kind == "out"]
    ins = [x for kind, x in seen if kind == "in"]
    assert len(outs) == len(ins) == 2
    for sent, got in zip(outs, ins):
        assert got is not sent and got._layout == sent._layout
        assert got._data is sent._data                    # the same buffer, not a copy
    # forward the activation, backward its gradient (the same shape), per micro-batch
    sends = [r for r in report.records if r.kind == "Send" and r.op == "blocks.1"]
    assert [r.bytes_per_device for r in sends] == [outs[0]._data[0].nbytes] * 4
    assert outs[0]._data[0].nbytes == 2 * 8 * 32 * 4


def test_per_rank_checkpoint_of_a_pipeline_on_simulated_devices(tmp_path):
    """save_checkpoint(..., integrated_save=False) with 2 stages of 4 devices writes one
    file per world rank (rank_0 .. rank_7): ranks 0-3 the first stage's weights and
    optimizer states as their slices over its 4 devices, ranks 4-7 the second's (the
    tied table only with the first stage, whose weight it is); merged, and loaded into a
    network of another layout, they are the weights one device trains."""
    from dualmode.train.reshard import (load_distributed_checkpoint, merge_sliced_checkpoints,
                                        transform_checkpoints)
    from dualmode.train.safetensors_io import CheckpointError, CheckpointFile
    from dualmode.train.serialization import sliced_path

    cfg = GPTConfig(dp=2, mp=2, pp=2, micro_size=2)
    kept = {}

    def save(net, opt):
        dm.save_checkpoint([net, opt], str(tmp_path / "gpt.ckpt"), integrated_save=False)
        kept["names"] = {p.name for p in net.trainable_params()}
        kept["stage0"] = {p.name for p in net.embedding.trainable_params()} | \
            {p.name for b in net.blocks if b.pipeline_stage == 0
             for p in b.trainable_params()}

    ref_losses, ref_w, _ = _gpt_steps(GPTConfig(micro_size=2), None, opt="momentum")
    losses, w, _ = _gpt_steps(cfg, 8, opt="momentum", after=save)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    files = [sliced_path(str(tmp_path / "gpt.ckpt"), r) for r in range(8)]
    for r, path in enumerate(files):
        with CheckpointFile(path) as f:
            weights = {n for n in f.names if n in kept["names"]}
            assert f.meta["rank"] == r and f.meta["stage"] == r // 4
            assert f.meta["stage_rank"] == r % 4 and f.meta["stages"] == 2
            if r < 4:
                assert weights == kept["stage0"]
            else:
                assert weights == kept["names"] - kept["stage0"]
            assert all(f"moments.{n}" in f.names for n in weights)
            assert "global_step" in f.names
            # the table's rows split over mp: each device of stage 0 holds half of them
            if r < 4:
                assert f.shape("embedding.embedding_table") == (32, 32)
    merge_sliced_checkpoints(files, None, str(tmp_path / "merged.ckpt"))
    merged = dm.load_checkpoint(str(tmp_path / "merged.ckpt"))
    for name, want in ref_w.items():
        np.testing.assert_allclose(merged[name].asnumpy(), want, rtol=1e-4, atol=1e-6,
                                   err_msg=name)
    transform_checkpoints(str(tmp_path), str(tmp_path / "whole"))   # the same, offline
    whole = dm.load_checkpoint(str(tmp_path / "whole" / "gpt.ckpt"))
    assert set(whole) == set(merged)
    for name in merged:
        np.testing.assert_array_equal(whole[name].asnumpy(), merged[name].asnumpy())
    # the files of one stage only, or one file short: refused by name, nothing written
    for given, match in [(files[:4], "holds pipeline stage 0 of 2"),
                         (files[:7], "run of 2 pipeline stages, but 7 files")]:
        with pytest.raises(CheckpointError, match=match):
            merge_sliced_checkpoints(given, None, str(tmp_path / "bad.ckpt"))
        assert not os.path.exists(tmp_path / "bad.ckpt")
    # into one device's network, read from the per-rank files directly
    dm.reset_auto_parallel_context()
    communication.init()
    dm.set_seed(1)
    one = GPT(GPTConfig(micro_size=2))
    assert load_distributed_checkpoint(one, files) == []
    for p in one.trainable_params():
        np.testing.assert_allclose(p.asnumpy(), ref_w[p.name], rtol=1e-4, atol=1e-6,
                                   err_msg=p.name)


def test_a_stage_boundary_copies_no_activation_under_mpi(tmp_path):
    """Two real ranks, one stage each, 2 micro-batches: stage 0 hands MPI its block's
    output buffer itself (forward, per micro-batch), stage 1's block reads the buffer MPI
    received into, and each transfer's Send is the activation's bytes (8 rows of 8
    floats per micro-batch), forward and its gradient back."""
    from _mpi import run_mpi_script

    run_mpi_script("pipeline_copies.py", [tmp_path], tmp_path, ranks=2, timeout=120)
    act = (16 // 2) * 8 * 4                   # one device a stage: the whole micro-batch
    for rank in range(2):
        data = np.load(tmp_path / f"rank{rank}.npz")
        assert int(data["stage"]) == rank
        assert int(data["act"]) == act
        assert list(data["same"]) == [True, True]
        assert list(data["sends"]) == [act, act]   # stage 0: activations, 1: gradients


def test_micro_batch_gradients_add_in_place_and_equal_one_device(monkeypatch):
    """GPT dp 2 x mp 2 x pp 2 (hidden 128) with 4 micro-batches (1F1B): from the third
    micro-batch on, each weight's gradient is added into the sum's own buffer in place
    (for every weight of both stages, each step; both as written stacks and, for the
    larger products' pending sums, as their known totals), and the weights equal one
    device's."""
    from dualmode.communication.totals import DeferredShares, stored
    from dualmode.parallel import pipeline

    done = []
    add_in_place = pipeline._add_in_place

    def count(a, g):
        ok = add_in_place(a, g)
        done.append((ok, type(stored(a)) is DeferredShares))
        return ok

    monkeypatch.setattr(pipeline, "_add_in_place", count)
    size = dict(micro_size=4, batch_size=16, hidden_size=128, vocab_size=256,
                seq_length=16)
    ref_losses, ref_w, _ = _gpt_steps(GPTConfig(**size), None, opt="momentum")
    assert not done                         # one device: no pipeline run
    losses, w, _ = _gpt_steps(GPTConfig(dp=2, mp=2, pp=2, **size), 8, opt="momentum")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, want in ref_w.items():
        np.testing.assert_allclose(w[name], want, rtol=1e-4, atol=1e-6, err_msg=name)
    # 2 steps x 2 later micro-batches x every weight (each stage's own)
    assert sum(ok for ok, _ in done) >= 2 * 2 * len(ref_w)
    assert any(ok and totals for ok, totals in done)
    assert any(ok and not totals for ok, totals in done)


def test_tied_table_gradient_in_slices_under_mpi(tmp_path):
    """The GPT (mp 2 x pp 2) on 4 real ranks, 2 micro-batches: every rank's losses and
    its stage's weights equal the simulated run's, and the table goes to the head and
    its gradient comes back as each rank's half of it (32 x 32 floats), once a step;
    the activations' transfers are as on simulated devices."""
    from _mpi import load_mpi_script, run_mpi_script

    run_mpi_script("pipeline_gpt.py", [tmp_path], tmp_path, ranks=4, timeout=300)
    mod = load_mpi_script("pipeline_gpt.py")
    try:
        ref_losses, ref_weights, ref_sends = mod.train(devices=4)
    finally:
        dm.reset_auto_parallel_context()
        communication.init()
    half_table = (64 // 2) * 32 * 4
    act = (8 // 2) * 8 * 32 * 4                 # 4 sequences of 8 tokens, hidden 32
    # simulated devices record every stage's Sends: per micro-batch the activation on
    # and its gradient back, once the table on and its gradient back
    assert sorted(ref_sends) == sorted([("blocks.1", act)] * 4 + [("head", half_table)] * 2)
    mine = {0: [], 1: []}
    for rank in range(4):
        data = np.load(tmp_path / f"rank{rank}.npz", allow_pickle=False)
        stage = int(data["stage"])
        assert stage == rank // 2
        np.testing.assert_allclose(data["losses"], ref_losses, rtol=1e-5)
        want = ref_weights[stage]
        assert sorted(data["names"]) == sorted(want)
        for name, w in want.items():
            np.testing.assert_allclose(data[f"w_{name}"], w, rtol=1e-4, atol=1e-6,
                                       err_msg=name)
        sends = sorted(zip(data["send_cells"].tolist(), data["send_bytes"].tolist()))
        mine[stage].append(sends)
    # stage 0 sends the activations and the table; stage 1 the gradients of both
    assert mine[0] == [sorted([("blocks.1", act)] * 2 + [("head", half_table)])] * 2
    assert mine[1] == mine[0]
