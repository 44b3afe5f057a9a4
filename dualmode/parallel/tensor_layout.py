"""TensorLayout: which device holds which slice of a tensor — the immutable value every
layer below the API shares: device matrix, per-dim tuples of splitting device axes
(outer first), global shape and the device axes over which stored values are pending
partial sums. Everything else (local shape, each rank's slice, communication groups) is
derived from it, vectorised over ranks with numpy so 4096-device meshes stay cheap.

A strategy tuple is a shorthand for a TensorLayout (``TensorLayout.from_strategy``):
``(2, 4)`` on 8 devices is device matrix ``(2, 4)`` with dim 0 on axis 0 and dim 1 on
axis 1; with fewer parts than devices the rest is repeated calculation, an extra highest
axis nothing maps to (``(2, 1)`` on 8 devices: device matrix ``(4, 2)``, dim 0 on axis 1).
A user's named-axis ``layout(...)`` (layout_spec.py) is recognised by its
``is_layout_spec`` attribute, so this module does not depend on the API above it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Sequence, Tuple

import numpy as np

from ..communication.sim import broadcast_view
from ._layout_checks import (IndivisibleError, LayoutError, _is_int, check_device_num,
                             check_strategy, check_tensor_layout)

__all__ = ["TensorLayout", "LayoutError", "IndivisibleError", "format_table", "stand_in",
           "is_layout_spec", "uneven_notes"]

Axes = Tuple[int, ...]


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@functools.lru_cache(maxsize=4096)
def stand_in(dtype, shape) -> np.ndarray:
    """A read-only zero array of ``shape`` and ``dtype`` that takes no memory (stride 0):
    what shape/dtype inference runs on in place of a distributed value (cached)."""
    return np.broadcast_to(np.zeros((), dtype), tuple(shape))


def is_layout_spec(x) -> bool:
    """Is `x` a user's ``layout(...)`` applied to dims (a LayoutSpec)?"""
    return getattr(x, "is_layout_spec", False) is True


# ============================================================================ TensorLayout

