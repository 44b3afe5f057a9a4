"""Shape and indexing ops: Reshape, Transpose, ExpandDims, Squeeze, Flatten, Concat,
Split, StridedSlice, indexing, Gather, OneHot, Tile, and their gradient ops; the index
reductions (ArgMaxWithValue, ArgMinWithValue, Argmax, Argmin); writing a Parameter in
place (Assign, AssignAdd, AssignSub)."""
from __future__ import annotations

import functools
import math

import numpy as np

from .._core._tensor import TensorBase
from ..common.dtype import as_dtype
from . import interpreter
from ._registry import apply, binary, check_int_dtype, check_same_dtype, const, get_op, \
    norm_axis, register, same_as_input, wrap


def _shape_of(x):
    return tuple(x.shape)


# ---------------------------------------------------------------------------
# Reshape / Flatten / ExpandDims / Squeeze (all are reshapes of the data)
# ---------------------------------------------------------------------------
def _resolve_shape(opname, in_shape, shape):
    """`shape` with its -1 filled in, checked to have the size of `in_shape`."""
    size = math.prod(in_shape)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{opname}: shape must be a tuple of ints (one -1 allowed), got "
                        f"{shape!r}")
    shape = tuple(shape)
    n_free = 0
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < -1:
            raise ValueError(f"{opname}: shape {shape} is invalid; entries must be ints >= 0 "
                             f"or a single -1")
        if s == -1:
            n_free += 1
    if n_free > 1:
        raise ValueError(f"{opname}: shape {shape} has more than one -1")
    if n_free:
        known = math.prod(int(s) for s in shape if s != -1)
        if known == 0 or size % known:
            raise ValueError(f"{opname}: cannot reshape input of shape {in_shape} (size {size}) "
                             f"to {shape}")
        shape = tuple(size // known if s == -1 else int(s) for s in shape)
    else:
        shape = tuple(int(s) for s in shape)
    if math.prod(shape) != size:
        raise ValueError(f"{opname}: cannot reshape input of shape {in_shape} (size {size}) to "
                         f"{shape} (size {math.prod(shape)})")
    return shape


def _infer_reshape(attrs, x):
    return ((_resolve_shape("Reshape", _shape_of(x), attrs["shape"]), x.dtype),)


RESHAPE = register("Reshape", linear=(0,), infer=_infer_reshape, reads_inputs=False,
                   kernel=lambda at, x: np.reshape(x, at["shape"]),
                   backward=lambda node, g: (reshape(g, node.inputs[0].shape),))


def reshape(x, shape):
    """`x` with a new shape of the same size (one -1 is inferred)."""
    x = const(x, "Reshape")
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    shape = _resolve_shape("Reshape", _shape_of(x), shape)
    if shape == _shape_of(x):
        return wrap(x)
    return apply(RESHAPE, {"shape": shape}, (x,))


def flatten(x):
    """(N, ...) -> (N, prod(...)); a 1-D input becomes (N, 1)."""
    x = const(x, "Flatten")
    if x.ndim == 0:
        raise ValueError("Flatten: input 0 is 0-d; expected rank >= 1")
    shape = _shape_of(x)
    return reshape(x, (shape[0], math.prod(shape[1:])))


def expand_dims(x, axis):
    """Insert a dim of size 1 at `axis` (-rank-1 <= axis <= rank)."""
    x = const(x, "ExpandDims")
    ax = norm_axis("ExpandDims", axis, x.ndim, extra=1)
    shape = _shape_of(x)
    return reshape(x, shape[:ax] + (1,) + shape[ax:])


def squeeze(x, axis=()):
    """Remove dims of size 1 (all of them, or those in `axis`)."""
    x = const(x, "Squeeze")
    shape = _shape_of(x)
    if axis is None or axis == ():
        axes = tuple(i for i, s in enumerate(shape) if s == 1)
    else:
        axes = axis if isinstance(axis, (tuple, list)) else (axis,)
        axes = tuple(norm_axis("Squeeze", a, x.ndim) for a in axes)
        for a in axes:
            if shape[a] != 1:
                raise ValueError(f"Squeeze: axis={a} has size {shape[a]} in input of shape "
                                 f"{shape}; only dims of size 1 can be squeezed")
    return reshape(x, tuple(s for i, s in enumerate(shape) if i not in axes))


# ---------------------------------------------------------------------------
# Transpose
# ---------------------------------------------------------------------------
def _check_perm(perm, ndim):
    if not isinstance(perm, (tuple, list)) or not all(
            isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in perm):
        raise TypeError(f"Transpose: perm must be a tuple of ints, got {perm!r}")
    perm = tuple(perm)
    if sorted(int(p) % ndim if ndim else p for p in perm) != list(range(ndim)) or \
            any(not -ndim <= p < ndim for p in perm):
        raise ValueError(f"Transpose: perm={perm} is not a permutation of the {ndim} dims of "
                         f"input 0; expected a reordering of {tuple(range(ndim))}")
    return tuple(int(p) % ndim for p in perm)


def _infer_transpose(attrs, x):
    perm = _check_perm(attrs["perm"], x.ndim)
    return ((tuple(x.shape[p] for p in perm), x.dtype),)


def _bw_transpose(node, g):
    perm = node.attrs["perm"]
    return (transpose(g, tuple(np.argsort(perm))),)


def _transpose_subscripts(attrs, ranks):
    """Einsum subscripts of a permutation (the contraction family, a one-input sum)."""
    perm = attrs.get("perm")
    if perm is None or len(ranks) != 1 or ranks[0] != len(perm) or ranks[0] > 26:
        return None
    letters = "abcdefghijklmnopqrstuvwxyz"[:ranks[0]]
    return (letters,), "".join(letters[p] for p in perm)


TRANSPOSE = register("Transpose", linear=(0,), infer=_infer_transpose, reads_inputs=False,
                     kernel=lambda at, x: np.transpose(x, at["perm"]), backward=_bw_transpose,
                     family=("contract", _transpose_subscripts, "add"))


def transpose(x, perm):
    """Permute the dims of `x`."""
    x = const(x, "Transpose")
    perm = _check_perm(perm, x.ndim)
    return apply(TRANSPOSE, {"perm": perm}, (x,))


# ---------------------------------------------------------------------------
# indexing: GetItem (basic and advanced) and its gradient IndexAdd
# ---------------------------------------------------------------------------
def _norm_index(index):
    """Turn Tensors and lists inside an index into numpy arrays; always return a tuple."""
    if not isinstance(index, tuple):
        index = (index,)
    out = []
    for k in index:
        if isinstance(k, TensorBase):
            k = k._value()
        elif isinstance(k, list):
            k = np.asarray(k)
            if k.size == 0:
                k = k.astype(np.int64)
        if isinstance(k, np.ndarray):
            if k.dtype.kind not in "iub":
                raise TypeError(f"GetItem: index arrays must be integer or bool, got dtype "
                                f"{k.dtype}")
        elif not (k is None or k is Ellipsis or isinstance(k, slice) or (
                isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)))):
            raise TypeError(f"GetItem: index element {k!r} of type {type(k).__name__} is not "
                            f"supported; expected ints, slices, None, Ellipsis, or integer/bool "
                            f"arrays or Tensors")
        out.append(k)
    return tuple(out)


