"""Pipeline parallelism (pipeline_stages, cell.pipeline_stage, nn.PipelineCell) on
simulated devices: training equals one device (the same program stand-alone, and the
whole batch by hand), the Send/Receive transfers between stages, the schedule tables,
and the errors."""
import gc

import numpy as np
import pytest

import dualmode as dm
from dualmode import communication, nn, ops
from dualmode.parallel import CommReport, pipeline_schedule
from dualmode.parallel.report import parameter_bytes_per_device

B, D = 16, 8          # batch rows, width of every layer


def _weights(stages, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((D, D)) * 0.4).astype(np.float32) for _ in range(stages)]


class Block(nn.Cell):
    """relu(x @ w + b) with an optional MatMul strategy."""

    def __init__(self, w, strategy=None):
        super().__init__()
        self.w = dm.Parameter(dm.Tensor(w.copy()), name="w")
        self.b = dm.Parameter(dm.Tensor(np.full((D,), 0.1, np.float32)), name="b")
        self.matmul = ops.MatMul()
        if strategy is not None:
            self.matmul.shard(strategy)
        self.relu = ops.ReLU()

    def construct(self, x):
        y = self.relu(self.matmul(x, self.w) + self.b)
        tied = self.__dict__.get("tied")
        return y if tied is None else y + ops.matmul(x, tied) * 0.5


class MLP(nn.Cell):
    def __init__(self, weights, strategies=None):
        super().__init__()
        strategies = strategies or [None] * len(weights)
        self.blocks = nn.CellList([Block(w, s) for w, s in zip(weights, strategies)])

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _data(seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, D)).astype(np.float32),
            rng.standard_normal((B, D)).astype(np.float32))


def _setup(stages, scheduler="1f1b", device_num=8):
    dm.reset_auto_parallel_context()
    communication.init()
    if stages:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                     device_num=device_num, pipeline_stages=stages,
                                     pipeline_config={"pipeline_scheduler": scheduler})
        communication.init()


def _optimizer(kind, params):
    if kind == "sgd":
        return nn.SGD(params, learning_rate=0.05)
    if kind == "momentum":
        return nn.Momentum(params, learning_rate=0.05, momentum=0.9)
    return nn.Adam(params, learning_rate=0.01)


def train(stages, micro, parallel, opt="sgd", strategies=None, steps=3, scheduler="1f1b",
          reduction="mean", tied=False):
    """Losses and weights after `steps` steps of PipelineCell(WithLossCell(MLP)) with
    `stages` blocks, one per stage; `parallel`: pipeline parallel on 8 simulated
    devices, else stand-alone."""
    _setup(stages if parallel else None, scheduler)
    net = MLP(_weights(stages), strategies if parallel else None)
    for k, block in enumerate(net.blocks):
        block.pipeline_stage = k
    if tied:
        net.blocks[-1].tied = net.blocks[0].w
    model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss(reduction=reduction)), micro)
    optimizer = _optimizer(opt, net.trainable_params())
    grad_fn = dm.value_and_grad(model, None, optimizer.parameters)
    x, y = _data()
    losses = []
    with CommReport() as report:
        for _ in range(steps):
            loss, grads = grad_fn(dm.Tensor(x), dm.Tensor(y))
            optimizer(grads)
            losses.append(float(loss.asnumpy()))
    weights = [p.asnumpy().copy() for p in net.trainable_params()]
    return np.array(losses), weights, report


def _close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- equal to one device


