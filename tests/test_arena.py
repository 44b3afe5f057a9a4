"""Graph mode's buffer pool (dualmode/_core/_arena.pyx, dualmode/parallel/buffers.py):
the pool's decisions against its pure-Python model, numpy arrays made by it, and a
compiled train step run with it against the same step without it and stand-alone."""
import ctypes
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy._core.multiarray import get_handler_name

from dualmode import Parameter, Tensor, nn, ops
from dualmode._core import _arena
from dualmode._core.arena_reference import PoolReference
from dualmode.parallel import buffers
from dualmode.parallel.auto_parallel import AutoParallel

from _devices import devices
from _steps import mean_square_step

KIB = 1024
POOL_NAME = "dualmode_buffer_pool"


# ---------------------------------------------------------------------------------------
# the pool's policy against the reference, raw blocks
# ---------------------------------------------------------------------------------------
SIZES = [1, 100, 5000, 16 * KIB - 1, 16 * KIB, 16 * KIB + 1, 20000, 40000, 64 * KIB,
         100000, 300000]
OPS = st.one_of(
    st.tuples(st.just("malloc"), st.sampled_from(SIZES)),
    st.tuples(st.just("calloc"), st.sampled_from(SIZES)),
    st.tuples(st.just("free"), st.integers(0, 1 << 16)),
    st.tuples(st.just("realloc"), st.integers(0, 1 << 16), st.sampled_from(SIZES)),
    st.tuples(st.just("cap"), st.sampled_from([0, 50000, 200000, 1 << 20])),
    st.tuples(st.just("empty"),))


def _fill(address, n, byte):
    ctypes.memset(address, byte, n)


def _bytes(address, n):
    return ctypes.string_at(address, n)


@settings(max_examples=150, deadline=None)
@given(ops_=st.lists(OPS, max_size=60), cap=st.sampled_from([0, 50000, 200000, 1 << 20]))
def test_pool_decisions_and_stats_equal_the_reference(ops_, cap):
    """Random malloc / calloc / free / realloc / cap / empty_cache sequences: after every
    operation the pool's stats equal the model's; a hit hands out the very block the
    model names; calloc'ed bytes are zero (also in a reused block) and a block's
    contents survive realloc."""
    pool = _arena.Pool(min_block=16 * KIB, max_cached_bytes=cap, page=4096)
    ref = PoolReference(min_block=16 * KIB, max_cached_bytes=cap, page=4096)
    live = []               # [address, reference block, size, fill byte]
    address_of = {}         # reference block -> the pool's address
    try:
        for k, op in enumerate(ops_):
            byte = k % 251 + 1
            if op[0] in ("malloc", "calloc"):
                size = op[1]
                a = pool.malloc(size) if op[0] == "malloc" else pool.calloc(size, 1)
                b = ref.malloc(size)
                assert a != 0
                if b is not None:
                    assert address_of.setdefault(b, a) == a
                    assert pool.block_size(a) == ref.size_class(size)
                if op[0] == "calloc":
                    assert _bytes(a, size) == bytes(size)
                _fill(a, size, byte)
                live.append([a, b, size, byte])
            elif op[0] == "free" and live:
                a, b, _, _ = live.pop(op[1] % len(live))
                pool.free(a)
                ref.free(b)
            elif op[0] == "realloc" and live:
                entry = live[op[1] % len(live)]
                a, b, size, byte = entry
                new = op[2]
                a2, b2 = pool.realloc(a, new), ref.realloc(b, new)
                if b2 is not None:
                    assert address_of.setdefault(b2, a2) == a2
                if b2 is not None and b2 == b:
                    assert a2 == a
                keep = min(size, new)
                assert _bytes(a2, keep) == bytes([byte]) * keep
                entry[:] = [a2, b2, new, byte]
                _fill(a2, new, byte)
            elif op[0] == "cap":
                pool.max_cached_bytes = op[1]
                ref.set_max_cached_bytes(op[1])
            elif op[0] == "empty":
                pool.empty_cache()
                ref.empty_cache()
            assert pool.stats() == ref.stats(), (k, op)
            assert pool.stats()["cached_bytes"] <= pool.max_cached_bytes
    finally:
        for a, *_ in live:
            pool.free(a)
    assert pool.stats()["active_blocks"] == 0


