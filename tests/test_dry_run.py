"""dm.parallel.dry_run: the compile path of a real call on abstract inputs, without
running it. For models small enough to run, its collectives equal what a real compiled
step records in a CommReport (the lists compared), its CommReport-style peak equals the
report's and its liveness peak is within 5% of the live values measured while the
executor runs the step; at GPT-3 size it is checked against the closed forms."""
import gc
import json
import math
import os
import subprocess
import sys
import weakref
from collections import Counter

import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, nn, ops
from dualmode.communication import get_backend
from dualmode.nn.utils import no_init_parameters
from dualmode.parallel import CommReport, abstract, dry_run
from dualmode.parallel.auto_parallel import AutoParallel
from dualmode.parallel.graph.trace import find_parameters
from dualmode.parallel.inputs import distribute_inputs
from dualmode.parallel.report import parameter_bytes_per_device
from dualmode.tensor import live_parameters

from _devices import devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

from gpt_model import GPT, GPTConfig, synthetic_batch  # noqa: E402
from operator_parallel import Network, learnable_batch  # noqa: E402


def _train_step(loss_of, opt):
    grad_fn = dm.value_and_grad(loss_of, None, opt.parameters)

    def step(*xs):
        loss, grads = grad_fn(*xs)
        opt(grads)
        return loss
    return step


def _root(x):
    while getattr(x, "base", None) is not None:
        x = x.base
    return id(x)


def _measured_live_peak(compiled, args):
    """Run the compiled step node by node (the executor's own steps and release points)
    and measure the most per-device bytes its environment holds at once, parameters
    aside: each distinct array once (views of one buffer count once), a distributed
    value at its devices' share."""
    prog = compiled.program
    env = prog.bind(list(distribute_inputs(args)))
    params = {v.id for _, v in prog.graph.params}
    peak = 0
    for k, step in enumerate(prog.steps):
        prog.run(env, k, k + 1, keep=True)
        seen, total = set(), 0
        for vid, x in env.items():
            if vid in params or _root(x) in seen:
                continue
            seen.add(_root(x))
            lay = prog.layouts.get(vid)
            if lay is None:
                total += np.asarray(x).nbytes
            else:
                total += math.prod(lay.local_shape) * np.dtype(x.dtype).itemsize
        peak = max(peak, total)
        for vid in step[-1]:
            env.pop(vid, None)
    return peak


@pytest.fixture(autouse=True)
def _older_parameters():
    """The Parameters alive before the test (module-level weights of other test files):
    a CommReport counts every live Parameter, so a comparison with one adds theirs."""
    gc.collect()
    _OLDER[:] = [weakref.ref(p) for p in live_parameters()]
    yield
    _OLDER.clear()


_OLDER: list = []


def _older_bytes():
    """What the Parameters alive before the test store per device."""
    return parameter_bytes_per_device([p for p in (r() for r in _OLDER) if p is not None])


