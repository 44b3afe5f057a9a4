"""The ops a transformer is written with, sharded, in every mode, against the
stand-alone run: GeLU, FastGeLU, Erf, Rsqrt, Sqrt, Cast, LayerNorm, Softmax and
LogSoftmax on any axis (that axis split too), Select, StridedSlice, Tile, ExpandDims,
Squeeze, Argmax, Concat, Split, BatchMatMul and Dropout (its mask is the stand-alone
mask for the same seed, whatever the strategy); then an attention block written with
BatchMatMul + Softmax + a causal mask (Select, or an added -1e9) under Megatron
strategies (heads over mp, batch over dp), forward and every gradient, in PyNative
mode and GRAPH_MODE.

Modes: the primitive's strategy in PyNative mode ("eager"), ``ops.shard`` of the
function ("ops.shard"), ``Cell.shard`` of the cell ("cell.shard"), and the cell with
its primitive's strategy compiled in GRAPH_MODE ("graph"). Each runs on 8 simulated
devices and compares the loss ``sum(out * w)`` and the inputs' gradients with the
stand-alone run of the same program.
"""
import math

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel import CommReport

from _devices import devices

RTOL = 1e-5          # one op
GRAD_RTOL = 1e-4     # gradients through a few ops
MODES = ("eager", "ops.shard", "cell.shard", "graph")


def _f32(shape, lo=-2.0, hi=2.0, seed=0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


class _Program(nn.Cell):
    """``out = body(prims, *xs)``; returns ``reduce_sum(out * w)``."""

    def __init__(self, body, make, strategy, w):
        super().__init__()
        self.prims = make()
        if strategy is not None:
            self.prims[0].shard(strategy)
        self.body, self.w = body, Tensor(w)

    def construct(self, *xs):
        out = self.body(self.prims, *xs)
        if out.dtype != dm.float32:
            out = ops.cast(out, dm.float32)
        return ops.reduce_sum(out * self.w)


def _run(mode, body, make, strategy, fn_strategy, inputs, pos, seed):
    """(loss, input gradients) of the program in `mode` (seeded alike in every mode)."""
    args = [Tensor(x) for x in inputs]
    with devices(None):
        dm.set_seed(seed)
        out = body(make(), *args)
    w = np.random.default_rng(99).standard_normal(out.shape).astype(np.float32)
    if mode == "single":
        with devices(None):
            dm.set_seed(seed)
            return dm.value_and_grad(_Program(body, make, None, w), pos)(*args)
    with devices(8, full_batch=True):
        dm.set_seed(seed)
        if mode == "eager":
            return dm.value_and_grad(_Program(body, make, strategy, w), pos)(*args)
        if mode == "ops.shard":
            net = _Program(body, make, None, w)
            f = ops.shard(lambda *a: net(*a), in_strategy=fn_strategy)
            return dm.value_and_grad(f, pos)(*args)
        if mode == "cell.shard":
            net = _Program(body, make, None, w)
            net.shard(in_strategy=fn_strategy)
            return dm.value_and_grad(net, pos)(*args)
        dm.set_context(mode=dm.GRAPH_MODE)
        return dm.value_and_grad(_Program(body, make, strategy, w), pos)(*args)


def check_modes(body, make, strategy, inputs, pos=0, fn_strategy=None, modes=MODES, seed=3):
    """Every mode's loss and input gradients equal the stand-alone run's. `strategy` is
    the first primitive's; `fn_strategy` (default: `strategy`) the function's inputs'
    for ops.shard and Cell.shard."""
    fn_strategy = strategy if fn_strategy is None else fn_strategy
    ref_loss, ref_g = _run("single", body, make, None, None, inputs, pos, seed)
    ref_g = ref_g if isinstance(ref_g, tuple) else (ref_g,)
    for mode in modes:
        loss, g = _run(mode, body, make, strategy, fn_strategy, inputs, pos, seed)
        g = g if isinstance(g, tuple) else (g,)
        np.testing.assert_allclose(loss.asnumpy(), ref_loss.asnumpy(), rtol=RTOL, atol=1e-5,
                                   err_msg=f"loss, {mode}")
        assert len(g) == len(ref_g)
        for k, (a, b) in enumerate(zip(g, ref_g)):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=GRAD_RTOL, atol=1e-5,
                                       err_msg=f"gradient {k}, {mode}")