def test_hand_computed_sequence():
    """One sequence worked by hand: 64 KiB classes, a 200 KiB cap."""
    pool = _arena.Pool(min_block=64 * KIB, max_cached_bytes=200 * KIB, page=4096)
    a = pool.malloc(100 * KIB)                 # miss, class 100 KiB
    b = pool.malloc(100 * KIB - 5)             # miss, same class (rounded up to pages)
    c = pool.malloc(1000)                      # small: not counted
    pool.free(a)
    pool.free(b)                               # 200 KiB cached: at the cap
    pool.free(c)
    assert pool.stats()["cached_bytes"] == 200 * KIB
    d = pool.malloc(100 * KIB)                 # hit: the most recently freed, b
    assert d == b
    e = pool.malloc(64 * KIB)                  # miss
    pool.free(e)                               # 164 KiB cached
    pool.free(d)                               # 264 > 200: a (the oldest) is evicted
    s = pool.stats()
    assert (s["hits"], s["misses"], s["evictions"]) == (1, 3, 1)
    assert (s["cached_bytes"], s["cached_blocks"], s["active_blocks"]) == (164 * KIB, 2, 0)
    big = pool.malloc(300 * KIB)               # larger than the cap: never cached
    pool.free(big)
    assert pool.stats()["oversize"] == 1 and pool.stats()["cached_bytes"] == 164 * KIB
    pool.empty_cache()
    assert pool.stats()["cached_bytes"] == 0 and pool.stats()["evictions"] == 1


def test_blocks_are_aligned_for_simd():
    pool = _arena.Pool()
    blocks = [pool.malloc(n) for n in (1, 17, 1000, 70000, 1 << 20)]
    try:
        assert all(a % 16 == 0 for a in blocks)
        assert all(a % 64 == 0 for a, n in zip(blocks, (1, 17, 1000, 70000, 1 << 20))
                   if n >= pool.min_block)
    finally:
        for a in blocks:
            pool.free(a)


@pytest.mark.parametrize("kwargs, match", [
    (dict(page=3000), r"page must be a power of two, got 3000"),
    (dict(min_block=0), r"min_block must be an int >= 1, got 0"),
    (dict(max_cached_bytes=-1), r"max_cached_bytes must be an int >= 0, got -1"),
    (dict(max_cached_bytes=1.5), r"max_cached_bytes must be an int >= 0, got 1.5"),
])
def test_bad_pool_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _arena.Pool(**kwargs)


def test_bad_switch_values_are_named():
    with pytest.raises(TypeError, match=r"enabled must be a bool, got 'yes'"):
        buffers.set_buffer_pool(enabled="yes")
    with pytest.raises(ValueError, match=r"max_cached_bytes must be an int >= 0, got -5"):
        buffers.set_buffer_pool(max_cached_bytes=-5)
    assert buffers.get_buffer_pool()["enabled"] is True


# ---------------------------------------------------------------------------------------
# numpy arrays made by the pool
# ---------------------------------------------------------------------------------------
def test_numpy_arrays_made_by_the_pool_are_correct():
    pool = _arena.Pool()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 200))
    with pool.installed():
        assert _arena.current_handler() is pool.handler
        y = x * 2 + 1                                   # 480 KB: a pool block
        s = np.ones(3)                                  # small
    assert get_handler_name(y) == POOL_NAME and get_handler_name(s) == POOL_NAME
    assert get_handler_name(np.ones(3)) != POOL_NAME    # the handler was restored
    np.testing.assert_array_equal(y, x * 2 + 1)
    np.testing.assert_array_equal(s, np.ones(3))
    y[...] = 7.0                                        # garbage for the next owner
    del y
    before = pool.stats()
    with pool.installed():
        z = np.zeros((300, 200))                        # calloc: the same class, reused
    assert pool.stats()["hits"] == before["hits"] + 1
    assert not z.any()


def test_realloc_keeps_the_data_of_resized_arrays():
    pool = _arena.Pool()
    with pool.installed():
        a = np.arange(100000, dtype=np.float64)         # 800 KB
        a.resize(250000, refcheck=False)                # ndarray.resize: realloc
        b = np.arange(1000, dtype=np.float32)           # small, grown into a pool block
        b.resize(100000, refcheck=False)
        c = np.arange(50000, dtype=np.float64)
        c.resize(100, refcheck=False)                   # shrunk to a small block
        d = np.resize(np.arange(10.0), (30000,))        # np.resize: repeats the data
    np.testing.assert_array_equal(a[:100000], np.arange(100000))
    assert not a[100000:].any()                         # numpy zero-fills the new part
    np.testing.assert_array_equal(b[:1000], np.arange(1000))
    np.testing.assert_array_equal(c, np.arange(100))
    np.testing.assert_array_equal(d, np.tile(np.arange(10.0), 3000))
    del a, b, c, d
    assert pool.stats()["active_blocks"] == 0


