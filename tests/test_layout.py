"""Layouts: Layout / LayoutSpec / TensorLayout, strategies, slices, groups and errors.

Every expectation is hand-computed (the SPEC section 8 example, the seed-003 tutorial
strategies) or a property that must hold for every layout (slices tile the tensor once
per replica set, groups partition the ranks).
"""
import dataclasses
import math
import pickle
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dualmode as dm
from dualmode.parallel import (EmptyShardError, IndivisibleError, Layout, LayoutError, LayoutSpec,
                               TensorLayout)
from dualmode.parallel.tensor_layout import format_table

E = re.escape
L3 = Layout((2, 2, 2), ("dp", "sp", "mp"))


def rng_slices(sl):
    """(start, stop) pairs of a tuple of slices, for compact comparisons."""
    return tuple((s.start, s.stop) for s in sl)


# ---------------------------------------------------------------- Layout and LayoutSpec

def test_layout_public_name():
    assert dm.parallel.Layout is Layout
    assert L3.device_matrix == (2, 2, 2) and L3.alias_name == ("dp", "sp", "mp")
    assert L3.device_num == 8 and L3.axis("sp") == 1


def test_layout_call_normalises_entries():
    spec = L3("mp", ("sp", "dp"), "None")
    assert isinstance(spec, LayoutSpec)
    assert spec.spec == (("mp",), ("sp", "dp"), ())
    assert spec.tensor_map == ((2,), (1, 0), ())
    assert spec.ndim == 3
    assert L3(("mp",), "None") == L3("mp", "None")
    assert repr(spec) == "Layout((2, 2, 2), ('dp', 'sp', 'mp'))('mp', ('sp', 'dp'), 'None')"


def test_layout_spec_to_dict_mindspore_convention():
    d = L3("mp", ("sp", "dp"), "None").to_dict()
    # MindSpore counts device axes from the last one: mp=0, sp=1, dp=2; -1 = not split
    assert d["tensor_map"] == (0, (1, 2), -1)
    assert d["device_matrix"] == (2, 2, 2) and d["alias_name"] == ("dp", "sp", "mp")


def test_layout_spec_example_slices():
    """SPEC section 8: rank 1 holds rows 4:8, cols 0:2; rank 4 rows 0:4, cols 2:4."""
    sl = L3("mp", ("sp", "dp")).device_slices((8, 8))
    assert sl[1] == (slice(4, 8), slice(0, 2))
    assert sl[4] == (slice(0, 4), slice(2, 4))
    # all ranks, by hand: rows by mp; cols block = sp*2 + dp
    expect = {0: ((0, 4), (0, 2)), 1: ((4, 8), (0, 2)), 2: ((0, 4), (4, 6)),
              3: ((4, 8), (4, 6)), 4: ((0, 4), (2, 4)), 5: ((4, 8), (2, 4)),
              6: ((0, 4), (6, 8)), 7: ((4, 8), (6, 8))}
    assert {r: rng_slices(s) for r, s in enumerate(sl)} == expect


def test_layout_rank_is_row_major():
    t = L3("dp", "sp", "mp").bind((2, 2, 2))
    for dp_ in range(2):
        for sp_ in range(2):
            for mp_ in range(2):
                r = dp_ * 4 + sp_ * 2 + mp_
                assert t.coords(r) == (dp_, sp_, mp_)
                assert t.rank_of((dp_, sp_, mp_)) == r
                assert t.slice_index(r) == (dp_, sp_, mp_)
    assert t.coords(np.arange(8)).tolist() == t.rank_coords.tolist()
    assert t.rank_of(t.rank_coords).tolist() == list(range(8))


def test_layout_seed003_weight_merged_axes():
    w = L3(("sp", "dp"), "None").bind((784, 512))
    assert w.local_shape == (196, 512)
    assert w.dim_parts == (4, 1) and w.parts(0) == 4 and w.parts(-1) == 1
    sl = w.device_slices()
    # rank 4 = (dp1, sp0, mp0): block 0*2+1 = 1; rank 2 = (0, 1, 0): block 2
    assert rng_slices(sl[4]) == ((196, 392), (0, 512))
    assert rng_slices(sl[2]) == ((392, 588), (0, 512))
    assert sl[0] == sl[1]                               # mp replicates the weight
    assert w.split_axes == (0, 1) and w.replicated_axes == (2,)