@pytest.mark.parametrize("scheduler", ["1f1b", "gpipe"])
@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_equals_stand_alone(stages, micro, scheduler):
    ref_losses, ref_w, _ = train(stages, micro, parallel=False)
    losses, w, report = train(stages, micro, parallel=True, scheduler=scheduler)
    _close(losses, ref_losses)
    for a, b in zip(w, ref_w):
        _close(a, b)
    # one activation forward and its gradient backward per boundary and micro-batch
    per_step = 2 * micro * (stages - 1)
    assert report.count("Send", "pipeline") == 3 * per_step
    assert report.count("Receive", "pipeline") == 3 * per_step
    assert report.count("Send") == report.count("Send", "pipeline")


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("stages", [2, 4])
def test_tensor_parallel_inside_stages(stages, opt):
    """Strategies are over one stage's devices: 8 / stages."""
    n = 8 // stages
    strategies = [((n // 2, 2), (2, 1)), ((n, 1), (1, 1))] * (stages // 2)
    ref_losses, ref_w, _ = train(stages, 2, parallel=False, opt=opt)
    losses, w, report = train(stages, 2, parallel=True, opt=opt, strategies=strategies)
    _close(losses, ref_losses)
    for a, b in zip(w, ref_w):
        _close(a, b)
    # the split contracted dim of the first blocks makes pending sums inside a stage
    assert report.count("AllReduce") > 0
    assert report.count("Send", "pipeline") == 3 * 2 * 2 * (stages - 1)


@pytest.mark.parametrize("stages", [2, 4])
def test_weight_shared_by_two_stages(stages):
    """The last block also reads the first block's weight (as a tied embedding): the
    weight goes from the first stage to the last once per step, its gradient comes back
    and adds to the first stage's own."""
    ref_losses, ref_w, _ = train(stages, 2, parallel=False, opt="momentum", tied=True)
    losses, w, report = train(stages, 2, parallel=True, opt="momentum", tied=True)
    _close(losses, ref_losses)
    assert len(w) == len(ref_w) == 2 * stages
    for a, b in zip(w, ref_w):
        _close(a, b)
    assert report.count("Send", "pipeline") == 3 * (2 * 2 * (stages - 1) + 2)
    # without the weight's gradient from the last stage the first stage's weight differs
    plain_losses, plain_w, _ = train(stages, 2, parallel=False, opt="momentum")
    assert not np.allclose(plain_w[0], w[0], rtol=1e-3)


def test_equals_the_whole_batch_on_one_device():
    """PipelineCell returns the sum of the micro-batch losses (as MindSpore): with a mean
    loss that is micro_size times the whole batch's mean loss, and with a summed loss
    the whole batch's loss itself; the weights after one step are those of one device
    on the whole batch (by hand, in numpy)."""
    x, y = _data()
    w0, w1 = _weights(2)
    b = np.full((D,), 0.1, np.float32)

    def whole_batch(w0, w1):
        h0 = np.maximum(x @ w0 + b, 0)
        out = np.maximum(h0 @ w1 + b, 0)
        diff = out - y
        g_out = 2 * diff * (out > 0)
        g_w1 = h0.T @ g_out
        g_h0 = (g_out @ w1.T) * (h0 > 0)
        g_w0 = x.T @ g_h0
        return (diff ** 2).sum(), g_w0, g_h0.sum(0), g_w1, g_out.sum(0)

    loss_sum, gw0, gb0, gw1, gb1 = whole_batch(w0, w1)
    for reduction, scale in (("sum", 1.0), ("mean", 4.0 / (B * D))):
        losses, w, _ = train(2, 4, parallel=True, steps=1, reduction=reduction)
        _close(losses[0], loss_sum * scale)
        lr = 0.05
        for got, start, g in zip(w, (w0, b, w1, b), (gw0, gb0, gw1, gb1)):
            _close(got, start - lr * scale * g)


def test_model_train_and_train_one_step_cell():
    """dm.train.Model and nn.TrainOneStepCell train a PipelineCell as value_and_grad
    does (Model: the network is the top-level call; TrainOneStepCell: the inputs are
    split before the PipelineCell cuts them)."""
    ref_losses, ref_w, _ = train(2, 2, parallel=False, steps=2)
    x, y = _data()
    for how in ("model", "one_step"):
        _setup(2)
        net = MLP(_weights(2))
        net.blocks[0].pipeline_stage = 0
        net.blocks[1].pipeline_stage = 1
        model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), 2)
        opt = nn.SGD(net.trainable_params(), learning_rate=0.05)
        losses = []
        if how == "model":
            ds = dm.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(B)
            seen = []

            class Keep(dm.train.Callback):
                def step_end(self, run_context):
                    seen.append(float(run_context.original_args().net_outputs.asnumpy()))

            dm.train.Model(model, optimizer=opt).train(2, ds, callbacks=[Keep()])
            losses = seen
        else:
            step = nn.TrainOneStepCell(model, opt)
            for _ in range(2):
                losses.append(float(step(dm.Tensor(x), dm.Tensor(y)).asnumpy()))
        _close(np.array(losses), ref_losses)
        for a, b in zip([p.asnumpy() for p in net.trainable_params()], ref_w):
            _close(a, b)


def test_micro_batch_interleaved_equals_stand_alone():
    x, y = _data()
    out = []
    for parallel in (False, True):
        _setup(None)
        if parallel:
            dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=4)
            communication.init()
        net = MLP(_weights(2))
        model = nn.MicroBatchInterleaved(nn.WithLossCell(net, nn.MSELoss()), 2)
        opt = nn.SGD(net.trainable_params(), learning_rate=0.05)
        grad_fn = dm.value_and_grad(model, None, opt.parameters)
        loss, grads = grad_fn(dm.Tensor(x), dm.Tensor(y))
        opt(grads)
        out.append((float(loss.asnumpy()), [p.asnumpy() for p in net.trainable_params()]))
    _close(out[0][0], out[1][0])
    for a, b in zip(out[0][1], out[1][1]):
        _close(a, b)