X = _f32((8, 16, 4), seed=1)
X_POS = _f32((8, 16, 4), 0.3, 2.0, seed=2)
STRATS3 = [((2, 4, 1),), ((1, 2, 4),), ((8, 1, 1),), ((2, 2, 2),)]


# ---------------------------------------------------------------------------
# elementwise: GeLU, FastGeLU, Erf, Rsqrt, Sqrt, Cast
# ---------------------------------------------------------------------------
UNARY = {"GeLU": (ops.GeLU, X), "FastGeLU": (ops.FastGeLU, X), "Erf": (ops.Erf, X),
         "Rsqrt": (ops.Rsqrt, X_POS), "Sqrt": (ops.Sqrt, X_POS)}


@pytest.mark.parametrize("strategy", STRATS3[:2], ids=str)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_sharded_every_mode(name, strategy):
    cls, x = UNARY[name]
    check_modes(lambda p, x: p[0](x), lambda: [cls()], strategy, [x])


@pytest.mark.parametrize("dtype", [dm.float64, dm.float16], ids=str)
@pytest.mark.parametrize("strategy", STRATS3[:2], ids=str)
def test_cast_sharded_every_mode(strategy, dtype):
    """Cast there and back (float16 rounds alike on every layout)."""
    check_modes(lambda p, x: ops.cast(p[0](x, dtype), dm.float32) * 1.5,
                lambda: [ops.Cast()], strategy, [X])


# ---------------------------------------------------------------------------
# Softmax / LogSoftmax on any axis, the axis split too; LayerNorm
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("axis,strategy", [(1, ((1, 8, 1),)), (0, ((8, 1, 1),)),
                                           (1, ((2, 4, 1),)), (-1, ((2, 1, 4),)),
                                           (0, ((2, 2, 2),)), (-2, ((1, 2, 4),))], ids=str)
@pytest.mark.parametrize("cls", [ops.Softmax, ops.LogSoftmax], ids=lambda c: c.name)
def test_softmax_on_any_axis_split_every_mode(cls, axis, strategy):
    check_modes(lambda p, x: p[0](x), lambda: [cls(axis)], strategy, [X])


def test_softmax_of_a_pending_sum_over_a_split_axis_every_mode():
    """A MatMul whose contracted dim is split leaves a pending sum; the Softmax over
    the axis split by its strategy resolves it first."""
    a, w = _f32((16, 8), seed=4), _f32((8, 12), seed=5)
    for axis in (0, 1):
        check_modes(lambda p, a, w: p[1](p[0](a, w)),
                    lambda: [ops.MatMul(), ops.Softmax(axis).shard(((2, 4),))],
                    ((2, 4), (4, 1)), [a, w], pos=(0, 1))


@pytest.mark.parametrize("strategy", [((8, 1, 1), (1,), (1,)), ((2, 4, 1), (1,), (1,))],
                         ids=str)
def test_layer_norm_rows_split_every_mode(strategy):
    g, b = _f32((4,), 0.5, 1.5, seed=6), _f32((4,), seed=7)

    def body(p, x, g, b):
        return p[0](x, g, b)[0]
    check_modes(body, lambda: [ops.LayerNorm(-1, -1, 1e-5)], strategy, [X, g, b],
                pos=(0, 1, 2))


def test_layer_norm_split_of_the_normalised_dim_is_refused():
    with devices(8):
        with pytest.raises(ValueError, match=r"LayerNorm"):
            ops.LayerNorm().shard(((2, 4), (4,), (4,)))(
                Tensor(_f32((8, 16))), Tensor(np.ones(16, np.float32)),
                Tensor(np.zeros(16, np.float32)))


