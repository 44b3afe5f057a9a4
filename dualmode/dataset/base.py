"""``Dataset``: the base of every pipeline node, and the methods that chain nodes.

A dataset is a lazily evaluated node: ``batch``, ``shuffle``, ``map`` and ``repeat``
return new nodes wrapping this one, and nothing is read until the dataset is iterated.
Every iteration of a dataset is a new epoch; random choices (shuffles) are keyed by the
epoch (and repeat) number, so each epoch is shuffled differently and the same seed gives
the same epochs.

Node protocol (for subclasses): ``_rows(key)`` yields the rows of one pass, where ``key``
is a tuple of ints naming the pass (epoch, then one index per enclosing ``repeat``);
``_num_rows()`` is the number of rows one pass yields.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ._rows import Row
from .iterators import DictIterator, TupleIterator

#: the pipeline stages (batch, shuffle, map, repeat) by name: each stage's module
#: subclasses Dataset, so it registers itself here instead of being imported by it
_STAGES: dict = {}


def register_stage(name: str, cls) -> None:
    """Make ``Dataset.<name>(...)`` build a `cls` over the dataset."""
    _STAGES[name] = cls


def _stage(name: str):
    try:
        return _STAGES[name]
    except KeyError:
        raise RuntimeError(f"Dataset.{name}: the stage is not loaded; import "
                           f"dualmode.dataset") from None


__all__ = ["Dataset", "register_stage"]

# Pass key used to look at the first row (output_shapes) without starting an epoch.
_PEEK_KEY = (2**32 - 1,)


class Dataset:
    """Base class of datasets: a node of a lazily evaluated data pipeline.

    Iterating a dataset (``for image, label in ds``) runs one epoch and yields tuples of
    :class:`dualmode.tensor.Tensor`, one per column.
    """

    def __init__(self, column_names: Sequence[str], children: Tuple["Dataset", ...] = ()):
        self._column_names = tuple(column_names)
        self._children = children
        self._epochs_started = 0

    # ----------------------------------------------------------- node protocol

    def _rows(self, key: Tuple[int, ...]) -> Iterator[Row]:
        raise NotImplementedError

    def _num_rows(self) -> int:
        return self._children[0]._num_rows()

    def _next_key(self) -> Tuple[int, ...]:
        key = (self._epochs_started,)
        self._epochs_started += 1
        return key

    # ------------------------------------------------------------- information

    def get_col_names(self) -> List[str]:
        """Names of the columns, in the order rows hold them."""
        return list(self._column_names)

    def get_dataset_size(self) -> int:
        """Number of rows (batches, after ``batch``) one epoch yields.

        An infinite ``repeat`` counts one pass of what it repeats, as in MindSpore.
        """
        return self._num_rows()

    def get_batch_size(self) -> int:
        """Batch size of the last ``batch`` in the pipeline (1 if there is none)."""
        return self._children[0].get_batch_size() if self._children else 1

    def get_repeat_count(self) -> int:
        """Count of the last ``repeat`` in the pipeline (1 if none, -1 if infinite)."""
        return self._children[0].get_repeat_count() if self._children else 1

    def output_shapes(self) -> List[List[int]]:
        """Shapes of the columns of the first row (reads one row)."""
        return [list(a.shape) for a in self._first_row()]

    def output_types(self) -> List[np.dtype]:
        """Numpy dtypes of the columns of the first row (reads one row)."""
        return [a.dtype for a in self._first_row()]

    def _first_row(self) -> Row:
        for row in self._rows(_PEEK_KEY):
            return row
        raise ValueError(f"{type(self).__name__}: the dataset is empty; it has no first row")

    # ----------------------------------------------------------------- chaining

    def batch(self, batch_size: int, drop_remainder: bool = False) -> "Dataset":
        """Stack ``batch_size`` consecutive rows into one.

        Parameters
        ----------
        batch_size : int
            Rows per batch (a positive int).
        drop_remainder : bool
            Drop the last batch if it has fewer than ``batch_size`` rows (default False).

        Returns
        -------
        BatchDataset
        """
        return _stage("batch")(self, batch_size, drop_remainder)

    def shuffle(self, buffer_size: int) -> "Dataset":
        """Shuffle rows through a buffer of ``buffer_size`` rows (as MindSpore).

        A buffer at least as large as the dataset gives a uniform permutation.

        Parameters
        ----------
        buffer_size : int
            Size of the shuffle buffer, an int >= 2.

        Returns
        -------
        ShuffleDataset
        """
        return _stage("shuffle")(self, buffer_size)

    def map(self, operations: Union[Callable[..., Any], Sequence[Callable[..., Any]]],
            input_columns: Union[str, Sequence[str], None] = None,
            output_columns: Union[str, Sequence[str], None] = None) -> "Dataset":
        """Apply ``operations`` to the ``input_columns`` of every row.

        Parameters
        ----------
        operations : callable or list of callables
            Each takes the column values (numpy arrays) as positional arguments and
            returns one value or a tuple of values; a list is applied in order, each
            operation taking the outputs of the previous one.
        input_columns : str or list of str, optional
            Columns passed to the first operation (default: the first column).
        output_columns : str or list of str, optional
            Names of the values the last operation returns (default: ``input_columns``).
            They replace the input columns, at the position of the first input column.

        Returns
        -------
        MapDataset
        """
        return _stage("map")(self, operations, input_columns, output_columns)

    def repeat(self, count: Optional[int] = None) -> "Dataset":
        """Repeat the dataset ``count`` times; ``None`` or -1 repeats forever.

        Each repetition is a new pass: shuffles draw new orders.

        Returns
        -------
        RepeatDataset
        """
        return _stage("repeat")(self, count)

    # ---------------------------------------------------------------- iterating

    def create_tuple_iterator(self, columns: Optional[Sequence[str]] = None,
                              num_epochs: int = -1, output_numpy: bool = False):
        """An iterator over rows as tuples of ``Tensor`` (numpy arrays with ``output_numpy``).

        Parameters
        ----------
        columns : list of str, optional
            Columns to yield, in this order (default: all).
        num_epochs : int
            Epochs the iterator can run (-1: unlimited). Each ``for`` loop over the
            iterator runs one epoch.
        output_numpy : bool
            Yield numpy arrays instead of ``Tensor``.
        """
        return TupleIterator(self, columns, num_epochs, output_numpy)

    def create_dict_iterator(self, num_epochs: int = -1, output_numpy: bool = False):
        """As :meth:`create_tuple_iterator`, yielding ``{column name: value}`` dicts."""
        return DictIterator(self, num_epochs, output_numpy)

    def __iter__(self):
        """Run one epoch, yielding tuples of ``Tensor``."""
        return TupleIterator(self, None, 1, False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(columns={list(self._column_names)})"
