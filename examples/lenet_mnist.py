"""LeNet-5 on MNIST, data parallel on simulated devices, against one device.

Reads the standard idx-ubyte files from ``--data_dir``; without one, a small synthetic
MNIST is written in that format first (there is no download). Prints the loss of the
first steps on one device and on ``--device_num`` devices (data parallel, global-batch
gradients), which must agree.

    python examples/lenet_mnist.py [--data_dir DIR] [--device_num 8] [--steps 3]
        [--batch 32] [--amp_level O0]

Under MPI (``python -m dualmode.run --worker_num 8 examples/lenet_mnist.py``) each rank
runs the same script; the data-parallel part is the same program.
"""
import argparse
import os
import tempfile

import numpy as np

import dualmode as dm
from dualmode import communication, nn
from dualmode.dataset import MnistDataset, transforms, vision


class LeNet5(nn.Cell):
    """LeNet-5 (MindSpore's model zoo version): two 5x5 valid convolutions with ReLU
    and 2x2 max pooling, then three Dense layers; input (N, 1, 32, 32)."""

    def __init__(self, num_class=10, num_channel=1):
        super().__init__()
        self.conv1 = nn.Conv2d(num_channel, 6, 5, pad_mode="valid")
        self.conv2 = nn.Conv2d(6, 16, 5, pad_mode="valid")
        self.fc1 = nn.Dense(16 * 5 * 5, 120)
        self.fc2 = nn.Dense(120, 84)
        self.fc3 = nn.Dense(84, num_class)
        self.relu = nn.ReLU()
        self.max_pool2d = nn.MaxPool2d(kernel_size=2, stride=2)
        self.flatten = nn.Flatten()

    def construct(self, x):
        x = self.max_pool2d(self.relu(self.conv1(x)))
        x = self.max_pool2d(self.relu(self.conv2(x)))
        x = self.flatten(x)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


def write_synthetic_mnist(data_dir, n=512, seed=0):
    """n 28x28 digits-like images (a blurred bar pattern per class, shifted and noised)
    written as the standard train idx-ubyte files."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    yy, xx = np.mgrid[0:28, 0:28]
    angle = labels[:, None, None] * np.pi / 10
    shift = rng.integers(-3, 4, (n, 2))
    u = (xx[None] - 14 - shift[:, 0, None, None]) * np.cos(angle) + \
        (yy[None] - 14 - shift[:, 1, None, None]) * np.sin(angle)
    img = 255 * np.exp(-u ** 2 / 8.0) * (np.abs(yy - 14)[None] < 10)
    img = np.clip(img + rng.normal(0, 20, img.shape), 0, 255).astype(np.uint8)
    vision.write_mnist(data_dir, img, labels, "train")
    return data_dir


def create_dataset(data_dir, batch_size=32, num_samples=None):
    """MNIST resized to 32x32, normalised, CHW float32, int32 labels, batched."""
    ds = MnistDataset(data_dir, usage="train", shuffle=False, num_samples=num_samples)
    ds = ds.map([vision.Resize((32, 32)), vision.Rescale(1.0 / 255.0, 0.0),
                 vision.Rescale(1 / 0.3081, -0.1307 / 0.3081), vision.HWC2CHW()],
                input_columns="image")
    ds = ds.map(transforms.TypeCast(dm.int32), input_columns="label")
    return ds.batch(batch_size, drop_remainder=True)


def train_steps(make_net, dataset, steps, device_num=None, lr=0.01, seed=1, **ctx):
    """Losses of the first `steps` Momentum steps and the final weights, on one device
    (``device_num=None``) or data parallel on `device_num` simulated devices."""
    dm.reset_auto_parallel_context()
    communication.init()
    if device_num:
        dm.set_auto_parallel_context(device_num=device_num,
                                     parallel_mode=ctx.pop("parallel_mode", "data_parallel"),
                                     gradients_mean=True, **ctx)
        communication.init()
    try:
        dm.set_seed(seed)
        net = make_net()
        net.set_train()
        opt = nn.Momentum(net.trainable_params(), lr, 0.9)
        loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
        losses = []
        for i, (x, y) in enumerate(dataset):
            if i == steps:
                break
            loss, grads = grad_fn(x, y)
            opt(grads)
            losses.append(float(loss.asnumpy()))
        return losses, {p.name: p.asnumpy() for p in net.get_parameters()}
    finally:
        dm.reset_auto_parallel_context()
        communication.init()


def compare(data_dir, args):
    """The losses of the same steps on one device and on ``args.device_num``."""
    ds = create_dataset(data_dir, args.batch, num_samples=args.batch * args.steps)
    single, _ = train_steps(LeNet5, ds, args.steps)
    sharded, _ = train_steps(LeNet5, ds, args.steps, device_num=args.device_num)
    return single, sharded


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--device_num", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    if args.data_dir is not None:
        single, sharded = compare(args.data_dir, args)
    else:
        with tempfile.TemporaryDirectory() as tmp:      # removed when training is done
            data_dir = write_synthetic_mnist(os.path.join(tmp, "mnist"),
                                             n=args.batch * args.steps)
            print("no --data_dir: training on a synthetic MNIST written to a temporary "
                  "folder")
            single, sharded = compare(data_dir, args)
    print(f"{'step':>4}  {'1 device':>12}  {f'{args.device_num} devices (DP)':>16}")
    for i, (a, b) in enumerate(zip(single, sharded), 1):
        print(f"{i:>4}  {a:12.6f}  {b:16.6f}")
    return single, sharded


if __name__ == "__main__":
    main()
