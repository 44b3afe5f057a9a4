"""ResNet on CIFAR-10 (after the ResNet-50 example of MindSpore's distributed training tutorial) on simulated devices, against one
device: data parallel, semi-auto parallel (a strategy on the final MatMul), a
``dataset_strategy`` that tiles the images on H and W, and hybrid parallel (the head's
classes split over the devices by hand, logits AllGathered).

Reads ``data_batch_*.bin`` from ``--data_dir`` (the ``cifar-10-batches-bin`` folder);
without one, a small synthetic CIFAR-10 is written in that format first. The pipeline is
the tutorial's (RandomCrop with padding 4, RandomHorizontalFlip, Resize, Rescale, Normalize,
HWC2CHW, TypeCast). ``--depth 50`` is ResNet-50 (bottleneck blocks 3-4-6-3, as MindSpore's;
heavy on a CPU: pair it with a small ``--image_size``); ``--depth 8`` (default) is a small
variant with one basic block per stage.

    python examples/resnet_cifar10.py [--data_dir DIR] [--depth 8] [--width 16]
        [--image_size 32] [--device_num 8] [--steps 3] [--batch 32]
        [--mode data_parallel|semi_auto|tiles|hybrid|all]
"""
import argparse
import math
import os
import tempfile

import numpy as np

import dualmode as dm
from dualmode import Parameter, communication, nn, ops
from dualmode.common.initializer import initializer
from dualmode.dataset import Cifar10Dataset, transforms, vision
from dualmode.parallel import set_layerwise_slices


def _conv_bn(cin, cout, k, stride):
    return [nn.Conv2d(cin, cout, k, stride=stride, pad_mode="same"), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Cell):
    """Two 3x3 conv+BN, identity (or 1x1 conv+BN) shortcut, ReLU."""
    expansion = 1

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = nn.SequentialCell(_conv_bn(cin, cout, 3, stride) + [nn.ReLU()]
                                      + _conv_bn(cout, cout, 3, 1))
        self.down = nn.SequentialCell(_conv_bn(cin, cout, 1, stride)) \
            if stride != 1 or cin != cout else None
        self.relu = nn.ReLU()

    def construct(self, x):
        short = x if self.down is None else self.down(x)
        return self.relu(self.body(x) + short)


class Bottleneck(nn.Cell):
    """1x1 reduce, 3x3, 1x1 expand (x4), each with BN; shortcut; ReLU (ResNet-50)."""
    expansion = 4

    def __init__(self, cin, cout, stride):
        super().__init__()
        mid = cout // 4
        self.body = nn.SequentialCell(_conv_bn(cin, mid, 1, 1) + [nn.ReLU()]
                                      + _conv_bn(mid, mid, 3, stride) + [nn.ReLU()]
                                      + _conv_bn(mid, cout, 1, 1))
        self.down = nn.SequentialCell(_conv_bn(cin, cout, 1, stride)) \
            if stride != 1 or cin != cout else None
        self.relu = nn.ReLU()

    def construct(self, x):
        short = x if self.down is None else self.down(x)
        return self.relu(self.body(x) + short)


DEPTHS = {8: (BasicBlock, (1, 1, 1)), 14: (BasicBlock, (2, 2, 2)),
          18: (BasicBlock, (2, 2, 2, 2)), 34: (BasicBlock, (3, 4, 6, 3)),
          50: (Bottleneck, (3, 4, 6, 3)), 101: (Bottleneck, (3, 4, 23, 3))}


