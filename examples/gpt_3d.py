"""Train a small GPT on N devices with Megatron strategies, checked against one device.

The GPT of ``gpt_model.py`` (vocabulary-parallel embedding, causal attention and MLP
blocks with LayerNorm and GeLU, tied output embedding, cross-entropy) is trained twice
from the same seed and the same batches: stand-alone, then under
``semi_auto_parallel`` on N devices with the batch split over dp and the attention
heads, MLP columns and vocabulary split over mp. The script prints both runs' losses
side by side, the strategies of one block, where each weight lives, and what the
parallel run communicated, by kind and by reason. N is ``--devices``, else the launched
world (one device per rank), else 8 simulated devices:

    python examples/gpt_3d.py [--dp 2 --mp 4] [--steps 4]
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

REASONS = ("forward", "backward", "redistribution", "gradient")


def make_config(devices, dp=None, mp=None, **sizes):
    """The model's config for `devices` devices: dp x mp with the given degrees, else
    mp = 2 (or 1 on one device) and dp the rest."""
    if mp is None:
        mp = 2 if devices >= 2 and devices % 2 == 0 else 1
    if dp is None:
        dp = devices // mp
    if dp * mp != devices:
        raise ValueError(f"gpt_3d: dp={dp} x mp={mp} = {dp * mp} must equal the device "
                         f"count {devices}")
    return GPTConfig(dp=dp, mp=mp, **sizes)


def train(config, devices, steps, lr=0.5):
    """Train `config`'s GPT for `steps` SGD steps on `devices` devices (1: stand-alone;
    the strategies are then ignored). Returns (losses, network, CommReport)."""
    dm.set_context(mode=dm.PYNATIVE_MODE)
    dm.reset_auto_parallel_context()
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=devices,
                                     full_batch=True)
    communication.init()
    dm.set_seed(1)
    net = GPT(config)
    optimizer = nn.SGD(net.trainable_params(), lr)
    grad_fn = dm.value_and_grad(net, None, optimizer.parameters)
    rng = np.random.default_rng(0)
    losses = []
    with CommReport() as report:
        for _ in range(steps):
            ids, labels = synthetic_batch(config, rng)
            loss, grads = grad_fn(dm.Tensor(ids), dm.Tensor(labels))
            optimizer(grads)
            losses.append(float(loss.asnumpy()))
    return losses, net, report


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
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    devices = device_count(args.devices)
    config = make_config(devices, args.dp, args.mp)

    ref, _, _ = train(config, 1, args.steps)
    losses, net, report = train(config, devices, args.steps)
    print(f"GPT: vocab {config.vocab_size}, sequence {config.seq_length}, hidden "
          f"{config.hidden_size}, {config.num_heads} heads, {config.num_layers} blocks, "
          f"batch {config.batch_size}; {devices} devices as dp={config.dp} x mp={config.mp}")
    for step, (a, b) in enumerate(zip(losses, ref)):
        print(f"step {step}: loss is {a:.7f}   (one device: {b:.7f})")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    print(f"largest relative loss difference from one device: {worst:.2e}")

    print(f"strategies (the first block; every block alike); a Layout names the axes of "
          f"the device matrix (dp, mp) = ({config.dp}, {config.mp}):")
    for name, st in (strategies(net.embedding, "embedding")
                     + strategies(net.blocks[0], "blocks.0") + strategies(net.head, "head")):
        print(f"  {name:<45} {st}")
    print("where the weights live (global shape -> what each device stores):")
    for p in net.trainable_params():
        if p.name.startswith("blocks.") and not p.name.startswith("blocks.0."):
            continue
        print(f"  {p.name:<40} {str(tuple(p.shape)):<12} -> {local_shape(p)}")

    steps = args.steps
    print(f"communicated per step: {report.count() // steps} collectives, "
          f"{report.bytes() / steps / 1024:.1f} KiB per device")
    kinds = sorted({r.kind for r in report.records})
    print(f"  {'':<15}" + "".join(f"{k:>16}" for k in kinds))
    for reason in REASONS:
        cells = "".join(f"{report.count(kind=k, reason=reason) // steps:>5} x "
                        f"{report.bytes(kind=k, reason=reason) / steps / 1024:6.1f} KiB"
                        for k in kinds)
        print(f"  {reason:<15}{cells}")
    return losses, ref, report


if __name__ == "__main__":
    main()