def _is_advanced(index):
    return any(isinstance(k, np.ndarray) and k.ndim >= 0 and not isinstance(k, slice)
               for k in index)


def _index_shape(opname, shape, dtype, index):
    """Result shape of `x[index]` for an x of `shape`, without touching data."""
    # a zero-stride bool view: indexing it gives the result shape (any dtype would do)
    probe = np.lib.stride_tricks.as_strided(np.zeros(1, dtype=np.bool_), shape=shape,
                                            strides=(0,) * len(shape))
    try:
        return probe[index].shape
    except IndexError as e:
        raise ValueError(f"{opname}: index {index!r} is invalid for a tensor of shape "
                         f"{shape}: {e}") from None
    except (TypeError, ValueError) as e:
        raise TypeError(f"{opname}: index {index!r} is not supported: {e}") from None


def _infer_getitem(attrs, x):
    return ((_index_shape("GetItem", _shape_of(x), x.dtype, attrs["index"]), x.dtype),)


def _bw_getitem(node, g):
    x = node.inputs[0]
    return (apply(INDEX_ADD, {"index": node.attrs["index"], "shape": _shape_of(x)}, (g,)),)


def _index_add_kernel(attrs, g):
    out = np.zeros(attrs["shape"], dtype=g.dtype)
    index = attrs["index"]
    if _is_advanced(index):
        np.add.at(out, index, g)
    else:
        out[index] = g
    return out


def _infer_index_add(attrs, g):
    return ((attrs["shape"], g.dtype),)


GET_ITEM = register("GetItem", infer=_infer_getitem, reads_inputs=False,
                    kernel=lambda at, x: np.array(x[at["index"]]), backward=_bw_getitem)
INDEX_ADD = register("IndexAdd", infer=_infer_index_add, kernel=_index_add_kernel,
                     reads_inputs=False,
                     backward=lambda node, g: (getitem(g, node.attrs["index"]),))


def getitem(x, index):
    """x[index]: ints, slices, None, Ellipsis, integer/bool arrays (differentiable)."""
    x = const(x, "GetItem")
    return apply(GET_ITEM, {"index": _norm_index(index)}, (x,))


def _int_tuple(opname, key, value):
    """A tuple of Python/numpy ints (StridedSlice's begin, end, strides)."""
    if not isinstance(value, (tuple, list)) or any(
            isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in value):
        raise TypeError(f"{opname}: {key}={value!r} must be a tuple of ints")
    return tuple(int(v) for v in value)


def _mask_bits(mask, n):
    return [(mask >> i) & 1 for i in range(n)]