class ResNet(nn.Cell):
    """Stem (3x3 conv+BN+ReLU, 3x3/2 max pool), stages of residual blocks (the first
    block of each later stage with stride 2), global average pool, and a MatMul head
    whose primitive takes a strategy (``head_strategy``) in semi-auto mode. With
    ``hybrid_devices=k`` the head weight is ``layerwise_parallel``: each device holds
    ``num_classes / k`` of its columns and the logits are put together with
    ``ops.AllGather`` (hybrid parallel: the user writes the communication)."""

    def __init__(self, depth=8, num_classes=10, width=16, head_strategy=None,
                 hybrid_devices=None):
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"ResNet: depth={depth} is not supported; expected one of "
                             f"{sorted(DEPTHS)}")
        block, counts = DEPTHS[depth]
        self.stem = nn.SequentialCell(_conv_bn(3, width, 3, 1) + [nn.ReLU(),
                                      nn.MaxPool2d(3, 2, "same")])
        layers, cin = [], width
        for i, n in enumerate(counts):
            cout = width * (2 ** i) * block.expansion
            for j in range(n):
                layers.append(block(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.SequentialCell(layers)
        cols = num_classes // hybrid_devices if hybrid_devices else num_classes
        self.head_weight = Parameter(initializer("normal", [cin, cols], dm.float32),
                                     name="head_weight",
                                     layerwise_parallel=bool(hybrid_devices))
        self.head = ops.MatMul()
        if head_strategy is not None:
            self.head.shard(head_strategy)
        # hybrid: the logits' classes are gathered over the devices by hand (AllGather
        # concatenates along dim 0); the other modes need no communication here
        self.gather = ops.AllGather() if hybrid_devices else None

    def construct(self, x):
        x = self.layers(self.stem(x))
        x = ops.reduce_mean(x, (2, 3))
        logits = self.head(x, self.head_weight)
        if self.gather is None:
            return logits
        return ops.transpose(self.gather(ops.transpose(logits, (1, 0))), (1, 0))


def write_synthetic_cifar10(data_dir, n=320, seed=0):
    """n 32x32 RGB images (a coloured gradient per class plus noise) as the five
    ``data_batch_*.bin`` files."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    colour = np.random.default_rng(99).uniform(0, 1, (10, 3))
    angle = labels * np.pi / 5
    ramp = (np.cos(angle)[:, None, None] * xx + np.sin(angle)[:, None, None] * yy)
    img = 255 * ramp[..., None] * colour[labels][:, None, None, :]
    img = np.clip(img + rng.normal(0, 25, img.shape), 0, 255).astype(np.uint8)
    vision.write_cifar10(data_dir, img, labels, "train")
    return data_dir


def create_dataset(data_dir, batch_size=32, image_size=32, num_samples=None, augment=True):
    """The tutorial's CIFAR-10 pipeline (augmentations drawn from ``dm.set_seed``'s stream)."""
    ds = Cifar10Dataset(data_dir, usage="train", shuffle=False, num_samples=num_samples)
    ops_ = [vision.RandomCrop((32, 32), (4, 4, 4, 4)), vision.RandomHorizontalFlip()] \
        if augment else []
    if image_size != 32:
        ops_.append(vision.Resize((image_size, image_size)))
    ops_ += [vision.Rescale(1.0 / 255.0, 0.0),
             vision.Normalize((0.4465, 0.4822, 0.4914), (0.2010, 0.1994, 0.2023)),
             vision.HWC2CHW()]
    ds = ds.map(operations=transforms.TypeCast(dm.int32), input_columns="label")
    ds = ds.map(operations=ops_, input_columns="image")
    return ds.batch(batch_size, drop_remainder=True)


def batches(data_dir, steps, batch, image_size, seed=3):
    """The first `steps` batches as numpy arrays (augmented once, reused by every run)."""
    dm.set_seed(seed)
    out = []
    for i, (x, y) in enumerate(create_dataset(data_dir, batch, image_size,
                                              num_samples=steps * batch)):
        if i == steps:
            break
        out.append((x.asnumpy(), y.asnumpy()))
    return out


MODES = {
    "data_parallel": dict(parallel_mode="data_parallel"),
    "semi_auto": dict(parallel_mode="semi_auto_parallel", head=((4, 1), (1, 2))),
    # images split on H and W over (2, 4) devices, labels whole on every device
    "tiles": dict(parallel_mode="semi_auto_parallel", dataset_strategy=((1, 1, 2, 4), (1,))),
    # the head's classes split over the devices (layerwise_parallel), the rest replicated
    # on the full batch; on gcd(device_num, 10) devices
    "hybrid": dict(parallel_mode="hybrid_parallel", dataset_strategy="full_batch"),
}


def train_steps(data, device_num=None, mode="data_parallel", depth=8, width=16, lr=0.05,
                seed=1):
    """Losses of Momentum steps over `data` and the final weights, on one device
    (``device_num=None``) or on `device_num` simulated devices in `mode`."""
    cfg = dict(MODES[mode])
    head = cfg.pop("head", None)
    hybrid = mode == "hybrid" and device_num
    if hybrid:
        device_num = math.gcd(device_num, 10)
    dm.reset_auto_parallel_context()
    communication.init()
    if device_num:
        dm.set_auto_parallel_context(device_num=device_num, gradients_mean=True, **cfg)
        communication.init()
    try:
        dm.set_seed(seed)
        net = ResNet(depth, 10, width, head_strategy=head,
                     hybrid_devices=device_num if hybrid else None)
        w0 = np.random.default_rng(seed).normal(0, 0.01, (net.head_weight.shape[0], 10))
        if hybrid:
            set_layerwise_slices(net.head_weight, w0.astype(np.float32), dim=1)
        else:
            net.head_weight.set_data(w0)
        net.set_train()
        opt = nn.Momentum(net.trainable_params(), lr, 0.9)
        loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        step = nn.WithLossCell(net, loss_fn)      # one top-level call: dataset_strategy
        grad_fn = dm.value_and_grad(step, None, opt.parameters)
        losses = []
        for x, y in data:
            loss, grads = grad_fn(dm.Tensor(x), dm.Tensor(y))
            opt(grads)
            losses.append(float(loss.asnumpy()))
        return losses, {p.name: p.asnumpy() for p in net.get_parameters()}
    finally:
        dm.reset_auto_parallel_context()
        communication.init()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--depth", type=int, default=8, choices=sorted(DEPTHS))
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--device_num", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--mode", default="all", choices=sorted(MODES) + ["all"])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir
        if data_dir is None:
            data_dir = write_synthetic_cifar10(os.path.join(tmp, "cifar-10-batches-bin"),
                                               n=max(args.batch * args.steps, 10))
            print("no --data_dir: wrote a synthetic CIFAR-10 (binary batches)")
        data = batches(data_dir, args.steps, args.batch, args.image_size)
    kw = dict(depth=args.depth, width=args.width)
    single, _ = train_steps(data, **kw)
    modes = sorted(MODES) if args.mode == "all" else [args.mode]
    results = {m: train_steps(data, args.device_num, m, **kw)[0] for m in modes}
    print(f"ResNet depth {args.depth}, {args.device_num} devices (hybrid: "
          f"{math.gcd(args.device_num, 10)}, the class count must divide): loss per step")
    print(f"{'step':>4}  {'1 device':>12}" + "".join(f"  {m:>14}" for m in modes))
    for i, a in enumerate(single):
        print(f"{i + 1:>4}  {a:12.6f}" + "".join(f"  {results[m][i]:14.6f}" for m in modes))
    return single, results


if __name__ == "__main__":
    main()