def test_layout_8_device_1d_layout():
    lay2 = Layout((8,), ("tp",))
    x = lay2("None", "tp").bind((32, 512))
    assert x.local_shape == (32, 64)
    assert rng_slices(x.device_slices()[3]) == ((0, 32), (192, 256))


# ---------------------------------------------------------------- strategies

def test_strategy_seed003_matmul1():
    """ops.MatMul().shard(((2, 4), (4, 1))) on 8 devices."""
    x = TensorLayout.from_strategy((2, 4), (32, 784), 8, "MatMul", 0)
    assert x.device_matrix == (2, 4) and x.tensor_map == ((0,), (1,))
    assert x.local_shape == (16, 196)
    assert rng_slices(x.device_slices()[5]) == ((16, 32), (196, 392))   # coords (1, 1)
    w = TensorLayout.from_strategy((4, 1), (784, 512), 8, "MatMul", 1)
    # 4 parts on 8 devices: repeated calculation on a new highest axis of size 2
    assert w.device_matrix == (2, 4) and w.tensor_map == ((1,), ())
    assert w.replicated_axes == (0,)
    sl = w.device_slices()
    assert rng_slices(sl[5]) == ((196, 392), (0, 512))
    assert sl[1] == sl[5] and sl[0] != sl[1]


def test_strategy_seed003_matmul2():
    """ops.MatMul().shard(((1, 8), (8, 1))) on 8 devices."""
    x = TensorLayout.from_strategy((1, 8), (32, 512), 8)
    assert x.device_matrix == (8,) and x.tensor_map == ((), (0,))
    assert rng_slices(x.device_slices()[3]) == ((0, 32), (192, 256))
    w = TensorLayout.from_strategy((8, 1), (512, 512), 8)
    assert w.device_matrix == (8,) and w.tensor_map == ((0,), ())
    assert w.local_shape == (64, 512)


@pytest.mark.parametrize("strategy, device_num, dev_matrix, tmap", [
    ((2, 1), 8, (4, 2), ((1,), ())),            # repeated calculation x4
    ((4, 1), 8, (2, 4), ((1,), ())),            # ReLU().shard(((4, 1),))
    ((8, 1), 8, (8,), ((0,), ())),
    ((2, 4), 16, (2, 2, 4), ((1,), (2,))),
    ((1, 1), 8, (8,), ((), ())),                # fully repeated
    ((1, 1), 1, (1,), ((), ())),
    ((2, 2), 4, (2, 2), ((0,), (1,))),
])
def test_strategy_device_matrix(strategy, device_num, dev_matrix, tmap):
    t = TensorLayout.from_strategy(strategy, (8, 8), device_num)
    assert t.device_matrix == dev_matrix and t.tensor_map == tmap
    assert t.device_num == device_num


def test_strategy_repeated_replicas_hold_same_slice():
    t = TensorLayout.from_strategy((2, 1), (8, 4), 8)
    sl = t.device_slices()
    # ranks r and r+2, r+4, r+6 differ only on the repeated axis
    for r in range(2):
        assert sl[r] == sl[r + 2] == sl[r + 4] == sl[r + 6]
    assert rng_slices(sl[1]) == ((4, 8), (0, 4))


def test_strategy_accepts_layout_spec():
    spec = L3("mp", ("sp", "dp"))
    t = TensorLayout.from_strategy(spec, (8, 8), 8, "MatMul", 0)
    assert t == spec.bind((8, 8)) and t.alias == ("dp", "sp", "mp")


def test_batch_split_and_replicated():
    b = TensorLayout.batch_split((32, 10), 8)
    assert b.device_matrix == (8,) and b.tensor_map == ((0,), ()) and b.local_shape == (4, 10)
    b1 = TensorLayout.batch_split((3, 32), 4, dim=-1)
    assert b1.tensor_map == ((), (0,)) and b1.local_shape == (3, 8)
    r = TensorLayout.replicated((3, 5), 4)
    assert r.device_matrix == (4,) and r.is_replicated and r.local_shape == (3, 5)
    assert r.replicated_axes == (0,) and all(s == (slice(0, 3), slice(0, 5))
                                             for s in r.device_slices())


def test_scalar_layout():
    t = L3().bind(())
    assert t.local_shape == () and t.device_slices()[7] == ()
    assert t.assemble(t.local_blocks(np.float32(3.0))) == 3.0