def test_check_equivalence_and_input_gradients():
    """check_equivalence compares the pipeline step op by op with stand-alone, the
    gradients of the inputs (cut into micro-batches on each device) included."""
    strategies = [((2, 2), (2, 1)), ((4, 1), (1, 1))]
    _setup(2)
    net = MLP(_weights(2), strategies)
    for k, block in enumerate(net.blocks):
        block.pipeline_stage = k
    model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), 2)
    x, y = _data()
    report = dm.parallel.check_equivalence(model, x, y)
    assert report.ok, str(report)
    grads = []
    for parallel in (True, False):
        _setup(2 if parallel else None)
        net = MLP(_weights(2), strategies if parallel else None)
        for k, block in enumerate(net.blocks):
            block.pipeline_stage = k
        model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), 4)
        _, g = dm.value_and_grad(model, 0, net.trainable_params())(dm.Tensor(x),
                                                                    dm.Tensor(y))
        grads.append([g[0].asnumpy()] + [w.asnumpy() for w in g[1]])
    for a, b in zip(*grads):
        _close(a, b)
    assert np.abs(grads[0][0]).max() > 0


def test_with_the_parallel_optimizer():
    """pipeline_stages=2 with enable_parallel_optimizer: each stage's Adam states are
    split over the stage's data-parallel devices; the numbers stay stand-alone's."""
    ref_losses, ref_w, _ = train(2, 2, parallel=False, opt="adam")
    _setup(2)
    dm.set_auto_parallel_context(enable_parallel_optimizer=True,
                                 parallel_optimizer_config={"parallel_optimizer_threshold": 0})
    net = MLP(_weights(2), [((2, 1), (1, 1)), ((2, 1), (1, 1))])
    for k, block in enumerate(net.blocks):
        block.pipeline_stage = k
    model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), 2)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    grad_fn = dm.value_and_grad(model, None, opt.parameters)
    x, y = _data()
    losses = []
    with CommReport() as report:
        for _ in range(3):
            loss, grads = grad_fn(dm.Tensor(x), dm.Tensor(y))
            opt(grads)
            losses.append(float(loss.asnumpy()))
    _close(np.array(losses), ref_losses)
    for p, w in zip(net.trainable_params(), ref_w):
        _close(p.asnumpy(), w)
    assert report.count("Send", "pipeline") == 3 * 2 * 2
    assert report.count(reason="parallel_optimizer") > 0
    # the weights are repeated on a stage's 4 devices (not the job's 8): split 4 ways
    shards = dm.parallel.optimizer_memory(opt).shards
    assert set(shards.values()) == {4}, shards


# ---------------------------------------------------------------- what moves where


def test_send_receive_bytes_and_stage_devices():
    """Each of a stage's 4 devices sends its shard of the micro-batch activation (2 of
    the micro-batch's 8 rows x 8 floats) to the same device of the next stage; the
    weight gradients are reduced inside each stage (groups of 4 devices)."""
    _, _, report = train(2, 2, parallel=True, steps=1)
    sends = [r for r in report.records if r.kind == "Send"]
    assert len(sends) == 4                              # 2 micro-batches, fwd + bwd
    for r in sends:
        assert (r.num_groups, r.group_size, r.bytes_per_device) == (4, 2, 2 * D * 4)
        assert r.reason == "pipeline" and r.op == "_backbone.blocks.1"
    assert report.bytes("Receive") == report.bytes("Send") == 4 * 2 * D * 4
    grads = [r for r in report.records if r.reason == "gradient"]
    assert grads and all(r.num_groups * r.group_size == 4 for r in grads)
    # the job's size is still the world's; the parallel layer runs on a stage's devices
    assert communication.get_group_size() == 8
    assert dm.parallel.devices.device_num() == 4


