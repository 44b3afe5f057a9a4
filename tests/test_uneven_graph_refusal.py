"""A sharding rule registered without declaring that it handles pieces of unequal size
refuses them by name in PyNative mode and compiled alike: a strategy that does not
divide, an input in such pieces (the compiled graph's lowering asks the rule as PyNative
mode does, instead of skipping it and gathering the input whole); compiled, an op
without a strategy is given a layout its rule handles. Dividing pieces run."""
import numpy as np
import pytest

from dualmode import Tensor, ops
from dualmode._core._tensor import KIND_GENERIC, apply
from dualmode.ops import REGISTRY, Primitive
from dualmode.ops._registry import register, same_as_input
from dualmode.parallel.sharding import RULES, register_rule

from _devices import devices

NAME = "TestTanhEvenOnly"


@pytest.fixture(scope="module")
def op():
    """A Tanh whose rule (Tanh's own) is registered without ``uneven=True``."""
    tanh_rule = RULES["Tanh"]
    o = register(NAME, kind=KIND_GENERIC, infer=same_as_input,
                 kernel=lambda attrs, x: np.tanh(x))
    register_rule(NAME, per_device=True)(
        lambda attrs, lays, dtypes: tanh_rule(attrs, lays, dtypes))
    yield o
    REGISTRY.pop(NAME)
    RULES.pop(NAME)


def _program(op):
    mul = ops.Mul().shard(((2, 1), (2, 1)))      # rows in 2 pieces (7 and 6 of 13)
    return lambda x: apply(op, None, (mul(x, x),))


MESSAGE = (rf"{NAME}: input 0 is split into pieces of unequal size \(dim 0, size 13, in 2 "
           rf"parts: 7 or 6 rows each\); {NAME} does not handle unequal pieces yet")


class _EvenOnly(Primitive):
    name = NAME

    def construct(self, x):
        return apply(REGISTRY[NAME], None, (x,))


def test_an_input_in_unequal_pieces_is_refused_by_name(op):
    x = np.linspace(-1, 1, 13 * 4, dtype=np.float32).reshape(13, 4)
    with devices(8):
        with pytest.raises(ValueError, match=MESSAGE):
            _program(op)(Tensor(x))


@pytest.mark.parametrize("mode", ["pynative", "ops.shard"])
def test_a_strategy_that_does_not_divide_is_refused_by_name(op, mode):
    x = np.linspace(-1, 1, 13 * 4, dtype=np.float32).reshape(13, 4)
    with devices(8):
        prim = _EvenOnly().shard(((2, 1),))
        f = prim if mode == "pynative" else ops.shard(lambda t: prim(t), in_strategy=((1, 1),))
        with pytest.raises(ValueError, match=rf"{NAME}: in_strategy\[0\]\[0\]=2 does not "
                                             rf"divide dim 0 \(size 13\) of input 0, and {NAME} "
                                             rf"does not handle pieces of unequal size"):
            f(Tensor(x))


def test_compiled_a_free_op_takes_a_layout_its_rule_handles(op):
    """Compiled, an op without a strategy gets the layout the search picks among the
    ones its rule handles (here whole: no split in 2, 4 or 8 divides 13 rows), so
    the numbers are the single device's."""
    x = np.linspace(-1, 1, 13 * 4, dtype=np.float32).reshape(13, 4)
    with devices(8):
        f = ops.shard(_program(op), in_strategy=((1, 1),))
        np.testing.assert_allclose(f(Tensor(x)).asnumpy(), np.tanh(x * x), rtol=1e-5)


def test_lowering_refuses_unequal_pieces_by_name(op):
    """The compiled graph's lowering asks the rule as PyNative mode does: a rule that
    does not handle unequal pieces refuses them by name instead of being skipped (which
    would gather the input whole)."""
    from dualmode.parallel.graph import lower
    from dualmode.parallel.tensor_layout import TensorLayout
    lay = TensorLayout.from_strategy((2, 1), (13, 4), 8)
    node = type("N", (), {"op_name": NAME})()
    low = lower._Lowering.__new__(lower._Lowering)
    low._specs = lambda node, ins, lays: (list(lays), [np.dtype(np.float32)])
    with pytest.raises(ValueError, match=MESSAGE):
        low.found_plan(node, [None], [lay])


@pytest.mark.parametrize("mode", ["pynative", "ops.shard"])
def test_dividing_pieces_run(op, mode):
    x = np.linspace(-1, 1, 12 * 4, dtype=np.float32).reshape(12, 4)
    with devices(8):
        f = _program(op)
        if mode == "ops.shard":
            f = ops.shard(f, in_strategy=((1, 1),))
        np.testing.assert_allclose(f(Tensor(x)).asnumpy(), np.tanh(x * x), rtol=1e-5)
