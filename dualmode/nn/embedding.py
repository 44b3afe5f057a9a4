"""Embedding: a lookup table of learnable vectors indexed by integer ids."""
from __future__ import annotations

import contextlib

import numpy as np

from .. import ops
from ..ps.embedding import RowCache, before_lookup
from ..ps.worker import active_worker
from ..common import dtype as _dt
from ..common.initializer import Initializer, _as_init
from ..tensor import Tensor, no_init_parameters
from ._checks import check_bool, check_int, check_tensor
from .basic import make_parameter
from .cell import Cell

__all__ = ["Embedding", "EmbeddingLookup"]


class _ZeroRow(Initializer):
    """Another initializer's values with one row set to zero (``padding_idx``)."""

    def __init__(self, base, row):
        self.base, self.row = base, row

    def __call__(self, shape, dtype):
        arr = self.base(shape, dtype)
        arr[self.row] = 0
        return arr


class Embedding(Cell):
    """Map integer ids to rows of a learnable table.

    Parameters
    ----------
    vocab_size : int
        Number of rows of the table.
    embedding_size : int
        Length of each row.
    use_one_hot : bool
        Look up by a one-hot matrix product instead of a gather (same result).
    embedding_table : str, Initializer, number or Tensor
        Initial table of shape ``(vocab_size, embedding_size)``; default "normal"
        (N(0, 0.01²), as MindSpore).
    dtype : dtype
        The integer dtype of the ids (int32 by default); the table is float32.
    padding_idx : int, optional
        The table row of this id is initialised to zero.

    Inputs: ids of any shape and an integer dtype; output shape ``ids.shape +
    (embedding_size,)``.
    """

    def __init__(self, vocab_size, embedding_size, use_one_hot=False,
                 embedding_table="normal", dtype=_dt.int32, padding_idx=None):
        super().__init__()
        self.vocab_size = check_int("Embedding", "vocab_size", vocab_size, 1)
        self.embedding_size = check_int("Embedding", "embedding_size", embedding_size, 1)
        self.use_one_hot = check_bool("Embedding", "use_one_hot", use_one_hot)
        self.dtype = _dt.as_dtype(dtype, "Embedding")
        if self.dtype.kind not in "iu":
            raise TypeError(f"Embedding: dtype {self.dtype} is the dtype of the ids and must "
                            f"be an integer dtype (int32 or int64)")
        shape = (self.vocab_size, self.embedding_size)
        if padding_idx is not None:
            padding_idx = check_int("Embedding", "padding_idx", padding_idx, 0)
            if padding_idx >= self.vocab_size:
                raise ValueError(f"Embedding: padding_idx={padding_idx} must be in "
                                 f"[0, vocab_size={self.vocab_size})")
            if isinstance(embedding_table, Tensor):
                table = np.array(embedding_table.asnumpy(), dtype=np.float32)
                table[padding_idx] = 0
                embedding_table = Tensor(table)
            else:
                embedding_table = _ZeroRow(_as_init(embedding_table), padding_idx)
        self.padding_idx = padding_idx
        self.embedding_table = make_parameter("Embedding", "embedding_table",
                                              embedding_table, shape, _dt.float32,
                                              "embedding_table")

    def construct(self, ids):
        check_tensor("Embedding", "ids", ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"Embedding: ids have dtype {ids.dtype}; expected an integer "
                            f"dtype")
        if self.use_one_hot:
            arr = np.asarray(ids)
            if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
                bad = arr.min() if arr.min() < 0 else arr.max()
                raise ValueError(f"Embedding: id {bad} is out of range; ids must be in "
                                 f"[0, vocab_size={self.vocab_size})")
            hot = ops.one_hot(ops.reshape(ids, (-1,)), self.vocab_size, 1.0, 0.0)
            out = ops.matmul(hot, self.embedding_table)
            return ops.reshape(out, tuple(ids.shape) + (self.embedding_size,))
        try:
            return ops.gather(self.embedding_table, ids, 0)
        except ValueError as e:
            raise ValueError(f"Embedding: ids must be in [0, vocab_size={self.vocab_size}); "
                             f"{e}") from None

    def extend_repr(self):
        return (f"vocab_size={self.vocab_size}, embedding_size={self.embedding_size}, "
                f"use_one_hot={self.use_one_hot}, padding_idx={self.padding_idx}")


_TARGETS = ("CPU", "DEVICE")


