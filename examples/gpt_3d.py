"""Train a small GPT in three dimensions on N devices, checked against one device.

The GPT of ``gpt_model.py`` (vocabulary-parallel embedding, causal attention and MLP
blocks with LayerNorm and GeLU, tied output embedding, cross-entropy) is trained twice
from the same seed and the same batches: stand-alone, then under
``semi_auto_parallel`` on N devices as dp x mp x pp:

- tensor (operator) parallel over mp: Megatron strategies (attention heads, the MLP's
  columns and the vocabulary split over mp; row-parallel layers summed over mp);
- data parallel over dp: the batch split over dp, with the parallel optimizer
  (``enable_parallel_optimizer``): gradients ReduceScattered over dp, each device
  updating its slice of the weights and optimizer states, the slices AllGathered back;
- pipeline parallel over pp (``pipeline_stages``): the blocks on pp stages of
  dp * mp devices each (``block.pipeline_stage``), the batch cut into micro-batches
  (``nn.PipelineCell``), activations and their gradients sent between stages.

The script prints both runs' losses side by side (the mean cross-entropy of each
batch), the strategies of one block, where each weight lives, the per-stage schedule,
the optimizer state each device keeps, and what the parallel run communicated, by kind
and by reason. N is ``--devices``, else the launched world (one device per rank), else 8
simulated devices (dp=2 x mp=2 x pp=2):

    python examples/gpt_3d.py [--dp 2 --mp 2 --pp 2 --micro_size 2] [--steps 4]
    python -m dualmode.run --worker_num 8 examples/gpt_3d.py
"""
import argparse
import os
import sys

import numpy as np

import dualmode as dm
from dualmode import communication, nn
from dualmode.ops.primitive import Primitive
from dualmode.parallel import CommReport, local_shape

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_model import GPT, GPTConfig, synthetic_batch  # noqa: E402

REASONS = ("forward", "backward", "redistribution", "pipeline", "gradient",
           "parallel_optimizer")


def make_config(devices, dp=None, mp=None, pp=None, micro_size=None, **sizes):
    """The model's config for `devices` devices: dp x mp x pp with the given degrees;
    by default mp = 2 and pp = 2 where the device count allows (each halves what is
    left), dp the rest, and 2 micro-batches when pp > 1."""
    left = devices
    if mp is None:
        mp = 2 if left % 2 == 0 else 1
    left //= mp
    if pp is None:
        pp = 2 if left % 2 == 0 else 1
    left //= pp
    if dp is None:
        dp = left
    if dp * mp * pp != devices:
        raise ValueError(f"gpt_3d: dp={dp} x mp={mp} x pp={pp} = {dp * mp * pp} must "
                         f"equal the device count {devices}")
    if micro_size is None:
        micro_size = 2 if pp > 1 else 1
    return GPTConfig(dp=dp, mp=mp, pp=pp, micro_size=micro_size, **sizes)


def _set_parallel(config, devices, parallel_optimizer):
    dm.reset_auto_parallel_context()
    communication.init()
    if devices > 1:
        extra = {}
        if parallel_optimizer:
            # every weight sharded, however small (the default threshold is 64 KB)
            extra = dict(enable_parallel_optimizer=True,
                         parallel_optimizer_config={"parallel_optimizer_threshold": 0})
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=devices,
                                     full_batch=True, pipeline_stages=config.pp, **extra)
        communication.init()


def train(config, devices, steps, parallel_optimizer=True, lr=0.1, momentum=0.9,
          graph=False):
    """Train `config`'s GPT for `steps` Momentum steps on `devices` devices (1:
    stand-alone; the strategies and stages are then ignored). The network is wrapped in
    ``nn.PipelineCell`` (micro_size micro-batches, their losses summed, as MindSpore)
    in both runs; `graph` compiles the network in GRAPH_MODE (pipeline stages run in
    PyNative mode only). Returns (mean losses, network, the optimizer's bytes per
    device (``dm.parallel.optimizer_memory``), CommReport)."""
    dm.set_context(mode=dm.GRAPH_MODE if graph else dm.PYNATIVE_MODE)
    _set_parallel(config, devices, parallel_optimizer)
    dm.set_seed(1)
    net = GPT(config)
    model = nn.PipelineCell(net, config.micro_size)
    optimizer = nn.Momentum(net.trainable_params(), lr, momentum)
    grad_fn = dm.value_and_grad(model, None, optimizer.parameters)
    rng = np.random.default_rng(0)
    losses = []
    with CommReport() as report:
        for _ in range(steps):
            ids, labels = synthetic_batch(config, rng)
            loss, grads = grad_fn(dm.Tensor(ids), dm.Tensor(labels))
            optimizer(grads)
            # the sum of the micro-batches' mean losses / micro_size: the batch's mean
            losses.append(float(loss.asnumpy()) / config.micro_size)
        # the parallel optimizer stores a weight as its slices, gathered where it is next
        # read (the next step's forward pass): read now, so that the report holds the
        # last update's gathers as well
        for p in net.trainable_params():
            p.asnumpy()
    return losses, net, dm.parallel.optimizer_memory(optimizer), report


