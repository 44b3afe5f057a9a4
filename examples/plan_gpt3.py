"""Plan GPT-3 (175 B parameters) on 1,024 devices without the devices: three strategies
side by side.

The GPT of ``gpt_model.py`` at GPT-3's size (96 layers, hidden 12,288, 96 heads,
sequence 2,048, vocabulary 51,200), trained with Adam (the third strategy with the
parallel optimizer), one sequence per data-parallel group, is dry-run (``dm.parallel.dry_run``) for each strategy: the same compile a real
run makes, on abstract inputs, with parameters that are never made. The table gives
per device the memory at the peak of a step, the bytes every collective moves, and the
predicted step time (NVLink-class links, 312 TFLOP/s per device, communication not
overlapped with compute), and the script says which strategies fit in 80 GB.

    python examples/plan_gpt3.py                 # the full 96 layers
    python examples/plan_gpt3.py --layers 8      # quicker, fewer layers
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dualmode as dm  # noqa: E402
from dualmode import nn  # noqa: E402
from dualmode.nn.utils import no_init_parameters  # noqa: E402
from dualmode.parallel import abstract, dry_run  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402

DEVICES = 1024
#: (name, tensor-parallel size, data-parallel size, parallel optimizer)
STRATEGIES = [("data 1024", 1, 1024, False), ("tensor 8 x data 128", 8, 128, False),
              ("tensor 16 x data 64 + parallel optimizer", 16, 64, True)]
GiB = 1 << 30


def plan(tensor, data, layers, parallel_optimizer=False, link="nvlink",
         device_flops=312e12):
    """The dry run of one train step with `tensor` x `data` devices (Adam's states and
    update split over the data-parallel devices with `parallel_optimizer`)."""
    cfg = GPTConfig(vocab_size=51200, seq_length=2048, hidden_size=12288, num_heads=96,
                    num_layers=layers, batch_size=data, dp=data, mp=tensor)
    with no_init_parameters():
        net = GPT(cfg)
        opt = nn.Adam(net.trainable_params(), 1e-4)
    grad_fn = dm.value_and_grad(lambda ids, labels: net(ids, labels), None, opt.parameters)

    def step(ids, labels):
        loss, grads = grad_fn(ids, labels)
        opt(grads)
        return loss

    # each data-parallel group takes its own sequences; the tensor-parallel devices of a
    # group share them
    dm.set_auto_parallel_context(dataset_strategy=((data, 1), (data, 1)),
                                 enable_parallel_optimizer=parallel_optimizer)
    ids = abstract((cfg.batch_size, cfg.seq_length), dm.int32)
    try:
        return dry_run(step, ids, ids, device_num=tensor * data, link=link,
                       device_flops=device_flops)
    finally:
        dm.reset_auto_parallel_context()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=96)
    args = parser.parse_args(argv)
    reports = []
    for name, tensor, data, zero in STRATEGIES:
        start = time.perf_counter()
        rep = plan(tensor, data, args.layers, zero)
        reports.append((name, rep))
        print(f"planned {name} in {time.perf_counter() - start:.1f} s", flush=True)
    widths = [max(len(name), 12) + 2 for name, _ in reports]
    print(f"\nGPT-3 ({args.layers} layers) on {DEVICES} devices, Adam, per device:")
    print(f"{'':<22}" + "".join(f"{name:>{w}}" for (name, _), w in zip(reports, widths)))
    rows = [("memory per device", lambda r: f"{r.peak_memory / GiB:.1f} GiB"),
            ("  parameters", lambda r: f"{r.parameter_bytes / GiB:.1f} GiB"),
            ("  optimizer states", lambda r: f"{r.optimizer_state_bytes / GiB:.1f} GiB"),
            ("  activations", lambda r: f"{r.activation_bytes / GiB:.1f} GiB"),
            ("bytes per step", lambda r: f"{r.bytes() / GiB:.1f} GiB"),
            ("collectives per step", lambda r: f"{len(r.records)}"),
            ("predicted step time", lambda r: f"{r.step_time:.2f} s"),
            ("  compute", lambda r: f"{r.compute_time:.2f} s"),
            ("  communication", lambda r: f"{r.comm_time:.2f} s")]
    for label, fmt in rows:
        print(f"{label:<22}" + "".join(f"{fmt(r):>{w}}" for (_, r), w in zip(reports, widths)))
    fits = [name for name, r in reports if r.peak_memory <= 80e9]
    if fits:
        print(f"\nfits in 80 GB: {', '.join(fits)}")
    else:
        print("\nnone fits in 80 GB: the fp32 weights alone take 175 B x 4 bytes / tensor "
              "size per device, and the activations of 96 layers come on top (pipeline "
              "stages would split both)")
    return reports


if __name__ == "__main__":
    main()