def strided_slice(x, begin, end, strides, begin_mask=0, end_mask=0, ellipsis_mask=0,
                  new_axis_mask=0, shrink_axis_mask=0):
    """x[begin:end:strides] per dim, with MindSpore's begin, end, ellipsis, new axis and
    shrink axis masks."""
    x = const(x, "StridedSlice")
    index = strided_slice_index(tuple(x.shape), begin, end, strides, begin_mask, end_mask,
                                ellipsis_mask, new_axis_mask, shrink_axis_mask)
    return apply(GET_ITEM, {"index": index}, (x,))


def strided_slice_index(shape, begin, end, strides, begin_mask=0, end_mask=0,
                        ellipsis_mask=0, new_axis_mask=0, shrink_axis_mask=0):
    """The basic index (ints, slices, None for a new axis, an Ellipsis) StridedSlice
    takes from a tensor of `shape`, with MindSpore's masks (bit i of a mask is about
    entry i); every argument checked by name."""
    begin, end, strides = (_int_tuple("StridedSlice", k, v) for k, v in
                           (("begin", begin), ("end", end), ("strides", strides)))
    for key, mask in (("begin_mask", begin_mask), ("end_mask", end_mask),
                      ("ellipsis_mask", ellipsis_mask), ("new_axis_mask", new_axis_mask),
                      ("shrink_axis_mask", shrink_axis_mask)):
        if isinstance(mask, bool) or not isinstance(mask, (int, np.integer)) or mask < 0:
            raise TypeError(f"StridedSlice: {key}={mask!r} must be an int >= 0 (a bit per "
                            f"dim)")
    if not len(begin) == len(end) == len(strides):
        raise ValueError(f"StridedSlice: begin {begin}, end {end} and strides {strides} must "
                         f"have the same length")
    n = len(begin)
    bm, em, el, na, sm = (_mask_bits(m, n) for m in (begin_mask, end_mask, ellipsis_mask,
                                                     new_axis_mask, shrink_axis_mask))
    if sum(el) > 1:
        raise ValueError(f"StridedSlice: ellipsis_mask={ellipsis_mask} sets {sum(el)} bits; "
                         f"at most one entry can be the ellipsis")
    # an ellipsis entry stands for the dims the other entries leave; a new axis entry
    # inserts a dim of size 1; their begin, end and strides are not read
    named = [i for i in range(n) if not el[i] and not na[i]]
    if len(named) > len(shape):
        extra = f" ({len(named)} of them name input dims)" if len(named) != n else ""
        raise ValueError(f"StridedSlice: begin has {n} entries{extra} but input 0 has rank "
                         f"{len(shape)}")
    if any(strides[i] == 0 for i in named):
        raise ValueError(f"StridedSlice: strides {strides} contain 0; strides must be non-zero")
    index, d = [], 0
    for i in range(n):
        if el[i]:
            index.append(Ellipsis)
            d += len(shape) - len(named)
        elif na[i]:
            index.append(None)
        elif sm[i]:
            size = shape[d]
            if not -size <= begin[i] < size:
                raise ValueError(f"StridedSlice: begin[{i}]={begin[i]} is out of range for dim "
                                 f"{d} (size {size}) of input 0, which shrink_axis_mask "
                                 f"removes; expected {-size} <= begin[{i}] < {size}")
            index.append(int(begin[i]))
            d += 1
        else:
            index.append(slice(None if bm[i] else int(begin[i]),
                               None if em[i] else int(end[i]), int(strides[i])))
            d += 1
    return tuple(index)


# ---------------------------------------------------------------------------
# Concat / Split
# ---------------------------------------------------------------------------
def _infer_concat(attrs, *xs):
    if not xs:
        raise ValueError("Concat: needs at least one input")
    axis = attrs["axis"]
    check_same_dtype("Concat", xs)
    r = xs[0].ndim
    for i, x in enumerate(xs):
        if x.ndim != r:
            raise ValueError(f"Concat: input {i} has rank {x.ndim} but input 0 has rank {r}")
        for d in range(r):
            if d != axis and x.shape[d] != xs[0].shape[d]:
                raise ValueError(f"Concat: input {i} has shape {tuple(x.shape)} but input 0 "
                                 f"has shape {tuple(xs[0].shape)}; all dims but axis {axis} "
                                 f"must match")
    shape = list(xs[0].shape)
    shape[axis] = sum(x.shape[axis] for x in xs)
    return ((tuple(shape), xs[0].dtype),)


def _bw_concat(node, g):
    axis = node.attrs["axis"]
    sizes = [x.shape[axis] for x in node.inputs]
    parts = split_sizes(g, axis, sizes)
    return tuple(p if node.needs_grad(i) else None for i, p in enumerate(parts))


CONCAT = register("Concat", infer=_infer_concat, reads_inputs=False,
                  kernel=lambda at, *xs: np.concatenate(xs, axis=at["axis"]),
                  backward=_bw_concat)


def concat(tensors, axis=0):
    """Join a tuple of tensors along `axis`."""
    if not isinstance(tensors, (tuple, list)) or not tensors:
        raise TypeError(f"Concat: expected a non-empty tuple or list of tensors, got "
                        f"{type(tensors).__name__}")
    xs = tuple(const(t, "Concat") for t in tensors)
    ax = norm_axis("Concat", axis, xs[0].ndim)
    return apply(CONCAT, {"axis": ax}, xs)


