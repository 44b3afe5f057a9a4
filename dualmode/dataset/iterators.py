"""Iterators that run a dataset epoch by epoch and hand rows to the user."""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from .. import context
from ..parallel.devices import live_backend as _live_backend
from ..parallel.inputs import RANK_SHARDS, rank_rows
from ..tensor import Tensor
from ._checks import check_bool, is_int
from ._rows import Row, owned

__all__ = ["TupleIterator", "DictIterator"]

@functools.lru_cache(maxsize=None)
def _tensor_maker() -> Callable[[np.ndarray], Any]:
    return getattr(Tensor, "_from_array", Tensor)


def _to_tensor(arr: np.ndarray) -> Any:
    """Wrap a row value in a ``Tensor`` (strings and objects stay numpy arrays)."""
    if arr.dtype.kind in "OSUV":
        return arr
    return _tensor_maker()(arr)


def _rank_shard_set(dataset):
    """When `dataset` reads this MPI rank's own shard (a DistributedSampler with
    num_shards = the world size and shard_id = this rank, one device per process), the
    set its tensors join so that a network takes them as local batch rows; else None."""
    b = _live_backend()
    if b is None or len(b.local_ranks) != 1 or b.world_size == 1:
        return None
    stack = [dataset]
    while stack:
        d = stack.pop()
        sampler = getattr(d, "_sampler", None)
        if getattr(sampler, "num_shards", None) == b.world_size and \
                getattr(sampler, "shard_id", None) == b.local_ranks[0]:
            return RANK_SHARDS
        stack.extend(getattr(d, "_children", None) or ())
    return None


def _rank_sampled(dataset):
    """The nodes of `dataset` whose sampler is a rank's shard (``num_shards`` and
    ``shard_id`` set), and whether a ``batch`` stage sits above them."""
    found, batched = [], False
    stack = [(dataset, False)]
    while stack:
        d, below_batch = stack.pop()
        sampler = getattr(d, "_sampler", None)
        if getattr(sampler, "num_shards", None) is not None:
            found.append((d, below_batch))
        here = below_batch or hasattr(d, "batch_size")
        stack.extend((c, here) for c in getattr(d, "_children", None) or ())
    if not found:
        return [], False
    batched = all(b for _, b in found)
    return [d for d, _ in found], batched


def _clone_for_shard(d, shard: int):
    """A copy of the pipeline `d` in which every rank-sharded sampler reads ``shard``
    (nodes copied shallowly: the data is shared)."""
    c = copy.copy(d)
    sampler = getattr(d, "_sampler", None)
    if getattr(sampler, "num_shards", None) is not None:
        c._sampler = copy.copy(sampler)
        c._sampler.shard_id = shard
    kids = getattr(d, "_children", None)
    if kids:
        c._children = tuple(_clone_for_shard(k, shard) for k in kids)
    return c


def _sim_shard_clones(dataset):
    """When one process simulates every device and `dataset` reads a rank's shard
    (``num_shards`` = the devices, ``shard_id`` = this process's rank, as
    ``num_shards=get_group_size(), shard_id=get_rank()`` gives under "sim"), one copy
    of the pipeline per device d reading shard d: their batches, concatenated in device
    order, form the global batch whose data-parallel split feeds device d with shard d
    (what each rank reads under "mpi"). Else None."""
    b = _live_backend()
    if b is None or b.world_size == 1 or len(b.local_ranks) != b.world_size:
        return None
    cfg = context._STATE.auto_parallel
    if cfg.parallel_mode == "stand_alone" or cfg.dataset_strategy != "data_parallel":
        return None
    nodes, batched = _rank_sampled(dataset)
    n = b.world_size
    rank = cfg.global_rank or 0
    if not nodes or not batched or any(d._sampler.num_shards != n or d._sampler.shard_id != rank
                                       for d in nodes):
        return None
    return [_clone_for_shard(dataset, d) for d in range(n)]


def _concat_rows(rows) -> Row:
    """The rows of the devices' batches, column by column, concatenated in device order."""
    return tuple(np.concatenate(cols, axis=0) if np.ndim(cols[0]) else np.stack(cols)
                 for cols in zip(*rows))


