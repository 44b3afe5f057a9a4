"""Network inputs: a top-level network call splits its Tensor arguments as batch data,
per the context's ``dataset_strategy``."""
from __future__ import annotations

import weakref

import numpy as np

from .. import context
from .._core import _tensor as _core
from .._core._tensor import TensorBase
from ..tensor import Parameter
from .devices import backend, device_num, some_devices
from .dtensor import distribute, moved
from .moves import remember_blocks
from .tensor_layout import TensorLayout

__all__ = ["distribute_inputs", "RANK_SHARDS", "rank_rows", "gathered_counts",
           "check_rank_rows"]

#: Tensors a data set made from this rank's own shard (``num_shards`` = the MPI world,
#: ``shard_id`` = this rank): a network takes them as its local rows of the batch.
#: (by id: tensors compare elementwise)
RANK_SHARDS = weakref.WeakValueDictionary()


#: per live backend: (kind, this rank's tuple of ints) -> every rank's tuple, a
#: (ranks, len) int64 array (see gathered_counts)
_GATHERED = weakref.WeakKeyDictionary()


def gathered_counts(kind, local):
    """Every rank's `local` (a tuple of ints of the `kind` the caller names: "rows" of a
    batch, a data set's batch "plan", an input's "shape") as a read-only
    ``(ranks, len(local))`` int64 array, in rank order: one AllGather over the world the
    first time this rank has this value, then cached, so a training loop whose batches
    keep their shape makes no collective for it. Every rank must call it at the same
    points with values it has, or has not, had alike (as every rank's batches change
    size at the same steps; under MPI ranks out of step wait for each other in this
    gather, on a communicator of its own, until the backend's timeout ends the job);
    an observation, not recorded in CommReport."""
    b = backend()
    cache = _GATHERED.setdefault(b, {})
    got = cache.get((kind, local))
    if got is None:
        mine = np.asarray(local, np.int64)
        side = getattr(b, "side_all_gather", None)    # MPI: apart from the program's
        what = (f"the ranks' {kind} check of their batches (made by a rank whose batch has "
                f"{kind} it had not had before: every rank's must change at the same steps)")
        got = side(mine, what) if side is not None else b.world_stack(mine[None])
        got.flags.writeable = False
        cache[(kind, local)] = got
    return got


def check_rank_rows(counts, what):
    """The rows of the global batch whose pieces, one per rank in rank order, have the
    row `counts` (one per rank): their total when they are equal or numpy.array_split's
    pieces of it (the first ``total % ranks`` ranks one row more), which the batch split
    of the total holds exactly; else a ValueError naming `what`, every rank's count and
    what is valid. Every rank gets the same answer from the same counts."""
    counts = [int(c) for c in counts]
    n, total = len(counts), sum(counts)
    want = [total // n + (r < total % n) for r in range(n)]
    if counts == want and total >= n:
        return total
    each = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
    if counts == want:
        problem = f"the global batch of {total} rows leaves some ranks no row"
    else:
        problem = (f"that is not how {total} rows split over {n} ranks (numpy.array_split's "
                   f"pieces in rank order: {want}, the first ranks one row longer)")
    raise ValueError(
        f"{what}: the ranks' batches have unequal row counts ({each}); under "
        f"dataset_strategy='data_parallel' each rank's batch is its piece of one global "
        f"batch, and {problem}; give the ranks batches of equal size or array_split's "
        f"pieces of the global batch in rank order (pad or drop rows, e.g. "
        f"batch(..., drop_remainder=True)), or, when every rank reads the same whole "
        f"batch, set_auto_parallel_context(full_batch=True)")


def _rank_piece(arr, what, counts=None):
    """`arr` (this rank's rows) as one rank's piece of the global batch: ``(stack,
    layout)``, the stack padded with zero rows to the layout's slot when the ranks'
    pieces are array_split's unequal ones. `counts` (every rank's rows) is gathered when
    not given."""
    n = device_num()
    rows = arr.shape[0]
    if counts is None:
        counts = gathered_counts("rows", (rows,))[:, 0]
    total = check_rank_rows(counts, what)
    layout = TensorLayout.batch_split((total,) + tuple(arr.shape[1:]), n)
    slot = layout.local_shape[0]
    if slot == rows:
        return arr[None], layout
    stack = np.zeros((1, slot) + tuple(arr.shape[1:]), arr.dtype)
    stack[0, :rows] = arr
    return stack, layout


def rank_rows(arr, what="data set column", counts=None):
    """A batch-split Tensor whose local rows are `arr`, this rank's batch of a data set
    sharded per rank: the global batch is the ranks' batches concatenated in rank order
    (one device per process), exactly what the one-process simulation builds from the
    devices' shards. Every column of the data set (features, labels) gets this layout,
    so they meet in any op, inside a network or not. The ranks' row counts (`counts`,
    gathered once per new local count when not given) must be equal or array_split's
    pieces of their total (:func:`check_rank_rows`, which names `what` when not)."""
    stack, layout = _rank_piece(arr, what, counts)
    return _core.wrap_dist(stack, layout)


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
            # rows of the global batch (the ranks' rows in rank order)
            stack, layout = _rank_piece(a._value(), f"input {i} (this rank's data set rows)")
            out.append(moved(a, stack, layout))
            k += 1
            continue
        if some_devices():
            _check_global_input(i, shape)
        layout = input_layout(i, shape, k, strategy, n)
        k += 1
        stack = distribute(a, layout)._data
        remember_blocks(stack, a._value(), layout)          # a plain value: it never changes
        out.append(moved(a, stack, layout))                 # on the tape
    return tuple(out)


def _check_global_input(i, shape):
    """Under MPI (one device per process) a plain Tensor input is the whole global value,
    the same on every rank, each rank taking its rows: ValueError naming input `i` and
    every rank's rows when the ranks pass tensors of different shapes (each rank would
    take rows of its own tensor as if of one batch). Gathered once per new shape."""
    got = gathered_counts("shape", (len(shape), shape[0], int(np.prod(shape))))
    if (got == got[0]).all():
        return
    each = ", ".join(f"rank {r}: {int(g[1])} rows of {int(g[2])} values"
                     for r, g in enumerate(got))
    raise ValueError(
        f"input {i}: a Tensor given to the network is the whole global batch, the same on "
        f"every rank (each rank takes its rows), but the ranks pass tensors of different "
        f"shapes (this rank's is {shape}; {each}); pass the same tensor on every rank, "
        f"or give each rank its own rows through a data set sharded per rank "
        f"(num_shards=get_group_size(), shard_id=get_rank())")


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
