"""MnistDataset (idx-ubyte files) and Cifar10Dataset (``cifar-10-batches-bin`` files),
reading the standard formats, plus writers of the same formats (tests and examples
make small data sets with them: there is no download).

Both are random-access sources (``usage``, ``num_samples``, ``shuffle``,
``num_shards``/``shard_id``, ``sampler`` as every dualmode source); images are
memory-mapped, so a shard reads only its rows. Columns: ``image`` (HWC uint8: MNIST
(28, 28, 1), CIFAR-10 (32, 32, 3)) and ``label`` (uint32), as MindSpore.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import numpy as np

from .._rows import Row
from ..samplers import Sampler
from ..source import RandomAccessDataset, resolve_sampler

__all__ = ["MnistDataset", "Cifar10Dataset", "write_mnist", "write_cifar10"]

_MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_CIFAR_FILES = {"train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
                "test": ("test_batch.bin",)}
_CIFAR_RECORD = 1 + 32 * 32 * 3


def _check_dir(owner: str, dataset_dir) -> str:
    if not isinstance(dataset_dir, (str, os.PathLike)):
        raise TypeError(f"{owner}: dataset_dir must be a path, got {dataset_dir!r}")
    path = os.fspath(dataset_dir)
    if not os.path.isdir(path):
        raise ValueError(f"{owner}: dataset_dir={path!r} is not a directory")
    return path


def _check_usage(owner: str, usage) -> Tuple[str, ...]:
    if usage is None:
        usage = "all"
    if usage not in ("train", "test", "all"):
        raise ValueError(f"{owner}: usage={usage!r} is not valid; expected 'train', 'test' "
                         f"or 'all'")
    return ("train", "test") if usage == "all" else (usage,)


def _need_file(owner: str, path: str) -> str:
    if not os.path.isfile(path):
        if os.path.isfile(path + ".gz"):
            raise ValueError(f"{owner}: file {path!r} is missing but {path + '.gz'!r} is "
                             f"there: decompress it first (gunzip {path + '.gz'!r}); the "
                             f"reader takes the uncompressed files")
        raise ValueError(f"{owner}: file {path!r} is missing (expected the standard "
                         f"{owner[:-7]} file names in dataset_dir)")
    return path


def _idx(owner: str, path: str, magic: int, dims: int) -> np.ndarray:
    """The array of an idx-ubyte file (big-endian header: magic, then `dims` sizes)."""
    size = os.path.getsize(path)
    head = 4 * (1 + dims)
    if size < head:
        raise ValueError(f"{owner}: file {path!r} is truncated ({size} bytes, shorter than "
                         f"its {head}-byte header)")
    hdr = np.fromfile(path, dtype=">u4", count=1 + dims)
    if int(hdr[0]) != magic:
        raise ValueError(f"{owner}: file {path!r} has magic number {int(hdr[0])}; expected "
                         f"{magic} (an idx{dims}-ubyte file)")
    shape = tuple(int(d) for d in hdr[1:])
    want = head + int(np.prod(shape))
    if size < want:
        raise ValueError(f"{owner}: file {path!r} is truncated: {size} bytes, its header "
                         f"{shape} needs {want}")
    return np.memmap(path, np.uint8, "r", offset=head, shape=shape)


class _ImageSource(RandomAccessDataset):
    _owner = ""

    def __init__(self, images: Sequence[np.ndarray], labels: Sequence[np.ndarray],
                 num_samples, num_parallel_workers, shuffle, sampler, num_shards, shard_id):
        sampler = resolve_sampler(self._owner, shuffle, num_shards, shard_id, sampler,
                                  num_samples)
        super().__init__(("image", "label"), sampler)
        self._images = list(images)
        self._labels = list(labels)
        self._starts = np.cumsum([0] + [len(lab) for lab in self._labels])

    def _length(self) -> int:
        return int(self._starts[-1])

    def _locate(self, idx: np.ndarray):
        part = np.searchsorted(self._starts, idx, side="right") - 1
        return part, idx - self._starts[part]

    def _image(self, part, i):
        raise NotImplementedError

    def _row(self, i: int) -> Row:
        part, j = self._locate(np.asarray([i]))
        p, k = int(part[0]), int(j[0])
        return (self._image(p, np.asarray([k]))[0],
                np.asarray(self._labels[p][k], np.uint32))

    def _take(self, idx: np.ndarray) -> Row:
        part, j = self._locate(np.asarray(idx))
        out_img, out_lab = [], []
        order = np.argsort(part, kind="stable")
        for p in np.unique(part):              # one read per file, not per row
            sel = part == p
            out_img.append(self._image(int(p), j[sel]))
            out_lab.append(np.asarray(self._labels[p])[j[sel]])
        img = np.concatenate(out_img)
        lab = np.concatenate(out_lab).astype(np.uint32)
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        return img[back], lab[back]


class MnistDataset(_ImageSource):
    """MNIST from the standard idx-ubyte files in `dataset_dir`
    (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-...``).

    Parameters
    ----------
    dataset_dir : path
    usage : "train", "test" or "all" (default: all)
    num_samples : int, optional
        At most this many rows per epoch (per shard when sharded).
    shuffle : bool, optional
        None (default) and True shuffle each epoch (seeded by ``set_seed``).
    num_shards, shard_id : int, optional
        Read shard `shard_id` of `num_shards` (see ``DistributedSampler``).
    sampler : Sampler, optional

    Rows: ``image`` (28, 28, 1) uint8 and ``label`` uint32. A missing or truncated file
    raises ValueError naming it.
    """
    _owner = "MnistDataset"

    def __init__(self, dataset_dir, usage=None, num_samples=None, num_parallel_workers=None,
                 shuffle=None, sampler: Optional[Sampler] = None, num_shards=None,
                 shard_id=None):
        path = _check_dir(self._owner, dataset_dir)
        images, labels = [], []
        for u in _check_usage(self._owner, usage):
            fi, fl = (_need_file(self._owner, os.path.join(path, f)) for f in _MNIST_FILES[u])
            img = _idx(self._owner, fi, 2051, 3)
            lab = _idx(self._owner, fl, 2049, 1)
            if len(img) != len(lab):
                raise ValueError(f"{self._owner}: file {fi!r} has {len(img)} images but "
                                 f"{fl!r} has {len(lab)} labels")
            images.append(img)
            labels.append(lab)
        super().__init__(images, labels, num_samples, num_parallel_workers, shuffle, sampler,
                         num_shards, shard_id)

    def _image(self, part, idx):
        return np.asarray(self._images[part][idx])[..., None]


class Cifar10Dataset(_ImageSource):
    """CIFAR-10 from the binary files in `dataset_dir` (``data_batch_1.bin`` ...
    ``data_batch_5.bin``, ``test_batch.bin``: records of 1 label byte + 3072 pixel bytes,
    channel planes R, G, B of 32x32). Arguments as :class:`MnistDataset`; rows:
    ``image`` (32, 32, 3) uint8 HWC and ``label`` uint32. Every file of the usage must be
    there; a missing file, or one that is not a whole number of records, raises
    ValueError naming it."""
    _owner = "Cifar10Dataset"

    def __init__(self, dataset_dir, usage=None, num_samples=None, num_parallel_workers=None,
                 shuffle=None, sampler: Optional[Sampler] = None, num_shards=None,
                 shard_id=None):
        path = _check_dir(self._owner, dataset_dir)
        images, labels = [], []
        for u in _check_usage(self._owner, usage):
            for name in _CIFAR_FILES[u]:
                f = _need_file(self._owner, os.path.join(path, name))
                size = os.path.getsize(f)
                if size == 0 or size % _CIFAR_RECORD:
                    raise ValueError(f"{self._owner}: file {f!r} is truncated: {size} bytes "
                                     f"is not a whole number of {_CIFAR_RECORD}-byte records")
                rec = np.memmap(f, np.uint8, "r", shape=(size // _CIFAR_RECORD,
                                                          _CIFAR_RECORD))
                images.append(rec)
                labels.append(np.asarray(rec[:, 0]))
        super().__init__(images, labels, num_samples, num_parallel_workers, shuffle, sampler,
                         num_shards, shard_id)

    def _image(self, part, idx):
        px = np.asarray(self._images[part][idx, 1:]).reshape(-1, 3, 32, 32)
        return np.ascontiguousarray(px.transpose(0, 2, 3, 1))


def write_mnist(dataset_dir, images, labels, usage="train") -> None:
    """Write (N, 28, 28[, 1]) uint8 images and labels as the idx-ubyte pair of `usage`."""
    images = np.asarray(images, np.uint8)
    if images.ndim == 4:
        images = images[..., 0]
    labels = np.asarray(labels, np.uint8)
    fi, fl = _MNIST_FILES[usage]
    os.makedirs(dataset_dir, exist_ok=True)
    with open(os.path.join(dataset_dir, fi), "wb") as f:
        f.write(np.asarray([2051, *images.shape], ">u4").tobytes() + images.tobytes())
    with open(os.path.join(dataset_dir, fl), "wb") as f:
        f.write(np.asarray([2049, len(labels)], ">u4").tobytes() + labels.tobytes())


def write_cifar10(dataset_dir, images, labels, usage="train") -> None:
    """Write (N, 32, 32, 3) uint8 HWC images and labels as CIFAR-10 binary files: for
    "train" split over the five ``data_batch_*.bin`` files, for "test" ``test_batch.bin``."""
    images = np.asarray(images, np.uint8)
    labels = np.asarray(labels, np.uint8)
    rec = np.concatenate([labels[:, None], images.transpose(0, 3, 1, 2).reshape(
        len(labels), -1)], axis=1)
    os.makedirs(dataset_dir, exist_ok=True)
    names = _CIFAR_FILES[usage]
    for name, part in zip(names, np.array_split(rec, len(names))):
        with open(os.path.join(dataset_dir, name), "wb") as f:
            f.write(part.tobytes())
