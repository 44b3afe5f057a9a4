"""``repeat``: several passes over a dataset."""
from __future__ import annotations

import itertools
from typing import Iterator, Optional, Tuple

from ._checks import is_int
from ._rows import Row
from .base import Dataset, register_stage

__all__ = ["RepeatDataset"]


class RepeatDataset(Dataset):
    """``count`` passes over ``child`` (see :meth:`Dataset.repeat`); -1 means forever.

    Pass ``r`` of epoch key ``k`` reads the child with key ``k + (r,)``, so every
    repetition is shuffled anew.
    """

    def __init__(self, child: Dataset, count: Optional[int] = None):
        if count is None:
            count = -1
        if not is_int(count):
            raise TypeError(f"repeat: count={count!r} must be a positive int, -1 or None "
                            f"(forever), not {type(count).__name__}")
        if count < 1 and count != -1:
            raise ValueError(f"repeat: count={count!r} must be a positive int, -1 or None "
                             "(forever)")
        self.count = int(count)
        super().__init__(child.get_col_names(), (child,))

    def _rows(self, key: Tuple[int, ...]) -> Iterator[Row]:
        passes = itertools.count() if self.count == -1 else range(self.count)
        child = self._children[0]
        for r in passes:
            empty = True
            for row in child._rows(key + (r,)):
                empty = False
                yield row
            if empty:  # an empty dataset repeated forever is empty, not a hang
                return

    def _num_rows(self) -> int:
        n = self._children[0]._num_rows()
        return n if self.count == -1 else n * self.count

    def get_repeat_count(self) -> int:
        return self.count


register_stage("repeat", RepeatDataset)