def test_parameter_memory_is_one_stages():
    """A device holds its stage's weights only: CommReport's parameter memory is one
    block's (the two stages hold one block each), not the network's; a weight split
    over the stage's 4 devices counts a quarter."""
    block = D * D * 4 + D * 4
    gc.collect()                       # weights of earlier tests in this process
    before = parameter_bytes_per_device()
    _, _, report = train(2, 2, parallel=False, steps=1)
    assert report.parameter_memory - before == 2 * block
    _, _, report = train(2, 2, parallel=True, steps=1)
    assert report.parameter_memory - before == block
    # Adam's two states of each weight are the weight's stage's too
    _, _, report = train(2, 2, parallel=True, steps=1, opt="adam")
    assert report.parameter_memory - before == 3 * block
    _setup(2)
    net = MLP(_weights(2), [((1, 1), (1, 4)), ((1, 1), (1, 4))])
    for k, b in enumerate(net.blocks):
        b.pipeline_stage = k
    model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), 2)
    opt = nn.SGD(net.trainable_params(), learning_rate=0.05)
    grad_fn = dm.value_and_grad(model, None, opt.parameters)
    x, y = _data()
    for _ in range(2):
        with CommReport() as report:        # the second step: the weights stored split
            opt(grad_fn(dm.Tensor(x), dm.Tensor(y))[1])
    assert report.parameter_memory - before == D * D * 4 // 4 + D * 4


def test_transfers_copy_nothing_on_simulated_devices():
    """Between two stages simulated in one process the activation is not copied: the
    next stage reads the same shards (forward) and the gradient comes back as it is."""
    seen = {}

    class Keep(nn.Cell):
        def __init__(self, block, key):
            super().__init__()
            self.block, self.key = block, key

        def construct(self, x):
            seen[self.key + "_in"] = x
            out = self.block(x)
            seen[self.key + "_out"] = out
            return out

    _setup(2)
    blocks = [Block(w, s) for w, s in zip(_weights(2), [((2, 2), (2, 1)), None])]
    net = nn.SequentialCell([Keep(blocks[0], "first"), Keep(blocks[1], "second")])
    net[0].pipeline_stage, net[1].pipeline_stage = 0, 1
    model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), 2)
    x, y = _data()
    model(dm.Tensor(x), dm.Tensor(y))
    sent, got = seen["first_out"], seen["second_in"]
    assert sent is not got and got._layout == sent._layout
    assert got._data is sent._data


def test_two_devices_per_stage_pass_whole_values():
    """Two stages of one device each (device_num=2): activations are whole tensors."""
    _setup(2, device_num=2)
    net = MLP(_weights(2))
    net.blocks[0].pipeline_stage = 0
    net.blocks[1].pipeline_stage = 1
    model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), 2)
    x, y = _data()
    with CommReport() as report:
        loss = model(dm.Tensor(x), dm.Tensor(y))
    sends = [r for r in report.records if r.kind == "Send"]
    assert [(r.num_groups, r.bytes_per_device) for r in sends] == [(1, 8 * D * 4)] * 2
    ref = train(2, 2, parallel=False, steps=1)[0][0]
    _close(float(loss.asnumpy()), ref)


# ---------------------------------------------------------------- the schedule