# ---------------------------------------------------------------------------
# shapes and indexing: Select, StridedSlice, Tile, ExpandDims, Squeeze, Argmax,
# Concat, Split
# ---------------------------------------------------------------------------
def test_select_causal_mask_every_mode():
    mask = np.tril(np.ones((16, 16), bool))[None]
    fill = np.full((1, 16, 16), -1e9, np.float32)
    x = _f32((4, 16, 16), seed=8)

    def body(p, x):
        return ops.softmax(p[0](Tensor(mask), x, Tensor(fill)), -1)
    # the mask's dims 1 and 2 are x's: split alike; its dim 0 broadcasts
    st = ((1, 2, 1), (4, 2, 1), (1, 2, 1))
    check_modes(body, lambda: [ops.Select()], st, [x], fn_strategy=((4, 2, 1),))


@pytest.mark.parametrize("strategy", [((2, 4, 1),), ((1, 8, 1),)], ids=str)
def test_strided_slice_every_mode(strategy):
    check_modes(lambda p, x: p[0](x, (0, 0, 1), (8, 16, 4), (1, 1, 2)),
                lambda: [ops.StridedSlice()], strategy, [X])
    check_modes(lambda p, x: p[0](x, (2, 0, 0), (8, 16, 3), (2, 1, 1)),
                lambda: [ops.StridedSlice()], strategy, [X])


@pytest.mark.parametrize("strategy", [((2, 4, 1),), ((1, 2, 2),)], ids=str)
def test_tile_every_mode(strategy):
    # (the strategy covers the output's dims: an entry splits a tiled dim's multiple)
    check_modes(lambda p, x: p[0](x, (1, 4, 2)), lambda: [ops.Tile()], strategy, [X])


@pytest.mark.parametrize("strategy", [((2, 4, 1),), ((8, 1, 1),)], ids=str)
def test_expand_dims_and_squeeze_every_mode(strategy):
    check_modes(lambda p, x: ops.squeeze(p[0](x, 1), 1) * x, lambda: [ops.ExpandDims()],
                strategy, [X])
    y = _f32((8, 1, 16, 4), seed=9)
    check_modes(lambda p, y: p[0](y), lambda: [ops.Squeeze(1)], ((2, 1, 4, 1),), [y])


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("strategy", STRATS3[:3], ids=str)
def test_argmax_every_mode(axis, strategy):
    """The index (split axis too) weights the input, so a wrong index changes the loss."""
    def body(p, x):
        return x * ops.cast(ops.expand_dims(p[0](x), axis), dm.float32)
    check_modes(body, lambda: [ops.Argmax(axis)], strategy, [X])


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("strategy", STRATS3[:3], ids=str)
def test_split_and_concat_every_mode(axis, strategy):
    def split_body(p, x):
        return ops.concat([a * float(i + 1) for i, a in enumerate(p[0](x))], axis)
    check_modes(split_body, lambda: [ops.Split(axis, 2)], strategy, [X])
    check_modes(lambda p, x: p[0]((x, x * x)), lambda: [ops.Concat(axis)],
                (strategy[0], strategy[0]), [X], modes=("eager", "graph"))


K = _f32((4, 8, 16, 8), -1.0, 1.0, seed=10)
Q = _f32((4, 8, 16, 8), -1.0, 1.0, seed=11)


@pytest.mark.parametrize("transpose_b,strategy", [
    (True, ((2, 4, 1, 1), (2, 4, 1, 1))), (True, ((2, 2, 2, 1), (2, 2, 1, 1))),
    (True, ((1, 2, 1, 4), (1, 2, 1, 4))), (False, ((2, 4, 1, 1), (2, 4, 1, 1))),
    (False, ((1, 2, 1, 4), (1, 2, 4, 1))), (False, ((2, 1, 1, 2), (2, 1, 2, 2)))], ids=str)
def test_batch_matmul_every_mode(transpose_b, strategy):
    k = K if transpose_b else np.ascontiguousarray(K.transpose(0, 1, 3, 2))
    check_modes(lambda p, q, k: p[0](q, k), lambda: [ops.BatchMatMul(transpose_b=transpose_b)],
                strategy, [Q, k], pos=(0, 1))


