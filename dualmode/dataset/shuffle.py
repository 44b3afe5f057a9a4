"""``shuffle``: MindSpore's buffer shuffle."""
from __future__ import annotations

from typing import Iterator, List, Tuple

from .. import context
from ._checks import check_int
from ._rows import Row
from .base import Dataset, register_stage

__all__ = ["ShuffleDataset"]

# First element of every derived_rng key drawn by shuffle buffers.
_SHUFFLE_STREAM = 102
_DRAWS = 1024  # random buffer slots drawn per numpy call


class ShuffleDataset(Dataset):
    """Rows of ``child`` shuffled through a buffer (see :meth:`Dataset.shuffle`).

    The buffer is filled with the first ``buffer_size`` rows; then each incoming row
    replaces a buffered row picked at random, which is yielded; at the end the rows left
    in the buffer are yielded in a random order. Random draws come from
    :func:`dualmode.context.derived_rng`, keyed by the pass, so a seed gives the same
    order every run and each epoch a different one.
    """

    def __init__(self, child: Dataset, buffer_size: int):
        self.buffer_size = check_int("shuffle", "buffer_size", buffer_size, 2,
                                     "an int >= 2 (MindSpore rejects 1, which would not shuffle)")
        super().__init__(child.get_col_names(), (child,))

    def _rows(self, key: Tuple[int, ...]) -> Iterator[Row]:
        g = context.derived_rng(_SHUFFLE_STREAM, *key)
        size = self.buffer_size
        buffer: List[Row] = []
        slots: List[int] = []
        for row in self._children[0]._rows(key):
            if len(buffer) < size:
                buffer.append(row)
                continue
            if not slots:
                slots = g.integers(0, size, size=_DRAWS).tolist()[::-1]
            j = slots.pop()
            out, buffer[j] = buffer[j], row
            yield out
        for j in g.permutation(len(buffer)).tolist():
            yield buffer[j]


register_stage("shuffle", ShuffleDataset)
