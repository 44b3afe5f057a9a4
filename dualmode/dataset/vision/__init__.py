"""Image data (MindSpore's ``dataset.vision`` and the image sources): the MNIST and
CIFAR-10 readers (and writers of their file formats), and vision transforms for
``Dataset.map``."""
from .readers import Cifar10Dataset, MnistDataset, write_cifar10, write_mnist
from .transforms import (CenterCrop, Decode, HWC2CHW, Inter, Normalize, RandomCrop,
                         RandomHorizontalFlip, Rescale, Resize)
from ._png import encode_png

__all__ = ["MnistDataset", "Cifar10Dataset", "write_mnist", "write_cifar10", "Decode",
           "Resize", "RandomCrop", "RandomHorizontalFlip", "CenterCrop", "Rescale",
           "Normalize", "HWC2CHW", "Inter", "encode_png"]