# ---------------------------------------------------------------------------
# Dropout: the stand-alone mask for the same seed, whatever the strategy
# ---------------------------------------------------------------------------
DROPOUT_STRATS = [((8, 1, 1),), ((2, 4, 1),), ((2, 2, 2),), ((2, 1, 1),), ((1, 1, 2),),
                  ((1, 4, 1),)]


@pytest.mark.parametrize("strategy", DROPOUT_STRATS, ids=str)
def test_dropout_equals_stand_alone_for_the_same_seed_every_mode(strategy):
    """Output and mask both in the loss (so the mask itself is compared); a second
    Dropout on another strategy after the first, and the first called twice, so the
    random stream continues alike."""
    def body(p, x):
        a, m = p[0](x)
        b, _ = p[1](a * 2.0 + m)
        return b + p[0](b)[1]
    check_modes(body, lambda: [ops.Dropout(0.6), ops.Dropout(0.8).shard(((1, 8, 1),))],
                strategy, [X])


@pytest.mark.parametrize("strategy", DROPOUT_STRATS, ids=str)
def test_dropout_mask_is_the_stand_alone_mask(strategy):
    """The mask itself, element by element, equals the stand-alone draw, and it is a
    real draw (some kept, some dropped; kept values scaled by 1 / keep_prob)."""
    with devices(None):
        dm.set_seed(11)
        ref_out, ref_mask = (t.asnumpy() for t in ops.Dropout(0.6)(Tensor(X)))
    assert 0.45 < ref_mask.mean() < 0.75
    np.testing.assert_allclose(ref_out, X * ref_mask / 0.6, rtol=RTOL)
    with devices(8):
        dm.set_seed(11)
        out, mask = ops.Dropout(0.6).shard(strategy)(Tensor(X))
        assert out.layout is not None and out.layout.tensor_map == mask.layout.tensor_map
        np.testing.assert_array_equal(mask.asnumpy(), ref_mask)
        np.testing.assert_array_equal(out.asnumpy(), ref_out)


def test_nn_dropout_cell_every_mode():
    check_modes(lambda p, x: p[0](x), lambda: [nn.Dropout(p=0.3)], None, [X],
                fn_strategy=((2, 4, 1),), modes=("ops.shard", "cell.shard", "graph"))


# ---------------------------------------------------------------------------
# an attention block, Megatron strategies
# ---------------------------------------------------------------------------
B, S, H, HEADS = 4, 8, 16, 4
HD = H // HEADS