def test_schedule_tables():
    assert pipeline_schedule(2, 4, "1f1b").rows() == [
        "F0 F1 .  B0 F2 B1 F3 B2 .  B3".split(),
        ".  F0 B0 F1 B1 F2 B2 F3 B3 .".split()]
    assert pipeline_schedule(2, 4, "gpipe").rows() == [
        "F0 F1 F2 F3 .  .  B0 B1 B2 B3".split(),
        ".  F0 F1 F2 F3 B0 B1 B2 B3 .".split()]
    assert pipeline_schedule(4, 4, "1f1b").rows() == [
        "F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3".split(),
        ".  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 .".split(),
        ".  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .  .".split(),
        ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  .".split()]
    assert pipeline_schedule(4, 4, "gpipe").rows() == [
        "F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3".split(),
        ".  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .".split(),
        ".  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .".split(),
        ".  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .".split()]
    s = pipeline_schedule(4, 4, "1f1b")
    assert (s.num_slots, s.bubbles) == (14, 24)
    assert s.in_flight == (4, 3, 2, 1)
    assert pipeline_schedule(4, 4, "gpipe").in_flight == (4, 4, 4, 4)
    text = str(s)
    assert "stage 3  .  .  .  F0 B0" in text.replace("stage 3 ", "stage 3  ")
    assert "1F1B" in text and "idle" in text


def test_schedule_follows_the_context():
    dm.set_auto_parallel_context(pipeline_stages=2,
                                 pipeline_config={"pipeline_scheduler": "gpipe"})
    s = pipeline_schedule(micro_size=4)
    assert (s.scheduler, s.stages) == ("gpipe", 2)
    got = dm.get_auto_parallel_context("pipeline_config")
    assert type(got) is dict and got == {"pipeline_interleave": False,
                                         "pipeline_scheduler": "gpipe"}
    got["pipeline_scheduler"] = "1f1b"             # a copy: the context keeps its own
    assert dm.get_auto_parallel_context("pipeline_config")["pipeline_scheduler"] == "gpipe"
    dm.reset_auto_parallel_context()
    assert pipeline_schedule(micro_size=2).scheduler == "1f1b"


# ---------------------------------------------------------------- bad input


def _staged_model(stages, assign, micro=2):
    net = MLP(_weights(len(assign)))
    for block, k in zip(net.blocks, assign):
        if k is not None:
            block.pipeline_stage = k
    return net, nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), micro)


def _unchanged(net, before):
    for p, w in zip(net.trainable_params(), before):
        np.testing.assert_array_equal(p.asnumpy(), w)
    for block in net.blocks:
        assert "construct" not in block.__dict__


@pytest.mark.parametrize("assign, micro, match", [
    ((0, 0), 2, r"pipeline stage 1 has no cell.*pipeline_stage = 1"),
    ((0, 2), 2, r"cell '_backbone.blocks.1' has pipeline_stage=2, but pipeline_stages=2"),
    ((0, 1), 3, r"micro_size=3 does not divide the batch of input 0 .*16 rows, 4 on each"),
    ((1, 0), 2, r"cell '_backbone.blocks.1' \(pipeline_stage 0\) takes an output of "
                r"pipeline stage 1, a later stage"),
])
def test_bad_stages_and_micro_size(assign, micro, match):
    _setup(2)
    net, model = _staged_model(2, assign, micro)
    before = [p.asnumpy().copy() for p in net.trainable_params()]
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    grad_fn = dm.value_and_grad(model, None, opt.parameters)
    x, y = _data()
    with pytest.raises(ValueError, match=match):
        grad_fn(dm.Tensor(x), dm.Tensor(y))
    _unchanged(net, before)


def test_bad_context_keys_change_nothing():
    _setup(2)
    with pytest.raises(ValueError, match=r"pipeline_stages=3 does not divide device_num=8"):
        dm.set_auto_parallel_context(pipeline_stages=3)
    with pytest.raises(ValueError, match=r"pipeline_stages=3 does not divide device_num=8"):
        dm.set_auto_parallel_context(device_num=8, pipeline_stages=3)
    with pytest.raises(ValueError, match=r"pipeline_stages=4 does not divide device_num=6"):
        dm.set_auto_parallel_context(device_num=6, pipeline_stages=4)
    with pytest.raises(ValueError, match=r"pipeline_scheduler'\]='zb' is not valid; "
                                         r"expected one of '1f1b', 'gpipe'"):
        dm.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": "zb"})
    with pytest.raises(ValueError, match=r"pipeline_config has unknown key 'stages'"):
        dm.set_auto_parallel_context(pipeline_config={"stages": 2})
    with pytest.raises(ValueError, match=r"pipeline_interleave'\]=True is not supported"):
        dm.set_auto_parallel_context(pipeline_config={"pipeline_interleave": True})
    with pytest.raises(ValueError, match=r"pipeline_stages=0 is not valid"):
        dm.set_auto_parallel_context(pipeline_stages=0)
    assert dm.get_auto_parallel_context("pipeline_stages") == 2
    assert dm.get_auto_parallel_context("device_num") == 8
    assert dm.get_auto_parallel_context("pipeline_config")["pipeline_scheduler"] == "1f1b"
    assert dm.parallel.devices.device_num() == 4
    with pytest.raises(ValueError, match=r"scheduler='zb' is not valid"):
        pipeline_schedule(2, 4, "zb")
    with pytest.raises(ValueError, match=r"micro_size=0 is not valid"):
        pipeline_schedule(2, 0)


