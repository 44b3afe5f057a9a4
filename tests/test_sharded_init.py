"""Delayed parameters made sharded: the Philox generator, block-wise initializers and
parameters that only ever build their local shards (issue 4)."""
import gc
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dualmode as dm
from dualmode import Parameter, Tensor, context, nn, ops
from dualmode._core import _random
from dualmode._core import random_reference as ref
from dualmode.common import initializer as init_mod
from dualmode.common.initializer import Initializer, initializer
from dualmode.nn.utils import no_init_parameters
from dualmode.parallel import CommReport, local_shape
from dualmode.parallel.report import parameter_bytes_per_device

from test_operator_parallel import _example, _setup

E = re.escape
KEYS = st.integers(0, 2 ** 64 - 1)


# ------------------------------------------------------------------ (a) the kernel

# Random123's tests/kat_vectors, the three "philox4x32 10" lines: counter, key, output
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr, key, want", KAT)
def test_philox4x32_known_answers(ctr, key, want):
    assert ref.philox_words(ctr, key, 32) == want
    got = _random.philox4x32_10(ctr[0] | ctr[1] << 32, ctr[2] | ctr[3] << 32,
                                key[0] | key[1] << 32)
    assert got == want


def test_philox_rounds_match_numpy_philox4x64():
    # numpy's np.random.Philox is Philox4x64-10: the same rounds and key schedule with
    # 64-bit words. It increments its counter before each block of four outputs.
    key = (0x0123456789ABCDEF, 0xFEDCBA9876543210)
    bg = np.random.Philox(key=np.array(key, np.uint64),
                          counter=np.array([41, 0, 0, 0], np.uint64))
    raw = bg.random_raw(12).tolist()
    for b in range(3):
        assert ref.philox_words((42 + b, 0, 0, 0), key, 64) == tuple(raw[4 * b:4 * b + 4])


def test_uniform_stream_matches_numpy_philox_doubles():
    # where the conventions line up: a 53-bit double from a 64-bit word, (w >> 11) 2**-53
    key = (7, 9)
    gen = np.random.Generator(np.random.Philox(key=np.array(key, np.uint64)))
    want = gen.random(8)
    words = [w for c in (1, 2) for w in ref.philox_words((c, 0, 0, 0), key, 64)]
    np.testing.assert_array_equal([(w >> 11) * 2.0 ** -53 for w in words], want)


@settings(max_examples=40, deadline=None)
@given(key=KEYS, idx=st.lists(st.integers(0, 2 ** 62), min_size=0, max_size=64),
       dtype=st.sampled_from([np.float32, np.float64]),
       dist=st.sampled_from([_random.UNIFORM, _random.NORMAL]),
       a=st.floats(-3, 3), b=st.floats(0.01, 4))
def test_fill_index_equals_reference(key, idx, dtype, dist, a, b):
    index = np.array(idx, np.int64)
    out = np.empty(len(index), dtype)
    _random.fill_index(key, index, out, dist, a, b)
    want = (ref.uniform(key, index, dtype, a, b) if dist == _random.UNIFORM
            else ref.normal(key, index, dtype, a, b))
    np.testing.assert_array_equal(out, want)