class _EpochIterator:
    """Runs ``num_epochs`` epochs of a dataset; each ``for`` loop consumes one epoch.

    ``__next__`` raises ``StopIteration`` at the end of every epoch; the next call starts
    the next epoch, until ``num_epochs`` epochs have run (-1: no limit).
    """

    _owner = "create_tuple_iterator"

    def __init__(self, dataset, num_epochs: int, output_numpy: bool):
        if not is_int(num_epochs) or (num_epochs < 1 and num_epochs != -1):
            raise (TypeError if not is_int(num_epochs) else ValueError)(
                f"{self._owner}: num_epochs={num_epochs!r} must be a positive int or -1 "
                "(no limit)")
        self._dataset = dataset
        self._num_epochs = int(num_epochs)
        self._output_numpy = check_bool(self._owner, "output_numpy", output_numpy)
        self._epochs_done = 0
        self._rows: Optional[Iterator[Row]] = None
        self._rank_shards = None if self._output_numpy else _rank_shard_set(dataset)
        self._device_shards = _sim_shard_clones(dataset)
        self._as_rank_rows = False
        if self._rank_shards is not None:
            cfg = context._STATE.auto_parallel
            if cfg.parallel_mode != "stand_alone" and cfg.dataset_strategy == "data_parallel" \
                    and _rank_sampled(dataset)[1]:
                # batches of this rank's shard: its rows of the global batch, every column
                self._as_rank_rows = True

    def __iter__(self):
        return self

    def _next_row(self) -> Row:
        if self._rows is None:
            if self._num_epochs != -1 and self._epochs_done >= self._num_epochs:
                raise StopIteration
            key = self._dataset._next_key()
            if self._device_shards is None:
                self._rows = self._dataset._rows(key)
            else:               # device d's batch from shard d, as rank d reads it
                self._rows = map(_concat_rows,
                                 zip(*(c._rows(key) for c in self._device_shards)))
        try:
            return next(self._rows)
        except StopIteration:
            self._rows = None
            self._epochs_done += 1
            raise

    def _convert(self, arr: np.ndarray) -> Any:
        arr = owned(arr)
        if self._output_numpy:
            return arr
        if self._as_rank_rows and arr.ndim and arr.dtype.kind not in "OSUV":
            return rank_rows(arr)
        t = _to_tensor(arr)
        if self._rank_shards is not None and not isinstance(t, np.ndarray):
            self._rank_shards[id(t)] = t
        return t

    def get_col_names(self):
        return self._dataset.get_col_names()


class TupleIterator(_EpochIterator):
    """Yields each row as a tuple of ``Tensor`` (or numpy arrays), one per column."""

    def __init__(self, dataset, columns: Optional[Sequence[str]] = None, num_epochs: int = -1,
                 output_numpy: bool = False):
        super().__init__(dataset, num_epochs, output_numpy)
        names = dataset.get_col_names()
        if columns is None:
            self._select: Optional[Tuple[int, ...]] = None
        else:
            cols = [columns] if isinstance(columns, str) else list(columns)
            for c in cols:
                if c not in names:
                    raise ValueError(f"{self._owner}: columns={columns!r} has unknown column "
                                     f"{c!r}; the dataset's columns are {names}")
            self._select = tuple(names.index(c) for c in cols)

    def __next__(self) -> Tuple[Any, ...]:
        row = self._next_row()
        if self._select is not None:
            row = tuple(row[i] for i in self._select)
        return tuple(self._convert(a) for a in row)


class DictIterator(_EpochIterator):
    """Yields each row as a dict ``{column name: Tensor (or numpy array)}``."""

    _owner = "create_dict_iterator"

    def __init__(self, dataset, num_epochs: int = -1, output_numpy: bool = False):
        super().__init__(dataset, num_epochs, output_numpy)
        self._names = dataset.get_col_names()

    def __next__(self) -> Dict[str, Any]:
        row = self._next_row()
        return {n: self._convert(a) for n, a in zip(self._names, row)}
