"""``map``: apply Python functions to some columns of every row."""
from __future__ import annotations

from typing import Any, Callable, Iterator, List, Sequence, Tuple, Union

import numpy as np

from ._checks import check_names
from ._rows import Row
from .base import Dataset, register_stage

__all__ = ["MapDataset"]


def _operations(operations: Any) -> Tuple[Callable[..., Any], ...]:
    ops = list(operations) if isinstance(operations, (list, tuple)) else [operations]
    if not ops:
        raise ValueError("map: operations=[] is empty; expected a callable or a non-empty "
                         "list of callables")
    for op in ops:
        if not callable(op):
            raise TypeError(f"map: operations holds {op!r} of type {type(op).__name__}, "
                            "which is not callable")
    return tuple(ops)


class MapDataset(Dataset):
    """Rows of ``child`` with ``operations`` applied (see :meth:`Dataset.map`)."""

    def __init__(self, child: Dataset,
                 operations: Union[Callable[..., Any], Sequence[Callable[..., Any]]],
                 input_columns: Union[str, Sequence[str], None] = None,
                 output_columns: Union[str, Sequence[str], None] = None):
        self.operations = _operations(operations)
        names = child.get_col_names()
        if input_columns is None:
            inputs = (names[0],)
        else:
            inputs = check_names("map", "input_columns", input_columns)
            for c in inputs:
                if c not in names:
                    raise ValueError(f"map: input_columns={list(inputs)} has unknown column "
                                     f"{c!r}; the dataset's columns are {names}")
        outputs = inputs if output_columns is None else check_names(
            "map", "output_columns", output_columns)
        self._in_idx = tuple(names.index(c) for c in inputs)
        self._keep_idx = tuple(i for i, n in enumerate(names) if n not in inputs)
        kept = [names[i] for i in self._keep_idx]
        for c in outputs:
            if c in kept:
                raise ValueError(f"map: output_columns={list(outputs)} has {c!r}, which is "
                                 "already a column not in input_columns; column names must "
                                 "be unique")
        # Outputs take the place of the first input column.
        self._at = min(self._in_idx)
        self._n_out = len(outputs)
        self.input_columns, self.output_columns = list(inputs), list(outputs)
        super().__init__(kept[:self._at] + list(outputs) + kept[self._at:], (child,))

    def _apply(self, values: Tuple[np.ndarray, ...]) -> Tuple[np.ndarray, ...]:
        out: Any = values
        for op in self.operations:
            out = op(*out)
            if not isinstance(out, tuple):
                out = (out,)
        if len(out) != self._n_out:
            raise ValueError(f"map: operations returned {len(out)} value(s) but "
                             f"output_columns has {self._n_out}: {self.output_columns}")
        return tuple(np.asarray(v) for v in out)

    def _rows(self, key: Tuple[int, ...]) -> Iterator[Row]:
        in_idx, keep_idx, at = self._in_idx, self._keep_idx, self._at
        for row in self._children[0]._rows(key):
            outputs = self._apply(tuple(row[i] for i in in_idx))
            kept: List[np.ndarray] = [row[i] for i in keep_idx]
            yield tuple(kept[:at]) + outputs + tuple(kept[at:])


register_stage("map", MapDataset)