class Attention(nn.Cell):
    """Causal self-attention on (B, S, H): Q, K, V column-parallel (heads over mp), the
    output projection row-parallel, batch over dp. `mask` "select" sets masked scores to
    -1e9 with Select; "add" adds -1e9 * (1 - mask)."""

    def __init__(self, dp, mp, mask="select"):
        super().__init__()
        rng = np.random.default_rng(12)
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self, name, Parameter(Tensor(rng.normal(0, 0.3, (H, H)).astype(np.float32)),
                                          name=name))
        self.bq = Parameter(Tensor(rng.normal(0, 0.1, (H,)).astype(np.float32)), name="bq")
        self.mask_kind = mask
        col, row = ((dp, 1), (1, mp)), ((dp, mp), (mp, 1))
        self.mm_q, self.mm_k, self.mm_v = (ops.MatMul().shard(col) for _ in range(3))
        self.add_bq = ops.Add().shard(((dp, mp), (mp,)))
        self.mm_o = ops.MatMul().shard(row)
        heads = ((dp, 1, mp, 1),)
        self.tq, self.tk, self.tv = (ops.Transpose().shard(heads) for _ in range(3))
        self.t_back = ops.Transpose().shard(((dp, mp, 1, 1),))
        self.scores = ops.BatchMatMul(transpose_b=True).shard(((dp, mp, 1, 1),
                                                              (dp, mp, 1, 1)))
        self.scale = ops.Mul().shard(((dp, mp, 1, 1), ()))
        self.select = ops.Select().shard(((1, 1, 1, 1), (dp, mp, 1, 1), (1, 1, 1, 1)))
        self.add_mask = ops.Add().shard(((dp, mp, 1, 1), (1, 1, 1, 1)))
        self.softmax = ops.Softmax(-1).shard(((dp, mp, 1, 1),))
        self.context = ops.BatchMatMul().shard(((dp, mp, 1, 1), (dp, mp, 1, 1)))
        tril = np.tril(np.ones((S, S), bool))[None, None]
        self.mask = Tensor(tril)
        self.fill = Tensor(np.full((1, 1, S, S), -1e9, np.float32))
        self.bias = Tensor(np.where(tril, 0.0, -1e9).astype(np.float32))

    def _heads(self, x, t):
        return t(ops.reshape(x, (B, S, HEADS, HD)), (0, 2, 1, 3))

    def construct(self, x):
        x2 = ops.reshape(x, (B * S, H))
        q = self._heads(self.add_bq(self.mm_q(x2, self.wq), self.bq), self.tq)
        k = self._heads(self.mm_k(x2, self.wk), self.tk)
        v = self._heads(self.mm_v(x2, self.wv), self.tv)
        s = self.scale(self.scores(q, k), 1.0 / math.sqrt(HD))
        if self.mask_kind == "select":
            s = self.select(self.mask, s, self.fill)
        else:
            s = self.add_mask(s, self.bias)
        ctx = self.t_back(self.context(self.softmax(s), v), (0, 2, 1, 3))
        out = self.mm_o(ops.reshape(ctx, (B * S, H)), self.wo)
        return ops.reshape(out, (B, S, H))


def np_attention(x, net, mask_kind):
    """The same block in numpy (float64)."""
    p = {n: getattr(net, n).asnumpy().astype(np.float64) for n in ("wq", "wk", "wv", "wo",
                                                                    "bq")}
    x = x.astype(np.float64).reshape(B * S, H)

    def heads(t):
        return t.reshape(B, S, HEADS, HD).transpose(0, 2, 1, 3)
    q, k, v = heads(x @ p["wq"] + p["bq"]), heads(x @ p["wk"]), heads(x @ p["wv"])
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(HD)
    tril = np.tril(np.ones((S, S), bool))
    s = np.where(tril, s, -1e9) if mask_kind == "select" else s + np.where(tril, 0, -1e9)
    e = np.exp(s - s.max(-1, keepdims=True))
    a = e / e.sum(-1, keepdims=True)
    ctx = (a @ v).transpose(0, 2, 1, 3).reshape(B * S, H)
    return (ctx @ p["wo"]).reshape(B, S, H)


def _attention_run(n, dp, mp, mask_kind, graph):
    """(output, loss, input gradient, {parameter: gradient}) on n devices (None:
    stand-alone)."""
    x = _f32((B, S, H), seed=13)
    w = np.random.default_rng(14).standard_normal((B, S, H)).astype(np.float32)
    with devices(n, full_batch=True):
        if graph:
            dm.set_context(mode=dm.GRAPH_MODE)
        net = Attention(dp, mp, mask_kind)
        params = net.trainable_params()

        def loss_fn(x):
            out = net(x)
            return ops.reduce_sum(out * Tensor(w)), out
        (loss, out), (gx, gw) = dm.value_and_grad(loss_fn, 0, params, has_aux=True)(Tensor(x))
        return (out.asnumpy(), loss.asnumpy(), gx.asnumpy(),
                {p.name: g.asnumpy() for p, g in zip(params, gw)}, net, x)


