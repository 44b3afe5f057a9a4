"""Errors before effects (issue 11): an optimizer given a bad gradient anywhere in its
list changes nothing — no parameter, no optimizer state, no step counter, no
collective — and says which parameter and what was expected."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel import CommReport

from _devices import devices
from test_optim_sharded import _Net

_OPTIMIZERS = {
    "sgd": lambda p: nn.SGD(p, learning_rate=0.1, weight_decay=0.01),
    "sgd-momentum": lambda p: nn.SGD(p, learning_rate=0.1, momentum=0.9),
    "momentum": lambda p: nn.Momentum(p, 0.05, 0.9, weight_decay=0.01),
    "adam": lambda p: nn.Adam(p, learning_rate=0.01, weight_decay=0.01),
}


def _snapshot(opt):
    """Every parameter and state the optimizer holds, as copies, and its step."""
    arrays = {p.name: p.asnumpy().copy() for p in opt.parameters}
    for name in opt.__dict__.get("_state_names", ()):
        for st in getattr(opt, name):
            arrays[st.name] = st.asnumpy().copy()
    return arrays, opt.global_step


def _assert_unchanged(opt, before):
    arrays, step = _snapshot(opt)
    assert step == before[1]
    assert arrays.keys() == before[0].keys()
    for k, v in arrays.items():
        np.testing.assert_array_equal(v, before[0][k], err_msg=k)


def _params():
    rng = np.random.default_rng(0)
    return [Parameter(Tensor(rng.standard_normal(s).astype(np.float32)), name=n)
            for n, s in (("a", (4, 3)), ("b", (3,)), ("c", (3, 2)))]


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_optimizer_bad_gradient_shape_in_the_middle_changes_nothing(name):
    params = _params()
    opt = _OPTIMIZERS[name](params)
    good = [Tensor(np.ones(p.shape, np.float32)) for p in params]
    opt(tuple(good))                              # states are non-zero from here on
    before = _snapshot(opt)
    bad = (good[0], Tensor(np.ones((4,), np.float32)), good[2])
    with pytest.raises(ValueError, match=rf"{type(opt).__name__}: the gradient for parameter "
                                         r"'b' has shape \(4,\); the parameter has shape "
                                         r"\(3,\)"):
        opt(bad)
    _assert_unchanged(opt, before)
    opt(tuple(good))                              # and it still works afterwards
    assert opt.global_step == before[1] + 1


@pytest.mark.parametrize("bad,error,message", [
    (None, TypeError, r"the gradient for parameter 'b' is a NoneType; expected a Tensor"),
    ("x", TypeError, r"the gradient for parameter 'b' is a str"),
    (np.ones(3, bool), TypeError, r"the gradient for parameter 'b' has dtype bool"),
])
def test_optimizer_bad_gradient_type_changes_nothing(bad, error, message):
    params = _params()
    opt = nn.Adam(params, learning_rate=0.01)
    before = _snapshot(opt)
    grads = (Tensor(np.ones((4, 3), np.float32)), bad, Tensor(np.ones((3, 2), np.float32)))
    with pytest.raises(error, match=message):
        opt(grads)
    _assert_unchanged(opt, before)


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_sharded_optimizer_bad_gradient_moves_and_changes_nothing(name):
    """Sharded weights (layouts with repeated blocks) on 8 devices: nothing updated and
    no gradient communication issued before the bad gradient is found."""
    with devices(8, gradients_mean=True):
        rng = np.random.default_rng(1)
        ws = [rng.standard_normal(s).astype(np.float32) for s in ((16, 32), (32, 16), (16, 4))]
        net = _Net(ws)
        opt = _OPTIMIZERS[name](net.trainable_params())
        x = Tensor(rng.standard_normal((16, 16)).astype(np.float32))
        loss_fn = dm.value_and_grad(lambda t: ops.reduce_sum(net(t)), None, opt.parameters)
        _, grads = loss_fn(x)
        opt(grads)
        before = _snapshot(opt)
        _, grads = loss_fn(x)
        bad = (grads[0], Tensor(np.ones((32, 15), np.float32)), grads[2])
        with CommReport() as rep:
            with pytest.raises(ValueError, match=r"the gradient for parameter 'w2' has shape "
                                                 r"\(32, 15\); the parameter has shape "
                                                 r"\(32, 16\)"):
                opt(bad)
        assert rep.count() == 0
        _assert_unchanged(opt, before)