def _infer_split(attrs, x):
    axis, sizes = attrs["axis"], attrs["sizes"]
    out = []
    for s in sizes:
        shape = list(x.shape)
        shape[axis] = s
        out.append((tuple(shape), x.dtype))
    return tuple(out)


def _split_kernel(attrs, x):
    axis = attrs["axis"]
    cuts = np.cumsum(attrs["sizes"])[:-1]
    return tuple(np.split(x, cuts, axis=axis))


def _bw_split(node, *gs):
    return (concat(gs, node.attrs["axis"]),)


SPLIT = register("Split", infer=_infer_split, kernel=_split_kernel, backward=_bw_split,
                 reads_inputs=False,
                 multi_output=True)


def split(x, axis=0, output_num=1):
    """Split `x` into `output_num` equal parts along `axis`; returns a tuple."""
    x = const(x, "Split")
    ax = norm_axis("Split", axis, x.ndim)
    if isinstance(output_num, bool) or not isinstance(output_num, (int, np.integer)) or \
            output_num < 1:
        raise ValueError(f"Split: output_num={output_num!r} must be a positive int")
    if x.shape[ax] % output_num:
        raise ValueError(f"Split: output_num={output_num} does not divide dim {ax} "
                         f"(size {x.shape[ax]}) of input 0")
    return split_sizes(x, ax, [x.shape[ax] // int(output_num)] * int(output_num))


def split_sizes(x, axis, sizes):
    """Split `x` along `axis` into parts of the given sizes."""
    x = const(x, "Split")
    axis = norm_axis("Split", axis, x.ndim)
    if not isinstance(sizes, (tuple, list)) or not sizes or not all(
            isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0
            for s in sizes):
        raise ValueError(f"Split: sizes={sizes!r} must be a non-empty list of ints >= 0")
    sizes = tuple(int(s) for s in sizes)
    if sum(sizes) != x.shape[axis]:
        raise ValueError(f"Split: sizes {sizes} do not add up to dim {axis} "
                         f"(size {x.shape[axis]})")
    return apply(SPLIT, {"axis": axis, "sizes": sizes}, (x,))


# ---------------------------------------------------------------------------
# Gather and its gradient
# ---------------------------------------------------------------------------
def _infer_gather(attrs, x, idx):
    check_int_dtype("Gather", idx, 1)
    axis = attrs["axis"]
    if idx.size and isinstance(idx, np.ndarray):
        lo, hi = idx.min(), idx.max()
        if lo < 0 or hi >= x.shape[axis]:
            bad = lo if lo < 0 else hi
            raise ValueError(f"Gather: index {bad} is out of range for dim {axis} (size "
                             f"{x.shape[axis]}) of input 0; expected 0 <= index < "
                             f"{x.shape[axis]}")
    shape = tuple(x.shape[:axis]) + tuple(idx.shape) + tuple(x.shape[axis + 1:])
    return ((shape, x.dtype),)


def _bw_gather(node, g):
    x, idx = node.inputs
    if not node.needs_grad(0):
        return None, None
    return apply(GATHER_GRAD, {"axis": node.attrs["axis"], "shape": _shape_of(x)},
                 (idx, g)), None


def _gather_grad_kernel(attrs, idx, g):
    axis, shape = attrs["axis"], attrs["shape"]
    out = np.zeros(shape, dtype=g.dtype)
    if axis == 0:
        np.add.at(out, idx.reshape(-1), g.reshape((-1,) + tuple(shape[1:])))
    else:
        index = (slice(None),) * axis + (idx,)
        np.add.at(out, index, g)
    return out


GATHER = register("Gather", infer=_infer_gather,
                  kernel=lambda at, x, idx: np.take(x, idx, axis=at["axis"]),
                  backward=_bw_gather)
GATHER_GRAD = register("GatherGrad",
                       infer=lambda at, idx, g: ((at["shape"], g.dtype),),
                       kernel=_gather_grad_kernel,
                       backward=lambda node, g: (None, gather(g, node.inputs[0],
                                                              node.attrs["axis"])))


def gather(input_params, input_indices, axis=0):
    """Rows (slices along `axis`) of `input_params` picked by integer `input_indices`."""
    x = const(input_params, "Gather")
    idx = const(input_indices, "Gather")
    ax = norm_axis("Gather", axis, x.ndim)
    return apply(GATHER, {"axis": ax}, (x, idx))


# ---------------------------------------------------------------------------
# OneHot
# ---------------------------------------------------------------------------
def _infer_onehot(attrs, idx, on, off):
    check_int_dtype("OneHot", idx, 0, "indices")
    if on.ndim or off.ndim:
        raise ValueError(f"OneHot: on_value and off_value must be scalars, got shapes "
                         f"{tuple(on.shape)} and {tuple(off.shape)}")
    check_same_dtype("OneHot", (on, off))
    shape = list(idx.shape)
    axis = attrs["axis"]
    shape.insert(axis if axis >= 0 else len(shape) + 1 + axis, attrs["depth"])
    return ((tuple(shape), on.dtype),)


def _onehot_kernel(attrs, idx, on, off):
    depth, axis = attrs["depth"], attrs["axis"]
    hot = idx[..., None] == np.arange(depth)
    out = np.where(hot, on, off).astype(on.dtype, copy=False)
    if axis != -1:
        out = np.moveaxis(out, -1, axis)
    return out


ONE_HOT = register("OneHot", infer=_infer_onehot, kernel=_onehot_kernel)


def one_hot(indices, depth, on_value=1.0, off_value=0.0, axis=-1):
    """One-hot encode integer `indices` (out-of-range indices give all off_value)."""
    idx = const(indices, "OneHot")
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 0:
        raise ValueError(f"OneHot: depth={depth!r} must be a non-negative int")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"OneHot: axis={axis!r} must be an int in "
                        f"[{-idx.ndim - 1}, {idx.ndim}]")
    if not -idx.ndim - 1 <= axis <= idx.ndim:
        raise ValueError(f"OneHot: axis={axis} is out of range; expected "
                         f"{-idx.ndim - 1} <= axis <= {idx.ndim}")
    on = const(on_value, "OneHot")
    off = const(off_value, "OneHot", on.dtype)
    return apply(ONE_HOT, {"depth": int(depth), "axis": int(axis)}, (idx, on, off))


# ---------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------
def _zeros_kernel(attrs):
    return np.zeros(attrs["shape"], dtype=attrs["dtype"])


ZEROS = register("Zeros", infer=lambda at: ((at["shape"], at["dtype"]),), kernel=_zeros_kernel)


def _check_shape(opname, shape):
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0
            for s in shape):
        raise ValueError(f"{opname}: shape={shape!r} must be a tuple of ints >= 0")
    return tuple(int(s) for s in shape)