def _check_against_real(step, inputs, n=8, mode="semi_auto", **settings):
    """Dry-run `step` (an AutoParallel step over delayed parameters), then run it for
    real on `n` simulated devices; compare."""
    with devices(n, **settings):
        compiled_step = AutoParallel(step, mode)
        params = find_parameters(step)
        dry = dry_run(compiled_step, *[abstract(x.shape, x.dtype) for x in inputs],
                      device_num=n, link="100GbE", device_flops=1e12)
        assert all(p.has_init for p in params if p.requires_grad), \
            "the dry run made a parameter"
        tensors = [Tensor(x) for x in inputs]
        compiled_step(*tensors)                       # stores the parameters sharded
        gc.collect()
        with CommReport(link="100GbE") as real:
            compiled_step(*tensors)
        live = _measured_live_peak(compiled_step.compiled, tensors)
    assert dry.records, "nothing communicated: the comparison would prove nothing"
    assert dry.records == real.records
    assert dry.bytes() == real.bytes()
    assert dry.predicted_time() == pytest.approx(real.predicted_time(), rel=1e-12)
    assert dry.comm_peak_memory == pytest.approx(real.peak_memory, rel=0.05)
    storage = dry.parameter_bytes + dry.optimizer_state_bytes
    older = _older_bytes()
    assert storage + older == real.parameter_memory
    assert dry.peak_memory + older == pytest.approx(real.parameter_memory + live, rel=0.05)
    assert dry.flops > 0 and dry.compute_time == pytest.approx(dry.flops / 1e12)
    assert dry.step_time == pytest.approx(dry.compute_time + dry.comm_time)
    return dry, real


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
def test_operator_parallel_mlp_equals_the_real_step(mode):
    """The configured MatMul / ReLU strategies; with sharding propagation the last
    MatMul's strategy is chosen, by the same search in both runs."""
    dm.set_seed(1)
    with devices(8):
        with no_init_parameters():
            net = Network(devices=8)
            opt = nn.SGD(net.trainable_params(), 0.1)
    loss_fn = nn.CrossEntropyLoss()
    step = _train_step(lambda x, y: loss_fn(net(x), y), opt)
    image, label = learnable_batch(np.random.default_rng(0), 32)
    dry, real = _check_against_real(step, [image, label], mode=mode, gradients_mean=True)
    # the configured strategies are the ones planned
    chosen = {k: v["strategy"] for k, v in dry.strategies.items() if v["configured"]}
    assert ((2, 4), (4, 1)) in chosen.values() and ((1, 8), (8, 1)) in chosen.values()
    # per device, by hand: fc1 (784 x 512) rows split 4 ways by ((2, 4), (4, 1)), fc2
    # (512 x 512) rows split 8 ways by ((1, 8), (8, 1)), fc3 (512 x 10) whole
    assert dry.parameter_bytes == 4 * (784 * 512 // 4 + 512 * 512 // 8 + 512 * 10)
    assert real.count(reason="gradient") < len(real.records)     # not only gradients


class _CNN(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2, 2)
        self.flatten = nn.Flatten()
        self.dense = nn.Dense(4 * 4 * 4, 10)

    def construct(self, x):
        return self.dense(self.flatten(self.pool(self.relu(self.conv(x)))))


def test_cnn_data_parallel_equals_the_real_step():
    dm.set_seed(2)
    with no_init_parameters():
        net = _CNN()
        opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    step = _train_step(lambda x, y: loss_fn(net(x), y), opt)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 16).astype(np.int32)
    dry, real = _check_against_real(step, [x, y], gradients_mean=True)
    # data parallel: the weights whole on every device, one gradient AllReduce each
    trained = net.trainable_params()
    n_params = sum(math.prod(p.shape) for p in trained)
    assert n_params == 4 * 1 * 3 * 3 + 64 * 10 + 10           # conv (no bias), dense
    assert dry.parameter_bytes == 4 * n_params
    assert dry.optimizer_state_bytes == 4 * n_params          # momentum
    assert dry.count("AllReduce", reason="gradient") == len(trained)


def _gpt_step(cfg, opt_cls=nn.Adam):
    with no_init_parameters():
        net = GPT(cfg)
        opt = opt_cls(net.trainable_params(), 1e-3)
    return _train_step(lambda i, l: net(i, l), opt)


_ZERO = {"enable_parallel_optimizer": True,
         "parallel_optimizer_config": {"parallel_optimizer_threshold": 0}}
_FUSED = {"comm_fusion": {"allreduce": {"mode": "size", "config": 32},
                          "allgather": {"mode": "auto"}, "reducescatter": {"mode": "auto"}}}


@pytest.mark.parametrize("settings", [{}, _ZERO, dict(_ZERO, **_FUSED)],
                         ids=["adam", "adam-parallel-optimizer", "parallel-optimizer-fused"])
def test_gpt_dp2_mp4_equals_the_real_step(settings):
    cfg = GPTConfig(dp=2, mp=4)
    dm.set_seed(0)
    step = _gpt_step(cfg)
    ids, labels = synthetic_batch(cfg, np.random.default_rng(0))
    dry, real = _check_against_real(step, [ids, labels], **settings)
    gathers = dry.count("AllGather", reason="parallel_optimizer")
    if settings == _ZERO:
        assert gathers > 0
    elif settings:                          # fused: fewer collectives, one per bucket
        with devices(8, **_ZERO):
            unfused = dry_run(AutoParallel(step, "semi_auto"),
                              *[abstract(x.shape, x.dtype) for x in (ids, labels)],
                              device_num=8)
        assert 0 < gathers < unfused.count("AllGather", reason="parallel_optimizer")
        assert dry.bytes("AllGather", reason="parallel_optimizer") == \
            unfused.bytes("AllGather", reason="parallel_optimizer")


