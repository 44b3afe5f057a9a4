"""The graph executor runs the lowered IR: communication is in the graph, the eager
sharded dispatcher is never reached, and a block's backward is derived once."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode._core import _tensor as _core
from dualmode.parallel import CommReport, compile_count
from dualmode.parallel.auto_parallel import AutoParallel
from dualmode.parallel.graph.ir import MOVE, REDUCE, flatten_refs
from dualmode.parallel import set_layerwise_slices
from dualmode.parallel.inputs import distribute_inputs

from _devices import devices
from _steps import mean_square_step

RNG = np.random.default_rng(7)
X = RNG.standard_normal((8, 16)).astype(np.float32)
W = RNG.standard_normal((16, 8)).astype(np.float32)


class _Refuse:
    """Makes the eager sharded dispatcher raise while active."""

    def __enter__(self):
        self.saved = _core.get_dist_hooks()
        dist_apply, assemble = self.saved

        def refuse(op, attrs, inputs, rec):
            raise AssertionError(f"the eager sharded dispatcher ran {op.name}")

        _core.set_dist_hooks(refuse, assemble)
        return self

    def __exit__(self, *exc):
        _core.set_dist_hooks(*self.saved)


def _block(w):
    return ops.shard(lambda x: ops.tanh(ops.matmul(x, w)), in_strategy=((2, 4),))


def _expected():
    t = np.tanh(X @ W)
    return t, (1 - t * t) @ W.T, X.T @ (1 - t * t)


def test_forward_runs_without_the_eager_dispatcher():
    with devices(8, "auto_parallel"):
        w = Parameter(Tensor(W.copy()), name="w")
        f = _block(w)
        f(Tensor(X))                                     # compiles (and stores w sharded)
        with _Refuse():
            out = f(Tensor(X))
        np.testing.assert_allclose(out.asnumpy(), _expected()[0], rtol=1e-5, atol=1e-6)


def test_a_differentiated_block_is_one_op_whose_backward_was_derived_at_compile():
    with devices(8, "auto_parallel"):
        w = Parameter(Tensor(W.copy()), name="w")
        f = _block(w)
        grad_fn = dm.grad(lambda x: ops.reduce_sum(f(x)), 0, [w])
        grad_fn(Tensor(X))
        compiles = compile_count()
        bw = f.compiled.block.program.graph
        assert sum(n.op_name == "MatMul" for n in bw.nodes if n.backward) == 2
        with _Refuse():
            out = f(Tensor(X))                      # no tape: the forward program only
        gx, (gw,) = grad_fn(Tensor(X))
        assert compile_count() == compiles          # nothing traced again
        _, ref_gx, ref_gw = _expected()
        np.testing.assert_allclose(out.asnumpy(), _expected()[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gx.asnumpy(), ref_gx, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(gw.asnumpy(), ref_gw, rtol=1e-4, atol=1e-5)


def test_the_lowered_graph_holds_every_collective_the_call_makes():
    with devices(8, "auto_parallel"):
        w = Parameter(Tensor(W.copy()), name="w")
        f = _block(w)
        f(Tensor(X))
        g = f.compiled.program.graph
        comm = [n for n in g.nodes if n.op == REDUCE or n.op == MOVE and (
            n.attrs["plan"] is not None and any(s.communicates for s in n.attrs["plan"])
            or n.attrs["kind"] in ("resolve", "gather"))]
        assert comm, g
        with CommReport() as rep:
            f(Tensor(X))
        assert rep.count() == sum(len([s for s in n.attrs["plan"] if s.communicates])
                                  if n.op == MOVE and n.attrs["plan"] is not None else 1
                                  for n in comm)
        assert "color=red" in f.dump()


class _Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(W.copy()), name="w")
        self.b = Parameter(Tensor(np.zeros(8, np.float32)), name="b")
        self.matmul = ops.MatMul()

    def construct(self, x):
        return ops.tanh(self.matmul(x, self.w) + self.b)


def test_a_compiled_train_step_matches_stand_alone_and_skips_the_dispatcher():
    def run(n):
        with devices(n):
            net = _Net()
            if n:
                net.matmul.shard(((2, 4), (4, 1)))
            opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
            step = mean_square_step(net, opt)
            step = AutoParallel(step, parallel_mode="semi_auto") if n else step
            losses = [float(step(Tensor(X)).asnumpy())]
            if n:
                with _Refuse():
                    out = step(Tensor(X))
            else:
                out = step(Tensor(X))
            losses.append(float(out.asnumpy()))
            return losses, net.w.asnumpy(), net.b.asnumpy()
    ref, got = run(None), run(8)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(got[1:], ref[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_per_device_values_in_a_compiled_graph_are_refused_by_name():
    with devices(4):
        w = Parameter(Tensor(np.zeros((16, 2), np.float32)), name="w", layerwise_parallel=True)
        set_layerwise_slices(w, W[:, :8], dim=1)
        f = ops.shard(lambda x: ops.matmul(x, w), in_strategy=((1, 1),))
        with pytest.raises(ValueError, match=r"parameter w holds per-device values"):
            f(Tensor(X))


def test_strategies_give_each_op_its_predicted_communication_time():
    with devices(8, "auto_parallel"):
        w = Parameter(Tensor(W.copy()), name="w")
        f = _block(w)
        f(Tensor(X))
        plain = f.strategies()
        timed = f.strategies(link="10GbE")
        assert all("time" not in v for v in plain.values())
        times = dm.parallel.compiled_comm_times(f, link="10GbE")
        assert times and all(timed[name]["time"] == t["time"] for name, t in times.items())
        assert sum(v["time"] for v in timed.values()) == pytest.approx(
            sum(t["time"] for t in times.values()))
        with pytest.raises(ValueError, match=r"link"):
            f.strategies(link="carrier pigeon")


class _StopGrad(nn.Cell):
    def construct(self, x):
        return ops.reduce_sum(ops.square(x)) + ops.reduce_sum(ops.stop_gradient(ops.square(x)))


@pytest.mark.parametrize("mode", ["GRAPH_MODE", "PYNATIVE_MODE"])
def test_stop_gradient_keeps_the_value_and_cuts_the_gradient(mode):
    # traced, stop_gradient once read its input's value, which an abstract value does not
    # have: the branch became a constant zero
    with devices(8):
        dm.set_context(mode=getattr(dm, mode))
        net = _StopGrad()
        loss, gx = dm.value_and_grad(net, 0)(Tensor(X))
    np.testing.assert_allclose(loss.asnumpy(), 2 * np.sum(X * X), rtol=1e-5)
    np.testing.assert_allclose(gx.asnumpy(), 2 * X, rtol=1e-5)


def test_values_are_dropped_after_their_last_reader_with_the_same_results():
    """Run with liveness release (the default) and keeping every value: bit-identical
    losses and weights; afterwards the environment holds only the graph's outputs and
    the arguments / parameters no node reads, and a forward block's environment still
    has what its backward nodes read."""
    def train(keep):
        with devices(8):
            net = _Net()
            net.matmul.shard(((2, 4), (4, 1)))
            opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
            step = mean_square_step(net, opt)
            step = AutoParallel(step, parallel_mode="semi_auto")
            step(Tensor(X))
            prog = step.compiled.program
            losses, envs = [], []
            for _ in range(3):
                env = prog.run(prog.bind(distribute_inputs((Tensor(X),))), keep=keep)
                losses.append(np.asarray(prog.outputs(env).asnumpy()))
                envs.append(env)
            return losses, net.w.asnumpy(), net.b.asnumpy(), envs[-1], prog
    kept, released = train(True), train(False)
    for a, b in zip(released[:3], kept[:3]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    env, prog = released[3], released[4]
    g = prog.graph
    read = {x.id for n in g.nodes for x in n.inputs if hasattr(x, "id")}
    outputs = {x.id for x in flatten_refs(g.outputs) if hasattr(x, "id")}
    unread = {v.id for v in g.args} | {v.id for _, v in g.params}
    assert set(env) == outputs | (unread - read)
    assert len(kept[3]) > 3 * len(env)                  # everything, when kept

    with devices(8, "auto_parallel"):                   # a block: forward, then backward
        w = Parameter(Tensor(W.copy()), name="w")
        f = _block(w)
        x = Tensor(X)
        grad = dm.grad(lambda x: ops.reduce_sum(f(x)), None, [w])
        got = grad(x)
        np.testing.assert_allclose(got[0].asnumpy(), _expected()[2], rtol=1e-5, atol=1e-5)
