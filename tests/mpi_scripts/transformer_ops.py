"""Run under ``mpiexec -n 4``: the transformer ops on backend "mpi" (each rank one
device) equal the stand-alone run of the same process: Dropout sharded three ways gives
the stand-alone output and mask for the same seed; Softmax over a split axis; the
attention block of tests/test_transformer_parallel.py (heads over mp=2, batch over
dp=2, causal mask by Select) in PyNative mode and GRAPH_MODE, its output, loss and
every gradient. A mismatch raises (non-zero exit). Rank 0 prints "transformer ops ok:
<count> checks"."""
import os
import sys

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication, ops

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_transformer_parallel import B, H, S, Attention  # noqa: E402

N = 4
CHECKS = [0]


def _close(what, got, want, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol,
                               err_msg=f"rank {communication.get_rank()}: {what}")
    CHECKS[0] += 1


def _context(parallel, graph=False):
    dm.set_context(mode=dm.GRAPH_MODE if graph else dm.PYNATIVE_MODE)
    dm.reset_auto_parallel_context()
    if parallel:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=N,
                                     full_batch=True)
    communication.init()


def _attention(parallel, graph, x, w):
    _context(parallel, graph)
    net = Attention(2, 2)
    params = net.trainable_params()

    def loss_fn(x):
        out = net(x)
        return ops.reduce_sum(out * Tensor(w)), out
    (loss, out), (gx, gw) = dm.value_and_grad(loss_fn, 0, params, has_aux=True)(Tensor(x))
    return out.asnumpy(), loss.asnumpy(), gx.asnumpy(), [g.asnumpy() for g in gw]


def main():
    communication.init()
    b = communication.get_backend()
    assert b.name == "mpi" and b.world_size == N, b
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, (8, 16, 4)).astype(np.float32)

    for strategy in (((4, 1, 1),), ((2, 2, 1),), ((1, 2, 2),)):
        _context(False)
        dm.set_seed(7)
        ref_out, ref_mask = (t.asnumpy() for t in ops.Dropout(0.6)(Tensor(x)))
        _context(True)
        dm.set_seed(7)
        out, mask = ops.Dropout(0.6).shard(strategy)(Tensor(x))
        _close(f"Dropout {strategy} mask", mask.asnumpy(), ref_mask, 0, 0)
        _close(f"Dropout {strategy} output", out.asnumpy(), ref_out, 0, 0)
        assert 0.45 < ref_mask.mean() < 0.75

    for axis, strategy in ((1, ((1, 4, 1),)), (0, ((2, 2, 1),))):
        _context(False)
        ref = ops.Softmax(axis)(Tensor(x)).asnumpy()
        _context(True)
        _close(f"Softmax axis {axis} {strategy}",
               ops.Softmax(axis).shard(strategy)(Tensor(x)).asnumpy(), ref)

    xa = rng.uniform(-2, 2, (B, S, H)).astype(np.float32)
    wa = rng.standard_normal((B, S, H)).astype(np.float32)
    ref = _attention(False, False, xa, wa)
    for graph in (False, True):
        got = _attention(True, graph, xa, wa)
        mode = "GRAPH_MODE" if graph else "PyNative"
        _close(f"attention output, {mode}", got[0], ref[0])
        _close(f"attention loss, {mode}", got[1], ref[1])
        _close(f"attention input gradient, {mode}", got[2], ref[2], 1e-4, 1e-5)
        for k, (g, r) in enumerate(zip(got[3], ref[3])):
            _close(f"attention weight gradient {k}, {mode}", g, r, 1e-4, 1e-5)
    _context(False)
    if communication.get_rank() == 0:
        print(f"transformer ops ok: {CHECKS[0]} checks", flush=True)


if __name__ == "__main__":
    main()
