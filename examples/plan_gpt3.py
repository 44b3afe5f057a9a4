"""Plan GPT-3 (175 B parameters) on 1,024 devices without the devices: three strategies
side by side.

The GPT of ``gpt_model.py`` at GPT-3's size (96 layers, hidden 12,288, 96 heads,
sequence 2,048, vocabulary 51,200), trained with Adam, one sequence per data-parallel
group (per micro-batch with the pipeline), is dry-run (``dm.parallel.dry_run``) for each
strategy: the same compile a real run makes, on abstract inputs, with parameters that
are never made. The third strategy cuts the 96 layers into 16 pipeline stages of 64
devices (``nn.PipelineCell`` with 16 micro-batches, the 1F1B schedule) and splits Adam's
states over the data-parallel devices (the parallel optimizer). The table gives per
device (for the pipeline: on the stage that needs the most) the memory at the peak of a
step, the bytes its collectives and transfers move, and the predicted step time
(NVLink-class links, 312 TFLOP/s per device, communication not overlapped with compute;
for the pipeline the schedule's micro-batch slots, idle ones included), and the script
says which strategies fit in an 80 GB device (80 GiB).

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
#: (name, tensor-parallel size, pipeline stages, data-parallel size, parallel optimizer)
STRATEGIES = [("data 1024", 1, 1, 1024, False), ("tensor 8 x data 128", 8, 1, 128, False),
              ("tensor 8 x pipeline 16 x data 8", 8, 16, 8, True)]
GiB = 1 << 30
DEVICE_MEMORY = 80 * GiB          # an "80 GB" accelerator holds 81,920 MiB


def plan(tensor, data, layers, parallel_optimizer=False, link="nvlink",
         device_flops=312e12, pipeline=1):
    """The dry run of one train step with `tensor` x `pipeline` x `data` devices (Adam's
    states and update split over the data-parallel devices with `parallel_optimizer`;
    with `pipeline` stages, as many micro-batches)."""
    micro = pipeline if pipeline > 1 else 1
    cfg = GPTConfig(vocab_size=51200, seq_length=2048, hidden_size=12288, num_heads=96,
                    num_layers=layers, batch_size=data * micro, dp=data, mp=tensor,
                    pp=pipeline, micro_size=micro)
    dm.set_auto_parallel_context(pipeline_stages=pipeline)
    with no_init_parameters():
        net = GPT(cfg)
        opt = nn.Adam(net.trainable_params(), 1e-4)
    train = nn.PipelineCell(net, micro) if pipeline > 1 else \
        (lambda ids, labels: net(ids, labels))
    grad_fn = dm.value_and_grad(train, None, opt.parameters)

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
        return dry_run(step, ids, ids, device_num=tensor * pipeline * data, link=link,
                       device_flops=device_flops)
    finally:
        dm.reset_auto_parallel_context()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=96)
    args = parser.parse_args(argv)
    reports = []
    for name, tensor, stages, data, zero in STRATEGIES:
        start = time.perf_counter()
        rep = plan(tensor, data, args.layers, zero, pipeline=stages)
        reports.append((name, rep))
        print(f"planned {name} in {time.perf_counter() - start:.1f} s", flush=True)
    widths = [max(len(name), 12) + 2 for name, _ in reports]
    print(f"\nGPT-3 ({args.layers} layers) on {DEVICES} devices, Adam (with the pipeline: "
          f"16 micro-batches, 1F1B, the parallel optimizer), per device:")
    print(f"{'':<22}" + "".join(f"{name:>{w}}" for (name, _), w in zip(reports, widths)))
    def device(r):        # the device that needs the most (a pipeline's largest stage)
        return r if r.stages is None else max(r.stages, key=lambda s: s.peak_memory)

    rows = [("memory per device", lambda r: f"{r.peak_memory / GiB:.1f} GiB"),
            ("  parameters", lambda r: f"{r.parameter_bytes / GiB:.1f} GiB"),
            ("  optimizer states", lambda r: f"{r.optimizer_state_bytes / GiB:.1f} GiB"),
            ("  activations", lambda r: f"{r.activation_bytes / GiB:.1f} GiB"),
            ("bytes per step", lambda r: f"{device(r).bytes() / GiB:.1f} GiB"),
            ("collectives per step", lambda r: f"{len(device(r).records)}"),
            ("predicted step time", lambda r: f"{r.step_time:.2f} s"),
            ("  compute", lambda r: f"{r.compute_time:.2f} s"),
            ("  communication", lambda r: f"{r.comm_time:.2f} s"),
            ("  pipeline bubble", lambda r: "-" if r.bubble_time is None
             else f"{r.bubble_time:.2f} s")]
    for label, fmt in rows:
        print(f"{label:<22}" + "".join(f"{fmt(r):>{w}}" for (_, r), w in zip(reports, widths)))
    fits = [name for name, r in reports if r.peak_memory <= DEVICE_MEMORY]
    if fits:
        print(f"\nfits in 80 GB: {', '.join(fits)}")
    else:
        print("\nnone fits in 80 GB: the fp32 weights alone take 175 B x 4 bytes / (tensor "
              "x pipeline size) per device, and the activations come on top")
    return reports


if __name__ == "__main__":
    main()
