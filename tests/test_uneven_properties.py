"""Property: small sharded programs equal numpy whether or not their strategies divide
the shapes. Shapes are drawn so that about a third of the dims a strategy splits do not
divide (numpy.array_split's pieces), the others divide; every result and gradient is
compared with the same program on one device, in PyNative mode and compiled."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import dualmode as dm
from dualmode import Tensor, communication, ops


def _setup(devices):
    dm.reset_auto_parallel_context()
    dm.set_context(mode=dm.PYNATIVE_MODE)
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=devices)
    communication.init()


@pytest.fixture(autouse=True)
def _reset():
    yield
    dm.reset_auto_parallel_context()


def _size(draw, parts):
    """A dim for `parts` pieces: dividing, or not (about a third of the split dims)."""
    if parts > 1 and draw(st.integers(0, 4)) < 2:
        return draw(st.integers(parts, 3 * parts)) // parts * parts + draw(
            st.integers(1, parts - 1))
    return parts * draw(st.integers(1, 3))


def _factors(draw, n, k):
    """`k` split factors (powers of two) whose product divides `n`."""
    out, left = [], n
    for _ in range(k):
        f = draw(st.sampled_from([d for d in (1, 2, 4, 8) if left % d == 0]))
        out.append(f)
        left //= f
    return tuple(out)


@st.composite
def programs(draw):
    n = draw(st.sampled_from([2, 4, 8]))
    kind = draw(st.sampled_from(["matmul", "bias_tanh", "reduce", "softmax", "mul"]))
    if kind == "matmul":
        m, k, c = _factors(draw, n, 3)
        shapes = [(_size(draw, m), _size(draw, k)), None]
        shapes[1] = (shapes[0][1], _size(draw, c))
        strategy = ((m, k), (k, c))
    elif kind in ("bias_tanh", "mul"):
        a, b = _factors(draw, n, 2)
        x = (_size(draw, a), _size(draw, b))
        shapes = [x, (x[1],)] if kind == "bias_tanh" else [x, x]
        strategy = ((a, b), (b,)) if kind == "bias_tanh" else ((a, b), (a, b))
    else:
        a, b = _factors(draw, n, 2)
        shapes = [(_size(draw, a), _size(draw, b))]
        strategy = ((a, b),)
    axis = draw(st.sampled_from([0, 1]))
    name = draw(st.sampled_from(["ReduceSum", "ReduceMean", "ReduceMax"]))
    return n, kind, tuple(shapes), strategy, axis, name


def _build(kind, strategy, axis, name):
    if kind == "matmul":
        mm = ops.MatMul().shard(strategy)
        return lambda a, b: mm(a, b)
    if kind == "bias_tanh":
        ba = ops.BiasAdd().shard(strategy)
        return lambda a, b: ops.tanh(ba(a, b))
    if kind == "mul":
        mul = ops.Mul().shard(strategy)
        return lambda a, b: ops.exp(mul(a, b))
    if kind == "reduce":
        red = getattr(ops, name)(False).shard(strategy)
        return lambda a: red(a, axis)
    sm = ops.Softmax(axis).shard(strategy)
    return lambda a: sm(a)


def _run(devices, program, arrays, compiled):
    n, kind, shapes, strategy, axis, name = program
    _setup(devices)
    fn = _build(kind, strategy, axis, name)
    w = np.random.default_rng(9)

    def loss(*xs):
        out = fn(*xs)
        weight = Tensor(w.standard_normal(out.shape).astype(np.float32))
        return ops.reduce_sum(out * weight), out

    if compiled and devices > 1:
        loss = ops.shard(loss, in_strategy=(None,) * len(arrays))
    (_, out), grads = dm.value_and_grad(loss, tuple(range(len(arrays))), has_aux=True)(
        *[Tensor(a) for a in arrays])
    return out.asnumpy(), [g.asnumpy() for g in grads]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_programs_equal_one_device_whether_or_not_the_strategies_divide(compiled):
    @settings(max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(programs(), st.integers(0, 2**31 - 1))
    def prop(program, seed):
        note(repr(program))
        rng = np.random.default_rng(seed)
        arrays = [rng.uniform(-1, 1, s).astype(np.float32) for s in program[2]]
        ref_out, ref_g = _run(1, program, arrays, False)
        out, g = _run(program[0], program, arrays, compiled)
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
        for a, b in zip(g, ref_g):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    prop()


def test_a_third_of_the_drawn_dims_do_not_divide():
    """The draw itself: over many programs, the split dims that do not divide are about a
    third (so the property above exercises both kinds)."""
    seen = {"even": 0, "uneven": 0}

    @settings(max_examples=300, deadline=None, database=None)
    @given(programs())
    def count(program):
        n, kind, shapes, strategy, axis, name = program
        for shape, st_ in zip(shapes, strategy):
            for size, parts in zip(shape, st_):
                if parts > 1:
                    seen["uneven" if size % parts else "even"] += 1
    count()
    share = seen["uneven"] / (seen["even"] + seen["uneven"])
    assert 0.2 < share < 0.5, seen