def test_uniform_in_unit_interval_and_normal_moments():
    index = np.arange(200_000, dtype=np.int64)
    for dtype in (np.float32, np.float64):
        u = np.empty(index.size, dtype)
        _random.fill_index(12345, index, u)
        assert u.min() >= 0.0 and u.max() < 1.0
        assert abs(u.mean() - 0.5) < 3e-3 and abs(u.var() - 1 / 12) < 2e-3
    z32, z64 = np.empty(index.size, np.float32), np.empty(index.size, np.float64)
    _random.fill_index(12345, index, z32, _random.NORMAL)
    _random.fill_index(12345, index, z64, _random.NORMAL)
    np.testing.assert_array_equal(z32, z64.astype(np.float32))   # one rounding of one value
    assert abs(z64.mean()) < 1e-2 and abs(z64.std() - 1) < 1e-2
    assert abs((z64 ** 4).mean() - 3) < 0.1                     # Gaussian kurtosis


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_fill_blocks_equals_fill_index(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    starts, steps, bshape = [], [], []
    for n in shape:
        s = data.draw(st.integers(-n, n - 1))
        stop = data.draw(st.integers(-n - 1, n))
        step = data.draw(st.sampled_from([1, 2, -1, -2, 3]))
        r = range(*slice(s, stop, step).indices(n))
        starts.append(r.start if len(r) else 0)
        steps.append(step)
        bshape.append(len(r))
    nb = data.draw(st.integers(1, 3))
    key = data.draw(KEYS)
    strides = init_mod._strides(shape)
    st_arr = np.array([starts] * nb, np.int64)
    out = np.empty(nb * math.prod(bshape), np.float64)
    _random.fill_blocks(key, strides, st_arr, np.array(steps, np.int64),
                        np.array(bshape, np.int64), out, _random.NORMAL, 0.0, 1.0)
    grids = np.meshgrid(*[s + np.arange(n) * t for s, n, t in zip(starts, bshape, steps)],
                        indexing="ij")
    flat = np.ravel_multi_index(tuple(grids), shape).reshape(-1) if math.prod(bshape) \
        else np.zeros(0, np.int64)
    want = np.empty(flat.size, np.float64)
    _random.fill_index(key, flat.astype(np.int64), want, _random.NORMAL, 0.0, 1.0)
    np.testing.assert_array_equal(out.reshape(nb, -1), np.broadcast_to(want, (nb, flat.size)))


def test_kernel_errors():
    with pytest.raises(ValueError, match=E("philox fill_index: index has 3 entries but out "
                                           "has 2")):
        _random.fill_index(1, np.arange(3, dtype=np.int64), np.empty(2))
    with pytest.raises(ValueError, match=E("philox: dist=5 is not valid; expected 0 "
                                           "(uniform) or 1 (normal)")):
        _random.fill_index(1, np.arange(2, dtype=np.int64), np.empty(2), 5)
    one = np.ones(2, np.int64)
    with pytest.raises(ValueError, match=E("philox fill_blocks: out has 3 values, expected 4 "
                                           "(1 blocks of 4)")):
        _random.fill_blocks(1, one, np.zeros((1, 2), np.int64), one, np.full(2, 2, np.int64),
                            np.empty(3))


# ------------------------------------------------------------------ (b) blocks of a tensor

RANDOM = ["normal", "uniform", "xavier_uniform", "he_uniform", "he_normal"]
ALL = RANDOM + ["zeros", "ones", 0.25]


@st.composite
def _shape_and_index(draw):
    shape = tuple(draw(st.lists(st.integers(2, 7), min_size=2, max_size=4)))
    index = []
    for n in shape[:draw(st.integers(0, len(shape)))]:
        a, b = sorted(draw(st.lists(st.integers(-n, n), min_size=2, max_size=2)))
        index.append(slice(a, b, draw(st.sampled_from([None, 1, 2, -1, 3]))))
    return shape, tuple(index)


@settings(max_examples=60, deadline=None)
@given(case=_shape_and_index(), name=st.sampled_from(ALL),
       dtype=st.sampled_from([np.float32, np.float64, np.float16]))
def test_block_equals_slice_of_full(case, name, dtype):
    shape, index = case
    context.set_seed(9)
    t = initializer(name, shape, dtype)
    full = t.asnumpy()
    block = t._init.block(shape, dtype, index)
    assert block.dtype == dtype
    np.testing.assert_array_equal(block, full[index])


@pytest.mark.parametrize("name", ALL)
def test_blocks_stack_equals_slices(name):
    shape, local = (8, 6, 4), (2, 3, 4)
    t = initializer(name, shape, np.float32)
    full = t.asnumpy()
    starts = np.array([[0, 0, 0], [6, 3, 0], [2, 0, 0], [6, 3, 0]])
    stack = t._init.blocks(shape, np.float32, starts, local)
    assert stack.shape == (4,) + local
    for k, s in enumerate(starts):
        np.testing.assert_array_equal(stack[k], full[tuple(slice(a, a + n)
                                                            for a, n in zip(s, local))])


@pytest.mark.parametrize("name", ALL + [2.5, init_mod.HeNormal(0.2, "fan_out", "relu")])
def test_described_initializer_makes_the_same_blocks(name):
    """describe / described (how a parameter server makes a table's rows): the rebuilt
    initializer, after a JSON round trip, makes every block of the original's tensor
    bit for bit, in a process where other keys were drawn since."""
    import json
    context.set_seed(4)
    t = initializer(name, (12, 5), np.float32)
    full = t.asnumpy()
    desc = json.loads(json.dumps(init_mod.describe(t._init)))
    initializer("normal", (3,))                          # another key drawn
    again = init_mod.described(desc)
    assert type(again) is type(t._init) and repr(again) == repr(t._init)
    starts = np.array([[7, 0], [0, 0]])
    np.testing.assert_array_equal(again.blocks((12, 5), np.float32, starts, (5, 5)),
                                  np.stack([full[7:12], full[0:5]]))


def test_describe_refuses_what_cannot_be_described():
    class Mine(init_mod.Normal):
        pass

    with pytest.raises(ValueError, match=r"Mine cannot be described to another process; "
                                         r"expected one of Normal, Uniform"):
        init_mod.describe(Mine().bind(key=1))
    with pytest.raises(ValueError, match=r"Normal is not bound to a key"):
        init_mod.describe(init_mod.Normal())
    with pytest.raises(ValueError, match=r"Constant: argument value=array\(\[1, 2\]\) cannot "
                                         r"be described"):
        init_mod.describe(init_mod.Constant(np.array([1, 2])))
    with pytest.raises(ValueError, match=r"initializer class 'Mine' is not known"):
        init_mod.described({"cls": "Mine", "args": {}, "key": 1})


@pytest.mark.parametrize("name", RANDOM)
def test_same_seed_same_values_other_seed_other_values(name):
    context.set_seed(5)
    a = initializer(name, (16, 8)).asnumpy()
    context.set_seed(5)
    b = initializer(name, (16, 8)).asnumpy()
    context.set_seed(6)
    c = initializer(name, (16, 8)).asnumpy()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_keys_follow_creation_order_not_other_draws_or_use_order():
    context.set_seed(3)
    a0, b0 = initializer("normal", (4, 4)).asnumpy(), initializer("uniform", (3,)).asnumpy()
    context.set_seed(3)
    with no_init_parameters():
        a = Parameter(initializer("normal", (4, 4)), name="a")
        context.rng().random(100)                   # other randomness in between
        b = Parameter(initializer("uniform", (3,)), name="b")
    assert a.has_init and b.has_init
    np.testing.assert_array_equal(b.asnumpy(), b0)  # made first, still b's own values
    np.testing.assert_array_equal(a.asnumpy(), a0)
    assert not np.array_equal(a0[0, :3], b0)


def test_unbound_initializer_draws_a_new_key_per_call():
    n = init_mod.Normal(sigma=1.0)
    assert not np.array_equal(n((5,), np.float64), n((5,), np.float64))
    bound = n.bind(key=99)
    np.testing.assert_array_equal(bound((5,), np.float64), bound((5,), np.float64))
    np.testing.assert_array_equal(bound((5,), np.float64), n.bind(key=99)((5,), np.float64))
    assert "_key" not in repr(bound) and repr(bound) == "Normal(sigma=1.0, mean=0.0)"


def test_initializer_values_follow_their_distributions():
    context.set_seed(11)
    v = initializer(init_mod.HeNormal(), (512, 256), np.float64).asnumpy()
    std = math.sqrt(2.0) / math.sqrt(256)
    assert abs(v.std() - std) < 0.01 * std and abs(v.mean()) < 0.01 * std
    u = initializer("uniform", (512, 256), np.float32).asnumpy()
    assert np.abs(u).max() <= 0.07 and abs(u.std() - 0.07 / math.sqrt(3)) < 5e-4


class _MakeOnly(Initializer):
    """An older user initializer: only the whole tensor (``_make``)."""

    def _make(self, shape):
        return np.arange(math.prod(shape), dtype=np.float64).reshape(shape)


def test_make_only_initializer_still_gives_tensors_and_blocks():
    t = initializer(_MakeOnly(), (4, 6))
    full = t.asnumpy()
    np.testing.assert_array_equal(full, np.arange(24).reshape(4, 6))
    np.testing.assert_array_equal(t._init.block((4, 6), np.float32, (slice(1, 3),
                                                                     slice(None, None, -2))),
                                  full[1:3, ::-2])


def test_block_errors_name_the_parameter_and_the_bad_value():
    with no_init_parameters():
        p = Parameter(initializer("normal", (4, 4)), name="w")
    with pytest.raises(ValueError, match=E("Parameter w: initializer: block 0 (start (3, 0), "
                                           "shape (2, 2), steps (1, 1)) lies outside shape "
                                           "(4, 4)")):
        p._init_blocks(np.array([[3, 0]]), (2, 2))
    with pytest.raises(ValueError, match=E("Parameter w: initializer: starts must be an int "
                                           "array (num_blocks, 2) for shape (4, 4), got "
                                           "float64 (1, 2)")):
        p._init_blocks(np.array([[0.0, 0.0]]), (2, 2))
    with pytest.raises(ValueError, match=E("Parameter w: initializer: block_shape=(2, -1) "
                                           "must be a tuple/list of ints >= 0")):
        p._init_blocks(np.zeros((1, 2), np.int64), (2, -1))
    assert p.has_init                       # nothing was made
    init = init_mod.Uniform().bind()
    with pytest.raises(TypeError, match=E("initializer: a block index must be a tuple of "
                                          "slices, got (1, 2)")):
        init.block((4, 4), np.float32, (1, 2))
    with pytest.raises(ValueError, match=E("initializer: block index (slice(None, None, "
                                           "None), slice(None, None, None), slice(None, "
                                           "None, None)) has 3 entries but the tensor has "
                                           "rank 2")):
        init.block((4, 4), np.float32, (slice(None),) * 3)
    with pytest.raises(ValueError, match=E("initializer: fan-in/fan-out need a shape of rank "
                                           ">= 2, got (5,)")):
        init_mod.XavierUniform().bind().block((5,), np.float32, (slice(0, 2),))
    with pytest.raises(ValueError, match=E("initializer: init='gaussian' is not a known "
                                           "initializer")):
        initializer("gaussian", (2, 2))
    with pytest.raises(ValueError, match=E("initializer: shape=(2, 'a') must be a tuple/list "
                                           "of ints >= 0")):
        initializer("normal", (2, "a"))


# ------------------------------------------------------------------ (c, d) the seed network

EXAMPLE = _example()


def _train_delayed(devices, layouts=False, steps=3):
    """The seed-003 network (small) built under no_init_parameters, trained `steps`."""
    _setup(devices)
    dm.set_seed(7)
    with no_init_parameters():
        net = EXAMPLE.Network(layouts, in_features=48, hidden=64)
        opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
    assert all(p.has_init for p in net.trainable_params())
    loss_fn = nn.CrossEntropyLoss()
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    losses, first = [], None
    for _ in range(steps):
        x = rng.standard_normal((16, 3, 4, 4)).astype(np.float32)
        y = rng.integers(0, 10, 16).astype(np.int32)
        if first is None:                     # the initial weights, as first made
            net(Tensor(x))
            first = [p.asnumpy() for p in net.trainable_params()]
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, first, net, opt


@pytest.mark.parametrize("layouts", [False, True], ids=["strategies", "layouts"])
def test_delayed_seed_network_trains_like_one_device(layouts):
    ref_losses, ref_first, ref_net, _ = _train_delayed(1, layouts)
    losses, first, net, opt = _train_delayed(8, layouts)
    for a, b in zip(first, ref_first):        # the same initial values, bit for bit
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for p, q in zip(net.trainable_params(), ref_net.trainable_params()):
        np.testing.assert_allclose(p.asnumpy(), q.asnumpy(), rtol=1e-4, atol=1e-6)
    assert local_shape(net.fc1_weight) == (12, 64) and local_shape(net.fc2_weight) == (8, 64)
    assert opt.moments[0].layout == net.fc1_weight.layout


def test_delayed_sharded_parameters_never_build_the_whole_tensor(monkeypatch):
    sharded = {(48, 64), (64, 64)}              # fc1 (4 row blocks), fc2 (8 row blocks)
    whole_calls, generated = [], []
    real_call, real_fill = Initializer.__call__, _random.fill_blocks

    def guarded_call(self, shape, dtype):
        whole_calls.append(tuple(shape))
        if tuple(shape) in sharded:
            raise AssertionError(f"the whole tensor {tuple(shape)} was built")
        return real_call(self, shape, dtype)

    def counting_fill(key, strides, starts, steps, bshape, out, *args):
        generated.append((tuple(int(s) for s in strides), len(starts), out.size))
        return real_fill(key, strides, starts, steps, bshape, out, *args)

    monkeypatch.setattr(Initializer, "__call__", guarded_call)
    monkeypatch.setattr(_random, "fill_blocks", counting_fill)
    losses, _, net, _ = _train_delayed(8, steps=2)
    # only fc3 (data parallel, so replicated) and its momentum state are made whole
    assert whole_calls == [(64, 10), (64, 10)]
    # one generated block per distinct slice: fc1's (4, 1) strategy on 8 devices repeats
    # each of its 4 row blocks twice, yet only 4 blocks of 12 x 64 are generated
    assert sorted(generated) == sorted([((64, 1), 4, 4 * 12 * 64), ((64, 1), 8, 8 * 8 * 64),
                                        ((10, 1), 1, 64 * 10)])
    assert sum(g[2] for g in generated) == 48 * 64 + 64 * 64 + 64 * 10
    assert np.isfinite(losses).all()


# ------------------------------------------------------------------ (e) memory per device

@pytest.mark.parametrize("k", [2, 4, 8])
def test_weight_split_k_ways_stores_one_kth_per_device(k):
    _setup(8)
    gc.collect()
    gc.disable()                 # no parameter of an earlier test disappears mid-report
    try:
        dm.set_seed(1)
        with no_init_parameters():
            w = Parameter(initializer("normal", (64, 32), dm.float32), name="w")
        full = 64 * 32 * 4
        mm = ops.MatMul().shard(((1, k), (k, 1)))       # w's rows split k ways
        x = Tensor(np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32))
        base = parameter_bytes_per_device()
        assert parameter_bytes_per_device([w]) == 0     # delayed: nothing stored yet
        with CommReport() as rep:
            out = mm(x, w)
        assert local_shape(w) == (64 // k, 32)
        assert parameter_bytes_per_device([w]) == full // k
        assert rep.parameter_memory == base + full // k
        assert rep.peak_memory >= rep.parameter_memory
        assert rep.peak_memory < base + full            # the whole weight never resident
    finally:
        gc.enable()
    dm.set_seed(1)
    want = x.asnumpy() @ initializer("normal", (64, 32), dm.float32).asnumpy()
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-5, atol=1e-6)


def test_comm_report_peak_memory_counts_parameter_storage():
    _setup(8)
    gc.collect()
    w = Parameter(Tensor(np.ones((16, 8), np.float32)), name="plain")
    base = parameter_bytes_per_device()
    assert parameter_bytes_per_device([w]) == 16 * 8 * 4            # plain: whole value
    with CommReport() as rep:
        ops.MatMul().shard(((1, 4), (4, 1)))(Tensor(np.ones((2, 16), np.float32)), w)
    assert parameter_bytes_per_device([w]) == 16 * 8 * 4 // 4        # now a quarter
    assert rep.parameter_memory == base
    assert rep.peak_memory >= base