def test_bad_cell_attributes_and_wrappers():
    cell = Block(_weights(1)[0])
    with pytest.raises(ValueError, match=r"Block: pipeline_stage=-1 is not valid"):
        cell.pipeline_stage = -1
    with pytest.raises(TypeError, match=r"Block: pipeline_stage must be an int, got bool"):
        cell.pipeline_stage = True
    assert cell.pipeline_stage == -1
    with pytest.raises(ValueError, match=r"PipelineCell: micro_size=0 is not valid"):
        nn.PipelineCell(cell, 0)
    with pytest.raises(TypeError, match=r"PipelineCell: network must be a Cell"):
        nn.PipelineCell(lambda x: x, 2)
    net = MLP(_weights(2))
    with pytest.raises(KeyError, match=r"stage_config names 'blocks.7'"):
        nn.PipelineCell(net, 2, stage_config={"blocks.0": 0, "blocks.7": 1})
    with pytest.raises(ValueError, match=r"stage_config\['blocks.1'\]=-1 is not valid"):
        nn.PipelineCell(net, 2, stage_config={"blocks.0": 0, "blocks.1": -1})
    assert [b.pipeline_stage for b in net.blocks] == [-1, -1]
    nn.PipelineCell(net, 2, stage_config={"blocks.0": 0, "blocks.1": 1})
    assert [b.pipeline_stage for b in net.blocks] == [0, 1]


def test_pipeline_needs_semi_auto_and_no_attribute_weights_across_stages_in_graph_mode():
    x, y = _data()
    _setup(None)
    dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8,
                                 pipeline_stages=2)
    communication.init()
    net, model = _staged_model(2, (0, 1))
    with pytest.raises(ValueError, match=r"pipeline_stages=2 needs parallel_mode "
                                         r"'semi_auto_parallel' or 'auto_parallel'"):
        model(dm.Tensor(x), dm.Tensor(y))
    # GRAPH_MODE: a weight a later stage's compiled cell would read as an attribute
    _setup(2)
    net, model = _staged_model(2, (0, 1))
    net.blocks[1].tied = net.blocks[0].w
    before = [p.asnumpy().copy() for p in net.trainable_params()]
    dm.set_context(mode=dm.GRAPH_MODE)
    try:
        with pytest.raises(RuntimeError, match=r"PipelineCell: weight 'blocks.0.w' is held "
                                               r"by cells of pipeline stages 0 and 1 .* "
                                               r"in GRAPH_MODE"):
            dm.value_and_grad(model, None, net.trainable_params())(dm.Tensor(x),
                                                                   dm.Tensor(y))
    finally:
        dm.set_context(mode=dm.PYNATIVE_MODE)
    _unchanged(net, before)
    assert all(p._node is None for p in net.trainable_params())


def test_staged_cell_outside_pipeline_cell_is_refused():
    """Under pipeline_stages > 1 a cell with a stage runs only inside nn.PipelineCell;
    stand-alone (the reference run) it runs as any cell."""
    x, y = _data()
    _setup(2)
    net, _ = _staged_model(2, (0, 1))
    before = [p.asnumpy().copy() for p in net.trainable_params()]
    with pytest.raises(RuntimeError, match=r"Block: this cell has pipeline_stage=0 and "
                                           r"pipeline_stages=2, but it runs outside "
                                           r"nn.PipelineCell"):
        net(dm.Tensor(x))
    for p, w in zip(net.trainable_params(), before):
        np.testing.assert_array_equal(p.asnumpy(), w)
    _setup(None)
    assert net(dm.Tensor(x)).shape == (B, D)


