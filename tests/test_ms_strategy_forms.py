"""Strategy forms and context keys MindSpore scripts use, checked against the single
device (numpy) in every mode:

- a 2-d MatMul whose inputs split the contracted dim differently, as MindSpore accepts
  it: the same strategy ``(p, q)`` for both inputs over all devices. Each input's
  contracted dim is gathered (reported as the op's "redistribution"), the product needs
  no pending sum and the output is split ``(p, q)``; other unequal splits stay refused;
- ``"None"`` merged with other aliases in one Layout dim (it adds no split);
- the context keys ``strategy_ckpt_config``, ``group_ckpt_save_file`` and
  ``enable_alltoall``.
"""
import json

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.ops import operations as P
from dualmode.parallel import CommReport, Layout, TensorLayout
from dualmode.parallel.strategy_checks import StrategyError
from dualmode.train.strategy_file import layout_from_dict

RNG = np.random.default_rng(2929)


def _normal(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _semi(device_num=8, **kw):
    dm.set_auto_parallel_context(device_num=device_num, global_rank=0,
                                 parallel_mode="semi_auto_parallel",
                                 dataset_strategy="full_batch", **kw)


@pytest.fixture(params=["pynative", "graph"])
def mode(request):
    if request.param == "graph":
        dm.set_context(mode=dm.GRAPH_MODE)
    return request.param


class _MatMulNet(nn.Cell):
    def __init__(self, w, strategy, transpose_b=False):
        super().__init__()
        self.mm = P.MatMul(transpose_b=transpose_b).shard(strategy)
        self.w = Parameter(Tensor(w), "w")

    def construct(self, x):
        return self.mm(x, self.w)


def _grads(net, x, sens):
    """d(sum(net(x) * sens)) / d(x, w)."""
    def loss(x):
        return (net(x) * Tensor(sens)).sum()
    gx, (gw,) = dm.grad(loss, grad_position=0, weights=net.trainable_params())(Tensor(x))
    return gx.asnumpy(), gw.asnumpy()


# ------------------------------------------------------------- MatMul, gathered form

# (strategy, devices, AllGathers of the forward: one per input whose contracted dim is
# split over a device axis the other input does not split it on)
GATHERED = [(((4, 2), (4, 2)), 8, 2), (((2, 4), (2, 4)), 8, 2), (((8, 1), (8, 1)), 8, 1),
            (((1, 8), (1, 8)), 8, 1), (((2, 2), (2, 2)), 4, 2), (((8, 4), (8, 4)), 32, 2)]


@pytest.mark.parametrize("strategy,devices,gathers", GATHERED)
def test_matmul_gathered_form_matches_single_device(mode, strategy, devices, gathers):
    _semi(devices)
    x, w, sens = _normal(16, 32), _normal(32, 16), _normal(16, 16)
    net = _MatMulNet(w, strategy)
    with CommReport() as comm:
        y = net(Tensor(x))
    np.testing.assert_allclose(y.asnumpy(), x @ w, rtol=1e-5, atol=1e-5)
    # MindSpore's layout of the product: split (p, q) over the devices, no pending sum
    p, q = strategy[0]
    assert y.layout.dim_parts == (p, q) and not y.layout.partial
    assert comm.count("AllReduce") == 0
    assert comm.count("AllGather", reason="redistribution", op="MatMul") == gathers
    assert comm.count() == gathers
    gx, gw = _grads(net, x, sens)
    np.testing.assert_allclose(gx, sens @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, x.T @ sens, rtol=1e-5, atol=1e-5)


def test_matmul_gathered_form_in_ops_shard_and_cell_shard():
    """The form inside a function given to ops.shard and a Cell.shard, as MindSpore's
    two-MatMul test writes it (both products (p, q) = (4, 2))."""
    _semi(8)
    x, y, b = _normal(16, 8), _normal(8, 16), _normal(16, 16)
    mm1 = P.MatMul().shard(((4, 2), (4, 2)))
    mm2 = P.MatMul().shard(((4, 2), (4, 2)))
    f = ops.shard(lambda x, y, b: mm2(mm1(x, y), b), in_strategy=((4, 2), (4, 2), (4, 2)))
    with CommReport() as comm:
        out = f(Tensor(x), Tensor(y), Tensor(b))
    np.testing.assert_allclose(out.asnumpy(), x @ y @ b, rtol=1e-5, atol=1e-5)
    assert comm.count("AllReduce") == 0
    assert comm.count("AllGather", reason="redistribution", op="MatMul") >= 2

    net = _MatMulNet(_normal(8, 16), ((4, 2), (4, 2)))
    net.shard(in_strategy=((4, 2),))
    np.testing.assert_allclose(net(Tensor(x)).asnumpy(), x @ net.w.asnumpy(), rtol=1e-5,
                               atol=1e-5)


def test_matmul_gathered_form_two_matmuls_train_like_single_device(mode):
    """MindSpore's test_two_matmul_both_a_b_strategy shape (8 devices): gradients of
    both inputs and a weight through two gathered products."""
    _semi(8)
    x, w1, b = _normal(16, 8), _normal(8, 16), _normal(16, 16)

    class Two(nn.Cell):
        def __init__(self):
            super().__init__()
            self.mm1 = P.MatMul().shard(((4, 2), (4, 2)))
            self.mm2 = P.MatMul().shard(((4, 2), (4, 2)))
            self.w = Parameter(Tensor(w1), "w1")

        def construct(self, x, b):
            return self.mm2(self.mm1(x, self.w), b)

    net = Two()
    report = dm.parallel.check_equivalence(net, Tensor(x), Tensor(b), device_num=8)
    assert report.ok, str(report)
    out = net(Tensor(x), Tensor(b)).asnumpy()
    np.testing.assert_allclose(out, x @ w1 @ b, rtol=1e-4, atol=1e-4)


REFUSED = [
    # (id, primitive, inputs, devices, message)
    ("devices-not-all", lambda: P.MatMul().shard(((4, 2), (4, 2))), ((16, 8), (8, 16)), 16,
     r"MatMul: in_strategy\[0\]\[1\]=2 and in_strategy\[1\]\[0\]=4 split the contracted dim "
     r"differently; they must be equal .*valid: the same number of parts in both, e\.g\. "
     r"both 2 \(a divisor of 8\), or the same strategy \(p, q\) for both inputs with "
     r"p \* q = device_num \(16\)"),
    ("strategies-differ", lambda: P.MatMul().shard(((4, 2), (4, 1))), ((16, 8), (8, 16)), 8,
     r"MatMul: in_strategy\[0\]\[1\]=2 and in_strategy\[1\]\[0\]=4 split the contracted dim "
     r"differently; .*or the same strategy \(p, q\) for both inputs with p \* q = "
     r"device_num \(8\)"),
    ("transpose_b", lambda: P.MatMul(transpose_b=True).shard(((4, 2), (8, 1))),
     ((16, 8), (16, 8)), 8,
     r"MatMul: in_strategy\[0\]\[1\]=2 and in_strategy\[1\]\[1\]=1 split the contracted dim "
     r"differently; they must be equal .*e\.g\. both 2 \(a divisor of 8\)\)$"),
    ("batch-matmul-3d", lambda: P.BatchMatMul().shard(((1, 4, 2), (1, 4, 2))),
     ((2, 16, 8), (2, 8, 16)), 8,
     r"BatchMatMul: in_strategy\[0\]\[2\]=2 and in_strategy\[1\]\[1\]=4 split the contracted "
     r"dim differently; they must be equal .*e\.g\. both 2 \(a divisor of 8\)\)$"),
    ("layouts", lambda: P.MatMul().shard((Layout((4, 2), ("dp", "mp"))("dp", "mp"),
                                          Layout((4, 2), ("dp", "mp"))("dp", "mp"))),
     ((16, 8), (8, 16)), 8,
     r"MatMul: in_strategy\[0\]\[1\]='mp' and in_strategy\[1\]\[0\]='dp' split the "
     r"contracted dim differently; they must be equal .*valid: the same device axes in both"),
]


@pytest.mark.parametrize("case,make,shapes,devices,msg", REFUSED,
                         ids=[c[0] for c in REFUSED])
def test_matmul_unequal_contracted_splits_refused(mode, case, make, shapes, devices, msg):
    """MindSpore refuses every other unequal split of the contracted dim (another device
    count, unequal strategies, transposes, batched products, layouts): so does dualmode,
    before anything moves."""
    _semi(devices)
    prim = make()
    xs = [Tensor(_normal(*s)) for s in shapes]
    f = prim if mode == "pynative" else ops.shard(lambda a, b: prim(a, b),
                                                  in_strategy=((1, 1), (1, 1)) if
                                                  len(shapes[0]) == 2 else
                                                  ((1, 1, 1), (1, 1, 1)))
    with pytest.raises(StrategyError, match=msg):
        f(*xs)
    assert all(x.layout is None for x in xs)


# --------------------------------------------------------- 'None' merged in a Layout dim

L3 = Layout((2, 2, 2), ("dp", "sp", "mp"))


@pytest.mark.parametrize("merged,plain", [
    (("dp", ("sp", "None")), ("dp", "sp")),
    ((("None", "sp"), "mp"), ("sp", "mp")),
    ((("dp", "None", "mp"), "None"), (("dp", "mp"), "None")),
    ((("None",), "mp"), ("None", "mp")),
    ((("None", "None"), ("sp", "None")), ("None", "sp")),
])
def test_layout_none_in_tuple_adds_no_split(merged, plain):
    """MindSpore maps 'None' inside a tuple to -1 (no device axis): the merged dim is
    split by the other aliases alone, in device_slices, tensor_map and to_dict."""
    a, b = L3(*merged), L3(*plain)
    assert a == b
    assert a.tensor_map == b.tensor_map
    assert a.to_dict() == b.to_dict()
    shape = (8, 8)
    assert a.device_slices(shape) == b.device_slices(shape)
    assert a.bind(shape) == b.bind(shape)
    full = np.arange(64, dtype=np.float32).reshape(shape)
    lay = a.bind(shape)
    np.testing.assert_array_equal(lay.assemble(lay.local_blocks(full)), full)


def test_layout_none_in_tuple_slices_by_hand():
    lay = L3("dp", ("sp", "None")).bind((4, 4))
    slices = lay.device_slices()
    # rank r = (dp, sp, mp) row-major: rows by dp, columns by sp, mp repeats
    assert slices[0] == (slice(0, 2), slice(0, 2))
    assert slices[1] == (slice(0, 2), slice(0, 2))
    assert slices[2] == (slice(0, 2), slice(2, 4))
    assert slices[5] == (slice(2, 4), slice(0, 2))


def test_layout_none_in_tuple_still_checks_the_other_aliases():
    with pytest.raises(ValueError, match=r"unknown alias 'xx' for dim 1"):
        L3("dp", ("None", "xx"))
    with pytest.raises(ValueError, match=r"alias 'dp' is used twice"):
        L3("dp", ("dp", "None"))
    with pytest.raises(ValueError, match=r"dim 0 maps to an empty tuple"):
        L3((), "None")


def test_strategy_file_tensor_map_minus_one_in_a_list():
    """MindSpore writes ("sp", "None") as [1, -1]: a strategy file entry with -1 in a
    list reads as the dim split by the other axes."""
    d = {"device_matrix": [2, 2, 2], "tensor_map": [2, [1, -1]], "shape": [8, 8]}
    assert layout_from_dict(d) == L3("dp", ("sp", "None")).bind((8, 8))
    with pytest.raises(ValueError, match=r"tensor_map entry \[1, -2\] is not valid"):
        layout_from_dict({"device_matrix": [2, 2, 2], "tensor_map": [2, [1, -2]],
                          "shape": [8, 8]})


def test_layout_none_in_tuple_matmul_matches_single_device(mode):
    """A layout strategy with 'None' merged in the contracted dim, forward and
    gradients (MindSpore's test_layout_extend reduce-axis case)."""
    _semi(8)
    x, w, sens = _normal(16, 16), _normal(16, 16), _normal(16, 16)
    strategy = (L3("dp", ("sp", "None")), L3(("sp", "None"), "mp"))
    net = _MatMulNet(w, strategy)
    y = net(Tensor(x))
    np.testing.assert_allclose(y.asnumpy(), x @ w, rtol=1e-5, atol=1e-5)
    gx, gw = _grads(net, x, sens)
    np.testing.assert_allclose(gx, sens @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, x.T @ sens, rtol=1e-5, atol=1e-5)
    if mode == "pynative":
        assert net.w.layout.dim_parts == (2, 2)


# ------------------------------------------------------------------ context keys

class _TwoWeights(nn.Cell):
    """A trainable and a frozen weight, both stored sharded by their strategies."""

    def __init__(self):
        super().__init__()
        self.mm1 = P.MatMul().shard(((2, 1), (1, 4)))
        self.mm2 = P.MatMul().shard(((2, 4), (4, 1)))
        self.w = Parameter(Tensor(_normal(8, 16)), "w")
        self.frozen = Parameter(Tensor(_normal(16, 8)), "frozen", requires_grad=False)

    def construct(self, x):
        return self.mm2(self.mm1(x, self.w), self.frozen)


def _saved(path):
    with open(path) as f:
        return json.load(f)["parameters"]


def test_strategy_ckpt_config_save_file_is_strategy_ckpt_save_file(tmp_path):
    """Both forms write the same file; only_trainable_params (default True, as in
    MindSpore) leaves the frozen weight out, False keeps it."""
    x = Tensor(_normal(4, 8))
    files = {}
    for form in ("old", "config", "config_all"):
        path = str(tmp_path / form / "strategy.json")
        if form == "old":
            _semi(8, strategy_ckpt_save_file=path)
        elif form == "config":
            _semi(8, strategy_ckpt_config={"save_file": path})
        else:
            _semi(8, strategy_ckpt_config={"save_file": path, "only_trainable_params": False})
        net = _TwoWeights()
        expected = x.asnumpy() @ net.w.asnumpy() @ net.frozen.asnumpy()
        np.testing.assert_allclose(net(x).asnumpy(), expected, rtol=1e-5, atol=1e-5)
        assert dm.get_auto_parallel_context("strategy_ckpt_save_file") == path
        files[form] = _saved(path)
        dm.reset_auto_parallel_context()
    assert files["old"] == files["config"]
    assert set(files["config"]) == {"w"}
    assert files["config"]["w"]["tensor_map"] == [-1, 0]
    assert set(files["config_all"]) == {"w", "frozen"}
    assert files["config_all"]["w"] == files["config"]["w"]


def test_strategy_ckpt_config_load_file(tmp_path):
    path = str(tmp_path / "strategy.json")
    _semi(8, strategy_ckpt_save_file=path)
    x = Tensor(_normal(4, 8))
    _TwoWeights()(x)
    dm.reset_auto_parallel_context()
    _semi(8, strategy_ckpt_config={"load_file": path})
    assert dm.get_auto_parallel_context("strategy_ckpt_load_file") == path
    assert dm.get_auto_parallel_context("strategy_ckpt_config") == {
        "save_file": None, "load_file": path, "only_trainable_params": True}
    net = _TwoWeights()
    expected = x.asnumpy() @ net.w.asnumpy() @ net.frozen.asnumpy()
    np.testing.assert_allclose(net(x).asnumpy(), expected, rtol=1e-5, atol=1e-5)
    assert net.w.layout.dim_parts == (1, 4)


@pytest.mark.parametrize("kwargs,err,msg", [
    ({"strategy_ckpt_config": {"save_file": "a.json"}, "strategy_ckpt_save_file": "b.json"},
     ValueError, r"set_auto_parallel_context: strategy_ckpt_config\['save_file'\]='a\.json' "
                 r"contradicts strategy_ckpt_save_file='b\.json'; they are one setting"),
    ({"strategy_ckpt_config": {"load_file": "a.json"}, "strategy_ckpt_load_file": "b.json"},
     ValueError, r"strategy_ckpt_config\['load_file'\]='a\.json' contradicts "
                 r"strategy_ckpt_load_file='b\.json'"),
    ({"strategy_ckpt_config": {"save": "a.json"}}, ValueError,
     r"strategy_ckpt_config has unknown key 'save'; valid keys are 'save_file', "
     r"'load_file', 'only_trainable_params'"),
    ({"strategy_ckpt_config": {"save_file": 3}}, TypeError,
     r"strategy_ckpt_config\['save_file'\]"),
    ({"strategy_ckpt_config": {"only_trainable_params": 1}}, TypeError,
     r"strategy_ckpt_config\['only_trainable_params'\]"),
    ({"strategy_ckpt_config": "a.json"}, TypeError, r"strategy_ckpt_config"),
    ({"group_ckpt_save_file": 3}, TypeError, r"group_ckpt_save_file"),
    ({"enable_alltoall": "yes"}, TypeError, r"enable_alltoall"),
])
def test_context_keys_refused_by_name_state_unchanged(kwargs, err, msg):
    dm.set_auto_parallel_context(strategy_ckpt_save_file="keep.json", enable_alltoall=False)
    before = {k: dm.get_auto_parallel_context(k) for k in (
        "strategy_ckpt_config", "strategy_ckpt_save_file", "strategy_ckpt_load_file",
        "group_ckpt_save_file", "enable_alltoall", "device_num")}
    with pytest.raises(err, match=msg):
        dm.set_auto_parallel_context(device_num=4, **kwargs)
    assert {k: dm.get_auto_parallel_context(k) for k in before} == before


def test_strategy_ckpt_config_same_value_in_both_forms_is_accepted():
    dm.set_auto_parallel_context(strategy_ckpt_config={"save_file": "a.json"},
                                 strategy_ckpt_save_file="a.json")
    assert dm.get_auto_parallel_context("strategy_ckpt_save_file") == "a.json"
    # only the keys given change, as MindSpore
    dm.set_auto_parallel_context(strategy_ckpt_config={"only_trainable_params": False})
    assert dm.get_auto_parallel_context("strategy_ckpt_config") == {
        "save_file": "a.json", "load_file": None, "only_trainable_params": False}


def test_group_ckpt_save_file_lists_the_groups_used(mode, tmp_path):
    """MatMul ((4, 2), (4, 2)) on 8 devices gathers x over the pairs of axis 1 and w over
    the four-device groups of axis 0: exactly those groups are in the file."""
    from dualmode.train.group_file import group_name, load_group_file
    path = tmp_path / "sub" / "groups.json"
    _semi(8, group_ckpt_save_file=str(path))
    x, w = _normal(16, 8), _normal(8, 16)
    np.testing.assert_allclose(_MatMulNet(w, ((4, 2), (4, 2)))(Tensor(x)).asnumpy(), x @ w,
                               rtol=1e-5, atol=1e-5)
    groups = load_group_file(path)
    expected = [[0, 1], [2, 3], [4, 5], [6, 7], [0, 2, 4, 6], [1, 3, 5, 7]]
    assert sorted(groups.values()) == sorted(expected)
    assert all(name == group_name(ranks) for name, ranks in groups.items())
    with pytest.raises(FileNotFoundError, match=r"group file .* does not exist"):
        load_group_file(tmp_path / "missing.json")


@pytest.mark.parametrize("enable", [True, False])
def test_enable_alltoall(mode, enable):
    """A split moved from dim 0 to dim 1: one AlltoAll (True, dualmode's default), or
    as MindSpore's default False an AllGather and a local slice (k times the bytes)."""
    _semi(8, enable_alltoall=enable)
    assert dm.get_auto_parallel_context("enable_alltoall") is enable
    lay = Layout((8,), ("tp",))
    xn = _normal(16, 16)
    x = dm.reshard(Tensor(xn), lay("tp", "None"))
    with CommReport() as comm:
        y = dm.reshard(x, lay("None", "tp"))
    np.testing.assert_array_equal(y.asnumpy(), xn)
    assert y.layout.tensor_map == ((), (0,))
    piece = 2 * 16 * 4                           # bytes of one device's (2, 16) block
    if enable:
        assert [r.kind for r in comm.records] == ["AlltoAll"]
        assert comm.bytes() == 7 / 8 * piece
    else:
        assert [r.kind for r in comm.records] == ["AllGather"]
        assert comm.bytes() == 7 * piece


def test_enable_alltoall_false_matmul_two_layouts_matches_single_device(mode):
    """The pending test's network (layout_extend_moe) shape: a GeLU then a BatchMatMul
    with layouts that switch the split dim, with AlltoAll off, against numpy."""
    _semi(16, enable_alltoall=False)
    layout = Layout((2, 2, 4), ("vp", "dp", "mp"))
    x, w = _normal(8, 16, 16), _normal(8, 16, 16)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.bmm = P.BatchMatMul().shard(in_strategy=(
                layout(("dp", "vp"), "None", "None"), layout(("dp", "vp"), "None", "mp")))
            self.neg = P.Neg().shard(in_strategy=(layout("None", ("dp", "vp"), "None"),))
            self.w = Parameter(Tensor(w), "w")

        def construct(self, y):
            return self.bmm(self.neg(y), self.w)

    with CommReport() as comm:
        out = Net()(Tensor(x))
    np.testing.assert_allclose(out.asnumpy(), np.matmul(-x, w), rtol=1e-5, atol=1e-5)
    assert comm.count("AlltoAll") == 0


# ------------------------------------------------- a strategy on an op of constants

def test_tile_of_a_constant_tensor_with_strategy(mode):
    """MindSpore's test_tile_tensor: Tile().shard(((2, 2, 2),)) of a constant Tensor (not
    a Parameter) then a sharded Mul, against numpy; in a compiled graph the Tile of a
    constant runs at trace time (no op to record) and its strategy places the result."""
    _semi(8)
    w, x, sens = _normal(2, 2, 4), _normal(16, 8, 8), _normal(16, 8, 8)

    class TileMul(nn.Cell):
        def __init__(self):
            super().__init__()
            self.tile = P.Tile().shard(((2, 2, 2),))
            self.mul = P.Mul().shard(((2, 2, 2), (2, 2, 2)))
            self.w = Tensor(w)

        def construct(self, x):
            return self.mul(x, self.tile(self.w, (8, 4, 2)))

    net = TileMul()
    tiled = np.tile(w, (8, 4, 2))
    np.testing.assert_allclose(net(Tensor(x)).asnumpy(), x * tiled, rtol=1e-6)
    gx = dm.grad(lambda x: (net(x) * Tensor(sens)).sum())(Tensor(x))
    np.testing.assert_allclose(gx.asnumpy(), sens * tiled, rtol=1e-6)