def zeros(shape, dtype=np.float32):
    """A new tensor of zeros."""
    return apply(ZEROS, {"shape": _check_shape("Zeros", shape),
                         "dtype": as_dtype(dtype, "Zeros")}, ())


def ones(shape, dtype=np.float32):
    """A new tensor of ones."""
    return wrap(np.ones(_check_shape("Ones", shape), dtype=as_dtype(dtype, "Ones")))


def zeros_like(x):
    return zeros(x.shape, x.dtype)


def ones_like(x):
    return ones(x.shape, x.dtype)


# the identity with no gradient: what stop_gradient records for a distributed or traced
# value (a plain one is just re-wrapped, off the tape)
STOP_GRADIENT = register("StopGradient", linear=(0,), family=("elementwise",), reads_inputs=False,
                         infer=same_as_input, kernel=lambda attrs, x: x,
                         backward=lambda node, g: (None,))


def stop_gradient(x):
    """The same value, cut off from the tape (no gradient flows through it)."""
    x = const(x, "stop_gradient")
    if isinstance(x, TensorBase) and x._layout is not None:
        # a distributed value keeps its shards and layout (reading the global value would
        # gather it); a traced one must stay a graph value, with the cut recorded
        return apply(STOP_GRADIENT, None, (x,))
    return wrap(x._value() if isinstance(x, TensorBase) else x)   # a new tensor, no tape


# ---------------------------------------------------------------------------
# Tile
# ---------------------------------------------------------------------------
def check_multiples(multiples, ndim):
    """`multiples` as a tuple of ints >= 1, one per dim of the output (at least one per
    input dim: extra leading entries tile new leading dims, as MindSpore's Tile)."""
    if not isinstance(multiples, (tuple, list)) or not multiples or any(
            isinstance(m, bool) or not isinstance(m, (int, np.integer)) for m in multiples):
        raise TypeError(f"Tile: multiples={multiples!r} must be a non-empty tuple of ints")
    multiples = tuple(int(m) for m in multiples)
    if any(m < 1 for m in multiples):
        raise ValueError(f"Tile: multiples={multiples} must be ints >= 1")
    if len(multiples) < ndim:
        raise ValueError(f"Tile: multiples={multiples} has {len(multiples)} entries but input "
                         f"0 has rank {ndim}; give at least one entry per dim")
    return multiples


def _tile_padded(shape, multiples):
    """`shape` with leading 1s up to the length of `multiples`."""
    return (1,) * (len(multiples) - len(shape)) + tuple(shape)


#: for a strategy over an op's output dims (MindSpore's form for Tile and OneHot), the
#: function giving the input its layout on that strategy's own device matrix, so cutting
#: the output into the strategy's layout moves nothing: ``fn(opname, strategy, dims)``
#: with `dims` the output dim of each input dim (None: the input dim is whole); installed
#: by the parallel layer
OUTPUT_STRATEGY_LAYOUTS: list = []


def _infer_tile(attrs, x):
    mult = attrs["multiples"]
    return ((tuple(s * m for s, m in zip(_tile_padded(x.shape, mult), mult)), x.dtype),)


def _tile_kernel(attrs, x):
    mult = attrs["multiples"]
    return np.tile(np.reshape(x, _tile_padded(np.shape(x), mult)), mult)


