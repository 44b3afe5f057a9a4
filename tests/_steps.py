"""Train steps shared by the tests."""
import numpy as np

import dualmode as dm
from dualmode import Tensor, nn, ops
from dualmode.parallel import CommReport


def mean_square_step(f, opt):
    """One train step of `f` (a network, or any function of the input) with the
    optimizer `opt`: the loss is the mean square of ``f(x)``; returns the loss (before
    the update)."""
    grad_fn = dm.value_and_grad(lambda x: ops.reduce_mean(ops.square(f(x))), None,
                                opt.parameters)

    def step(x):
        loss, grads = grad_fn(x)
        opt(grads)
        return loss
    return step


def sgd_steps(f, net, x, steps, lr=0.1):
    """`steps` SGD steps (rate `lr`) of the loss ``f(x)`` over `net`'s weights: the losses,
    the input gradients, every parameter of `net` after them, and the CommReport."""
    opt = nn.SGD(net.trainable_params(), lr)
    g = dm.value_and_grad(f, 0, opt.parameters)
    losses, dxs = [], []
    with CommReport() as rep:
        for _ in range(steps):
            loss, (dx, grads) = g(Tensor(x))
            opt(grads)
            losses.append(float(loss.asnumpy()))
            dxs.append(dx.asnumpy())
    return losses, dxs, {p.name: p.asnumpy() for p in net.get_parameters()}, rep


def assert_same_steps(got, ref, rtol=1e-4, atol=1e-6):
    """:func:`sgd_steps`' results `got` equal `ref` (the stand-alone run's): the losses,
    the input gradients and every parameter of `ref` after the steps."""
    losses, dxs, params, _ = got
    np.testing.assert_allclose(losses, ref[0], rtol=rtol)
    for a, b in zip(dxs, ref[1]):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg="gradient of x")
    for name, want in ref[2].items():
        np.testing.assert_allclose(params[name], want, rtol=rtol, atol=atol, err_msg=name)
