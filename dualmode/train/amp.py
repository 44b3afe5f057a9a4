"""Mixed precision for ``Model(amp_level=...)``: which layers compute in float16, and the
static loss scale.

"O0" (default): everything as built (float32). "O2": Dense and Conv2d layers (their
MatMul / Conv2D) compute in float16 from float32 master weights (the weights are cast
for each step; their gradients flow back through the cast as float32), BatchNorm2d
computes its statistics in float32, the network's output is cast to float32 before the
loss, and the loss is multiplied by a static loss scale before differentiation (the
gradients divided by it after), so small float16 gradients do not flush to zero.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..common import dtype as _dt
from ..nn import Conv2d, Dense

__all__ = ["AMP_LEVELS", "FixedLossScaleManager", "check_amp_level", "apply_amp",
           "grads_finite"]

AMP_LEVELS = ("O0", "O2")


def check_amp_level(level):
    if level not in AMP_LEVELS:
        raise ValueError(f"Model: amp_level={level!r} is not supported; expected one of "
                         + ", ".join(repr(v) for v in AMP_LEVELS)
                         + " ('O1' and 'O3' are not implemented)")
    return level


class FixedLossScaleManager:
    """A static loss scale (MindSpore's ``FixedLossScaleManager``).

    Parameters
    ----------
    loss_scale : float
        The loss is multiplied by it before differentiation and the gradients divided by
        it after (default 128.0, MindSpore's).
    drop_overflow_update : bool
        Skip the optimizer step when a gradient is not finite (default True).
    """

    def __init__(self, loss_scale=128.0, drop_overflow_update=True):
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or \
                not loss_scale >= 1.0 or not np.isfinite(loss_scale):
            raise ValueError(f"FixedLossScaleManager: loss_scale={loss_scale!r} must be a "
                             f"finite number >= 1")
        if not isinstance(drop_overflow_update, bool):
            raise TypeError(f"FixedLossScaleManager: drop_overflow_update must be a bool, "
                            f"got {drop_overflow_update!r}")
        self.loss_scale = float(loss_scale)
        self.drop_overflow_update = drop_overflow_update

    def get_loss_scale(self):
        return self.loss_scale


def apply_amp(network, level):
    """Mark the layers of `network` that compute in float16 under `level`."""
    for _, cell in network.cells_and_names():
        if isinstance(cell, (Dense, Conv2d)):
            if level == "O2":
                cell.__dict__["amp_dtype"] = _dt.float16
            else:
                cell.__dict__.pop("amp_dtype", None)


def to_float32(out):
    """The network's float outputs as float32 (the loss is computed in float32)."""
    if isinstance(out, (tuple, list)):
        return type(out)(to_float32(o) for o in out)
    if hasattr(out, "dtype") and out.dtype == np.float16:
        return ops.cast(out, _dt.float32)
    return out


def grads_finite(grads) -> bool:
    """Are all gradients finite (a read of every gradient)?"""
    return all(bool(np.isfinite(np.asarray(g.asnumpy())).all()) for g in grads if g is not None)
