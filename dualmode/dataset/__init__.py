"""MindSpore-style data pipelines: sources, samplers, ``batch`` / ``shuffle`` / ``map`` /
``repeat``, and iterators yielding :class:`dualmode.tensor.Tensor`.

>>> import numpy as np
>>> from dualmode.dataset import NumpySlicesDataset
>>> ds = NumpySlicesDataset((np.arange(8.0).reshape(4, 2), np.arange(4)),
...                         column_names=["x", "y"], shuffle=False).batch(2)
>>> for x, y in ds:
...     ...
"""
from .base import Dataset
from .batch import BatchDataset
from .generator import GeneratorDataset
from .iterators import DictIterator, TupleIterator
from .map import MapDataset
from .numpy_slices import NumpySlicesDataset
from .repeat import RepeatDataset
from .samplers import DistributedSampler, RandomSampler, Sampler, SequentialSampler
from .shuffle import ShuffleDataset
from . import transforms, vision
from .vision import Cifar10Dataset, MnistDataset

__all__ = [
    "Dataset",
    "NumpySlicesDataset",
    "GeneratorDataset",
    "BatchDataset",
    "ShuffleDataset",
    "MapDataset",
    "RepeatDataset",
    "Sampler",
    "SequentialSampler",
    "RandomSampler",
    "DistributedSampler",
    "TupleIterator",
    "DictIterator",
    "MnistDataset",
    "Cifar10Dataset",
    "vision",
    "transforms",
]