@dataclass(frozen=True, eq=True)
class TensorLayout:
    """Who holds which slice of a tensor: the immutable layout every layer shares.

    Parameters
    ----------
    device_matrix : tuple of int
        Devices along each axis, axis 0 highest (ranks run row-major, last axis fastest).
    tensor_map : tuple of tuple of int
        Per tensor dim, the device axes that split it, outer first; ``()`` = not split.
    shape : tuple of int
        The global shape.
    partial : tuple of int
        Sorted device axes over which stored values are pending partial sums.
    alias : tuple of str, optional
        Axis names, for printing only (not part of equality or hashing).
    partial_op : str, optional
        With ``partial``: the class name of the op whose strategy made the pending sums
        (e.g. ``"MatMul"``), so that the collective that resolves them is reported under
        it (:func:`dualmode.communication.trace.pending_sum`). Not part of equality or
        hashing: two layouts that place the same values alike are equal whoever made
        them. Set by :meth:`with_partial_op`.
    """

    device_matrix: Tuple[int, ...]
    tensor_map: Tuple[Axes, ...]
    shape: Tuple[int, ...]
    partial: Axes = ()
    alias: Optional[Tuple[str, ...]] = field(default=None, compare=False)
    partial_op: Optional[str] = field(default=None, compare=False)

    def __post_init__(self):
        fields = check_tensor_layout(self.device_matrix, self.tensor_map, self.shape,
                                     self.partial, self.alias)
        for name, value in zip(("device_matrix", "tensor_map", "shape", "partial", "alias"),
                               fields):
            object.__setattr__(self, name, value)

    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.device_matrix, self.tensor_map, self.shape, self.partial))
            self.__dict__["_hash"] = h
        return h

    def __eq__(self, other):
        # layouts are compared on every op call: the same object, or a different cached
        # hash, decides without comparing the fields (the dataclass's __eq__ otherwise)
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        if hash(self) != hash(other):
            return False
        return (self.device_matrix == other.device_matrix and self.tensor_map ==
                other.tensor_map and self.shape == other.shape and
                self.partial == other.partial)

    def __getstate__(self):   # cached values (slices, groups) are rebuilt on demand
        return {k: getattr(self, k) for k in ("device_matrix", "tensor_map", "shape",
                                              "partial", "alias", "partial_op")}

    def __setstate__(self, state):
        self.__dict__.update(state)

    # ------------------------------------------------------------ constructors

    @classmethod
    def _checked(cls, device_matrix, tensor_map, shape, partial=(), alias=None,
                 owner="TensorLayout"):
        """Validate with errors prefixed by ``owner``, then build without re-checking."""
        fields = check_tensor_layout(device_matrix, tensor_map, shape, partial, alias, owner)
        self = object.__new__(cls)
        for name, value in zip(("device_matrix", "tensor_map", "shape", "partial", "alias"),
                               fields):
            object.__setattr__(self, name, value)
        return self

    @classmethod
    def replicated(cls, shape: Sequence[int], device_matrix) -> "TensorLayout":
        """Every device holds the whole tensor. ``device_matrix`` may be an int."""
        dm = (device_matrix,) if _is_int(device_matrix) else device_matrix
        return cls(dm, ((),) * len(tuple(shape)), shape)

    @classmethod
    def batch_split(cls, shape: Sequence[int], device_num: int, dim: int = 0) -> "TensorLayout":
        """Data parallel: ``dim`` split over all ``device_num`` devices (one axis)."""
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else shape
        if _plain_ints(shape, (device_num, dim)):
            return _batch_split_cached(cls, shape, device_num, dim)
        return cls._batch_split(shape, device_num, dim)      # the checks name the problem

    @classmethod
    def _batch_split(cls, shape, device_num, dim):
        device_num = check_device_num("batch_split", device_num)
        shape = tuple(shape)
        if not _is_int(dim) or not -len(shape) <= dim < len(shape):
            raise LayoutError(f"batch_split: dim={dim!r} is out of range for shape {shape}")
        dim = dim % len(shape)
        tmap = tuple((0,) if d == dim else () for d in range(len(shape)))
        return cls._checked((device_num,), tmap, shape,
                            owner=f"batch_split over {device_num} devices")

    @classmethod
    def from_spec(cls, spec, shape: Sequence[int], owner: str = "Layout") -> "TensorLayout":
        """The layout of a tensor of global ``shape`` under ``layout(...)`` (a
        LayoutSpec, layout_spec.py)."""
        if not is_layout_spec(spec):
            raise TypeError(f"{owner}: expected a Layout applied to dims, e.g. "
                            f"layout('dp', 'None'); got {spec!r}")
        if not isinstance(shape, (tuple, list)):
            raise TypeError(f"{owner}: shape must be a tuple of ints (the tensor's global "
                            f"shape), got {shape!r}")
        shape = tuple(shape)
        if len(shape) != spec.ndim:
            raise LayoutError(f"{owner}: {spec!r} maps {spec.ndim} dims but the tensor has "
                              f"rank {len(shape)} (shape {shape})")
        return cls._checked(spec.device_matrix, spec.tensor_map, shape,
                            alias=spec.alias_name, owner=owner)

    @classmethod
    def from_strategy(cls, strategy, shape: Sequence[int], device_num: int, op_name: str = "",
                      input_index: int = 0, param: str = "in_strategy") -> "TensorLayout":
        """MindSpore semantics of one input's strategy tuple (or an applied Layout).

        ``(2, 4)`` on 8 devices: device matrix ``(2, 4)``, dim 0 on axis 0, dim 1 on axis 1.
        When the product is smaller than ``device_num`` the rest is repeated calculation,
        an extra highest axis: ``(2, 4)`` on 16 devices is ``(2, 2, 4)`` with the dims on
        axes 1 and 2. Entries equal to 1 map to no axis (and add none).
        """
        if is_layout_spec(strategy):
            owner = f"{op_name or 'Layout'}: {param}[{input_index}]"
            device_num = check_device_num(owner, device_num)
            if strategy.device_num != device_num:
                raise LayoutError(f"{owner}: {strategy!r} has {strategy.device_num} devices but "
                                  f"device_num is {device_num}; a layout's device matrix must "
                                  f"hold exactly device_num devices")
            return cls.from_spec(strategy, shape, owner=owner)
        if isinstance(strategy, (tuple, list)) and isinstance(shape, (tuple, list)):
            strategy, shape = tuple(strategy), tuple(shape)
            if _plain_ints(strategy, shape, (device_num, input_index)) and \
                    isinstance(op_name, str) and isinstance(param, str):
                return _from_strategy_cached(cls, strategy, shape, device_num, op_name,
                                             input_index, param)
        return cls._from_strategy(strategy, shape, device_num, op_name, input_index, param)

    @classmethod
    def _from_strategy(cls, strategy, shape, device_num, op_name, input_index, param):
        strategy, shape, device_num = check_strategy(strategy, shape, device_num, op_name,
                                                     input_index, param)
        repeat = device_num // math.prod(strategy)
        dm = ((repeat,) if repeat > 1 else ()) + tuple(s for s in strategy if s > 1)
        tmap, axis = [], 1 if repeat > 1 else 0
        for s in strategy:
            if s > 1:
                tmap.append((axis,))
                axis += 1
            else:
                tmap.append(())
        return cls._checked(dm or (1,), tuple(tmap), shape, owner=op_name or "strategy")

    @classmethod
    def from_op_strategy(cls, strategies, shapes, device_num: int, shared=(),
                         op_name: str = "") -> Tuple["TensorLayout", ...]:
        """MindSpore semantics of an op's whole in_strategy: ONE device matrix for the op.

        Each op dim gets one device axis (in order of first appearance over the inputs'
        dims; dims split 1 way get none); the dims inputs share (``shared``: tuples
        ``(i, di, j, dj, ...)``, dim ``di`` of input ``i`` is dim ``dj`` of input ``j``)
        map to the same axis; the leftover factor of ``device_num`` is repeated
        calculation, the highest axis. ``MatMul((2, 2), (2, 2))`` on 8 devices: device
        matrix ``(2, 2, 2)`` = (rows, contracted, columns), input 0 on axes (0, 1), input
        1 on axes (1, 2), so both inputs already agree on the contracted dim. Entries
        that are applied Layouts are taken as they are (then every entry is).
        """
        strategies, shapes = tuple(strategies), [tuple(s) for s in shapes]
        if len(strategies) != len(shapes):
            raise LayoutError(f"{op_name or 'strategy'}: in_strategy has {len(strategies)} "
                              f"entries for {len(shapes)} inputs")
        if any(is_layout_spec(s) for s in strategies):
            return tuple(cls.from_strategy(s, shape, device_num, op_name, i)
                         for i, (s, shape) in enumerate(zip(strategies, shapes)))
        checked = [check_strategy(s, shape, device_num, op_name, i)[0]
                   for i, (s, shape) in enumerate(zip(strategies, shapes))]
        device_num = int(device_num)
        parent = {}

        def find(k):
            while parent.get(k, k) != k:
                k = parent[k]
            return k

        for i, di, j, dj, *_ in shared:
            if checked[i][di] == checked[j][dj]:
                a, b = find((i, di)), find((j, dj))
                if a != b:
                    parent[max(a, b)] = min(a, b)
        axis_of, sizes = {}, []
        for i, st in enumerate(checked):
            for d, v in enumerate(st):
                root = find((i, d))
                if v > 1 and root not in axis_of:
                    axis_of[root] = len(sizes)
                    sizes.append(v)
        total = math.prod(sizes)
        if device_num % total:
            raise LayoutError(f"{op_name or 'strategy'}: in_strategy={strategies} needs a "
                              f"device matrix of {total} devices (one axis per op dim, "
                              f"shared dims on one axis) but device_num is {device_num}; "
                              f"its product must divide device_num")
        repeat = device_num // total
        off = 1 if repeat > 1 else 0
        dm = ((repeat,) if repeat > 1 else ()) + tuple(sizes)
        out = []
        for i, (st, shape) in enumerate(zip(checked, shapes)):
            tmap = tuple((axis_of[find((i, d))] + off,) if v > 1 else ()
                         for d, v in enumerate(st))
            out.append(cls._checked(dm or (1,), tmap, shape, owner=op_name or "strategy"))
        return tuple(out)

    def replace(self, **changes) -> "TensorLayout":
        """A new layout with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ basic derived values

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @cached_property
    def device_num(self) -> int:
        return math.prod(self.device_matrix)

    @cached_property
    def dim_parts(self) -> Tuple[int, ...]:
        """Number of parts each dim is cut into."""
        dm = self.device_matrix
        return tuple(math.prod(dm[a] for a in axes) for axes in self.tensor_map)

    def parts(self, dim: int) -> int:
        """Number of parts dim ``dim`` is cut into."""
        return self.dim_parts[self._dim(dim)]

    @cached_property
    def local_shape(self) -> Tuple[int, ...]:
        """The shape of each device's slot in a stack: the largest piece. When a split
        does not divide its dim (``n`` rows in ``k`` parts, as ``numpy.array_split``: the
        first ``n % k`` parts have ``ceil(n/k)`` rows, the others ``floor(n/k)``) the
        smaller pieces are stored padded with zeros to ``ceil(n/k)``; :attr:`local_shapes`
        gives each device's own shape."""
        return tuple(-(-n // p) for n, p in zip(self.shape, self.dim_parts))

    @cached_property
    def even(self) -> bool:
        """Does every split divide its dim (every device's piece of one shape, no pads)?"""
        return all(n % p == 0 for n, p in zip(self.shape, self.dim_parts))

    @cached_property
    def uneven_dims(self) -> Tuple[int, ...]:
        """The dims whose split does not divide them."""
        return tuple(d for d, (n, p) in enumerate(zip(self.shape, self.dim_parts)) if n % p)

    @cached_property
    def _part_sizes(self) -> Tuple[np.ndarray, ...]:
        """Per dim, the rows of each of its parts (numpy.array_split's rule)."""
        out = []
        for n, p in zip(self.shape, self.dim_parts):
            q, r = divmod(n, p)
            out.append(_readonly(q + (np.arange(p, dtype=np.int64) < r)))
        return tuple(out)

    @cached_property
    def local_shapes(self) -> np.ndarray:
        """(device_num, ndim) int64: the shape of the piece each rank really holds (equal
        to :attr:`local_shape` on every rank when the splits divide)."""
        out = np.empty((self.device_num, self.ndim), np.int64)
        for d, sizes in enumerate(self._part_sizes):
            out[:, d] = sizes[self.block_index[:, d]]
        return _readonly(out)

    def local_shape_of(self, rank: int) -> Tuple[int, ...]:
        """The shape of the piece ``rank`` holds (smaller than :attr:`local_shape` along a
        dim that does not divide, on the last parts)."""
        self._check_rank(rank)
        return tuple(int(v) for v in self.local_shapes[rank])

    @cached_property
    def padded(self) -> "TensorLayout":
        """The layout itself when its splits divide; else the same placement of a tensor
        padded to ``ceil(n/k) * k`` along each uneven dim (which divides): a stack of this
        layout is also a stack of that one, the pads at the end of each short piece."""
        if self.even:
            return self
        shape = tuple(c * p for c, p in zip(self.local_shape, self.dim_parts))
        return TensorLayout._checked(self.device_matrix, self.tensor_map, shape, self.partial,
                                     self.alias)

    def pad_global(self, array) -> np.ndarray:
        """The global ``array`` spread to the padded shape (:attr:`padded`): each part's
        rows at the start of its ``ceil(n/k)`` slot, zeros after them. The array itself
        when the splits divide."""
        x = np.asarray(array)
        for d in self.uneven_dims:
            n, p = self.shape[d], self.dim_parts[d]
            q, r = divmod(n, p)
            c, pre, rest = q + 1, x.shape[:d], x.shape[d + 1:]
            out = np.empty(pre + (p, c) + rest, x.dtype)     # written once: rows, then pads
            lead = (slice(None),) * d
            out[lead + (slice(r, p), q)] = 0
            out[lead + (slice(0, r),)] = x[lead + (slice(0, r * c),)].reshape(pre + (r, c) + rest)
            out[lead + (slice(r, p), slice(0, q))] = \
                x[lead + (slice(r * c, n),)].reshape(pre + (p - r, q) + rest)
            x = out.reshape(pre + (p * c,) + rest)
        return x

    def unpad_global(self, array) -> np.ndarray:
        """The inverse of :meth:`pad_global`: the real rows of a padded global value."""
        x = np.asarray(array)
        for d in self.uneven_dims:
            n, p = self.shape[d], self.dim_parts[d]
            q, r = divmod(n, p)
            c, pre, rest = q + 1, x.shape[:d], x.shape[d + 1:]
            y = x.reshape(pre + (p, c) + rest)
            lead = (slice(None),) * d
            x = np.concatenate((y[lead + (slice(0, r),)].reshape(pre + (r * c,) + rest),
                                y[lead + (slice(r, p), slice(0, q))].reshape(
                                    pre + ((p - r) * q,) + rest)), axis=d)
        return x

    @cached_property
    def _pad_rows(self) -> tuple:
        """Per uneven dim: (dim, ranks whose piece is one row short, the local index of
        that row)."""
        out = []
        for d in self.uneven_dims:
            q, r = divmod(self.shape[d], self.dim_parts[d])
            ranks = np.flatnonzero(self.block_index[:, d] >= r)
            out.append((d, _readonly(ranks), q))
        return tuple(out)

    def pad_ranks(self, ranks=None) -> tuple:
        """Per uneven dim: ``(dim, positions, row)`` -- the positions in a stack of
        ``ranks`` (default: every rank, in order) whose piece is one row short along
        ``dim``, and the local index of the pad row there."""
        if ranks is None:
            return self._pad_rows
        ranks = np.asarray(ranks, np.int64)
        return tuple((d, np.flatnonzero(np.isin(ranks, short)), row)
                     for d, short, row in self._pad_rows)

    def zero_pads(self, stack, ranks=None) -> np.ndarray:
        """Write zeros into the pads of a stack ``(len(ranks), *local_shape)`` of this
        layout (in place; only the pad rows are written) and return it."""
        return self.fill_pads(stack, 0, ranks)

    def fill_pads(self, stack, value, ranks=None, dims=None) -> np.ndarray:
        """Write `value` into the pads of a stack ``(len(ranks), *local_shape)`` of this
        layout (in place; only the pad rows are written; along ``dims`` only, when
        given) and return it."""
        for d, pos, row in self.pad_ranks(ranks):
            if len(pos) and (dims is None or d in dims):
                stack[(pos,) + (slice(None),) * d + (row,)] = value
        return stack

    @cached_property
    def part_starts(self) -> np.ndarray:
        """(device_num, ndim) int64: per rank, the global index where its piece starts
        along each dim."""
        return _readonly(np.asarray([[s.start for s in row] for row in self._slices],
                                    np.int64).reshape(self.device_num, self.ndim))

    @cached_property
    def stack_shape(self) -> Tuple[int, ...]:
        """The shape of a stack of every device's block: ``(device_num, *local_shape)``."""
        return (self.device_num,) + self.local_shape

    @cached_property
    def split_axes(self) -> Axes:
        """Sorted device axes that split some dim."""
        return tuple(sorted(a for axes in self.tensor_map for a in axes))

    @cached_property
    def replicated_axes(self) -> Axes:
        """Device axes that neither split a dim nor hold partial sums."""
        used = set(self.split_axes) | set(self.partial)
        return tuple(a for a in range(len(self.device_matrix)) if a not in used)

    @property
    def is_partial(self) -> bool:
        return bool(self.partial)

    @property
    def is_replicated(self) -> bool:
        """Every device holds the whole, final value."""
        return not self.split_axes and not self.partial

    def with_partial(self, axes) -> "TensorLayout":
        """The same layout with values pending partial sums over ``axes`` as well."""
        axes = self._axes(axes, "with_partial")
        return self.replace(partial=tuple(sorted(set(self.partial) | set(axes))))

    def without_partial(self) -> "TensorLayout":
        return self.replace(partial=(), partial_op=None) if self.partial else self

    def with_partial_op(self, op_name: Optional[str]) -> "TensorLayout":
        """This layout (equal to it) with its pending sums marked as made by the op
        `op_name` (a class name such as ``"MatMul"``); itself when it already is. A copy
        of the fields and cached values, nothing validated again: cheap enough for
        every op call that makes or keeps a pending sum."""
        if self.partial_op == op_name:
            return self
        new = object.__new__(self.__class__)
        new.__dict__.update(self.__dict__)
        new.__dict__["partial_op"] = op_name
        return new

    def axis_name(self, axis: int) -> str:
        return self.alias[axis] if self.alias is not None else f"a{axis}"

    # ------------------------------------------------------------ ranks and coordinates

    @cached_property
    def rank_coords(self) -> np.ndarray:
        """(device_num, n_axes) int64: the device-matrix coordinates of every rank."""
        idx = np.unravel_index(np.arange(self.device_num, dtype=np.int64), self.device_matrix)
        return _readonly(np.stack(idx, axis=1).astype(np.int64, copy=False))

    def coords(self, rank):
        """Coordinates of ``rank`` (a tuple), or of an array of ranks (``(n, n_axes)``)."""
        if _is_int(rank):
            self._check_rank(rank)
            return tuple(int(c) for c in np.unravel_index(int(rank), self.device_matrix))
        ranks = np.asarray(rank)
        if ranks.size and (ranks.min() < 0 or ranks.max() >= self.device_num):
            raise LayoutError(f"{self!r}: ranks must lie in 0..{self.device_num - 1}")
        return np.stack(np.unravel_index(ranks, self.device_matrix), axis=-1)

    def rank_of(self, coords):
        """Rank of one coordinate tuple, or of an ``(..., n_axes)`` array of them."""
        arr = np.asarray(coords)
        if arr.ndim == 0 or arr.shape[-1] != len(self.device_matrix):
            raise LayoutError(f"{self!r}: coordinates need {len(self.device_matrix)} entries "
                              f"(one per device axis); got {coords!r}")
        try:
            r = np.ravel_multi_index(tuple(np.moveaxis(arr, -1, 0)), self.device_matrix)
        except ValueError:
            raise LayoutError(f"{self!r}: coordinates {coords!r} lie outside the device matrix "
                              f"{self.device_matrix}") from None
        return int(r) if arr.ndim == 1 else r

    # ------------------------------------------------------------ slices

    @cached_property
    def block_index(self) -> np.ndarray:
        """(device_num, ndim) int64: per rank, the index of the block it holds along each dim."""
        c, dm = self.rank_coords, self.device_matrix
        out = np.zeros((self.device_num, self.ndim), np.int64)
        for d, axes in enumerate(self.tensor_map):
            for a in axes:
                out[:, d] = out[:, d] * dm[a] + c[:, a]
        return _readonly(out)

    def slice_index(self, rank: int) -> Tuple[int, ...]:
        """Per dim, the index of the block ``rank`` holds."""
        self._check_rank(rank)
        return tuple(int(v) for v in self.block_index[rank])

    @cached_property
    def _slices(self) -> tuple:
        q = np.asarray([n // p for n, p in zip(self.shape, self.dim_parts)], np.int64)
        r = np.asarray([n % p for n, p in zip(self.shape, self.dim_parts)], np.int64)
        b = self.block_index
        starts = (b * q + np.minimum(b, r)).tolist()
        stops = (np.asarray(starts, np.int64).reshape(b.shape) + self.local_shapes).tolist()
        return tuple(tuple(slice(s, e) for s, e in zip(a, z)) for a, z in zip(starts, stops))

    def device_slices(self) -> list:
        """For each rank (list index), the tuple of ``slice`` per dim of the global tensor."""
        return list(self._slices)

    def local_blocks(self, array) -> np.ndarray:
        """Split a global array into the stack ``(device_num, *local_shape)`` of local shards."""
        y = self._blocks_grid(array, "local_blocks")
        return np.ascontiguousarray(y).reshape(self.stack_shape)

    def local_blocks_of(self, array, ranks) -> np.ndarray:
        """The stack ``(len(ranks), *local_shape)`` of the blocks of ``ranks`` only (the
        devices one process holds: ``backend.local_ranks``); the other blocks are never
        built. A fresh, writable copy."""
        if not self.even:
            return self.padded.local_blocks_of(self._padded_value(array, "local_blocks_of"),
                                               ranks)
        y = self._blocks_grid(array, "local_blocks_of", broadcast=False)
        coords = self.rank_coords[np.asarray(ranks, np.int64)]
        index = tuple(coords[:, a] if y.shape[a] > 1 else np.zeros(len(coords), np.int64)
                      for a in range(len(self.device_matrix)))
        return y[index]

    def local_blocks_view(self, array) -> np.ndarray:
        """:meth:`local_blocks` as a read-only view of ``array`` when its strides allow one
        (e.g. columns split over one axis: device d sees columns d*k:(d+1)*k in place;
        nothing split: every device sees the whole array, stride 0), else a fresh copy."""
        out = self.blocks_view(array)
        if out is None:
            y = self._blocks_grid(array, "local_blocks_view")
            return np.ascontiguousarray(y).reshape(self.stack_shape)
        return out

    def blocks_view(self, array) -> Optional[np.ndarray]:
        """:meth:`local_blocks` as a read-only view of ``array``, or None when its strides
        do not allow one (the blocks are not one strided grid)."""
        # for a C-contiguous array whether the blocks are one strided grid depends on
        # the layout alone: the answer is kept (a failed view costs an exception)
        if not self.even:                       # the pads are written: never a view
            return None
        contiguous = array.flags.c_contiguous if isinstance(array, np.ndarray) else False
        if contiguous and self.__dict__.get("_blocks_not_a_view"):
            return None
        y = self._blocks_grid(array, "local_blocks_view")
        shape = self.stack_shape
        try:
            out = np.reshape(y, shape, copy=False)
        except ValueError:                      # the blocks are not one strided grid
            if contiguous:
                self.__dict__["_blocks_not_a_view"] = True
            return None
        if out.flags.writeable:
            out = out.view()
            out.flags.writeable = False
        return out

    def local_blocks_grid(self, array) -> np.ndarray:
        """The global array viewed (no copy) with shape ``device_matrix + local_shape``,
        except that device axes splitting nothing have size 1: it broadcasts against a
        stack reshaped to ``device_matrix + local_shape`` (replicas share one block)."""
        return self._blocks_grid(array, "local_blocks_grid", broadcast=False)

    def _blocks_grid(self, array, what, broadcast=True) -> np.ndarray:
        """The global array viewed as ``device_matrix + local_shape`` (no copy): the block
        of each device at its coordinates, stride 0 along axes that split nothing (size 1
        there when not ``broadcast``)."""
        if not self.even:
            return self.padded._blocks_grid(self._padded_value(array, what), what, broadcast)
        x = self._global_value(array, what)
        ext, order, grid = self._grid_plan
        y = x.reshape(ext).transpose(order).reshape(grid)
        if not broadcast or grid == self.device_matrix + self.local_shape:
            return y
        return broadcast_view(y, self.device_matrix + self.local_shape)

    def _global_value(self, array, what) -> np.ndarray:
        x = np.asarray(array)
        if tuple(x.shape) != self.shape:
            raise LayoutError(f"{self!r}: {what} got an array of shape {x.shape}, expected "
                              f"the global shape {self.shape}")
        if self.partial:
            raise LayoutError(f"{self!r}: a global value has no pending partial sums to split "
                              f"into; use without_partial() first")
        return x

    def _padded_value(self, array, what) -> np.ndarray:
        return self.pad_global(self._global_value(array, what))

    @cached_property
    def _grid_plan(self):
        """(shape splitting each dim by its axes, transpose order, grid shape)."""
        dm = self.device_matrix
        ext, pos, local_pos = [], {}, []    # x viewed as (axes of dim 0..., local 0, ...)
        for d, axes in enumerate(self.tensor_map):
            for a in axes:
                pos[a] = len(ext)
                ext.append(dm[a])
            local_pos.append(len(ext))
            ext.append(self.local_shape[d])
        order = [pos[a] for a in self.split_axes] + local_pos
        grid = tuple(dm[a] if a in pos else 1 for a in range(len(dm))) + self.local_shape
        return tuple(ext), tuple(order), grid

    def assemble(self, stack) -> np.ndarray:
        """The global value from a stack ``(device_num, *local_shape)`` of local shards:
        one replica along replicated axes, summed along partial axes."""
        s = np.asarray(stack)
        want = self.stack_shape
        if tuple(s.shape) != want:
            raise LayoutError(f"{self!r}: assemble got a stack of shape {s.shape}, expected "
                              f"{want} (device_num, *local_shape)")
        index, sum_axes, order = self._assemble_plan
        s = s.reshape(self.device_matrix + self.local_shape)[index]
        if sum_axes:
            s = np.add.reduce(s, axis=sum_axes, dtype=s.dtype)
        if not self.even:
            return self.unpad_global(s.transpose(order).reshape(self.padded.shape))
        return s.transpose(order).reshape(self.shape)

    def assemble_totals(self, grid) -> np.ndarray:
        """The global value from a grid of the totals of the pending sums (see
        :mod:`dualmode.communication.totals`): shape ``device_matrix + local_shape``
        with size 1 along the partial axes (and size 1 or full along the replicated
        ones). A view of `grid` when its blocks allow (a split of dim 0 only)."""
        # the shapes a grid of totals may have are few: each one's check is done once
        seen = self.__dict__.setdefault("_totals_shapes", {})
        first = seen.get(grid.shape)
        if first is None:
            k = len(self.device_matrix)
            ok = grid.shape[k:] == self.local_shape and all(
                t == (1 if a in self.partial else d) or (t == 1 and a in self.replicated_axes)
                for a, (t, d) in enumerate(zip(grid.shape[:k], self.device_matrix)))
            if not ok:
                raise LayoutError(f"{self!r}: assemble_totals got a grid of shape "
                                  f"{grid.shape}, expected {self.device_matrix} with 1 along "
                                  f"the partial axes {self.partial}, then {self.local_shape}")
            first = seen[grid.shape] = tuple(0 if a in self.partial else i
                                             for a, i in enumerate(self._assemble_plan[0]))
        if not self.even:
            return self.unpad_global(
                grid[first].transpose(self._assemble_plan[2]).reshape(self.padded.shape))
        return grid[first].transpose(self._assemble_plan[2]).reshape(self.shape)

    @cached_property
    def _assemble_plan(self):
        """(index keeping replica 0 of replicated axes, axes to sum, transpose order)."""
        dm = self.device_matrix
        rep = self.replicated_axes
        index = tuple(0 if a in rep else slice(None) for a in range(len(dm)))
        kept = [a for a in range(len(dm)) if a not in rep]
        sum_axes = tuple(kept.index(a) for a in self.partial)
        kept = [a for a in kept if a not in self.partial]
        pos = {a: i for i, a in enumerate(kept)}
        order = []
        for d, axes in enumerate(self.tensor_map):
            order += [pos[a] for a in axes] + [len(kept) + d]
        return index, sum_axes, tuple(order)

    # ------------------------------------------------------------ groups

    def group_members(self, axes) -> np.ndarray:
        """(num_groups, group_size) int64: the ranks grouped so that each row varies only
        along ``axes`` (aliases or indices). Rows are ordered by the remaining coordinates,
        members row-major along ``axes`` in the order given (first = outer), which is the
        order in which AllGather concatenates. Cached and read-only."""
        axes = self._axes(axes, "group_members")
        cache = self.__dict__.setdefault("_groups", {})
        g = cache.get(axes)
        if g is None:
            dm = self.device_matrix
            rest = [a for a in range(len(dm)) if a not in axes]
            size = math.prod(dm[a] for a in axes)
            ranks = np.arange(self.device_num, dtype=np.int64).reshape(dm)
            g = cache[axes] = _readonly(
                np.ascontiguousarray(ranks.transpose(rest + list(axes))).reshape(-1, size))
        return g

    def group_of(self, rank: int, axes) -> np.ndarray:
        """The members of ``rank``'s group along ``axes`` (its row of ``group_members``)."""
        self._check_rank(rank)
        axes = self._axes(axes, "group_of")
        dm = self.device_matrix
        rest = [a for a in range(len(dm)) if a not in axes]
        c = self.rank_coords[rank]
        row = int(np.ravel_multi_index(tuple(c[rest]), tuple(dm[a] for a in rest))) if rest else 0
        return self.group_members(axes)[row]

    # ------------------------------------------------------------ helpers

    def _check_rank(self, rank):
        if not _is_int(rank) or not 0 <= rank < self.device_num:
            raise LayoutError(f"{self!r}: rank {rank!r} is not in 0..{self.device_num - 1}")

    def _dim(self, dim):
        if not _is_int(dim) or not -self.ndim <= dim < self.ndim:
            raise LayoutError(f"{self!r}: dim {dim!r} is out of range for shape {self.shape}")
        return dim % self.ndim

    def _axes(self, axes, what) -> Axes:
        """Normalise axes given as an alias, an index, or a tuple of them."""
        if isinstance(axes, str) or _is_int(axes):
            axes = (axes,)
        out = []
        for given in tuple(axes):
            a = given
            if isinstance(a, str):
                if self.alias is None or a not in self.alias:
                    valid = ", ".join(map(repr, self.alias)) if self.alias else "none (no alias)"
                    raise LayoutError(f"{self!r}: {what} got unknown axis name {a!r}; valid "
                                      f"names: {valid}")
                a = self.alias.index(a)
            if not _is_int(a) or not 0 <= a < len(self.device_matrix):
                raise LayoutError(f"{self!r}: {what} got axis {a!r}; valid axes are "
                                  f"0..{len(self.device_matrix) - 1}")
            if int(a) in out:
                raise LayoutError(f"{self!r}: {what} got axis {given!r} twice")
            out.append(int(a))
        return tuple(out)

    # ------------------------------------------------------------ printing

    def _map_str(self):
        parts = []
        for axes in self.tensor_map:
            names = [self.axis_name(a) if self.alias else str(a) for a in axes]
            parts.append("None" if not names else names[0] if len(names) == 1
                         else "(" + ", ".join(names) + ")")
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"

    def __repr__(self):
        if self.alias:
            mesh = ", ".join(f"{n}={s}" for n, s in zip(self.alias, self.device_matrix))
            mesh = f"({mesh})"
        else:
            mesh = str(self.device_matrix)
        extra = ""
        if self.partial:
            names = [self.axis_name(a) if self.alias else str(a) for a in self.partial]
            extra = ", partial=(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"
        return f"TensorLayout({self.shape}, mesh={mesh}, map={self._map_str()}{extra})"

    def table(self, max_rows: Optional[int] = None) -> str:
        """The device-to-slice table: rank, device coordinates, the index range per dim."""
        return format_table({"slice": self}, max_rows=max_rows)

    def __str__(self):
        return self.table(max_rows=64)


def _plain_ints(*groups) -> bool:
    """Every value an exact int (no bool, no numpy scalar): safe as a cache key, since
    the checks treat those differently while they hash alike."""
    for g in groups:                    # loops, not generators: called on every step
        if type(g) is not tuple:
            return False
        for v in g:
            if type(v) is not int:
                return False
    return True


@functools.lru_cache(maxsize=4096)
def _batch_split_cached(cls, shape, device_num, dim):
    """TensorLayout.batch_split for hashable arguments (a shared, validated value)."""
    return cls._batch_split(shape, device_num, dim)


@functools.lru_cache(maxsize=4096)
def _from_strategy_cached(cls, strategy, shape, device_num, op_name, input_index, param):
    """TensorLayout.from_strategy for tuple arguments (layouts are immutable values, so the
    validated result is shared; errors are raised again on every call)."""
    return cls._from_strategy(strategy, shape, device_num, op_name, input_index, param)


def format_table(layouts: dict, max_rows: Optional[int] = None) -> str:
    """Device-to-slice table of several tensors on one device matrix (one column each),
    as MindSpore's operator-parallel tutorial shows for MatMul's input and weight."""
    items = list(layouts.items())
    if not items:
        raise LayoutError("format_table: no layouts given")
    first = items[0][1]
    for name, lay in items:
        if not isinstance(lay, TensorLayout):
            raise TypeError(f"format_table: {name!r} is {lay!r}, not a TensorLayout")
        if lay.device_matrix != first.device_matrix:
            raise LayoutError(f"format_table: {name!r} has device matrix {lay.device_matrix} but "
                              f"{items[0][0]!r} has {first.device_matrix}; one table needs one "
                              f"device matrix")
    n = first.device_num
    rows = n if max_rows is None else min(n, max_rows)
    names = [first.axis_name(a) for a in range(len(first.device_matrix))]
    head = ["rank", "device coordinates (" + ", ".join(names) + ")"] + [n for n, _ in items]
    coords = first.rank_coords[:rows].tolist()
    body = []
    for r in range(rows):
        cells = [str(r), "(" + ", ".join(map(str, coords[r])) + ")"]
        for _, lay in items:
            sl = lay._slices[r]
            cells.append("[" + ", ".join(f"{s.start}:{s.stop}" for s in sl) + "]")
        body.append(cells)
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.rjust(w) if i == 0 else c.ljust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths))).rstrip()
    lines = [f"{name}: {lay!r}" for name, lay in items] if len(items) > 1 else [repr(first)]
    lines += [fmt(head)] + [fmt(row) for row in body]
    if rows < n:
        lines.append(f"... ({n - rows} more ranks)")
    partial = [(name, lay) for name, lay in items if lay.partial]
    for name, lay in partial:
        axes = ", ".join(lay.axis_name(a) for a in lay.partial)
        lines.append(f"{name}: values are partial sums pending over ({axes})")
    for name, lay in items:
        lines += [(f"{name}: " if len(items) > 1 else "") + note for note in uneven_notes(lay)]
    return "\n".join(lines)


def uneven_notes(layout) -> list:
    """One line per dim whose split does not divide it: how many rows its parts hold."""
    out = []
    for d in layout.uneven_dims:
        n, k = layout.shape[d], layout.dim_parts[d]
        q, r = divmod(n, k)
        out.append(f"unequal pieces: dim {d} has {n} rows in {k} parts, {q + 1} in the first "
                   f"{r} and {q} in the other {k - r}")
    return out