def _bw_tile(node, g):
    """The sum of the copies: g viewed as (m0, s0, m1, s1, ...), summed over the m's."""
    x = node.inputs[0]
    mult = node.attrs["multiples"]
    padded = _tile_padded(_shape_of(x), mult)
    split = tuple(v for m, s in zip(mult, padded) for v in (m, s))
    g = apply(RESHAPE, {"shape": split}, (g,))
    axes = tuple(2 * d for d, m in enumerate(mult) if m > 1)
    if axes:
        g = apply(get_op("ReduceSum"), {"axis": axes, "keep_dims": False}, (g,))
    return (reshape(g, _shape_of(x)),)


TILE = register("Tile", linear=(0,), infer=_infer_tile, kernel=_tile_kernel,
                backward=_bw_tile, reads_inputs=False)


def tile(input_x, multiples):
    """`input_x` repeated `multiples[d]` times along each dim d (more entries than dims
    tile new leading dims), as MindSpore's Tile."""
    x = const(input_x, "Tile")
    mult = check_multiples(multiples, x.ndim)
    return apply(TILE, {"multiples": mult}, (x,))


# ---------------------------------------------------------------------------
# ArgMaxWithValue / ArgMinWithValue (index, value) and Argmax / Argmin (index): the
# reduce family; the value's gradient goes to the position of the index
# ---------------------------------------------------------------------------
def _infer_arg(attrs, x):
    name = attrs["name"]
    if x.dtype.kind not in "fiu":
        raise TypeError(f"{name}: input 0 has dtype {x.dtype}; expected a float or integer "
                        f"dtype")
    (ax,) = attrs["axis"]
    if ax >= x.ndim:
        raise ValueError(f"{name}: axis={ax} is out of range for an input of rank {x.ndim}")
    shape = tuple(x.shape)
    if shape[ax] == 0:
        raise ValueError(f"{name}: cannot reduce the empty dim {ax} (shape {shape})")
    out = tuple(1 if d == ax else s for d, s in enumerate(shape)) if attrs["keep_dims"] \
        else shape[:ax] + shape[ax + 1:]
    idx = (out, np.dtype(attrs["index_dtype"]))
    return (idx, (out, x.dtype)) if attrs["with_value"] else (idx,)


def _arg_kernel(attrs, x):
    (ax,) = attrs["axis"]
    pick = np.argmax if attrs["kind"] == "max" else np.argmin
    idx = pick(x, axis=ax, keepdims=True)
    val = np.take_along_axis(x, idx, axis=ax) if attrs["with_value"] else None
    if not attrs["keep_dims"]:
        idx = np.squeeze(idx, ax)
        val = np.squeeze(val, ax) if val is not None else None
    idx = idx.astype(attrs["index_dtype"], copy=False)
    return (idx, val) if attrs["with_value"] else idx


def _bw_arg_with_value(node, g_idx, g_val):
    """d value / d x: one at the index's position along the axis (ties: the first)."""
    x = node.inputs[0]
    if g_val is None or x.dtype.kind != "f":
        return (None,)
    (ax,) = node.attrs["axis"]
    shape = _shape_of(x)
    kept = tuple(1 if d == ax else s for d, s in enumerate(shape))
    idx = reshape(node.outputs[0], shape[:ax] + shape[ax + 1:])
    hot = apply(ONE_HOT, {"depth": shape[ax], "axis": ax},
                (idx, np.ones((), x.dtype), np.zeros((), x.dtype)))
    return (binary(get_op("Mul"), hot, reshape(g_val, kept), False),)


def _register_arg(name, kind, with_value):
    return register(name, family=("reduce", "arg"), infer=_infer_arg, kernel=_arg_kernel,
                    backward=_bw_arg_with_value if with_value else None,
                    save_outputs=with_value, multi_output=with_value)


ARG_MAX_WITH_VALUE = _register_arg("ArgMaxWithValue", "max", True)
ARG_MIN_WITH_VALUE = _register_arg("ArgMinWithValue", "min", True)
ARG_MAX = _register_arg("Argmax", "max", False)
ARG_MIN = _register_arg("Argmin", "min", False)
_ARG_OPS = {"ArgMaxWithValue": (ARG_MAX_WITH_VALUE, "max"),
            "ArgMinWithValue": (ARG_MIN_WITH_VALUE, "min"),
            "Argmax": (ARG_MAX, "max"), "Argmin": (ARG_MIN, "min")}


def arg_reduce(name, x, axis, keep_dims=False, output_type=np.int32):
    """`name`'s op (ArgMaxWithValue, ArgMinWithValue, Argmax, Argmin) along one `axis`:
    the index of the first largest (smallest) element, as `output_type`, and for the
    *WithValue ops that element too, as ``(index, value)``."""
    op, kind = _ARG_OPS[name]
    x = const(x, name)
    if not isinstance(keep_dims, (bool, np.bool_)):
        raise TypeError(f"{name}: keep_dims must be a bool, got {keep_dims!r}")
    ax = norm_axis(name, axis, x.ndim) if x.ndim else None
    if ax is None:
        raise ValueError(f"{name}: input 0 is 0-d; expected rank >= 1")
    dt = as_dtype(output_type, name)
    if dt not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"{name}: output_type={output_type!r} is not supported; expected "
                        f"int32 or int64")
    attrs = {"name": name, "kind": kind, "axis": (ax,), "keep_dims": bool(keep_dims),
             "with_value": op.multi_output, "index_dtype": dt}
    return apply(op, attrs, (x,))


