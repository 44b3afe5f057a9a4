"""Train steps shared by the tests."""
import dualmode as dm
from dualmode import ops


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