def test_the_cap_bounds_the_cached_memory_of_numpy_arrays():
    pool = _arena.Pool(max_cached_bytes=1 << 20)
    rng = np.random.default_rng(1)
    with pool.installed():
        for _ in range(200):
            arrays = [np.empty(int(n)) for n in rng.integers(8192, 100000, 6)]
            del arrays
            assert pool.stats()["cached_bytes"] <= 1 << 20
    s = pool.stats()
    assert s["peak_cached_bytes"] <= 1 << 20 and s["evictions"] > 0 and s["hits"] > 0
    pool.max_cached_bytes = 100 * KIB                   # lowering the cap evicts at once
    assert pool.stats()["cached_bytes"] <= 100 * KIB


def test_calling_installs_the_pool_for_each_call_and_enabled_switches_it():
    pool = _arena.Pool()
    make = pool.calling(lambda n: np.ones(n))
    outer = _arena.current_handler()
    assert get_handler_name(make(100000)) == POOL_NAME
    assert _arena.current_handler() is outer                # restored after the call
    with pytest.raises(ValueError):
        pool.calling(lambda: np.ones(-1))()                  # restored after an error
    assert _arena.current_handler() is outer
    pool.enabled = False
    assert get_handler_name(make(100000)) == "default_allocator"
    with pool.installed():
        assert get_handler_name(np.ones(100000)) == "default_allocator"
    pool.enabled = True
    with pool.installed():
        with pytest.raises(RuntimeError, match=r"already entered"):
            with pool.installed() as inner:
                inner.__enter__()


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_empty_cache_gives_the_memory_back():
    pool = _arena.Pool()
    with pool.installed():
        a = np.ones(1 << 23)                            # 64 MiB, touched
    del a
    assert pool.stats()["cached_bytes"] >= 64 << 20
    rss = _rss_bytes()
    pool.empty_cache()
    assert pool.stats()["cached_bytes"] == 0 and pool.stats()["cached_blocks"] == 0
    assert rss - _rss_bytes() >= 32 << 20


def test_threads_allocate_and_free_through_one_pool():
    """Each thread installs the pool in its own context; arrays made by one thread are
    freed by another; the counts add up."""
    pool = _arena.Pool(max_cached_bytes=4 << 20)
    made, errors = [], []

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            with pool.installed():
                for _ in range(200):
                    a = np.full(int(rng.integers(8192, 40000)), float(seed))
                    assert (a == seed).all()
                    made.append(a)              # freed by whichever thread pops it
                    if len(made) > 8:
                        made.pop(0)
        except Exception as e:                  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not errors
    made.clear()
    s = pool.stats()
    assert s["active_blocks"] == 0 and s["active_bytes"] == 0
    assert s["hits"] + s["misses"] == 800 and s["cached_bytes"] <= 4 << 20


