"""Layouts whose splits do not divide their dims: each device's piece as
numpy.array_split cuts it (the first n % k parts one row longer), stacks padded with
zeros to the largest piece, tables and local shapes showing the real pieces; a split
into more parts than the dim has rows (an empty piece) refused by name."""
import io
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dualmode as dm
from dualmode import Tensor, communication
from dualmode.parallel import (EmptyShardError, IndivisibleError, Layout, LayoutError,
                               TensorLayout, visualize)
from dualmode.parallel.visualize import layout_rows


def E(text):
    import re
    return re.escape(text)


# ------------------------------------------------------------------ the rule

@pytest.mark.parametrize("n, k", [(30, 4), (30, 8), (7, 7), (10, 3), (2047, 8), (9, 2),
                                  (5, 5), (13, 6)])
def test_one_axis_pieces_are_numpy_array_split(n, k):
    lay = TensorLayout((k,), ((0,), ()), (n, 3))
    x = np.arange(n * 3, dtype=np.float64).reshape(n, 3)
    want = np.array_split(x, k)
    slices = lay.device_slices()
    assert [s[0].stop - s[0].start for s in slices] == [len(w) for w in want]
    for s, w in zip(slices, want):
        assert np.array_equal(x[s], w)
    assert lay.local_shape == (-(-n // k), 3)
    assert lay.even == (n % k == 0)
    assert [tuple(v) for v in lay.local_shapes] == [w.shape for w in want]


def test_thirty_over_eight_is_not_the_chunk_rule():
    lay = TensorLayout.batch_split((30,), 8)
    sizes = [s[0].stop - s[0].start for s in lay.device_slices()]
    assert sizes == [4, 4, 4, 4, 4, 4, 3, 3]          # torch.chunk: 4 x 7, then 2


def test_merged_axes_cut_the_dim_once():
    # ('a', 'c') split dim 0 into 4 parts: part = a*2 + c, 7 rows -> 2, 2, 2, 1
    spec = Layout((2, 2, 2), ("a", "b", "c"))(("a", "c"), "b")
    lay = spec.bind((7, 5))
    rows = {r: (s[0].start, s[0].stop) for r, s in enumerate(lay.device_slices())}
    assert [rows[r] for r in (0, 1, 4, 5)] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert rows[2] == rows[0] and rows[7] == rows[5]
    cols = {r: (s[1].start, s[1].stop) for r, s in enumerate(lay.device_slices())}
    assert cols[0] == (0, 3) and cols[2] == (3, 5)
    assert spec.local_shape((7, 5)) == (2, 3)
    assert spec.local_shape((7, 5), rank=7) == (1, 2)
    assert lay.local_shape_of(5) == (1, 3)


# ------------------------------------------------------------------ stacks

def test_local_blocks_pad_with_zeros_and_assemble_back():
    lay = TensorLayout.from_strategy((4, 1), (30, 3), 4)
    x = np.arange(1.0, 91.0).reshape(30, 3)
    stack = lay.local_blocks(x)
    assert stack.shape == (4, 8, 3)
    assert np.array_equal(stack[2, :7], x[16:23]) and np.array_equal(stack[3, :7], x[23:])
    assert not stack[2, 7].any() and not stack[3, 7].any()     # the pads: zeros
    assert np.array_equal(lay.assemble(stack), x)
    assert lay.pad_global(x).shape == (32, 3)
    assert np.array_equal(lay.unpad_global(lay.pad_global(x)), x)


def test_zero_pads_writes_only_the_pads():
    lay = Layout((2, 2), ("a", "b"))("a", "b").bind((5, 7))
    x = np.arange(1.0, 36.0).reshape(5, 7)
    stack = lay.local_blocks(x)
    dirty = stack + 100.0                     # what an op such as exp leaves in the pads
    real = np.zeros(stack.shape, bool)
    for r, shape in enumerate(lay.local_shapes):
        real[r, :shape[0], :shape[1]] = True
    dirty[real] = stack[real]
    assert not np.array_equal(dirty, stack)
    lay.zero_pads(dirty)
    assert np.array_equal(dirty, stack)
    # only the devices of the ranks given
    part = stack[[1, 3]] + 100.0
    part[real[[1, 3]]] = stack[[1, 3]][real[[1, 3]]]
    lay.zero_pads(part, ranks=[1, 3])
    assert np.array_equal(part, stack[[1, 3]])


def test_blocks_of_some_ranks_and_grids():
    lay = TensorLayout((2, 3), ((0,), (1,)), (5, 7))
    x = np.arange(35.0).reshape(5, 7)
    full = lay.local_blocks(x)
    assert np.array_equal(lay.local_blocks_of(x, [4, 1]), full[[4, 1]])
    assert lay.blocks_view(x) is None                  # the pads are written: a copy
    assert np.array_equal(lay.local_blocks_view(x), full)
    grid = lay.local_blocks_grid(x)
    assert grid.shape == (2, 3, 3, 3)
    assert np.array_equal(lay.assemble_totals(grid), x)


def test_partial_layout_assembles_the_sum():
    lay = TensorLayout((3, 2), ((1,), ()), (5, 2), partial=(0,))
    x = np.arange(10.0).reshape(5, 2)
    share = lay.without_partial().local_blocks(x)
    stack = share * np.repeat([0.5, 0.25, 0.25], 2)[:, None, None]
    assert np.allclose(lay.assemble(stack), x)


# ------------------------------------------------------------------ properties

@st.composite
def layouts(draw):
    dmat = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    ndim = draw(st.integers(1, 3))
    axes = list(range(len(dmat)))
    owner = [draw(st.integers(-1, ndim - 1)) for _ in axes]     # -1: splits nothing
    order = draw(st.permutations(axes))
    tmap = tuple(tuple(a for a in order if owner[a] == d) for d in range(ndim))
    parts = [math.prod(dmat[a] for a in m) for m in tmap]
    shape = tuple(draw(st.integers(p, p * 3 + 2)) for p in parts)
    return TensorLayout(dmat, tmap, shape)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_element_is_held_by_exactly_its_replicas(lay):
    count = np.zeros(lay.shape, np.int64)
    for sl in lay.device_slices():
        count[sl] += 1
    replicas = lay.device_num // math.prod(lay.dim_parts)
    assert (count == replicas).all()
    # the pieces are numpy.array_split's along every dim
    for d, (n, k) in enumerate(zip(lay.shape, lay.dim_parts)):
        want = [len(p) for p in np.array_split(np.arange(n), k)]
        got = {}
        for r, sl in enumerate(lay.device_slices()):
            got[int(lay.block_index[r, d])] = sl[d].stop - sl[d].start
        assert [got[b] for b in range(k)] == want


@settings(max_examples=150, deadline=None)
@given(layouts(), st.randoms(use_true_random=False))
def test_pieces_concatenate_to_the_whole(lay, rnd):
    x = np.array([rnd.random() for _ in range(math.prod(lay.shape))]).reshape(lay.shape)
    stack = lay.local_blocks(x)
    assert stack.shape == lay.stack_shape
    for r, (sl, shape) in enumerate(zip(lay.device_slices(), lay.local_shapes)):
        real = tuple(slice(0, s) for s in shape)
        assert np.array_equal(stack[r][real], x[sl])
        pad = np.ones(stack.shape[1:], bool)
        pad[real] = False
        assert not stack[r][pad].any()
    assert np.array_equal(lay.assemble(stack), x)
    # one device per part along every axis: concatenating the pieces in block order
    firsts = {}
    for r in range(lay.device_num):
        firsts.setdefault(tuple(lay.block_index[r]), r)
    grid = np.empty(lay.dim_parts, object)
    for idx, r in firsts.items():
        grid[idx] = x[lay.device_slices()[r]]
    assert np.array_equal(np.block(grid.tolist()) if lay.ndim > 1 else
                          np.concatenate(list(grid)), x)


# ------------------------------------------------------------------ tables and shapes

def test_table_and_visualize_show_the_unequal_pieces():
    lay = TensorLayout.from_strategy((4, 1), (30, 3), 4)
    table = lay.table()
    assert "[16:23, 0:3]" in table and "[23:30, 0:3]" in table and "[8:16, 0:3]" in table
    assert "unequal pieces: dim 0 has 30 rows in 4 parts, 8 in the first 2 and 7 in the " \
           "other 2" in table
    text = visualize(Layout((2, 2), ("dp", "mp"))("dp", "mp"), shape=(5, 3),
                     file=io.StringIO())
    assert "dim 0 has 5 rows in 2 parts, 3 in the first 1 and 2 in the other 1" in text
    assert "dim 1 has 3 rows in 2 parts, 2 in the first 1 and 1 in the other 1" in text
    rows = layout_rows(Layout((2, 2), ("dp", "mp"))("dp", "mp").bind((5, 3)))
    assert [r["slices"] for r in rows] == [((0, 3), (0, 2)), ((0, 3), (2, 3)),
                                           ((3, 5), (0, 2)), ((3, 5), (2, 3))]


def test_even_tables_have_no_note():
    assert "unequal" not in TensorLayout.from_strategy((4, 1), (32, 3), 4).table()


@pytest.fixture
def four_devices():
    dm.reset_auto_parallel_context()
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=4)
    communication.init()
    yield
    dm.reset_auto_parallel_context()


def test_local_shape_of_a_tensor(four_devices):
    x = np.arange(30.0 * 3).reshape(30, 3).astype(np.float32)
    t = dm.reshard(Tensor(x), (4, 1))
    assert dm.parallel.local_shape(t) == (8, 3)
    assert [dm.parallel.local_shape(t, rank=r) for r in range(4)] == [(8, 3), (8, 3), (7, 3),
                                                                      (7, 3)]
    assert np.array_equal(t.asnumpy(), x)
    assert dm.parallel.local_shape(Tensor(x), rank=2) == (30, 3)


# ------------------------------------------------------------------ refused

@pytest.mark.parametrize("make, msg", [
    (lambda: TensorLayout((8,), ((0,),), (5,)),
     "TensorLayout: dim 0 (size 5) cannot be split into the 8 parts of axis 0: 3 devices "
     "would hold an empty piece (shape (5,)); a split may not exceed the dim (at most 5 "
     "parts)"),
    (lambda: Layout((2, 4), ("dp", "mp"))("None", "mp").bind((4, 3)),
     "Layout: dim 1 (size 3) cannot be split into the 4 parts of 'mp': 1 device would hold"),
    (lambda: TensorLayout.from_strategy((1, 8), (4, 6), 8, "MatMul", 1),
     "MatMul: in_strategy[1][1]=8 exceeds dim 1 (size 6) of input 1: 2 devices would hold "
     "an empty piece"),
    (lambda: TensorLayout.batch_split((3, 2), 4),
     "batch_split over 4 devices: dim 0 (size 3) cannot be split into the 4 parts"),
])
def test_an_empty_piece_is_refused_by_name(make, msg):
    with pytest.raises(EmptyShardError, match=E(msg)):
        make()
    assert issubclass(EmptyShardError, IndivisibleError)
    assert issubclass(EmptyShardError, LayoutError)


def test_a_dim_of_size_zero_may_still_be_split():
    lay = TensorLayout((4,), ((0,), ()), (0, 3))
    assert lay.even and lay.local_shape == (0, 3)


def test_ops_on_unequal_pieces_and_rules_that_do_not_handle_them(four_devices):
    x = np.arange(30.0 * 3).reshape(30, 3).astype(np.float32)
    t = dm.reshard(Tensor(x), (4, 1))
    # an op's rule: the single device's numbers, zeros in the pads
    y = dm.ops.ReLU()(t - 40.0)
    assert np.array_equal(y.asnumpy(), np.maximum(x - 40.0, 0))
    assert not y._data[2, 7].any() and not y._data[3, 7].any()
    # a rule registered without uneven=True is refused by name, before it runs
    from dualmode.parallel.sharding import check_even
    with pytest.raises(ValueError, match=E(
            "NewOp: input 0 is split into pieces of unequal size (dim 0, size 30, in 4 "
            "parts: 8 or 7 rows each); NewOp does not handle unequal pieces yet")):
        check_even(lambda attrs, lays, dtypes: None, "NewOp", [t._layout])
    # and so is a strategy that does not divide, before anything moves
    from dualmode.ops.primitive import Primitive

    class NoRule(Primitive):
        name = "NoRule"

        def construct(self, a):
            return a

    w = dm.Parameter(Tensor(np.ones((30, 3), np.float32)), name="w")
    with pytest.raises(ValueError, match=E("NoRule: in_strategy[0][0]=4 does not divide dim 0 "
                                           "(size 30) of input 0, and NoRule does not handle "
                                           "pieces of unequal size yet")):
        NoRule().shard(((4, 1),))(w)
    assert w.layout is None and np.array_equal(w.asnumpy(), np.ones((30, 3)))