# ---------------------------------------------------------------- TensorLayout values

def test_tensor_layout_hash_and_equality():
    a = L3("mp", ("sp", "dp")).bind((8, 8))
    b = TensorLayout((2, 2, 2), ((2,), (1, 0)), (8, 8))          # no alias
    assert a == b and hash(a) == hash(b)                          # alias is for printing only
    assert {a: 1}[b] == 1
    assert a != TensorLayout((2, 2, 2), ((2,), (0, 1)), (8, 8))   # merge order matters
    assert a != a.replace(shape=(8, 16))
    c = TensorLayout((2, 2, 2), ((2,), ()), (8, 8), alias=("dp", "sp", "mp"))
    assert c.with_partial("dp") != c and c.with_partial(0) == c.with_partial(("dp",))
    assert L3 == Layout((2, 2, 2), ("dp", "sp", "mp")) and hash(L3) == hash(Layout((2, 2, 2),
                                                                               ("dp", "sp", "mp")))
    assert L3 != Layout((2, 2, 2), ("a", "b", "c"))
    assert L3("mp", "None") == L3("mp", "None") and hash(L3("mp", "None")) == hash(L3("mp", None))


def test_tensor_layout_immutable_and_picklable():
    t = L3("mp", ("sp", "dp")).bind((8, 8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.shape = (4, 4)
    with pytest.raises(AttributeError, match="Layout is immutable"):
        L3.device_matrix = (8,)
    t.device_slices(); t.group_members("mp")   # noqa: E702  (fill caches before pickling)
    u = pickle.loads(pickle.dumps(t))
    assert u == t and u.alias == t.alias and u.device_slices() == t.device_slices()
    assert pickle.loads(pickle.dumps(L3)) == L3
    assert pickle.loads(pickle.dumps(L3("mp", "None"))) == L3("mp", "None")
    with pytest.raises(ValueError, match="read-only"):
        t.block_index[0, 0] = 5


def test_tensor_layout_normalises_fields():
    t = TensorLayout([np.int64(2), 4], [[0], []], [np.int32(8), 6], partial=[1])
    assert t.device_matrix == (2, 4) and t.tensor_map == ((0,), ()) and t.shape == (8, 6)
    assert t.partial == (1,) and type(t.shape[0]) is int


def test_tensor_layout_partial():
    c = TensorLayout((2, 2, 2), ((2,), ()), (8, 8), alias=("dp", "sp", "mp"))
    p = c.with_partial(("sp", "dp"))
    assert p.partial == (0, 1) and p.is_partial and p.replicated_axes == ()
    assert p.without_partial() == c and c.without_partial() is c
    assert repr(p) == ("TensorLayout((8, 8), mesh=(dp=2, sp=2, mp=2), map=(mp, None), "
                       "partial=(dp, sp))")
    # pending sums: the global value is the sum over the partial group
    x = np.arange(64.0).reshape(8, 8)
    stack = c.local_blocks(x)
    assert np.array_equal(p.assemble(stack), 4 * x)


def test_tensor_layout_repr_without_alias():
    t = TensorLayout.from_strategy((2, 1), (8, 4), 8)
    assert repr(t) == "TensorLayout((8, 4), mesh=(4, 2), map=(1, None))"
    assert repr(TensorLayout((4,), ((0,),), (8,))) == "TensorLayout((8,), mesh=(4,), map=(0,))"


# ---------------------------------------------------------------- groups

def test_group_members_spec_example():
    t = L3("mp", ("sp", "dp")).bind((8, 8))
    # AllGather of dim 1 runs over (sp, dp), sp outer: members ordered sp*2 + dp
    g = t.group_members(("sp", "dp"))
    assert g.tolist() == [[0, 4, 2, 6], [1, 5, 3, 7]]
    assert [rng_slices(t.device_slices()[r])[1] for r in g[0]] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert t.group_members("mp").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.group_members(()).tolist() == [[r] for r in range(8)]
    assert t.group_members((0, 1, 2)).tolist() == [list(range(8))]
    assert t.group_of(5, ("sp", "dp")).tolist() == [1, 5, 3, 7]


# ---------------------------------------------------------------- table

def test_table_small_case():
    t = Layout((2, 2), ("dp", "mp"))("dp", "None").bind((4, 3))
    assert t.table() == "\n".join([
        "TensorLayout((4, 3), mesh=(dp=2, mp=2), map=(dp, None))",
        "rank  device coordinates (dp, mp)  slice",
        "   0  (0, 0)                       [0:2, 0:3]",
        "   1  (0, 1)                       [0:2, 0:3]",
        "   2  (1, 0)                       [2:4, 0:3]",
        "   3  (1, 1)                       [2:4, 0:3]",
    ])
    assert str(t) == t.table()
    assert t.table(max_rows=2).splitlines()[-1] == "... (2 more ranks)"
    assert "values are partial sums pending over (mp)" in t.with_partial("mp").table()


def test_table_seed003_two_tensors():
    x = L3("mp", ("sp", "dp")).bind((8, 8))
    w = L3(("sp", "dp"), "None").bind((8, 4))
    lines = format_table({"x": x, "weight": w}).splitlines()
    assert lines[2].split() == ["rank", "device", "coordinates", "(dp,", "sp,", "mp)", "x",
                                "weight"]
    assert lines[3 + 4].split() == ["4", "(1,", "0,", "0)", "[0:4,", "2:4]", "[2:4,", "0:4]"]


# ---------------------------------------------------------------- properties

@st.composite
def layouts(draw, max_devices=64, max_axes=4, partial=False):
    naxes = draw(st.integers(1, max_axes))
    dev = []
    for _ in range(naxes):
        room = max_devices // max(1, math.prod(dev))
        dev.append(draw(st.integers(1, max(1, min(4, room)))))
    ndim = draw(st.integers(0, 3))
    owner = [draw(st.integers(-2 if partial else -1, ndim - 1)) for _ in range(naxes)]
    order = draw(st.permutations(range(naxes)))
    tmap = tuple(tuple(a for a in order if owner[a] == d) for d in range(ndim))
    parts = [math.prod(dev[a] for a in axes) for axes in tmap]
    shape = tuple(p * draw(st.integers(1, 3)) for p in parts)
    part = tuple(a for a in range(naxes) if owner[a] == -2)
    return TensorLayout(tuple(dev), tmap, shape, part)


@settings(max_examples=60, deadline=None)
@given(layouts(), st.randoms(use_true_random=False))
def test_property_slices_tile_tensor_once_per_replica_set(t, rnd):
    assert all(lo * p == n for lo, p, n in zip(t.local_shape, t.dim_parts, t.shape))
    x = np.arange(math.prod(t.shape), dtype=np.int64).reshape(t.shape)
    sl = t.device_slices()
    replicas = t.group_members(t.replicated_axes)
    out, hits = np.full(t.shape, -1), np.zeros(t.shape, np.int64)
    for row in replicas:
        assert len({rng_slices(sl[r]) for r in row}) == 1   # replicas hold the same slice
        r = rnd.choice(list(row))
        out[sl[r]] = x[sl[r]]
        hits[sl[r]] += 1
        assert x[sl[r]].shape == t.local_shape
    assert (hits == 1).all() and np.array_equal(out, x)
    stack = t.local_blocks(x)
    assert all(np.array_equal(stack[r], x[sl[r]]) for r in range(t.device_num))
    assert np.array_equal(t.assemble(stack), x)


@settings(max_examples=60, deadline=None)
@given(layouts(partial=True), st.data())
def test_property_group_members_partition_ranks(t, data):
    naxes = len(t.device_matrix)
    axes = tuple(data.draw(st.permutations(range(naxes)))[:data.draw(st.integers(0, naxes))])
    g = t.group_members(axes)
    size = math.prod(t.device_matrix[a] for a in axes)
    assert g.shape == (t.device_num // size, size)
    assert sorted(g.ravel().tolist()) == list(range(t.device_num))
    c = t.rank_coords[g]                                 # (groups, size, naxes)
    rest = [a for a in range(naxes) if a not in axes]
    assert (c[:, :, rest] == c[:, :1, rest]).all()       # members differ only on `axes`
    inner = np.stack(np.unravel_index(np.arange(size), tuple(t.device_matrix[a] for a in axes)),
                     axis=1) if axes else np.zeros((1, 0), np.int64)
    assert (c[:, :, list(axes)] == inner).all()          # row-major along `axes`, as given
    r = data.draw(st.integers(0, t.device_num - 1))
    assert r in t.group_of(r, axes).tolist()


# ---------------------------------------------------------------- scale

def test_layout_4096_devices():
    lay = Layout((8, 8, 8, 8), ("pp", "dp", "sp", "mp"))
    t = lay(("dp", "pp"), "mp", "None").bind((4096, 1024, 3))
    assert t.device_num == 4096 and t.local_shape == (64, 128, 3)
    sl = t.device_slices()                   # timed in bench/test_bench_layout.py
    assert len(sl) == 4096
    # rank 4095 = (7, 7, 7, 7): dim 0 block dp*8 + pp = 63, dim 1 block mp = 7
    assert rng_slices(sl[4095]) == ((4032, 4096), (896, 1024), (0, 3))
    # rank 1234 = (2, 3, 2, 2): block 3*8 + 2 = 26
    assert t.coords(1234) == (2, 3, 2, 2)
    assert rng_slices(sl[1234]) == ((26 * 64, 27 * 64), (256, 384), (0, 3))
    g = t.group_members(("dp", "pp"))
    assert g.shape == (64, 64) and g[0, :3].tolist() == [0, 512, 1024]
    rep = t.group_members(t.replicated_axes)
    assert rep.shape == (512, 8) and rep[0].tolist() == list(range(0, 64, 8))
    s = TensorLayout.from_strategy((64, 32), (4096, 64), 4096)
    assert s.device_matrix == (2, 64, 32) and s.local_shape == (64, 2)
    assert len(s.device_slices()) == 4096


# ---------------------------------------------------------------- errors

ERRORS = [
    # Layout constructor
    ("dm-type", lambda: Layout(8, ("dp",)), TypeError,
     E("Layout(8, ('dp',)): device_matrix must be a non-empty tuple of ints, e.g. (2, 4); got 8")),
    ("dm-float", lambda: Layout((2.0, 4), ("a", "b")), TypeError,
     E("device_matrix must be a non-empty tuple of ints")),
    ("dm-nonpositive", lambda: Layout((2, 0), ("a", "b")), ValueError,
     E("Layout((2, 0), ('a', 'b')): device_matrix[1]=0 must be a positive int")),
    ("alias-type", lambda: Layout((2, 2), ("a", 1)), TypeError,
     E("alias_name must be a tuple of strings, one per device-matrix axis")),
    ("alias-length", lambda: Layout((2, 2), ("a",)), ValueError,
     E("Layout((2, 2), ('a',)): alias_name ('a',) has 1 names but device_matrix (2, 2) has 2 "
       "axes")),
    ("alias-dup", lambda: Layout((2, 2), ("a", "a")), ValueError,
     E("alias 'a' appears twice in alias_name ('a', 'a'); aliases must be distinct")),
    ("alias-None", lambda: Layout((2, 2), ("dp", "None")), ValueError,
     E("alias_name[1]='None' is reserved")),
    ("alias-empty", lambda: Layout((2,), ("",)), ValueError, E("alias_name[0] is empty")),
    # layout(...)
    ("unknown-alias", lambda: L3("tp", "None"), ValueError,
     E("Layout((2, 2, 2), ('dp', 'sp', 'mp')): unknown alias 'tp' for dim 0; valid aliases are "
       "'dp', 'sp', 'mp' or 'None'")),
    ("unknown-merged", lambda: L3("dp", ("sp", "xx")), ValueError,
     E("unknown alias 'xx' for dim 1")),
    ("alias-twice-across", lambda: L3("mp", ("sp", "mp")), ValueError,
     E("Layout((2, 2, 2), ('dp', 'sp', 'mp')): alias 'mp' is used twice in ('mp', ('sp', 'mp')) "
       "(dims 0 and 1); each device axis may split at most one dim once")),
    ("alias-twice-within", lambda: L3(("sp", "sp")), ValueError,
     E("alias 'sp' is used twice in (('sp', 'sp'),) (dim 0)")),
    ("entry-type", lambda: L3(0, "None"), TypeError,
     E("dim 0 maps to 0; each dim takes an alias, a tuple of aliases or 'None'")),
    ("entry-list", lambda: L3(["dp"], "None"), TypeError, E("dim 0 maps to ['dp']")),
    ("entry-empty", lambda: L3((), "None"), ValueError,
     E("dim 0 maps to an empty tuple; use 'None' to leave a dim unsplit")),
    # binding a spec to a shape
    ("spec-empty", lambda: L3("mp", ("sp", "dp")).bind((8, 3)), EmptyShardError,
     E("Layout: dim 1 (size 3) cannot be split into the 4 parts of ('sp', 'dp'): 1 device would "
       "hold an empty piece (shape (8, 3)); a split may not exceed the dim (at most 3 parts)")),
    ("spec-empty-one", lambda: L3("mp", "None").bind((1, 6)), ValueError,
     E("Layout: dim 0 (size 1) cannot be split into the 2 parts of 'mp'")),
    ("spec-rank", lambda: L3("mp", "None").bind((8,)), ValueError,
     E("Layout: Layout((2, 2, 2), ('dp', 'sp', 'mp'))('mp', 'None') maps 2 dims but the tensor "
       "has rank 1 (shape (8,))")),
    ("spec-not-spec", lambda: TensorLayout.from_spec(L3, (8,)), TypeError,
     E("Layout: expected a Layout applied to dims, e.g. layout('dp', 'None')")),
    # strategies
    ("strategy-empty", lambda: TensorLayout.from_strategy((2, 4), (8, 3), 8, "MatMul", 0),
     IndivisibleError, E("MatMul: in_strategy[0][1]=4 exceeds dim 1 (size 3) of input 0: 1 "
                         "device would hold an empty piece; a split may not exceed the dim")),
    ("strategy-rank", lambda: TensorLayout.from_strategy((2, 4, 1), (8, 8), 8, "MatMul", 1),
     ValueError, E("MatMul: in_strategy[1]=(2, 4, 1) has 3 entries but input 1 has rank 2 "
                   "(shape (8, 8))")),
    ("strategy-too-many", lambda: TensorLayout.from_strategy((4, 4), (8, 8), 8, "MatMul"),
     ValueError, E("MatMul: in_strategy[0]=(4, 4) needs 16 devices but device_num is 8; the "
                   "product of a strategy must divide device_num")),
    ("strategy-not-dividing", lambda: TensorLayout.from_strategy((3, 1), (6, 8), 8, "ReLU"),
     ValueError, E("ReLU: in_strategy[0]=(3, 1) needs 3 devices, which does not divide "
                   "device_num=8")),
    ("strategy-zero", lambda: TensorLayout.from_strategy((0, 1), (6, 8), 8, "ReLU"), ValueError,
     E("ReLU: in_strategy[0][0]=0 must be a positive int")),
    ("strategy-type", lambda: TensorLayout.from_strategy((2.0, 1), (6, 8), 8, "ReLU"), TypeError,
     E("ReLU: in_strategy[0]=(2.0, 1) must be a tuple of ints, one per dim of input 0")),
    ("strategy-out", lambda: TensorLayout.from_strategy((4,), (2,), 4, "Add", 0, "out_strategy"),
     ValueError, E("Add: out_strategy[0][0]=4 exceeds dim 0 (size 2) of output 0: 2 devices")),
    ("strategy-device-num", lambda: TensorLayout.from_strategy((1,), (6,), 0, "Add"), ValueError,
     E("Add: device_num must be a positive int; got 0")),
    ("strategy-layout-devices", lambda: TensorLayout.from_strategy(L3("mp"), (8,), 16, "MatMul"),
     ValueError, E("MatMul: in_strategy[0]: Layout((2, 2, 2), ('dp', 'sp', 'mp'))('mp') has 8 "
                   "devices but device_num is 16")),
    ("strategy-layout-empty", lambda: TensorLayout.from_strategy(L3(("dp", "sp", "mp")), (5,), 8,
                                                                 "MatMul"),
     ValueError, E("MatMul: in_strategy[0]: dim 0 (size 5) cannot be split into the 8 parts of "
                   "('dp', 'sp', 'mp'): 3 devices would hold an empty piece")),
    ("batch-split", lambda: TensorLayout.batch_split((3, 3), 4), EmptyShardError,
     E("batch_split over 4 devices: dim 0 (size 3) cannot be split into the 4 parts of axis 0")),
    ("batch-split-dim", lambda: TensorLayout.batch_split((10, 3), 2, dim=2), ValueError,
     E("batch_split: dim=2 is out of range for shape (10, 3)")),
    # TensorLayout fields
    ("tl-map-rank", lambda: TensorLayout((2,), ((0,),), (4, 4)), ValueError,
     E("TensorLayout: tensor_map ((0,),) has 1 entries but the tensor has rank 2 (shape (4, 4))")),
    ("tl-axis-range", lambda: TensorLayout((2,), ((1,),), (4,)), ValueError,
     E("TensorLayout: tensor_map[0] names device axis 1, but the device matrix has axes 0..0")),
    ("tl-axis-twice", lambda: TensorLayout((2, 2), ((0,), (0,)), (4, 4)), ValueError,
     E("TensorLayout: axis 0 splits both dim 0 and dim 1")),
    ("tl-empty", lambda: TensorLayout((2, 3), ((), (1, 0)), (4, 5)), IndivisibleError,
     E("TensorLayout: dim 1 (size 5) cannot be split into the 6 parts of axes (1, 0)")),
    ("tl-partial-split", lambda: TensorLayout((2, 2), ((0,),), (4,), partial=(0,)), ValueError,
     E("TensorLayout: axis 0 both splits a dim and holds partial sums")),
    ("tl-partial-range", lambda: TensorLayout((2,), ((),), (4,), partial=(3,)), ValueError,
     E("TensorLayout: partial names device axis 3")),
    ("tl-shape-negative", lambda: TensorLayout((2,), ((),), (-1,)), ValueError,
     E("TensorLayout: shape (-1,) has negative size -1 at dim 0")),
    ("tl-alias", lambda: TensorLayout((2,), ((),), (4,), alias=("a", "b")), ValueError,
     E("TensorLayout: alias must be None or 1 distinct non-empty strings")),
    ("tl-map-type", lambda: TensorLayout((2,), (0,), (4,)), TypeError,
     E("TensorLayout: tensor_map[0] must be a tuple of ints; got 0")),
]


@pytest.mark.parametrize("name, fn, exc, msg", ERRORS, ids=[e[0] for e in ERRORS])
def test_layout_errors(name, fn, exc, msg):
    with pytest.raises(exc, match=msg):
        fn()


def test_layout_error_classes():
    assert issubclass(IndivisibleError, LayoutError) and issubclass(LayoutError, ValueError)


def test_tensor_layout_method_errors():
    t = L3("mp", ("sp", "dp")).bind((8, 8))
    with pytest.raises(ValueError, match=E("rank 8 is not in 0..7")):
        t.slice_index(8)
    with pytest.raises(ValueError, match=E("rank -1 is not in 0..7")):
        t.coords(-1)
    with pytest.raises(ValueError, match=E("coordinates (0, 2, 0) lie outside the device "
                                           "matrix (2, 2, 2)")):
        t.rank_of((0, 2, 0))
    with pytest.raises(ValueError, match=E("coordinates need 3 entries")):
        t.rank_of((0, 1))
    with pytest.raises(ValueError, match=E("group_members got unknown axis name 'tp'; valid "
                                           "names: 'dp', 'sp', 'mp'")):
        t.group_members("tp")
    with pytest.raises(ValueError, match=E("group_members got axis 3; valid axes are 0..2")):
        t.group_members((3,))
    with pytest.raises(ValueError, match=E("group_members got axis 0 twice")):
        t.group_members(("dp", 0))
    with pytest.raises(ValueError, match=E("dim 2 is out of range for shape (8, 8)")):
        t.parts(2)
    with pytest.raises(ValueError, match=E("axis 'mp' both splits a dim and holds partial")):
        t.with_partial("mp")
    with pytest.raises(ValueError, match=E("local_blocks got an array of shape (8,), expected "
                                           "the global shape (8, 8)")):
        t.local_blocks(np.zeros(8))
    with pytest.raises(ValueError, match=E("assemble got a stack of shape (8, 8), expected "
                                           "(8, 4, 2)")):
        t.assemble(np.zeros((8, 8)))
    with pytest.raises(ValueError, match=E("a global value has no pending partial sums")):
        TensorLayout((2,), ((),), (4,), partial=(0,)).local_blocks(np.zeros(4))
    with pytest.raises(ValueError, match=E("format_table: 'b' has device matrix (8,)")):
        format_table({"a": t, "b": TensorLayout.batch_split((8,), 8)})
