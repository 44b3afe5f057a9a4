"""Iterators that run a dataset epoch by epoch and hand rows to the user."""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from .. import context
from ..parallel.devices import live_backend as _live_backend
from ..parallel.inputs import RANK_SHARDS, gathered_counts, rank_rows
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


def _batch_plan(dataset):
    """``(batch_size, full batches, rows of the short last batch)`` of one epoch of
    `dataset` when its last stage is ``batch`` over rows it can count, else
    ``(-1, -1, -1)``."""
    if hasattr(dataset, "batch_size") and hasattr(dataset, "drop_remainder"):
        stack = list(dataset._children)
        while stack:                 # a streaming source would be read through to count
            d = stack.pop()
            if getattr(d, "_count", 0) is None:
                return -1, -1, -1
            stack.extend(getattr(d, "_children", None) or ())
        try:
            rows = int(dataset._children[0]._num_rows())
        except Exception:            # a source that cannot count its rows up front
            rows = -1
        if rows >= 0:
            q, r = divmod(rows, dataset.batch_size)
            return dataset.batch_size, q, 0 if dataset.drop_remainder else r
    return -1, -1, -1


def _rank_plans(dataset):
    """Every rank's :func:`_batch_plan`, ``(ranks, 3)`` (gathered once per plan, so
    every epoch's batch sizes on every rank are known without a collective per batch),
    or None when some rank's data set cannot tell its batch sizes up front. ValueError
    when the ranks' epochs have different numbers of batches (a rank would wait for the
    others in a step they never take)."""
    plans = gathered_counts("plan", _batch_plan(dataset))
    if (plans < 0).any():
        return None
    steps = plans[:, 1] + (plans[:, 2] > 0)
    if (steps != steps[0]).any():
        each = ", ".join(f"rank {r}: {int(s)}" for r, s in enumerate(steps))
        raise ValueError(
            f"data set read per rank: the ranks' epochs have different numbers of batches "
            f"({each}); every rank must take the same steps: give every rank the same "
            f"number of batches (equal rows per rank, or drop_remainder=True)")
    return plans


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
        self._batch_at = 0               # batches of the current epoch taken so far
        self._plans = None               # every rank's batch plan (see _rank_counts)
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
            self._batch_at = 0
            if self._device_shards is None:
                self._rows = self._dataset._rows(key)
            else:               # device d's batch from shard d, as rank d reads it
                self._rows = map(_concat_rows,
                                 zip(*(c._rows(key) for c in self._device_shards)))
        try:
            row = next(self._rows)
            self._batch_at += 1
            return row
        except StopIteration:
            self._rows = None
            self._epochs_done += 1
            raise

    def _rank_counts(self, row: Row):
        """Every rank's row count of this batch (rank order), from the ranks' batch plans
        gathered at the first batch (no collective per batch); None when some rank's
        data set cannot tell its batch sizes up front (then each column's batch is
        checked by its row count, gathered once per new count)."""
        local = next((a.shape[0] for a in row if np.ndim(a) and a.dtype.kind not in "OSUV"),
                     None)
        if local is None:
            return None
        if self._plans is None:
            self._plans = _rank_plans(self._dataset)
            if self._plans is None:
                self._plans = False
        if self._plans is False:
            return None
        plans = self._plans
        counts = np.where(self._batch_at - 1 < plans[:, 1], plans[:, 0], plans[:, 2])
        rank = _live_backend().local_ranks[0]
        if counts[rank] != local:
            # this rank's data set broke its own plan; the job must end (an error here
            # aborts every rank), never wait for a batch the others do not expect
            raise RuntimeError(
                f"data set read per rank: batch {self._batch_at} of the epoch has {local} "
                f"rows on rank {rank}, where its batch_size and rows promised "
                f"{int(counts[rank])}")
        return counts

    def _convert(self, arr: np.ndarray, name: str = "", counts=None) -> Any:
        arr = owned(arr)
        if self._output_numpy:
            return arr
        if self._as_rank_rows and arr.ndim and arr.dtype.kind not in "OSUV":
            return rank_rows(arr, f"data set column {name!r}", counts)
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
        names = self._names = dataset.get_col_names()
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
        counts = self._rank_counts(row) if self._as_rank_rows else None
        names = self._names
        if self._select is not None:
            row = tuple(row[i] for i in self._select)
            names = [names[i] for i in self._select]
        return tuple(self._convert(a, n, counts) for a, n in zip(row, names))


class DictIterator(_EpochIterator):
    """Yields each row as a dict ``{column name: Tensor (or numpy array)}``."""

    _owner = "create_dict_iterator"

    def __init__(self, dataset, num_epochs: int = -1, output_numpy: bool = False):
        super().__init__(dataset, num_epochs, output_numpy)
        self._names = dataset.get_col_names()

    def __next__(self) -> Dict[str, Any]:
        row = self._next_row()
        counts = self._rank_counts(row) if self._as_rank_rows else None
        return {n: self._convert(a, n, counts) for n, a in zip(self._names, row)}
