"""The data-parallel dispatch in C (dualmode/_core/_dp.pyx).

Oracles: numpy on the global values (each op's single-device result), the general
Python path of the parallel layer (dtensor._dist_apply, which works the route out
afresh) for the layouts and storage forms, and ``np.broadcast_to`` for
``broadcast_view``."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import dualmode as dm
from dualmode import Tensor, communication, ops
from dualmode._core._dp import broadcast_view
from dualmode.communication.totals import DeferredShares, known_totals, stored
from dualmode.parallel import dtensor
from dualmode.parallel.inputs import distribute_inputs

N = 8


@pytest.fixture
def dp():
    dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=N,
                                 gradients_mean=True)
    communication.init()
    yield
    dm.reset_auto_parallel_context()
    communication.init()


def _rng(seed=0):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------
# broadcast_view against np.broadcast_to
# ---------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=5),
       ones=st.lists(st.booleans(), min_size=5, max_size=5),
       dtype=st.sampled_from([np.float32, np.float64, np.int32, np.bool_]),
       writeable=st.booleans())
def test_broadcast_view_is_np_broadcast_to(shape, ones, dtype, writeable):
    src_shape = tuple(1 if one else d for d, one in zip(shape, ones))
    a = np.array(_rng().standard_normal(src_shape) * 10, dtype=dtype)
    a.flags.writeable = writeable
    got, want = broadcast_view(a, tuple(shape)), np.broadcast_to(a, tuple(shape))
    assert got.shape == want.shape and got.dtype == want.dtype
    # the same memory walk (a stride along a dim of size 1 is never used)
    assert [s for s, d in zip(got.strides, shape) if d > 1] == \
        [s for s, d in zip(want.strides, shape) if d > 1]
    np.testing.assert_array_equal(got, want)
    assert not got.flags.writeable
    assert np.shares_memory(got, a) or a.size == 0


def test_broadcast_view_of_a_non_contiguous_array_and_a_list_shape():
    a = np.arange(12.0).reshape(3, 4)[:, ::2]            # not C-contiguous
    np.testing.assert_array_equal(broadcast_view(a[None], [5, 3, 2]),
                                  np.broadcast_to(a[None], (5, 3, 2)))


def test_broadcast_view_of_shapes_that_do_not_broadcast_raises_as_numpy():
    with pytest.raises(ValueError, match="broadcast"):
        broadcast_view(np.zeros((3, 4)), (3, 5))
    with pytest.raises(ValueError, match="more dimensions"):
        broadcast_view(np.zeros((3, 4)), (4,))


# ---------------------------------------------------------------------------
# a signature seen before runs its route: same numbers and layouts as the general path
# ---------------------------------------------------------------------------
def _calls():
    rng = _rng(1)
    x = rng.standard_normal((64, 12)).astype(np.float32)
    g = rng.standard_normal((64, 5)).astype(np.float32)
    w = rng.standard_normal((12, 5)).astype(np.float32)
    b = rng.standard_normal((5,)).astype(np.float32)
    big = rng.standard_normal((64, 300)).astype(np.float32)     # x^T big: 14 KiB
    mm_t = ops.MatMul(transpose_a=True)
    return [
        ("matmul x @ w", lambda X, G, B: ops.matmul(X, Tensor(w)), x @ w),
        ("matmul x^T g (pending sum)", lambda X, G, B: mm_t(X, G), x.T @ g),
        ("matmul x^T big (pending sum)", lambda X, G, B: mm_t(X, B), x.T @ big),
        ("bias_add", lambda X, G, B: ops.bias_add(G, Tensor(b)), g + b),
        ("relu", lambda X, G, B: ops.relu(X), np.maximum(x, 0)),
        ("reduce_sum over the batch", lambda X, G, B: ops.ReduceSum()(G, 0),
         g.sum(axis=0)),
        ("mean over the batch", lambda X, G, B: ops.ReduceMean()(X, 0), x.mean(axis=0)),
        ("scalar mul", lambda X, G, B: X * 3.0, x * 3.0),
    ], (x, g, big)


@pytest.mark.parametrize("case", range(8))
def test_route_hit_equals_the_general_path_and_numpy(dp, monkeypatch, case):
    calls, arrays = _calls()
    name, fn, want = calls[case]
    X, G, B = distribute_inputs(tuple(Tensor(a) for a in arrays))
    dtensor._DP_ROUTES.clear()
    first = fn(X, G, B)                        # the general path works the route out
    assert dtensor._DP_ROUTES, name

    def no_decision(*a, **k):
        raise AssertionError("a signature seen before must not be decided again")

    monkeypatch.setattr(dtensor, "decide", no_decision)
    second = fn(X, G, B)                       # the route, in C
    assert second._layout == first._layout, name
    assert type(stored(second)) is type(stored(first)), name
    for out in (first, second):
        np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_pending_sum_outputs_are_equal_shares_or_deferred_by_size(dp, monkeypatch):
    rng = _rng(2)
    x = rng.standard_normal((64, 40)).astype(np.float32)
    X, = distribute_inputs((Tensor(x),))
    mm_t = ops.MatMul(transpose_a=True)
    for _ in range(2):                           # the general path, then the route
        small = mm_t(X, X)                       # 40 x 40 floats: 6.4 KiB, written
        assert not isinstance(stored(small), DeferredShares)
        assert stored(small).strides[0] == 0
        total = known_totals(stored(small), (N,), (0,))
        np.testing.assert_allclose(total[0], x.T @ x, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(dtensor.dist_apply, "defer_bytes", 1024)
    deferred = mm_t(X, X)                        # now over the threshold: not written
    assert isinstance(stored(deferred), DeferredShares)
    np.testing.assert_allclose(deferred.asnumpy(), x.T @ x, rtol=1e-5, atol=1e-5)


def test_defer_bytes_is_an_int(dp):
    with pytest.raises(TypeError):
        dtensor.dist_apply.defer_bytes = "big"