def argmax(x, axis=-1, output_type=np.int32):
    """The index of the largest element along `axis` (the first of ties)."""
    return arg_reduce("Argmax", x, axis, False, output_type)


def argmin(x, axis=-1, output_type=np.int32):
    """The index of the smallest element along `axis` (the first of ties)."""
    return arg_reduce("Argmin", x, axis, False, output_type)


def arg_max_with_value(x, axis=0, keep_dims=False):
    """``(index, value)`` of the largest element along `axis`, as MindSpore's
    ArgMaxWithValue (index int32)."""
    return arg_reduce("ArgMaxWithValue", x, axis, keep_dims)


def arg_min_with_value(x, axis=0, keep_dims=False):
    """``(index, value)`` of the smallest element along `axis` (index int32)."""
    return arg_reduce("ArgMinWithValue", x, axis, keep_dims)


# ---------------------------------------------------------------------------
# writing a Parameter in place (Assign / AssignAdd / AssignSub)
# ---------------------------------------------------------------------------
#: the function writing a value into a Parameter stored in a layout (its own shards,
#: the layout kept), installed by the parallel layer; without one, the global value
PARAMETER_WRITERS: list = []


def write_parameters(label, params, *values):
    """Set each Parameter of `params` to its value in `values` (converted to the
    parameter's dtype); a sharded Parameter keeps its layout. Inside a graph being traced
    (an interpreter that records opaque calls) this is recorded as one call named
    `label`, which writes them each time the graph runs."""
    record = getattr(interpreter.current(), "call_opaque", None)
    if record is not None:
        record(functools.partial(write_parameters, label, params), label, values)
        for p, v in zip(params, values):
            # later reads in the traced graph read the written value (the trace keeps
            # the parameter's own value and restores it when it ends)
            if isinstance(v, TensorBase) and v._layout is not None and \
                    tuple(v.shape) == tuple(p.shape) and v.dtype == p.dtype:
                p._layout = v._layout
        return
    for p, v in zip(params, values):
        if PARAMETER_WRITERS and p._layout is not None:
            PARAMETER_WRITERS[0](p, v, label)
        else:
            p.set_data(np.asarray(v._value() if isinstance(v, TensorBase) else v,
                                  dtype=p.dtype))


def _infer_assign(attrs, variable, value):
    return ((tuple(variable.shape), variable.dtype),)


def _assign_kernel(attrs, variable, value):
    """The new value of `variable`: `value` (broadcast to it) in its dtype."""
    shape = np.broadcast_shapes(np.shape(variable), np.shape(value))
    return np.array(np.broadcast_to(value, shape), dtype=np.asarray(variable).dtype)


#: Assign's new value: `value` in the shape and dtype of `variable` (the write itself is
#: :func:`write_parameters`); elementwise, so a strategy over both inputs places it
ASSIGN = register("Assign", family=("elementwise",), infer=_infer_assign,
                  kernel=_assign_kernel, reads_inputs=False)


#: what each of the in-place ops computes: the Assign op, or the binary op it applies
_ASSIGN_OPS = {"Assign": None, "AssignAdd": "Add", "AssignSub": "Sub"}


def assign_operand(name, variable, value):
    """`value` as the operand of `name` (Assign, AssignAdd, AssignSub) on `variable`,
    checked: `variable` is a Parameter; `value` has its shape (Assign) or broadcasts to
    it (AssignAdd, AssignSub)."""
    if not callable(getattr(variable, "set_data", None)):     # not a Parameter
        raise TypeError(f"{name}: variable must be a Parameter (it is updated in place), "
                        f"got {type(variable).__name__}")
    value = const(value, name)
    shape, vshape = tuple(variable.shape), tuple(np.shape(value))
    broadcasts = _ASSIGN_OPS[name] is not None
    if vshape != shape and not (broadcasts and len(vshape) <= len(shape) and all(
            v in (1, s) for v, s in zip(vshape[::-1], shape[::-1]))):
        valid = "one that broadcasts to it" if broadcasts else "the same shape"
        raise ValueError(f"{name}: value has shape {vshape} but variable {variable.name!r} "
                         f"has shape {shape}; expected {valid}")
    return value


def assigned_value(name, variable, value):
    """The value `name` writes into `variable`, in its dtype (recorded ops over both
    inputs, so a strategy places them)."""
    op = _ASSIGN_OPS[name]
    new = apply(ASSIGN, None, (variable, value)) if op is None else \
        binary(get_op(op), variable, value, False)
    if new.dtype != variable.dtype:
        new = apply(get_op("Cast"), {"dtype": np.dtype(variable.dtype)}, (new,))
    return new