def test_arrays_outliving_the_pool_and_the_context_are_freed_at_exit():
    """In a fresh interpreter: arrays made by a pool outlive the ``with`` block, the Pool
    object, and some live until interpreter exit; all are freed through the pool that
    made them without a crash."""
    script = textwrap.dedent("""
        import gc
        import numpy as np
        from dualmode._core import _arena
        from dualmode.parallel import buffers
        pool = _arena.Pool()
        with pool.installed():
            kept = [np.full(50000, float(k)) for k in range(5)] + [np.ones(10)]
        del pool
        gc.collect()
        with buffers.pooled():
            LATE = np.arange(200000.0)
        assert all((a == k).all() for k, a in enumerate(kept[:5]))
        kept[0].resize(80000, refcheck=False)
        del kept[1:3]
        print("ok", float(LATE.sum()))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", str(float(np.arange(200000.0).sum()))]


# ---------------------------------------------------------------------------------------
# graph mode
# ---------------------------------------------------------------------------------------
B, D, H = 128, 256, 256          # stacks and weights of 64 KiB and more: pool blocks
RNG = np.random.default_rng(17)
X = RNG.standard_normal((B, D)).astype(np.float32)
W1 = (RNG.standard_normal((D, H)) / np.sqrt(D)).astype(np.float32)
W2 = (RNG.standard_normal((H, D)) / np.sqrt(H)).astype(np.float32)


class _Mlp(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w1 = Parameter(Tensor(W1.copy()), name="w1")
        self.w2 = Parameter(Tensor(W2.copy()), name="w2")
        self.mm1 = ops.MatMul()
        self.mm2 = ops.MatMul()
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.mm2(self.relu(self.mm1(x, self.w1)), self.w2)


def _train(n, pool=True, steps=3, between=None, graph=True):
    """Losses and weights after `steps` steps of the MLP stand-alone (n None) or sharded
    on n devices, compiled (`graph`) or eager, with the pool on or off; `between(k)`
    runs after step k."""
    buffers.set_buffer_pool(enabled=pool)
    try:
        with devices(n):
            net = _Mlp()
            if n:
                net.mm1.shard(((2, 4), (4, 1)))
                net.relu.shard(((8, 1),))
                net.mm2.shard(((1, 8), (8, 1)))
            opt = nn.SGD(net.trainable_params(), learning_rate=0.05)
            step = mean_square_step(net, opt)
            step = AutoParallel(step, parallel_mode="semi_auto") if n and graph else step
            losses = []
            for k in range(steps):
                losses.append(step(Tensor(X)).asnumpy())
                if between is not None:
                    between(k, losses[-1])
            return np.array(losses), net.w1.asnumpy(), net.w2.asnumpy()
    finally:
        buffers.set_buffer_pool(enabled=True)


def test_compiled_steps_with_the_pool_equal_without_it_and_stand_alone():
    on, off, alone = _train(8, True), _train(8, False), _train(None)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(on[0], alone[0], rtol=1e-5)
    for a, b in zip(on[1:], alone[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(on[1], W1)                 # the steps did train


def test_eager_sharded_steps_with_the_pool_equal_without_it_and_stand_alone():
    """The eager sharded ops run in the pool too (dtensor's dist hook; the data-parallel
    ones of the step do not, see below)."""
    seen = []
    on = _train(8, True, graph=False,
                between=lambda k, loss: seen.append(buffers.buffer_pool_stats()))
    off, alone = _train(8, False, graph=False), _train(None)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(on[0], alone[0], rtol=1e-5)
    for a, b in zip(on[1:], alone[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert seen[2]["hits"] - seen[1]["hits"] >= 5


def test_remembered_data_parallel_routes_take_numpy_memory_and_train_as_one_device():
    """A data-parallel op makes the arrays a single-device op makes, so once its route is
    remembered it takes them from numpy's allocator (warm blocks shared with the rest
    of the program), not the pool; the steps still equal single-device training."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((256, 96)).astype(np.float32)      # activations: 96 KiB
    w = (rng.standard_normal((96, 96)) * 0.1).astype(np.float32)

    def train(n):
        seen = []
        with devices(n, parallel_mode="data_parallel", gradients_mean=True):
            net = nn.Dense(96, 96, weight_init=Tensor(w), has_bias=False)
            step = mean_square_step(net, nn.SGD(net.trainable_params(), learning_rate=0.1))
            losses = []
            for _ in range(4):
                losses.append(step(Tensor(x)).asnumpy())
                seen.append(buffers.buffer_pool_stats())
            return np.array(losses), net.weight.asnumpy(), seen

    dp_losses, dp_w, seen = train(8)
    losses, w1, _ = train(None)
    np.testing.assert_allclose(dp_losses, losses, rtol=1e-5)
    np.testing.assert_allclose(dp_w, w1, rtol=1e-5, atol=1e-6)
    for before, after in zip(seen[1:], seen[2:]):
        assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


def test_a_steps_large_buffers_are_the_blocks_the_step_before_freed():
    """From the second step on, a compiled step makes no new large block: every request
    of 64 KiB or more is a hit."""
    seen = []
    _train(8, True, steps=4, between=lambda k, loss: seen.append(buffers.buffer_pool_stats()))
    for before, after in zip(seen, seen[1:]):
        assert after["misses"] == before["misses"]
        assert after["hits"] - before["hits"] >= 10


def test_pool_off_steps_do_not_touch_the_pool():
    seen = []
    _train(8, False, steps=2, between=lambda k, loss: seen.append(buffers.buffer_pool_stats()))
    assert (seen[1]["hits"], seen[1]["misses"]) == (seen[0]["hits"], seen[0]["misses"])


def test_graph_mode_memory_is_bounded_by_the_cap_and_empty_cache_releases():
    cap = buffers.get_buffer_pool()["max_cached_bytes"]
    caps = []
    try:
        buffers.empty_cache()
        buffers.set_buffer_pool(max_cached_bytes=256 * KIB)
        _train(8, True, steps=2,
               between=lambda k, loss: caps.append(buffers.buffer_pool_stats()))
        assert all(0 < s["cached_bytes"] <= 256 * KIB for s in caps)
    finally:
        buffers.set_buffer_pool(max_cached_bytes=cap)
    _train(8, True, steps=2)
    assert buffers.buffer_pool_stats()["cached_bytes"] > 256 * KIB
    buffers.empty_cache()
    s = buffers.buffer_pool_stats()
    assert s["cached_bytes"] == 0 and s["cached_blocks"] == 0