class EmbeddingLookup(Cell):
    """An embedding table looked up by ids, made for large tables held by parameter
    servers (MindSpore's ``nn.EmbeddingLookup``).

    Outside parameter server mode it is a plain lookup (``ops.gather`` on the table).
    In parameter server mode, once its table is held by the servers
    (``set_param_ps()``), the table is split by rows over the servers; with
    ``sparse=True`` a step pushes and pulls only the rows of the batch's de-duplicated
    ids, and ``vocab_cache_size=K`` keeps the K most recently used rows valid on the
    worker so only the others are pulled (the servers' changes to cached rows come back
    with each step: results equal the uncached run). With
    ``embedding_table.set_param_ps(init_in_server=True)`` the servers make their rows
    from the table's initializer and the worker never makes the whole table, only the
    rows it looks up (build the network after ``init()``). See
    ``dualmode.ps.embedding``.

    Parameters
    ----------
    vocab_size, embedding_size : int
        Rows and columns of the table.
    param_init : str, Initializer, number or Tensor
        Initial table; default "normal".
    target : str
        "CPU" or "DEVICE" (the same here).
    slice_mode : str
        Only "batch_slice" (the batch is split, the table replicated or on servers).
    manual_shapes : None
    max_norm : None
    sparse : bool
        Push and pull only the used rows (parameter server mode).
    vocab_cache_size : int
        Rows kept on the worker (0: no cache); needs ``sparse=True``.
    dtype : dtype
        The integer dtype of the ids (int32 by default); the table is float32.
    """

    def __init__(self, vocab_size, embedding_size, param_init="normal", target="CPU",
                 slice_mode="batch_slice", manual_shapes=None, max_norm=None, sparse=True,
                 vocab_cache_size=0, dtype=_dt.int32):
        super().__init__()
        owner = "EmbeddingLookup"
        self.vocab_size = check_int(owner, "vocab_size", vocab_size, 1)
        self.embedding_size = check_int(owner, "embedding_size", embedding_size, 1)
        if target not in _TARGETS:
            raise ValueError(f"{owner}: target={target!r} is not valid; expected one of "
                             + ", ".join(repr(t) for t in _TARGETS))
        if slice_mode != "batch_slice":
            raise ValueError(f"{owner}: slice_mode={slice_mode!r} is not supported; expected "
                             "'batch_slice' (shard the table with a Gather strategy, or hold "
                             "it on parameter servers with set_param_ps)")
        if manual_shapes is not None:
            raise ValueError(f"{owner}: manual_shapes={manual_shapes!r} is not supported; "
                             "expected None")
        if max_norm is not None:
            raise ValueError(f"{owner}: max_norm={max_norm!r} is not supported; expected None")
        self.sparse = check_bool(owner, "sparse", sparse)
        self.vocab_cache_size = check_int(owner, "vocab_cache_size", vocab_cache_size, 0)
        if self.vocab_cache_size and not self.sparse:
            raise ValueError(f"{owner}: vocab_cache_size={self.vocab_cache_size} needs "
                             "sparse=True (the cache exchanges rows, not the whole table)")
        self.target = target
        self.dtype = _dt.as_dtype(dtype, owner)
        if self.dtype.kind not in "iu":
            raise TypeError(f"{owner}: dtype {self.dtype} is the dtype of the ids and must be "
                            "an integer dtype (int32 or int64)")
        # on a parameter server worker the table is made when first read, so that one
        # the servers initialise (set_param_ps(init_in_server=True)) is never made here
        with no_init_parameters() if active_worker() is not None else \
                contextlib.nullcontext():
            self.embedding_table = make_parameter(owner, "param_init", param_init,
                                                  (self.vocab_size, self.embedding_size),
                                                  _dt.float32, "embedding_table")
        table = self.embedding_table
        table.ps_split = True              # split by rows over the servers
        table.ps_sparse = self.sparse
        self._cache = RowCache(self.vocab_cache_size)

    def construct(self, ids):
        check_tensor("EmbeddingLookup", "ids", ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"EmbeddingLookup: ids have dtype {ids.dtype}; expected an "
                            "integer dtype")
        table = self.embedding_table
        worker = active_worker()
        if worker is not None and table.is_param_ps and self.sparse:
            arr = np.asarray(ids)
            if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
                bad = arr.min() if arr.min() < 0 else arr.max()
                raise ValueError(f"EmbeddingLookup: id {bad} is out of range; ids must be in "
                                 f"[0, vocab_size={self.vocab_size})")
            before_lookup(worker, table, self._cache, arr)
        try:
            return ops.gather(table, ids, 0)
        except ValueError as e:
            raise ValueError(f"EmbeddingLookup: ids must be in [0, vocab_size="
                             f"{self.vocab_size}); {e}") from None

    def extend_repr(self):
        return (f"vocab_size={self.vocab_size}, embedding_size={self.embedding_size}, "
                f"sparse={self.sparse}, vocab_cache_size={self.vocab_cache_size}")
