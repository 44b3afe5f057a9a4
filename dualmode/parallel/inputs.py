"""Network inputs: a top-level network call splits its Tensor arguments as batch data,
per the context's ``dataset_strategy``."""
from __future__ import annotations

import weakref

from .. import context
from .._core import _tensor as _core
from .._core._tensor import TensorBase
from ..tensor import Parameter
from .devices import device_num, some_devices
from .dtensor import distribute, moved
from .moves import remember_blocks
from .tensor_layout import TensorLayout

__all__ = ["distribute_inputs", "RANK_SHARDS", "rank_rows"]

#: Tensors a data set made from this rank's own shard (``num_shards`` = the MPI world,
#: ``shard_id`` = this rank): a network takes them as its local rows of the batch.
#: (by id: tensors compare elementwise)
RANK_SHARDS = weakref.WeakValueDictionary()


def rank_rows(arr):
    """A batch-split Tensor whose local rows are `arr`, this rank's batch of a data set
    sharded per rank: the global batch is the ranks' batches concatenated in rank order
    (one device per process), exactly what the one-process simulation builds from the
    devices' shards. Every column of the data set (features, labels) gets this layout,
    so they meet in any op, inside a network or not."""
    n = device_num()
    layout = TensorLayout.batch_split((arr.shape[0] * n,) + tuple(arr.shape[1:]), n)
    return _core.wrap_dist(arr[None], layout)


def distribute_inputs(args):
    """Split the Tensor arguments of a top-level network call as batch data, per the
    context's ``dataset_strategy`` ("data_parallel", "full_batch" or per-input
    strategy tuples). Tensors already distributed, Parameters and 0-d values are
    left alone."""
    strategy = context.get_auto_parallel_context("dataset_strategy")
    if strategy == "full_batch":
        return args
    n = device_num()
    out, k = [], 0
    for i, a in enumerate(args):
        if not isinstance(a, TensorBase) or a._layout is not None or a.ndim == 0 \
                or isinstance(a, Parameter):
            out.append(a)
            continue
        shape = tuple(a.shape)
        if strategy == "data_parallel" and RANK_SHARDS.get(id(a)) is a and some_devices():
            # this rank's own shard of the data set (num_shards = ranks): it IS the local
            # rows of a global batch n times as large
            layout = TensorLayout.batch_split((shape[0] * n,) + shape[1:], n)
            out.append(moved(a, a._value()[None], layout))
            k += 1
            continue
        layout = input_layout(i, shape, k, strategy, n)
        k += 1
        stack = distribute(a, layout)._data
        remember_blocks(stack, a._value(), layout)          # a plain value: it never changes
        out.append(moved(a, stack, layout))                 # on the tape
    return tuple(out)


def input_layout(i, shape, k, strategy, n):
    """The layout a top-level network call gives its tensor input `i` (the `k`-th one
    split, global shape `shape`) on `n` devices per ``dataset_strategy`` ("data_parallel"
    or per-input strategy tuples): what :func:`distribute_inputs` moves it into, and
    what a dry run plans with."""
    if strategy == "data_parallel":
        if 0 < shape[0] < n:
            fewer = [d for d in range(n - 1, 0, -1) if shape[0] % d == 0][0]
            raise ValueError(
                f"dataset_strategy='data_parallel': input {i} has batch size {shape[0]} "
                f"(shape {shape}), fewer rows than the {n} devices (some would get none); "
                f"use a batch size of at least {n} (or drop_remainder=True), or "
                f"set_auto_parallel_context(full_batch=True) (every device takes the "
                f"whole batch), or fewer devices (device_num={fewer} divides it)")
        # a batch that does not divide: the first batch % n devices one row more
        layout = TensorLayout.batch_split(shape, n)
    else:
        if k >= len(strategy):
            raise ValueError(f"dataset_strategy={strategy!r} gives {len(strategy)} "
                             f"strategies but the network got more tensor inputs (input "
                             f"{i}); give one strategy per input")
        # tiles that do not divide: numpy.array_split's pieces along each split dim
        layout = TensorLayout.from_strategy(strategy[k], shape, n, "dataset_strategy", k)
    return layout