@pytest.mark.parametrize("graph", [False, True], ids=["pynative", "graph"])
@pytest.mark.parametrize("mask_kind", ["select", "add"])
@pytest.mark.parametrize("dp,mp", [(2, 4), (4, 2), (1, 4), (2, 2)])
def test_attention_block_megatron_equals_stand_alone(dp, mp, mask_kind, graph):
    out0, loss0, gx0, gw0, net0, x = _attention_run(None, dp, mp, mask_kind, False)
    # the stand-alone block itself against numpy
    np.testing.assert_allclose(out0, np_attention(x, net0, mask_kind), rtol=1e-4, atol=1e-5)
    out, loss, gx, gw, _, _ = _attention_run(8, dp, mp, mask_kind, graph)
    np.testing.assert_allclose(out, out0, rtol=RTOL, atol=1e-6)
    np.testing.assert_allclose(loss, loss0, rtol=RTOL)
    np.testing.assert_allclose(gx, gx0, rtol=GRAD_RTOL, atol=1e-5)
    assert gw.keys() == gw0.keys() == {"wq", "wk", "wv", "wo", "bq"}
    for name in gw0:
        np.testing.assert_allclose(gw[name], gw0[name], rtol=GRAD_RTOL, atol=1e-5,
                                   err_msg=name)


def test_attention_block_forward_communicates_one_all_reduce():
    """Megatron's property: with heads over mp, the forward block needs only the row-
    parallel projection's sum over mp, one AllReduce of the output (B*S*H/dp floats),
    made where the next op (here a ReLU) reads it; the weights stay split (each device
    stores H*H/mp of each)."""
    x = Tensor(_f32((B, S, H), seed=13))
    with devices(8, full_batch=True):
        net = Attention(2, 4)
        net(x)                                     # first call stores the weights split
        with CommReport() as rep:
            out = net(x)
            assert out.layout.partial
            out = ops.relu(out)
        assert [r.kind for r in rep.records] == ["AllReduce"], rep.records
        assert rep.records[0].op == "MatMul" and rep.records[0].resolved_by == "ReLU"
        assert rep.bytes() == B * S * H // 2 * 4 * 2 * 3 / 4     # ring: 2 (p-1)/p n
        for name in ("wq", "wk", "wv", "wo"):
            assert dm.parallel.local_shape(getattr(net, name)) in ((H, H // 4), (H // 4, H))


@pytest.mark.parametrize("dp,mp", [(2, 4), (4, 2)])
def test_graph_mode_communicates_what_pynative_does(dp, mp):
    """A compiled block places each strategy's inputs where the op's one device matrix
    puts them (as PyNative does): a column-parallel MatMul ((dp, 1), (1, mp)) reading a
    whole input and its stored weight moves nothing, and the attention block's forward
    makes the same single AllReduce in GRAPH_MODE as in PyNative mode."""
    class Column(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(_f32((H, H), seed=15)), name="w")
            self.mm = ops.MatMul().shard(((dp, 1), (1, mp)))

        def construct(self, x):
            return self.mm(x, self.w)

    x2 = _f32((B * S, H), seed=16)
    x3 = Tensor(_f32((B, S, H), seed=13))
    kinds = {}
    for graph in (False, True):
        with devices(8, full_batch=True):
            if graph:
                dm.set_context(mode=dm.GRAPH_MODE)
            col, att = Column(), Attention(dp, mp)
            col(Tensor(x2))
            att(x3)                                     # compiled, weights stored
            with CommReport() as rep:
                y = col(Tensor(x2))
            assert rep.records == [], rep.records
            np.testing.assert_allclose(y.asnumpy(), x2 @ col.w.asnumpy(), rtol=RTOL,
                                       atol=1e-5)
            with CommReport() as rep:
                ops.relu(att(x3)).asnumpy()
            kinds[graph] = [(r.kind, r.op) for r in rep.records]
    assert kinds[True] == kinds[False] == [("AllReduce", "MatMul")], kinds


def test_transformer_ops_under_mpi_equal_stand_alone(tmp_path):
    """On 4 real MPI ranks (tests/mpi_scripts/transformer_ops.py): Dropout sharded
    three ways gives the stand-alone mask and output for the same seed, Softmax over a
    split axis, and the attention block (dp=2 x mp=2) in PyNative mode and GRAPH_MODE
    gives the stand-alone output, loss and every gradient."""
    from _mpi import run_mpi_script
    proc = run_mpi_script("transformer_ops.py", [], tmp_path, ranks=4, timeout=180)
    assert "transformer ops ok: 24 checks" in proc.stdout, proc.stdout
