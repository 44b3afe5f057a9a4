"""The operator-level parallelism tutorial network on N devices.

The network of MindSpore's operator-parallel tutorial: on 8 devices MatMul
sharded ((2, 4), (4, 1)), ReLU ((4, 1),), MatMul ((1, 8), (8, 1)), ReLU ((8, 1),), and
a data-parallel MatMul — or the same with Layout objects; on N devices the same
strategies scaled to N (((2, N/2), (N/2, 1)), ...). It trains under
``semi_auto_parallel`` on N devices and, from the same seed, on one device; the losses
agree, the weights live sharded, and the CommReport shows what moved. N is
``--devices``, else the launched world (one device per rank), else 8 simulated devices:

    python examples/operator_parallel.py [--layouts] [--steps 10] [--devices 8]
    python -m dualmode.run --worker_num 4 examples/operator_parallel.py
"""
import argparse

import numpy as np

import dualmode as dm
from dualmode import Parameter, communication, nn, ops
from dualmode.common.initializer import initializer
from dualmode.nn.utils import no_init_parameters
from dualmode.parallel import CommReport, Layout, local_shape


class Network(nn.Cell):
    def __init__(self, use_layouts=False, in_features=28 * 28, hidden=512, devices=8):
        super().__init__()
        a = 2 if devices >= 2 else 1          # the tutorial's 2 x 4 on 8 devices
        b = devices // a
        self.flatten = ops.Flatten()
        self.fc1_weight = Parameter(initializer("xavier_uniform", [in_features, hidden], dm.float32))
        self.fc2_weight = Parameter(initializer("xavier_uniform", [hidden, hidden], dm.float32))
        self.fc3_weight = Parameter(initializer("xavier_uniform", [hidden, 10], dm.float32))
        if use_layouts:
            if devices % 4:
                raise ValueError(f"Network: use_layouts needs a device count that is a "
                                 f"multiple of 4 (Layout((2, 2, n/4), ...)); got {devices}")
            layout = Layout((2, 2, devices // 4), ("dp", "sp", "mp"))
            layout2 = Layout((devices,), ("tp",))
            self.matmul1 = ops.MatMul().shard((layout("mp", ("sp", "dp")),
                                               layout(("sp", "dp"), "None")))
            self.matmul2 = ops.MatMul().shard((layout2("None", "tp"), layout2("tp", "None")))
        else:
            self.matmul1 = ops.MatMul().shard(((a, b), (b, 1)))
            self.matmul2 = ops.MatMul().shard(((1, devices), (devices, 1)))
        self.relu1 = ops.ReLU().shard(((b, 1),))
        self.relu2 = ops.ReLU().shard(((devices, 1),))
        self.matmul3 = ops.MatMul()

    def construct(self, x):
        x = self.flatten(x)
        x = self.relu1(self.matmul1(x, self.fc1_weight))
        x = self.relu2(self.matmul2(x, self.fc2_weight))
        return self.matmul3(x, self.fc3_weight)


def learnable_batch(rng, batch):
    """A batch of images the network can learn: each of the 10 classes is a fixed random
    28 x 28 pattern (drawn from one generator, so every run sees the same ones), and a
    sample is its class's pattern plus noise."""
    patterns = np.random.default_rng(2024).random((10, 1, 28, 28), dtype=np.float32) - 0.5
    label = rng.integers(0, 10, batch).astype(np.int32)
    noise = 0.1 * rng.standard_normal((batch, 1, 28, 28), dtype=np.float32)
    return patterns[label] + noise, label


def run(devices, use_layouts, steps, batch=32, strategy_devices=None):
    """Train on `devices` devices (1: stand-alone, where the strategies written for
    `strategy_devices` are checked but run on one device)."""
    dm.reset_auto_parallel_context()
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=devices,
                                     gradients_mean=True)
    communication.init()
    dm.set_seed(1)
    with no_init_parameters():
        net = Network(use_layouts, devices=strategy_devices or devices)
        optimizer = nn.SGD(net.trainable_params(), 0.1)
    loss_fn = nn.CrossEntropyLoss()

    def forward_fn(data, target):
        logits = net(data)
        return loss_fn(logits, target), logits

    grad_fn = dm.value_and_grad(forward_fn, None, optimizer.parameters, has_aux=True)
    rng = np.random.default_rng(0)
    losses = []
    with CommReport() as report:
        for step in range(steps):
            image, label = learnable_batch(rng, batch)
            (loss, _), grads = grad_fn(dm.Tensor(image), dm.Tensor(label))
            optimizer(grads)
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
    parser.add_argument("--layouts", action="store_true", help="use the Layout variant")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--devices", type=int, default=None,
                        help="devices of the sharded run (default: the launched ranks, "
                             "else 8 simulated devices)")
    args = parser.parse_args(argv)
    devices = device_count(args.devices)
    ref, _, _ = run(1, args.layouts, args.steps, strategy_devices=devices)
    losses, net, report = run(devices, args.layouts, args.steps)
    for step, (a, b) in enumerate(zip(losses, ref)):
        print(f"epoch: 0 step: {step}, loss is {a:.7f}   (one device: {b:.7f})")
    for p in net.trainable_params():
        print(f"{p.name}: global {tuple(p.shape)}, each device stores {local_shape(p)}")
    per_step = report.bytes() / args.steps
    print(f"{report.count() // args.steps} collectives and {per_step / 1024:.1f} KiB per "
          f"device per step; by reason:")
    for reason in ("forward", "backward", "redistribution", "gradient"):
        print(f"  {reason:<15} {report.count(reason=reason) // args.steps:3d} collectives  "
              f"{report.bytes(reason=reason) / args.steps / 1024:9.1f} KiB")
    return losses, ref, report


if __name__ == "__main__":
    main()