def test_remote_values_say_what_is_wrong():
    """Under MPI a cell of another stage yields a stand-in for its output; code that
    unpacks, indexes or reads it gets an error naming the stage."""
    from dualmode.parallel.pipeline import Remote
    r = Remote(1)
    with pytest.raises(TypeError, match=r"unpacking a value of pipeline stage 1, which "
                                        r"another process computes"):
        a, b = r
    with pytest.raises(TypeError, match=r"indexing a value of pipeline stage 1"):
        r[0]
    with pytest.raises(AttributeError, match=r"reading .shape of a value of pipeline "
                                             r"stage 1"):
        r.shape
    assert getattr(r, "_layout", None) is None


def test_reset_returns_to_the_whole_world():
    _setup(2)
    assert dm.parallel.devices.device_num() == 4
    dm.reset_auto_parallel_context()
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    assert dm.parallel.devices.device_num() == 8
    dm.set_auto_parallel_context(pipeline_stages=4)
    assert dm.parallel.devices.device_num() == 2
    dm.set_auto_parallel_context(pipeline_stages=1)
    assert dm.parallel.devices.device_num() == 8


# ------------------------------------------------------------------- the 1F1B order


def _wide_step(scheduler, stages, micro, rows=4096, d=64, position=0):
    """One differentiated call of a 2-block PipelineCell on wide micro-batches: its
    loss, the input's gradient (None without `position`), the weights' gradients, the
    order it ran and the most bytes allocated at once during it."""
    import tracemalloc
    _setup(stages, scheduler)
    rng = np.random.default_rng(0)
    net = MLP([(rng.standard_normal((d, d)) * 0.1).astype(np.float32)
               for _ in range(stages)])
    for k, block in enumerate(net.blocks):
        block.b = dm.Parameter(dm.Tensor(np.zeros((d,), np.float32)), name="b")
        block.pipeline_stage = k
    model = nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), micro)
    grad_fn = dm.value_and_grad(model, position, net.trainable_params())
    x = dm.Tensor(rng.standard_normal((rows, d)).astype(np.float32))
    y = dm.Tensor(rng.standard_normal((rows, d)).astype(np.float32))
    grad_fn(x, y)
    gc.collect()
    tracemalloc.start()
    try:
        loss, grads = grad_fn(x, y)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    gx = None
    if position is not None:
        gx, grads = grads
        gx = gx.asnumpy()
    return (float(loss.asnumpy()), gx, [g.asnumpy() for g in grads], model.last_order,
            peak)


