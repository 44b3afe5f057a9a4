"""Pipeline parallelism under backend "mpi" (2 and 4 real ranks, each running its own
stage's cells and exchanging activations and gradients as point-to-point messages)
equals the same program on simulated devices: losses on every rank, each stage's
weights, and the Send/Receive traffic; each rank runs its stage's row of the 1F1B
time table; a rank updates only its own stage's weights, the checkpoint holds every
stage's, and the per-rank checkpoint files (each rank its stage's slices) merge into
them (tests/mpi_scripts/pipeline_train.py)."""
import numpy as np
import pytest

from _mpi import load_mpi_script, run_mpi_script

import dualmode as dm
from dualmode import communication
from dualmode.parallel import pipeline_schedule
from dualmode.train.reshard import merge_sliced_checkpoints
from dualmode.train.serialization import sliced_path

SCRIPT = "pipeline_train.py"


@pytest.mark.parametrize("ranks, stages, micro, scheduler, optimizer, shard, tied", [
    (2, 2, 2, "1f1b", "sgd", False, False),
    (2, 2, 4, "gpipe", "momentum", False, False),
    (4, 2, 4, "1f1b", "adam", True, False),   # 2 devices per stage, tensor parallel in it
    (4, 4, 4, "gpipe", "sgd", False, False),
    (4, 4, 1, "1f1b", "momentum", False, False),
    (2, 2, 2, "1f1b", "momentum", False, True),   # a weight of stage 0 read by stage 1
    (4, 4, 2, "gpipe", "adam", False, True),      # ... by stage 3
])
def test_pipeline_under_mpi_equals_sim(tmp_path, ranks, stages, micro, scheduler,
                                       optimizer, shard, tied):
    run_mpi_script(SCRIPT, [tmp_path, stages, micro, scheduler, optimizer, int(shard),
                            int(tied)], tmp_path, ranks=ranks, timeout=240)
    mod = load_mpi_script(SCRIPT)
    try:
        ref_losses, ref_weights, ref_counts = mod.train(stages, micro, scheduler,
                                                        optimizer, shard, devices=ranks,
                                                        tied=tied)
    finally:
        dm.reset_auto_parallel_context()
        communication.init("sim")
    per = ranks // stages
    copies = {"sgd": 1, "momentum": 2, "adam": 3}[optimizer]
    steps = len(ref_losses)
    send_bytes = {}
    for rank in range(ranks):
        data = np.load(tmp_path / f"rank{rank}.npz")
        stage = int(data["stage"])
        assert stage == rank // per
        np.testing.assert_allclose(data["losses"], ref_losses, rtol=1e-5)
        weights = [data[f"w{i}"] for i in range(len(ref_weights[stage]))]
        for got, want in zip(weights, ref_weights[stage]):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        # this rank sends each micro-batch's activation on (all but the last stage) and
        # its gradient back (all but the first), and receives as many
        sends, receives, nbytes, memory = data["counts"][:4]
        # the order the rank ran its stage in: the time table's row of its stage (1F1B:
        # warm-up forwards, one forward one backward, cool-down backwards); GPipe runs
        # the tape's one backward pass after every forward
        order = [("F", int(m)) if m >= 0 else ("B", -int(m) - 1) for m in data["order"]]
        if scheduler == "1f1b":
            row = pipeline_schedule(stages, micro, "1f1b").table[stage]
            assert order == [e for e in row if e is not None]
        else:
            assert order == []
        # a rank holds its stage's block: w (8 x 8, split over the stage's devices in the
        # first block with shard) and b (8), float32, and the optimizer's states of them
        # (none for SGD, one for Momentum, two for Adam); a shared weight is stage 0's
        assert memory == copies * (8 * 8 * 4 // (per if shard and stage == 0 else 1)
                                   + 8 * 4)
        want = steps * micro * ((stage < stages - 1) + (stage > 0))
        if tied and stage in (0, stages - 1):      # the weight on, its gradient back
            want += steps
        assert (sends, receives) == (want, want)
        send_bytes[stage] = nbytes
    # the simulated run records every stage's transfers, each device's bytes once
    assert ref_counts[:2] == (steps * (micro * 2 * (stages - 1) + 2 * tied),) * 2
    assert ref_counts[3] == copies * (8 * 8 + 8) * 4   # the largest stage's, simulated
    assert sum(send_bytes.values()) == ref_counts[2]


