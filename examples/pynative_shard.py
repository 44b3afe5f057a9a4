"""One block compiled and sharded, the rest of the program eager and data parallel.

An MLP classifier whose middle block (two matrix products around a tanh) is wrapped in
``ops.shard``. Only the block's input and output strategies are given; sharding
propagation chooses the strategies of the ops inside.
The loop around it is plain PyNative code on N devices (``--devices``, else the
launched world, one device per rank, else 8 simulated devices). The same script runs
on one device; the losses agree step by step, and the CommReport shows what the
sharded run communicated and why.

    python examples/pynative_shard.py [--steps 10] [--dump block.dot] [--devices 8]
    python -m dualmode.run --worker_num 4 examples/pynative_shard.py
"""
import argparse

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import CommReport, local_shape


class Block(nn.Cell):
    """x @ W1, tanh, @ W2: the part compiled to graph mode."""

    def __init__(self, width=64, hidden=256):
        super().__init__()
        rng = np.random.default_rng(11)
        self.w1 = Parameter(Tensor((rng.standard_normal((width, hidden)) / np.sqrt(width))
                                   .astype(np.float32)), name="w1")
        self.w2 = Parameter(Tensor((rng.standard_normal((hidden, width)) / np.sqrt(hidden))
                                   .astype(np.float32)), name="w2")

    def construct(self, x):
        return ops.matmul(ops.tanh(ops.matmul(x, self.w1)), self.w2)


class Classifier(nn.Cell):
    def __init__(self, in_features=784, width=64, classes=10, shard=True, devices=8):
        super().__init__()
        shard = shard and devices > 1
        self.embed = nn.Dense(in_features, width, activation="relu")
        self.block = Block(width)
        # the block: input split N/2 ways on the batch and 2 ways on features (4 x 2 on
        # 8 devices), output back to a plain batch split; everything inside is chosen by
        # propagation
        self.run_block = ops.shard(self.block, in_strategy=((devices // 2, 2),),
                                   out_strategy=((devices, 1),)) if shard else self.block
        self.head = nn.Dense(width, classes)

    def construct(self, x):
        h = self.embed(x)
        return self.head(ops.relu(h + self.run_block(h)))


def run(devices, steps, batch=64):
    dm.reset_auto_parallel_context()
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="auto_parallel", device_num=devices,
                                     search_mode="sharding_propagation", gradients_mean=True)
    communication.init()
    dm.set_seed(3)
    net = Classifier(shard=devices > 1, devices=devices)
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((10, 784)).astype(np.float32)
    losses = []
    with CommReport() as report:
        for _ in range(steps):
            y = rng.integers(0, 10, batch).astype(np.int32)
            x = centers[y] + 0.5 * rng.standard_normal((batch, 784)).astype(np.float32)
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
            losses.append(float(loss.asnumpy()))
    return losses, net, report


def device_count(requested=None):
    """``requested``; else the MPI world this script was launched in (``python -m
    dualmode.run --worker_num N`` or ``mpiexec -n N``); else 8 simulated devices."""
    if requested:
        return requested
    communication.init()
    backend = communication.get_backend()
    return backend.world_size if backend.name == "mpi" else 8


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dump", default=None, help="write the block's graph (dot) here")
    parser.add_argument("--devices", type=int, default=None,
                        help="devices of the sharded run (default: the launched ranks, "
                             "else 8 simulated devices)")
    args = parser.parse_args(argv)
    devices = device_count(args.devices)
    ref, _, _ = run(1, args.steps)
    losses, net, report = run(devices, args.steps)
    for step, (a, b) in enumerate(zip(losses, ref)):
        print(f"step {step}: loss {a:.6f}   (one device: {b:.6f})")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    print(f"largest relative difference from the single-device run: {worst:.2e}")
    print("strategies inside the compiled block (chosen by propagation unless configured):")
    for name, info in net.run_block.strategies().items():
        if not info["backward"]:
            print(f"  {name:<10} {info['strategy']}")
    for p in (net.block.w1, net.block.w2):
        print(f"{p.name}: global {tuple(p.shape)}, each device stores {local_shape(p)}")
    print(f"communication per step ({report.count() // args.steps} collectives, "
          f"{report.bytes() / args.steps / 1024:.1f} KiB per device; peak memory "
          f"{report.peak_memory / 1024:.1f} KiB per device):")
    for reason in ("forward", "backward", "redistribution", "gradient"):
        for kind in ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll"):
            count = report.count(kind=kind, reason=reason) // args.steps
            if count:
                print(f"  {reason:<15} {kind:<14} {count:3d} x  "
                      f"{report.bytes(kind=kind, reason=reason) / args.steps / 1024:8.1f} KiB")
    if args.dump:
        net.run_block.dump(args.dump)
        print(f"graph written to {args.dump}")
    return losses, ref, report


if __name__ == "__main__":
    main()
