"""``batch``: stack consecutive rows into batches."""
from __future__ import annotations

from typing import Iterator, List, Tuple

from ._checks import check_bool, check_int
from ._rows import Row, stack_rows
from .base import Dataset, register_stage
from .source import RandomAccessDataset

__all__ = ["BatchDataset"]


class BatchDataset(Dataset):
    """Rows of ``child`` stacked ``batch_size`` at a time (see :meth:`Dataset.batch`).

    Directly over an in-memory source, each batch is read with one gather per column
    instead of stacking rows one by one.
    """

    def __init__(self, child: Dataset, batch_size: int, drop_remainder: bool = False):
        self.batch_size = check_int("batch", "batch_size", batch_size, 1)
        self.drop_remainder = check_bool("batch", "drop_remainder", drop_remainder)
        super().__init__(child.get_col_names(), (child,))

    def _rows(self, key: Tuple[int, ...]) -> Iterator[Row]:
        child, size = self._children[0], self.batch_size
        if isinstance(child, RandomAccessDataset):
            order = child._order(key)
            stop = len(order) - len(order) % size if self.drop_remainder else len(order)
            for start in range(0, stop, size):
                yield child._take(order[start:start + size])
            return
        pending: List[Row] = []
        for row in child._rows(key):
            pending.append(row)
            if len(pending) == size:
                yield stack_rows("batch", pending, self._column_names)
                pending = []
        if pending and not self.drop_remainder:
            yield stack_rows("batch", pending, self._column_names)

    def _num_rows(self) -> int:
        n = self._children[0]._num_rows()
        return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

    def get_batch_size(self) -> int:
        return self.batch_size


register_stage("batch", BatchDataset)