@pytest.mark.parametrize("ranks, stages, micro, shard, tied, zero", [
    (2, 2, 2, False, True, False),     # one rank a stage, a weight shared by both
    (4, 2, 2, True, False, False),     # 2 ranks a stage, tensor parallel in it
    (4, 2, 4, True, False, True),      # ... with the parallel optimizer
    (4, 4, 2, False, True, True),
])
def test_a_rank_updates_only_its_own_stage_weights(tmp_path, ranks, stages, micro, shard,
                                                   tied, zero):
    """Adam with weight decay (which would change a weight whose gradient is zero): each
    rank's stage weights equal the simulated run's, the other stages' weights it holds
    keep their initial values, and its last step's gradient and parallel-optimizer
    collectives are its own stage's only (one rank per stage adds up to the simulated
    run, which records every stage's once)."""
    run_mpi_script(SCRIPT, [tmp_path, stages, micro, "1f1b", "adamw", int(shard), int(tied),
                            int(zero)], tmp_path, ranks=ranks, timeout=240)
    mod = load_mpi_script(SCRIPT)
    try:
        ref_losses, ref_weights, ref_counts = mod.train(stages, micro, "1f1b", "adamw",
                                                        shard, devices=ranks, tied=tied,
                                                        zero=zero)
    finally:
        dm.reset_auto_parallel_context()
        communication.init("sim")
    per = ranks // stages
    per_stage = {}
    for rank in range(ranks):
        data = np.load(tmp_path / f"rank{rank}.npz")
        stage = int(data["stage"])
        np.testing.assert_allclose(data["losses"], ref_losses, rtol=1e-5)
        for i, want in enumerate(ref_weights[stage]):
            np.testing.assert_allclose(data[f"w{i}"], want, rtol=1e-4, atol=1e-6)
        changed, grads, gathers, reloaded = data["counts"][4:]
        assert changed == 0, f"rank {rank} changed another stage's weights"
        assert reloaded == 1                 # its own per-rank file loads back into it
        per_stage.setdefault(stage, set()).add((int(grads), int(gathers)))
    assert all(len(v) == 1 for v in per_stage.values())   # a stage's ranks alike
    # the checkpoint (written by the first stage's process) holds every stage's trained
    # weights: loaded into a stand-alone network they are the simulated run's
    standalone = mod.MLP(stages, [None] * max(stages, 2))
    not_loaded = dm.load_param_into_net(standalone, dm.load_checkpoint(
        str(tmp_path / "net.ckpt")))
    assert not not_loaded
    want = [w for k in sorted(ref_weights) for w in ref_weights[k]]
    got = standalone.trainable_params()
    assert len(got) == len(want)
    for p, w in zip(got, want):
        np.testing.assert_allclose(p.asnumpy(), w, rtol=1e-4, atol=1e-6, err_msg=p.name)
    # the per-rank files (each rank its stage's slices) merged: the same weights
    files = [sliced_path(str(tmp_path / "sliced.ckpt"), r) for r in range(ranks)]
    merge_sliced_checkpoints(files, None, str(tmp_path / "merged.ckpt"))
    merged = dm.load_checkpoint(str(tmp_path / "merged.ckpt"))
    standalone = mod.MLP(stages, [None] * max(stages, 2))
    assert not dm.load_param_into_net(standalone, merged)
    for p, w in zip(standalone.trainable_params(), want):
        np.testing.assert_allclose(p.asnumpy(), w, rtol=1e-4, atol=1e-6, err_msg=p.name)
    assert all(f"moment1.{p.name}" in merged for p in standalone.trainable_params())
    assert sum(next(iter(v))[0] for v in per_stage.values()) == ref_counts[5]
    assert sum(next(iter(v))[1] for v in per_stage.values()) == ref_counts[6]
    if zero:
        # a stage gathers its block's w and b once a step, when they have replicas (not
        # with one device a stage; not w of the first block when tensor parallel splits it)
        want = {k: 0 if per == 1 else 2 - (shard and k == 0) for k in range(stages)}
        assert {k: next(iter(v))[1] for k, v in per_stage.items()} == want


@pytest.mark.parametrize("ranks, stages, micro, scheduler, optimizer, shard", [
    (2, 2, 2, "1f1b", "adam", False),
    (4, 2, 4, "1f1b", "momentum", True),     # tensor parallel in each 2-rank stage
    (4, 4, 2, "gpipe", "sgd", False),
])
def test_graph_mode_under_mpi_equals_sim(tmp_path, ranks, stages, micro, scheduler,
                                         optimizer, shard):
    """GRAPH_MODE on real ranks (each rank compiles its stage's cells): the losses and
    its stage's weights equal the PyNative simulated run's."""
    run_mpi_script(SCRIPT, [tmp_path, stages, micro, scheduler, optimizer, int(shard), 0,
                            0, 1], tmp_path, ranks=ranks, timeout=240)
    mod = load_mpi_script(SCRIPT)
    try:
        ref_losses, ref_weights, _ = mod.train(stages, micro, scheduler, optimizer, shard,
                                               devices=ranks)
    finally:
        dm.reset_auto_parallel_context()
        communication.init("sim")
    for rank in range(ranks):
        data = np.load(tmp_path / f"rank{rank}.npz")
        stage = int(data["stage"])
        np.testing.assert_allclose(data["losses"], ref_losses, rtol=1e-5)
        for i, want in enumerate(ref_weights[stage]):
            np.testing.assert_allclose(data[f"w{i}"], want, rtol=1e-4, atol=1e-6)
