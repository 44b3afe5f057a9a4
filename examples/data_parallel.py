"""Data-parallel training on N devices, checked against one device.

The same MLP is trained twice from the same seed: once stand-alone, once with
``parallel_mode="data_parallel"`` on N devices with fused gradient AllReduce. The
losses and final weights agree, and the CommReport shows what the parallel run
communicated. N is ``--devices``, else the launched world (one device per rank), else 8
simulated devices:

    python examples/data_parallel.py [--devices 8] [--steps 20]
    python -m dualmode.run --worker_num 4 examples/data_parallel.py
"""
import argparse

import numpy as np

import dualmode as dm
from dualmode import communication, nn
from dualmode.dataset import NumpySlicesDataset
from dualmode.parallel import CommReport
from dualmode.train import LossMonitor, Model


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.body = nn.SequentialCell([nn.Dense(64, 128), nn.ReLU(), nn.Dense(128, 128),
                                       nn.ReLU(), nn.Dense(128, 10)])

    def construct(self, x):
        return self.body(x)


def make_data(n, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((10, 64)) * 2.0
    labels = rng.integers(0, 10, n)
    x = centers[labels] + rng.standard_normal((n, 64))
    return x.astype(np.float32), labels.astype(np.int32)


def train(devices, steps, batch):
    dm.reset_auto_parallel_context()
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=devices,
                                     gradients_mean=True, all_reduce_fusion_config=[2, 4])
    communication.init()
    dm.set_seed(1)
    x, y = make_data(steps * batch)
    ds = NumpySlicesDataset((x, y), column_names=["x", "y"], shuffle=False).batch(batch)
    net = MLP()
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True),
                  nn.Momentum(net.trainable_params(), 0.05, 0.9))
    monitor = LossMonitor(max(1, steps // 4))
    with CommReport() as report:
        model.train(1, ds, callbacks=[monitor])
    return monitor.losses, [p.asnumpy() for p in net.trainable_params()], report


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
    parser.add_argument("--devices", type=int, default=None,
                        help="devices of the parallel run (default: the launched ranks, "
                             "else 8 simulated devices)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    args.devices = device_count(args.devices)

    print("one device:")
    ref_losses, ref_w, _ = train(1, args.steps, args.batch)
    print(f"{args.devices} devices:")
    losses, w, report = train(args.devices, args.steps, args.batch)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    w_err = max(float(np.max(np.abs(a - b))) for a, b in zip(w, ref_w))
    print(f"max relative loss difference {loss_err:.2e}, max weight difference {w_err:.2e}")
    steps = args.steps
    print(f"communication per step: {report.count('AllReduce', 'gradient') // steps} fused "
          f"gradient AllReduce(s), {report.bytes(reason='gradient') / steps / 1024:.1f} KiB "
          f"per device; first step:")
    first = report.records[:report.count('AllReduce', 'gradient') // steps]
    for r in first:
        print(f"  {r.kind:<10} {r.op:<40} group {r.group_size}  "
              f"{r.bytes_per_device / 1024:8.2f} KiB/device")
    return loss_err, w_err, report


if __name__ == "__main__":
    main()
