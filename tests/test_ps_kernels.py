"""The parameter server's fused SGD/Momentum kernel (``_ps_kernels.sgd_update``): bit-
identical to its numpy reference (``fused_update_reference``), and a server's fused
step (``fused_step``) bit-identical to the optimizer classes' own update of the mean
gradient, the way a server ran them before the kernel."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, nn
from dualmode._core import _ps_kernels
from dualmode.ps.optim import fusable, fused_step, fused_update_reference
from dualmode.tensor import Parameter


def _arrays(rng, shape, dtype, n):
    w = rng.standard_normal(shape).astype(dtype)
    grads = [rng.standard_normal(shape).astype(dtype) for _ in range(n)]
    return w, grads


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("momentum", [None, 0.9])
@pytest.mark.parametrize("shape", [(7,), (1000, 3), (2053,), (0,)])
def test_sgd_update_equals_reference(dtype, n, mean, momentum, shape):
    """Sizes around the kernel's 1024-element blocks; into a new array, into the
    first gradient (what a server does) and in place over the weight."""
    rng = np.random.default_rng(n + len(shape))
    w, grads = _arrays(rng, shape, dtype, n)
    v0 = rng.standard_normal(shape).astype(dtype) if momentum is not None else None
    want = np.empty_like(w)
    v_ref = None if v0 is None else v0.copy()
    fused_update_reference(want, w, grads, 0.037, mean, v_ref, momentum or 0.0)
    for target in ("new", "grad", "weight"):
        ws, gs = w.copy(), [g.copy() for g in grads]
        out = {"new": np.empty_like(w), "grad": gs[0], "weight": ws}[target]
        v = None if v0 is None else v0.copy()
        assert _ps_kernels.sgd_update(out, ws, gs, 0.037, mean, v, momentum or 0.0)
        np.testing.assert_array_equal(out, want)
        if v is not None:
            np.testing.assert_array_equal(v, v_ref)
        if target != "grad":
            for a, b in zip(gs, grads):
                np.testing.assert_array_equal(a, b)        # gradients only read


def test_sgd_update_refuses_arrays_it_cannot_take():
    """False, and nothing written, for arrays the kernel does not take (the caller
    runs the reference instead)."""
    w = np.ones(8, np.float32)
    g = np.ones(8, np.float32)
    ro = np.ones(8, np.float32)
    ro.flags.writeable = False
    cases = [
        (np.empty(8, np.float64), w, [g]),                 # out dtype differs
        (np.empty(8, np.float32), w, [g.astype(np.float64)]),
        (np.empty(8, np.float32), w, [np.ones(16, np.float32)[::2]]),   # not contiguous
        (np.empty(9, np.float32), w, [g]),                 # shapes differ
        (ro, w, [g]),                                      # out read-only
        (np.empty(8, np.float16), w.astype(np.float16), [g.astype(np.float16)]),
        (np.empty(8, np.float32), w, []),
    ]
    for out, ww, gs in cases:
        before = out.copy()
        assert not _ps_kernels.sgd_update(out, ww, gs, 0.1, True)
        np.testing.assert_array_equal(out, before)
    v = np.zeros(4, np.float32)
    assert not _ps_kernels.sgd_update(np.empty(8, np.float32), w, [g], 0.1, True, v, 0.9)


def _server_opt(kind, params):
    if kind == "sgd":
        return nn.SGD(params, learning_rate=[0.1, 0.05, 0.02])
    return nn.Momentum(params, learning_rate=0.05, momentum=0.9)


@pytest.mark.parametrize("kind", ["sgd", "momentum"])
@pytest.mark.parametrize("workers", [1, 3])
def test_fused_step_equals_the_optimizer(kind, workers):
    """Three steps of fused_step equal the optimizer class updating in place with the
    mean gradient (summed in worker order, then divided), bit for bit; the new weights
    go into the first worker's gradient buffer, and the old weight array is left as
    it was (ZeroMQ may still be sending it)."""
    dm.set_seed(3)
    rng = np.random.default_rng(7)
    shapes = [(33, 40), (40,)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    mine = [Parameter(Tensor._from_array(a.copy()), name=f"p{i}") for i, a in enumerate(init)]
    ref = [Parameter(Tensor._from_array(a.copy()), name=f"p{i}") for i, a in enumerate(init)]
    opt, ref_opt = _server_opt(kind, mine), _server_opt(kind, ref)
    assert fusable(opt)
    for _ in range(3):
        pushes = [[rng.standard_normal(s).astype(np.float32) for s in shapes]
                  for _ in range(workers)]
        mean = []
        for k in range(len(shapes)):
            g = pushes[0][k].copy()
            for p in pushes[1:]:
                np.add(g, p[k], out=g)
            if workers > 1:
                np.divide(g, workers, out=g)
            mean.append(Tensor._from_array(g))
        ref_opt(tuple(mean))
        old = [p._data for p in mine]
        kept = [a.copy() for a in old]
        firsts = [pushes[0][k] for k in range(len(shapes))]
        fused_step(opt, [(p, k, [push[k] for push in pushes]) for k, p in enumerate(mine)],
                   mean=True)
        for k, p in enumerate(mine):
            assert p._data is firsts[k]                    # written into the first push
            np.testing.assert_array_equal(old[k], kept[k])  # the old weight untouched
            np.testing.assert_array_equal(p._data, ref[k]._data)
    assert opt.global_step == ref_opt.global_step == 3


def test_fusable_names_what_runs_fused():
    """Plain SGD and Momentum without Nesterov, loss scale 1 and no weight decay run
    fused; every other optimizer runs in place through its own update."""
    p = [Parameter(Tensor._from_array(np.zeros(3, np.float32)), name="w")]
    assert fusable(nn.SGD(p, learning_rate=0.1))
    assert fusable(nn.Momentum(p, learning_rate=0.1, momentum=0.9))
    assert not fusable(nn.SGD(p, learning_rate=0.1, momentum=0.9))
    assert not fusable(nn.Momentum(p, learning_rate=0.1, momentum=0.9, use_nesterov=True))
    assert not fusable(nn.SGD(p, learning_rate=0.1, weight_decay=0.01))
    assert not fusable(nn.SGD(p, learning_rate=0.1, loss_scale=8.0))
    assert not fusable(nn.Adam(p, learning_rate=0.1))