def _key(r, reason=True):
    return (r.kind, r.group_size, r.num_groups, r.op, r.reason if reason else None,
            r.buffer_bytes, r.resolved_by)


_ONCE = ("gradient", "parallel_optimizer")       # once per step; the rest per micro-batch


@pytest.mark.parametrize("settings", [{}, _ZERO], ids=["adam", "adam-parallel-optimizer"])
def test_gpt_pp2_equals_the_real_pipeline(settings):
    """dp 2 x mp 2 x pp 2 on 8 devices, 2 micro-batches: the dry run of the PipelineCell
    step against a real simulated pipeline step (PyNative) and against a real compiled
    step of one micro-batch on one stage's 4 devices. The Send/Receive records, the
    forward collectives and the per-device parameter and state storage equal the
    pipeline run's; the backward and gradient collectives are the compiled step's
    (a compiled step and a PyNative one resolve the tensor-parallel gradient sums at
    different points: PyNative each MatMul's input gradient per micro-batch, the
    compiled step also the replicated weights' gradients once per step), per
    micro-batch and once per step as the pipeline runs them."""
    cfg = GPTConfig(dp=2, mp=2, pp=2, micro_size=2, batch_size=8)
    micro, stages = 2, 2
    ids, labels = synthetic_batch(cfg, np.random.default_rng(0))
    shapes = [abstract(x.shape, dm.int32) for x in (ids, labels)]
    with devices(8, pipeline_stages=stages, **settings):
        dm.set_seed(0)
        with no_init_parameters():
            net = GPT(cfg)
            opt = nn.Adam(net.trainable_params(), 1e-3)
        step = _train_step(nn.PipelineCell(net, micro), opt)
        dry = dry_run(step, *shapes, device_num=8, link="100GbE", device_flops=1e12)
        assert all(p.has_init for p in net.trainable_params()), "the dry run made one"
        dm.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": "gpipe"})
        gpipe = dry_run(step, *shapes, device_num=8)
        dm.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": "1f1b"})
        step(Tensor(ids), Tensor(labels))               # makes the parameters
        gc.collect()
        with CommReport(link="100GbE") as real:
            step(Tensor(ids), Tensor(labels))
    with devices(4, **settings):                       # one micro-batch, one stage
        dm.set_seed(0)
        one = GPT(GPTConfig(dp=2, mp=2, batch_size=4))
        compiled = AutoParallel(_train_step(lambda i, l: one(i, l),
                                            nn.Adam(one.trainable_params(), 1e-3)),
                                "semi_auto")
        compiled(Tensor(ids[:4]), Tensor(labels[:4]))
        with CommReport() as ref:
            compiled(Tensor(ids[:4]), Tensor(labels[:4]))
    # the pipeline's transfers, exactly: per micro-batch the activation into blocks.1
    # and its gradient back (b s h / dp bytes per device: 4 sequences of 8 tokens of
    # hidden 32 over dp 2), once per step the tied table (its mp half) into the head
    # and its gradient back (the same mp half: each device's rows of its share)
    pipe = Counter(_key(r) for r in dry.records if r.reason == "pipeline")
    assert pipe == Counter(_key(r) for r in real.records if r.reason == "pipeline")
    assert dry.count("Send", "pipeline") == 2 * micro + 2
    assert dry.bytes("Send", "pipeline") == 2 * micro * 4 * (4 * 8 // 2) * 32 + \
        2 * 4 * (64 // 2) * 32
    for k, sub in enumerate(dry.stages):               # each stage sends and receives
        assert sub.count("Send") == sub.count("Receive") == micro + 1
    # the forward collectives (PyNative lists a pending sum's resolution under
    # "redistribution", a compiled step under "forward")
    fwd = ("forward", "redistribution")
    assert Counter(_key(r, False) for r in dry.records if r.reason in fwd) == \
        Counter(_key(r, False) for r in real.records if r.reason in fwd)
    # everything but the transfers: the compiled step's, per micro-batch / per step
    expected = Counter()
    for r in ref.records:
        expected[_key(r)] += 1 if r.reason in _ONCE else micro
    assert Counter(_key(r) for r in dry.records if r.reason != "pipeline") == expected
    # one gathered weight each: the table and positions, 16 per block, the final LayerNorm
    assert dry.count(reason="parallel_optimizer") == (2 + 16 * 2 + 2 if settings else 0)
    # per device: the stage's weights (stage 0: the table's mp half, the positions and
    # block 0; stage 1: block 1 and the final LayerNorm) and their Adam moments
    h = 32
    block = 12 * h * h // 2 + 3 * h // 2 + h + 4 * h // 2 + h + 4 * h
    assert [s.parameter_bytes for s in dry.stages] == [4 * (block + 64 * h // 2 + 8 * h),
                                                       4 * (block + 2 * h)]
    if not settings:
        assert [s.optimizer_state_bytes for s in dry.stages] == \
            [2 * s.parameter_bytes for s in dry.stages]
    storage = max(s.parameter_bytes + s.optimizer_state_bytes for s in dry.stages)
    assert real.parameter_memory == storage + _older_bytes()   # the largest stage's
    # activations: 1F1B keeps 2 micro-batches on stage 0 and 1 on stage 1, GPipe 2 on both
    assert dry.schedule.in_flight == (2, 1) and gpipe.schedule.in_flight == (2, 2)
    assert gpipe.stages[0].activation_bytes == dry.stages[0].activation_bytes
    assert gpipe.stages[1].activation_bytes > dry.stages[1].activation_bytes
    # the time: (micro + stages - 1) slots of the slowest stage's micro-batch
    assert dry.bubble_time == pytest.approx((stages - 1) * dry.micro_batch_time)
    assert dry.step_time > (micro + stages - 1) * dry.micro_batch_time > 0


def test_the_dry_run_leaves_the_context_and_the_backend_as_they_were():
    with devices(4):                        # planned for 8 devices while 4 are up
        backend = get_backend()
        step = _gpt_step(GPTConfig(dp=2, mp=4))
        rep = dry_run(step, abstract((8, 8), dm.int32), abstract((8, 8), dm.int32),
                      device_num=8)
        assert rep.device_num == 8 and rep.records
        assert get_backend() is backend and backend.world_size == 4
        assert dm.get_auto_parallel_context("device_num") == 4


# ---------------------------------------------------------------------------
# GPT-3 size
# ---------------------------------------------------------------------------
_GPT3 = r"""
import json, resource, sys, time
sys.path.insert(0, {examples!r})
import dualmode as dm
from dualmode import nn
from dualmode.nn.utils import no_init_parameters
from dualmode.parallel import abstract, dry_run
from gpt_model import GPT, GPTConfig
t, d = 8, 128
cfg = GPTConfig(vocab_size=51200, seq_length=2048, hidden_size=12288, num_heads=96,
                num_layers=96, batch_size=d, dp=d, mp=t)
start = time.perf_counter()
with no_init_parameters():
    net = GPT(cfg)
    opt = nn.Adam(net.trainable_params(), 1e-4)
grad_fn = dm.value_and_grad(lambda i, l: net(i, l), None, opt.parameters)
def step(i, l):
    loss, grads = grad_fn(i, l)
    opt(grads)
    return loss
dm.set_auto_parallel_context(dataset_strategy=((d, 1), (d, 1)),
                             enable_parallel_optimizer={zero})
ids = abstract((cfg.batch_size, cfg.seq_length), dm.int32)
rep = dry_run(step, ids, ids, device_num=t * d, link="nvlink", device_flops=312e12)
elapsed = time.perf_counter() - start
print(json.dumps({{
    "elapsed": elapsed,
    "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "parameter_bytes": rep.parameter_bytes,
    "optimizer_state_bytes": rep.optimizer_state_bytes,
    "records": [[r.kind, r.group_size, r.op, r.reason, r.resolved_by, r.buffer_bytes]
                for r in rep.records],
    "made": sum(not p.has_init for p in net.get_parameters()),
}}))
"""


@pytest.mark.parametrize("zero", [False, True], ids=["adam", "adam-parallel-optimizer"])
def test_gpt3_175b_on_1024_devices_tensor_8_data_128(zero):
    """96 layers, hidden 12,288, 96 heads, sequence 2,048, vocabulary 51,200 on 1,024
    devices as tensor 8 x data 128 with Adam, with and without the parallel optimizer,
    one sequence per data-parallel group, in under 2 GB (its time, under 30 s, is
    measured in bench/test_bench_dry_run.py). No pipeline: pipeline stages run eagerly, not
    through the compile the dry run plans (it refuses pipeline_stages > 1)."""
    script = _GPT3.format(examples=EXAMPLES, zero=zero)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["maxrss_mb"] < 2048, out["maxrss_mb"]
    assert out["made"] == 0                               # no parameter was made
    l, h, t, V, S = 96, 12288, 8, 51200, 2048
    b = 1                                                 # sequences per data-parallel group
    # parameters per device, by hand: per layer the 12 h^2 of Q, K, V, the projection and
    # the MLP's two matrices split over t, the column-parallel biases split (3h + 4h)/t,
    # the row-parallel biases (2h) and two LayerNorms (4h) whole; the vocabulary-parallel
    # table V h / t, the positions S h and the final LayerNorm 2h whole
    per_device = l * (12 * h * h // t + 7 * h // t + 6 * h) + V * h // t + S * h + 2 * h
    assert out["parameter_bytes"] == 4 * per_device
    assert out["parameter_bytes"] / 4 == pytest.approx(12 * l * h * h / t + V * h / t,
                                                       rel=0.01)
    if not zero:
        assert out["optimizer_state_bytes"] == 2 * out["parameter_bytes"]   # Adam's moments
    else:
        # the parallel optimizer: Adam's two moments of every weight of 64 KB or more
        # (counted whole) cut over its replicas: the matrices, the table and the MLP's
        # first bias (4h) over the 128 data-parallel devices, the positions (replicated
        # on all 1,024) 1,024 ways; the other biases and the LayerNorms (48 KB) whole
        over_dp = (l * (12 * h * h // t + 4 * h // t) + V * h // t) // 128
        over_all = S * h // 1024
        whole = l * (3 * h // t + 6 * h) + 2 * h
        assert out["optimizer_state_bytes"] == 2 * 4 * (over_dp + over_all + whole)
        # each cut weight's updated slices are gathered back: 7 per layer, table, positions
        gathers = [r for r in out["records"] if r[3] == "parallel_optimizer"]
        assert len(gathers) == 7 * l + 2 and {r[1] for r in gathers} == {128, 1024}
    # tensor parallel: per layer 2 AllReduces of b s h elements over t devices forward
    # (after the row-parallel attention projection and MLP) and 2 backward (the
    # column-parallel layers' input gradients), plus one more backward for the tied
    # output embedding's input gradient
    recs = out["records"]
    fwd = [r for r in recs if r[0] == "AllReduce" and r[2] == "MatMul" and r[3] == "forward"]
    bwd = [r for r in recs if r[0] == "AllReduce" and r[2] == "MatMul" and r[3] == "backward"]
    assert len(fwd) == 2 * l and len(bwd) == 2 * l + 1
    assert {(r[1], r[5]) for r in fwd + bwd} == {(t, 4 * b * S * h)}


_GPT3_PP = r"""
import json, resource, sys, time
sys.path.insert(0, {examples!r})
import dualmode as dm
from dualmode import nn
from dualmode.nn.utils import no_init_parameters
from dualmode.parallel import abstract, dry_run
from gpt_model import GPT, GPTConfig
t, p, d, m = 8, 16, 8, 16
cfg = GPTConfig(vocab_size=51200, seq_length=2048, hidden_size=12288, num_heads=96,
                num_layers=96, batch_size=d * m, dp=d, mp=t, pp=p, micro_size=m)
start = time.perf_counter()
dm.set_auto_parallel_context(pipeline_stages=p)
with no_init_parameters():
    net = GPT(cfg)
    opt = nn.Adam(net.trainable_params(), 1e-4)
grad_fn = dm.value_and_grad(nn.PipelineCell(net, m), None, opt.parameters)
def step(i, l):
    loss, grads = grad_fn(i, l)
    opt(grads)
    return loss
dm.set_auto_parallel_context(dataset_strategy=((d, 1), (d, 1)),
                             enable_parallel_optimizer=True)
ids = abstract((cfg.batch_size, cfg.seq_length), dm.int32)
rep = dry_run(step, ids, ids, device_num=t * p * d, link="nvlink", device_flops=312e12)
print(json.dumps({{
    "elapsed": time.perf_counter() - start,
    "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "made": sum(not q.has_init for q in net.get_parameters()),
    "in_flight": rep.schedule.in_flight,
    "stages": [[s.parameter_bytes, s.optimizer_state_bytes, s.peak_memory,
                s.activation_bytes, s.device_num] for s in rep.stages],
    "peak_memory": rep.peak_memory,
    "records": {{k: [[r.kind, r.group_size, r.op, r.reason, r.resolved_by, r.buffer_bytes]
                   for r in rep.stages[k].records] for k in (0, 1, p - 1)}},
}}))
"""


def test_gpt3_175b_on_1024_devices_tensor_8_pipeline_16_data_8():
    """GPT-3 on 1,024 devices as tensor 8 x pipeline 16 x data 8 with the parallel
    optimizer: 16 micro-batches of one sequence per data-parallel group, 6 layers a
    stage on 64 devices, planned in under 2 GB (time: bench/test_bench_dry_run.py)."""
    script = _GPT3_PP.format(examples=EXAMPLES)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["maxrss_mb"] < 2048, out["maxrss_mb"]
    assert out["made"] == 0
    l, h, t, p, d, V, S, m = 96, 12288, 8, 16, 8, 51200, 2048, 16
    b = 1                                                 # sequences per group, micro-batch
    stages = out["stages"]
    assert len(stages) == p and {s[4] for s in stages} == {t * d}
    # parameters per device: the closed form 12 l h^2 / (t p) of a stage's 6 layers, plus
    # the layers' biases and LayerNorms (as in the tensor 8 x data 128 test), plus the
    # embeddings on the first stage (vocabulary-parallel table V h / t, positions S h)
    # and the final LayerNorm on the last
    layers = l // p
    per_layer = 12 * h * h // t + 7 * h // t + 6 * h
    params = [s[0] // 4 for s in stages]
    assert params[0] == layers * per_layer + V * h // t + S * h
    assert params[1:p - 1] == [layers * per_layer] * (p - 2)
    assert params[p - 1] == layers * per_layer + 2 * h
    assert params[1] == pytest.approx(12 * l * h * h / (t * p), rel=1e-3)
    # Adam's moments under the parallel optimizer: the weights of 64 KB or more cut over
    # the 8 data-parallel devices (the positions, replicated on the stage's 64, 64 ways),
    # the smaller biases and the LayerNorms whole
    over_dp = layers * (12 * h * h // t + 4 * h // t)
    whole = layers * (3 * h // t + 6 * h)
    states = [s[1] for s in stages]
    assert states[1] == 2 * 4 * (over_dp // d + whole)
    assert states[0] == 2 * 4 * ((over_dp + V * h // t) // d + S * h // (t * d) + whole)
    assert states[p - 1] == 2 * 4 * (over_dp // d + whole + 2 * h)
    # per device memory: the first stage (the most micro-batches in flight under 1F1B,
    # and the embeddings) is the largest
    assert out["in_flight"] == list(range(p, 0, -1))
    assert out["peak_memory"] == stages[0][2] == max(s[2] for s in stages)
    assert out["peak_memory"] == stages[0][0] + stages[0][1] + stages[0][3]
    assert out["peak_memory"] < 80 * 2 ** 30
    # tensor parallel on a middle stage, per micro-batch: 2 AllReduces of b s h elements
    # over t devices per layer forward, 2 backward; on the first stage one more each way
    # (the vocabulary-parallel lookup's sum forward; backward, the first block's input
    # gradient summed where the embedding's gradient reads it)
    recs = out["records"]
    for k, extra_fwd, extra_bwd in (("1", 0, 0), (str(p - 1), 0, 0), ("0", 1, 1)):
        fwd = [r for r in recs[k] if r[0] == "AllReduce" and r[3] == "forward"]
        bwd = [r for r in recs[k] if r[0] == "AllReduce" and r[3] == "backward"]
        assert len(fwd) == m * (2 * layers + extra_fwd), k
        assert len(bwd) == m * (2 * layers + extra_bwd), k
        assert {(r[1], r[5]) for r in fwd + bwd} == {(t, 4 * b * S * h)}
        # point to point: per micro-batch b s h elements across each boundary, forward
        # in, gradient out (the first stage only sends, the last only receives
        # activations); the tied table once a step from the first stage to the last (its
        # V h / t rows) and its gradient back (the same rows of each device's share)
        pipe = [r for r in recs[k] if r[3] == "pipeline"]
        acts = [r for r in pipe if r[5] == 4 * b * S * h]
        assert {r[1] for r in pipe} == {2}
        assert len(acts) == (2 * m if k in ("0", str(p - 1)) else 4 * m), k
        assert len(pipe) - len(acts) == (0 if k == "1" else 2), k
        assert {r[5] for r in pipe} - {4 * b * S * h} <= {4 * V * h // t}


def test_plan_gpt3_example_prints_the_three_strategies():
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "plan_gpt3.py"),
                           "--layers", "16"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    for name in ("data 1024", "tensor 8 x data 128", "tensor 8 x pipeline 16 x data 8"):
        assert name in text
    for row in ("memory per device", "bytes per step", "predicted step time",
                "pipeline bubble"):
        assert row in text
    fits = [line for line in text.splitlines() if line.startswith("fits in 80 GB: ")]
    assert len(fits) == 1, text
    assert "tensor 8 x pipeline 16 x data 8" in fits[0] and "data 1024" not in fits[0]


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------
def test_a_device_count_the_strategies_do_not_divide_is_refused_and_nothing_changes():
    with devices(8):
        backend = get_backend()
        step = _gpt_step(GPTConfig(dp=2, mp=4))
        with pytest.raises(ValueError, match=r"has 8 devices but device_num is 6"):
            dry_run(step, abstract((6, 8), dm.int32), abstract((6, 8), dm.int32),
                    device_num=6)
        assert get_backend() is backend
        assert dm.get_auto_parallel_context("device_num") == 8


def test_a_strategy_whose_product_does_not_divide_the_device_count_is_named():
    with no_init_parameters():
        net = Network(devices=8)                # MatMul ((2, 4), (4, 1)): 8 devices
    loss_fn = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match=r"MatMul: in_strategy\[0\]=\(2, 4\) needs 8 "
                                         r"devices but device_num is 6"):
        dry_run(lambda x, y: loss_fn(net(x), y), abstract((24, 1, 28, 28)),
                abstract((24,), dm.int32), device_num=6)


@pytest.mark.parametrize("n", [0, -8, 2.5, "8", True])
def test_a_device_num_that_is_not_a_positive_int_is_refused(n):
    with pytest.raises(ValueError, match=r"dry_run: device_num=.* is not valid; expected a "
                                         r"positive int"):
        dry_run(lambda x: x, abstract((8, 8)), device_num=n)


@pytest.mark.parametrize("shape", [(8, 0), (-2, 4), (3, 2.0)])
def test_a_shape_with_a_dim_that_is_not_positive_is_refused(shape):
    with pytest.raises(ValueError, match=r"abstract: shape=.* has dim \d = .*; every dim "
                                         r"must be a positive int"):
        abstract(shape, dm.float32)


def test_an_unknown_link_or_a_bad_speed_is_refused():
    x = abstract((8, 8))
    with pytest.raises(ValueError, match=r"dry_run: link='5G' is not valid; expected one "
                                         r"of '10GbE', '100GbE', 'nvlink'"):
        dry_run(lambda x: x, x, device_num=8, link="5G")
    with pytest.raises(ValueError, match=r"dry_run: device_flops=-1.0 is not valid"):
        dry_run(lambda x: x, x, device_num=8, device_flops=-1.0)
    with pytest.raises(ValueError, match=r"dry_run: parallel_mode='data_parallel' is not "
                                         r"valid"):
        dry_run(lambda x: x, x, device_num=8, parallel_mode="data_parallel")


def test_an_abstract_tensor_has_no_value():
    x = abstract((2, 3), dm.int32)
    assert x.shape == (2, 3) and x.dtype == np.int32
    with pytest.raises(TypeError, match=r"abstract tensor \(shape \(2, 3\), dtype int32\) "
                                        r"has no value"):
        x.asnumpy()


class _BatchNormNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def construct(self, x):
        return self.bn(self.conv(x))


def test_a_collective_inside_an_op_is_refused_rather_than_missed():
    """BatchNorm over a batch split 8 ways totals its statistics with an AllReduce its
    rule runs inside the op: not a node of the graph, so not counted, so refused."""
    with devices(8):
        with no_init_parameters():
            net = _BatchNormNet()
            opt = nn.SGD(net.trainable_params(), 0.1)
        net.set_train(True)
        step = _train_step(lambda x: ops.reduce_mean(net(x)), opt)
        with pytest.raises(RuntimeError, match=r"dry_run: BatchNorm-0 communicates inside "
                                               r"its own computation"):
            dry_run(step, abstract((16, 1, 8, 8)), device_num=8)


def test_a_convolution_exchanging_halos_is_refused_rather_than_missed():
    """Rows of the image split 8 ways under a 3 x 3 kernel: each device needs its
    neighbours' edge rows, an AllGather the rule runs inside Conv2D."""
    with devices(8):
        with no_init_parameters():
            net = nn.Conv2d(1, 4, 3)
            opt = nn.SGD(net.trainable_params(), 0.1)
        net.conv2d.shard(((1, 1, 8, 1), (1, 1, 1, 1)))
        step = _train_step(lambda x: ops.reduce_mean(net(x)), opt)
        with pytest.raises(RuntimeError, match=r"dry_run: Conv2D-0 communicates inside its "
                                               r"own computation"):
            dry_run(step, abstract((8, 1, 16, 16)), device_num=8)
        # a 1 x 1 kernel needs no halo: planned
        with no_init_parameters():
            net = nn.Conv2d(1, 4, 1)
            opt = nn.SGD(net.trainable_params(), 0.1)
        net.conv2d.shard(((1, 1, 8, 1), (1, 1, 1, 1)))
        step = _train_step(lambda x: ops.reduce_mean(net(x)), opt)
        assert dry_run(step, abstract((8, 1, 16, 16)), device_num=8).records


def test_pipeline_bad_input_is_refused_by_name():
    with devices(8):
        dm.set_auto_parallel_context(pipeline_stages=2)
        with pytest.raises(ValueError, match=r"dry_run: pipeline_stages=2 does not divide "
                                             r"device_num=9"):
            dry_run(lambda x: x, abstract((8, 8)), device_num=9)
        with pytest.raises(ValueError, match=r"dry_run: pipeline_stages=2 plans a step that "
                                             r"runs one nn.PipelineCell .* 0 were found"):
            dry_run(lambda x: x, abstract((8, 8)), device_num=8)
        cfg = GPTConfig(dp=2, mp=2, pp=2, micro_size=2)
        with no_init_parameters():
            net = GPT(cfg)
        train = nn.PipelineCell(net, 3)
        with pytest.raises(ValueError, match=r"dry_run: micro_size=3 \(nn.PipelineCell\) "
                                             r"does not divide the batch of input 0 "
                                             r"\(shape \(8, 8\)\)"):
            dry_run(train, abstract((8, 8), dm.int32), abstract((8, 8), dm.int32),
                    device_num=8)
        assert dm.get_auto_parallel_context("pipeline_stages") == 2