def strategies(cell, prefix=""):
    """(name, in_strategy) of every primitive with a strategy held by `cell` and the
    cells under it, in attribute order."""
    out = []
    for cname, sub in cell.cells_and_names():
        for attr, v in vars(sub).items():
            if isinstance(v, Primitive) and v.in_strategy is not None:
                name = ".".join(p for p in (prefix, cname, attr) if p)
                out.append((f"{name} ({v.name})", _short(v.in_strategy)))
    return out


def _short(strategy):
    """A strategy as text; a Layout entry as its dims' axis names (the device matrix is
    printed once, above)."""
    parts = []
    for entry in strategy:
        text = str(entry)
        parts.append("(" + text.split(")(", 1)[1] if ")(" in text else text)
    return "(" + ", ".join(parts) + ")"


def device_count(requested=None):
    """``requested``; else the MPI world this script was launched in; else 8 simulated
    devices."""
    if requested:
        return requested
    communication.init()
    backend = communication.get_backend()
    return backend.world_size if backend.name == "mpi" else 8


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None,
                        help="devices of the parallel run (default: the launched ranks, "
                             "else 8 simulated devices)")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel degree")
    parser.add_argument("--mp", type=int, default=None,
                        help="model (tensor) parallel degree (default 2)")
    parser.add_argument("--pp", type=int, default=None,
                        help="pipeline stages (default 2)")
    parser.add_argument("--micro_size", type=int, default=None,
                        help="micro-batches per batch (default 2 with pipeline stages)")
    parser.add_argument("--no_parallel_optimizer", action="store_true",
                        help="keep whole optimizer states on every device")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    devices = device_count(args.devices)
    config = make_config(devices, args.dp, args.mp, args.pp, args.micro_size)
    popt = not args.no_parallel_optimizer and config.dp > 1

    ref, _, ref_mem, _ = train(config, 1, args.steps)
    losses, net, mem, report = train(config, devices, args.steps, popt)
    print(f"GPT: vocab {config.vocab_size}, sequence {config.seq_length}, hidden "
          f"{config.hidden_size}, {config.num_heads} heads, {config.num_layers} blocks, "
          f"batch {config.batch_size}"
          f"{f' in {config.micro_size} micro-batches' if config.micro_size > 1 else ''}; "
          f"{devices} "
          f"devices as dp={config.dp} x mp={config.mp} x pp={config.pp}, parallel "
          f"optimizer {'on' if popt else 'off'}")
    for step, (a, b) in enumerate(zip(losses, ref)):
        print(f"step {step}: loss is {a:.7f}   (one device: {b:.7f})")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    print(f"largest relative loss difference from one device: {worst:.2e}")

    print(f"strategies (the first block; every block alike); a Layout names the axes of "
          f"the device matrix (dp, mp) = ({config.dp}, {config.mp}) of one stage:")
    for name, st in (strategies(net.embedding, "embedding")
                     + strategies(net.blocks[0], "blocks.0") + strategies(net.head, "head")):
        print(f"  {name:<45} {st}")
    stages = [getattr(b, "pipeline_stage", 0) for b in net.blocks]
    print(f"pipeline stages: embedding on stage 0, blocks on {stages}, the head and loss "
          f"on stage {config.pp - 1}")
    print("where the weights live (global shape -> what each device stores):")
    for p in net.trainable_params():
        if p.name.startswith("blocks.") and not p.name.startswith("blocks.0."):
            continue
        print(f"  {p.name:<40} {str(tuple(p.shape)):<12} -> {local_shape(p)}")
    if config.pp > 1:
        print(dm.parallel.pipeline_schedule(config.pp, config.micro_size))
    print(f"Momentum state per device: {mem.states / 1024:.1f} KiB, weight slices it "
          f"updates: {mem.weights / 1024:.1f} KiB (one device: {ref_mem.states / 1024:.1f} "
          f"and {ref_mem.weights / 1024:.1f} KiB)")

    steps = args.steps
    print(f"communicated per step: {report.count() // steps} collectives, "
          f"{report.bytes() / steps / 1024:.1f} KiB per device")
    kinds = sorted({r.kind for r in report.records})
    reasons = [r for r in REASONS if report.count(reason=r)]
    print(f"  {'':<19}" + "".join(f"{k:>18}" for k in kinds))
    for reason in reasons:
        cells = "".join(f"{report.count(kind=k, reason=reason) // steps:>5} x "
                        f"{report.bytes(kind=k, reason=reason) / steps / 1024:7.1f} KiB"
                        for k in kinds)
        print(f"  {reason:<19}{cells}")
    return losses, ref, report


if __name__ == "__main__":
    main()