@pytest.mark.parametrize("stages, micro", [(2, 8), (4, 4), (4, 2)])
def test_1f1b_runs_in_the_schedule_order(stages, micro):
    """With the 1F1B scheduler each micro-batch's backward runs where the schedule puts
    it (the first stage's row of the time table: every micro-batch's forward and
    backward run on all stages in this process), with the numbers of the GPipe order
    (every forward, then every backward) and of one device."""
    loss, gx, grads, order, _ = _wide_step("1f1b", stages, micro, rows=64, d=8)
    table = pipeline_schedule(stages, micro, "1f1b")
    assert order == [e for e in table.table[0] if e is not None]
    g_loss, g_gx, g_grads, g_order, _ = _wide_step("gpipe", stages, micro, rows=64, d=8)
    assert g_order is None                      # GPipe: the tape's one backward pass
    np.testing.assert_allclose(loss, g_loss, rtol=1e-6)
    np.testing.assert_allclose(gx, g_gx, rtol=1e-5, atol=1e-7)
    for a, b in zip(grads, g_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_1f1b_keeps_fewer_micro_batches_alive():
    """8 micro-batches over 2 stages: GPipe keeps the activations of all 8 until the
    backward, 1F1B at most 2 (the first stage's in flight), so the most memory the
    step allocates at once is far lower; the numbers are the same."""
    loss, _, grads, order, peak = _wide_step("1f1b", 2, 8, position=None)
    g_loss, _, g_grads, _, g_peak = _wide_step("gpipe", 2, 8, position=None)
    assert max(pipeline_schedule(2, 8, "1f1b").in_flight) == 2
    assert peak < 0.5 * g_peak, (peak, g_peak)
    np.testing.assert_allclose(loss, g_loss, rtol=1e-6)
    for a, b in zip(grads, g_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_1f1b_needs_one_loss_from_the_network():
    class Pair(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def construct(self, x, y):
            out = self.net(x)
            return ops.reduce_mean((out - y) ** 2), out

    _setup(2)
    net = MLP(_weights(2))
    for k, block in enumerate(net.blocks):
        block.pipeline_stage = k
    model = nn.PipelineCell(Pair(net), 2)
    grad_fn = dm.value_and_grad(model, None, net.trainable_params())
    x, y = _data()
    before = [p.asnumpy().copy() for p in net.trainable_params()]
    with pytest.raises(TypeError, match=r"PipelineCell: with pipeline_scheduler '1f1b' the "
                                        r"network of a differentiated call must return one "
                                        r"Tensor \(its loss\), got tuple"):
        grad_fn(dm.Tensor(x), dm.Tensor(y))
    assert all(p._node is None for p in net.trainable_params())
    for p, b in zip(net.trainable_params(), before):
        np.testing.assert_array_equal(p.asnumpy(), b)
    dm.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": "gpipe"})
    loss, grads = dm.value_and_grad(model, None, net.trainable_params(), has_aux=True)(
        dm.Tensor(x), dm.Tensor(y))
    assert np.isfinite(float(loss[0].asnumpy())) and len(grads) == 4



# ------------------------------------------------------------------- GRAPH_MODE


@pytest.mark.parametrize("scheduler", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages, strategies", [
    (2, [((2, 2), (2, 1)), ((4, 1), (1, 1))]),        # tensor parallel in each stage
    (4, None),
])
def test_graph_mode_compiles_each_stage_and_equals_one_device(stages, strategies,
                                                              scheduler):
    """GRAPH_MODE: each staged cell is compiled once for its stage's devices (the
    micro-batches share one shape) and three training steps equal the stand-alone
    network's; the transfers are those of PyNative."""
    from dualmode.parallel.graph.api import compile_count
    ref_losses, ref_w, _ = train(stages, 4, parallel=False)
    _, _, eager = train(stages, 4, parallel=True, scheduler=scheduler,
                        strategies=strategies)
    dm.set_context(mode=dm.GRAPH_MODE)
    try:
        before = compile_count()
        losses, w, report = train(stages, 4, parallel=True, scheduler=scheduler,
                                  strategies=strategies)
        compiled = compile_count() - before
    finally:
        dm.set_context(mode=dm.PYNATIVE_MODE)
    assert compiled == stages                    # one graph per staged cell, 3 steps
    _close(losses, ref_losses)
    for a, b in zip(w, ref_w):
        _close(a, b)
    assert report.count("Send", "pipeline") == eager.count("Send", "pipeline") > 0
    assert report.bytes("Send", "pipeline") == eager.bytes("Send", "pipeline")


def test_graph_mode_gpt_with_a_tied_table_passed_as_an_argument():
    """The GPT of the examples (dp 2 x mp 2 x pp 2, the embedding table passed to the
    output layer of the last stage): GRAPH_MODE trains as one device."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "examples"))
    from gpt_model import GPT, GPTConfig, synthetic_batch

    def run(cfg, n, graph):
        _setup(None)
        if n:
            dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n,
                                         pipeline_stages=cfg.pp)
            communication.init()
        dm.set_seed(0)
        net = GPT(cfg)
        model = nn.PipelineCell(net, cfg.micro_size)
        opt = nn.SGD(net.trainable_params(), 0.5)
        grad_fn = dm.value_and_grad(model, None, opt.parameters)
        ids, labels = synthetic_batch(cfg, np.random.default_rng(0))
        losses = []
        if graph:
            dm.set_context(mode=dm.GRAPH_MODE)
        try:
            for _ in range(2):
                loss, grads = grad_fn(dm.Tensor(ids), dm.Tensor(labels))
                opt(grads)
                losses.append(float(loss.asnumpy()))
        finally:
            dm.set_context(mode=dm.PYNATIVE_MODE)
        return np.array(losses), {p.name: p.asnumpy() for p in net.trainable_params()}

    cfg = GPTConfig(dp=2, mp=2, pp=2, micro_size=2)
    ref, ref_w = run(GPTConfig(micro_size=2), None, False)
    losses, w = run(cfg, 8, True)
    np.testing.assert_allclose(losses, ref, rtol=1e-4)
    for name in ref_w:
        np.testing.assert_allclose(w[name], ref_w[name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)