def assign_in_place(name, variable, value):
    """`name` (Assign, AssignAdd, AssignSub) on the Parameter `variable`: `variable`
    written in place and returned (the new value in a compiled graph)."""
    value = assign_operand(name, variable, value)
    new = assigned_value(name, variable, value)
    write_parameters(name, (variable,), new)
    return new if is_traced() else variable


def assign(variable, value):
    """The Parameter `variable` set to `value` (same shape) in place; returns it."""
    return assign_in_place("Assign", variable, value)


def assign_add(variable, value):
    """``variable += value`` in place (value broadcasting to it); returns `variable`."""
    return assign_in_place("AssignAdd", variable, value)


def assign_sub(variable, value):
    """``variable -= value`` in place (value broadcasting to it); returns `variable`."""
    return assign_in_place("AssignSub", variable, value)


def is_traced():
    """Is a graph being traced (ops are recorded, not run)?"""
    return getattr(interpreter.current(), "call_opaque", None) is not None


# ---------------------------------------------------------------------------
# Diag and FillV2: MindSpore's creation ops (their rules in parallel/rules/array.py: Diag
# runs whole on every device, as MindSpore has no parallel implementation of it; FillV2's
# strategy covers its output, which each device cuts from the value locally through the
# primitive's out_strategy)
# ---------------------------------------------------------------------------
def _infer_diag(attrs, x):
    if x.ndim < 1:
        raise ValueError("Diag: input 0 is 0-d; expected a tensor of rank >= 1")
    return ((tuple(x.shape) * 2, x.dtype),)


def _diag_kernel(attrs, x):
    n = x.size
    out = np.zeros((n, n), dtype=x.dtype)
    out.reshape(-1)[::n + 1] = x.reshape(-1)
    return out.reshape(x.shape * 2)


def _bw_diag(node, g):
    """The diagonal of g: g masked by the identity, summed over its second half of dims."""
    shape = _shape_of(node.inputs[0])
    eye = np.eye(math.prod(shape), dtype=g.dtype).reshape(shape * 2)
    picked = binary(get_op("Mul"), g, eye, False)
    axes = tuple(range(len(shape), 2 * len(shape)))
    return (apply(get_op("ReduceSum"), {"axis": axes, "keep_dims": False}, (picked,)),)


DIAG = register("Diag", linear=(0,), infer=_infer_diag, kernel=_diag_kernel,
                backward=_bw_diag)


def diag(input_x):
    """The tensor of shape ``input_x.shape * 2`` with `input_x` on its diagonal
    (``out[i..., i...] = input_x[i...]``) and zeros elsewhere, as ``mindspore.ops.diag``."""
    return apply(DIAG, None, (const(input_x, "Diag"),))


def _infer_fill_v2(attrs, value):
    if value.ndim != 0:
        raise ValueError(f"FillV2: value (input 1) has shape {tuple(value.shape)}; expected a "
                         f"0-d tensor")
    return ((attrs["shape"], value.dtype),)


def _bw_fill_v2(node, g):
    """d out / d value: the sum of the incoming gradient."""
    axes = tuple(range(len(node.attrs["shape"])))
    return (apply(get_op("ReduceSum"), {"axis": axes, "keep_dims": False}, (g,)),)


FILL_V2 = register("FillV2", linear=(0,), infer=_infer_fill_v2, reads_inputs=False,
                   kernel=lambda attrs, value: np.full(attrs["shape"], value, value.dtype),
                   backward=_bw_fill_v2)


def fill_shape(shape):
    """FillV2's `shape`: a tuple or list of ints >= 0, or a 1-D int32 / int64 Tensor."""
    if isinstance(shape, (TensorBase, np.ndarray)):
        arr = shape.asnumpy() if isinstance(shape, TensorBase) else shape
        if arr.ndim != 1 or arr.dtype not in (np.int32, np.int64):
            raise TypeError(f"FillV2: shape is a tensor of shape {tuple(arr.shape)} and dtype "
                            f"{arr.dtype}; expected a 1-D int32 or int64 tensor (or a tuple "
                            f"of ints)")
        shape = tuple(int(s) for s in arr)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"FillV2: shape must be a tuple of ints or a 1-D int Tensor, got "
                        f"{type(shape).__name__}")
    return _check_shape("FillV2", shape)


def fill_v2(shape, value):
    """A tensor of `shape` (a tuple of ints or a 1-D int Tensor) filled with `value` (a
    0-d tensor, or a Python number: float32 / int64), of value's dtype, as MindSpore's
    FillV2; the gradient of value is the sum of the output's."""
    shape = fill_shape(shape)
    if isinstance(value, bool) or not isinstance(value, (TensorBase, np.ndarray, int, float,
                                                         np.number)):
        raise TypeError(f"FillV2: value must be a 0-d Tensor or a Python number, got "
                        f"{type(value).__name__}")
    return apply(FILL_V2, {"shape": shape}, (const(value, "FillV2"),))
