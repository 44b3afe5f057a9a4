"""Loss cells: LossBase, MSELoss, L1Loss, CrossEntropyLoss, SoftmaxCrossEntropyWithLogits.

Each loss computes a per-element loss with dualmode ops (so autograd differentiates
it) and reduces it with ``LossBase.get_loss``. Labels are constants: masks and class
weights are built from them in numpy.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..parallel.graph.trace import is_abstract
from ._checks import check_float, check_float_tensor, check_int, check_tensor
from .cell import Cell

__all__ = ["LossBase", "MSELoss", "L1Loss", "CrossEntropyLoss",
           "SoftmaxCrossEntropyWithLogits"]

_REDUCTIONS = ("mean", "sum", "none")


class LossBase(Cell):
    """Base of the losses: holds `reduction` and applies it in ``get_loss``.

    Parameters
    ----------
    reduction : {"mean", "sum", "none"}
        How the per-element losses are combined (default "mean").
    """

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
            raise ValueError(f"{type(self).__name__}: reduction={reduction!r} is not valid; "
                             f"expected one of 'mean', 'sum', 'none'")
        self.reduction = reduction.lower()

    def get_axis(self, x):
        """All axes of `x`."""
        return tuple(range(len(x.shape)))

    def get_loss(self, x, weights=1.0):
        """Multiply `x` by `weights`, then reduce it as `reduction` says."""
        if not (isinstance(weights, (int, float)) and weights == 1.0):
            x = ops.mul(weights, x)
        if self.reduction == "mean":
            return ops.reduce_mean(x)
        if self.reduction == "sum":
            return ops.reduce_sum(x)
        return x

    def extend_repr(self):
        return f"reduction={self.reduction}"


def _check_pair(owner, logits, labels):
    """Float logits and labels of the same dtype whose shapes broadcast."""
    check_float_tensor(owner, "logits", logits)
    check_float_tensor(owner, "labels", labels)
    if logits.dtype != labels.dtype:
        raise TypeError(f"{owner}: logits have dtype {logits.dtype} but labels have dtype "
                        f"{labels.dtype}; they must match (use ops.cast)")
    try:
        np.broadcast_shapes(tuple(logits.shape), tuple(labels.shape))
    except ValueError:
        raise ValueError(f"{owner}: logits have shape {tuple(logits.shape)} and labels have "
                         f"shape {tuple(labels.shape)}; the shapes must be equal or "
                         f"broadcastable") from None


class MSELoss(LossBase):
    """Mean squared error: reduction of ``(logits - labels) ** 2``.

    Parameters
    ----------
    reduction : {"mean", "sum", "none"}
    """

    def construct(self, logits, labels):
        _check_pair("MSELoss", logits, labels)
        return self.get_loss(ops.square(ops.sub(logits, labels)))


class L1Loss(LossBase):
    """Mean absolute error: reduction of ``|logits - labels|``.

    Parameters
    ----------
    reduction : {"mean", "sum", "none"}
    """

    def construct(self, logits, labels):
        _check_pair("L1Loss", logits, labels)
        return self.get_loss(ops.abs(ops.sub(logits, labels)))


def _class_shape(ndim, c):
    """Shape that broadcasts a (C,) vector along the class axis (dim 1)."""
    return (1, c) + (1,) * (ndim - 2)


class CrossEntropyLoss(LossBase):
    """Cross entropy between logits and class indices or class probabilities.

    Parameters
    ----------
    weight : Tensor of shape (C,), optional
        Per-class rescaling weights.
    ignore_index : int
        Class-index targets equal to it contribute nothing (default -100).
    reduction : {"mean", "sum", "none"}
        With class indices, "mean" divides by the sum of the weights of the
        non-ignored targets (their count without `weight`); with probabilities, by
        the number of samples.
    label_smoothing : float in [0, 1]
        Mix the targets with the uniform distribution over the C classes.

    Inputs: logits of shape (N, C) or (N, C, d1, ...), labels of int dtype and shape
    (N,) / (N, d1, ...), or of the logits' float dtype and shape (probabilities).
    """

    def __init__(self, weight=None, ignore_index=-100, reduction="mean",
                 label_smoothing=0.0):
        super().__init__(reduction)
        if weight is not None:
            check_float_tensor("CrossEntropyLoss", "weight", weight)
            if len(weight.shape) != 1:
                raise ValueError(f"CrossEntropyLoss: weight has shape {tuple(weight.shape)}; "
                                 f"expected a 1-D tensor of one weight per class")
            weight = np.array(weight)
        self.weight = weight
        self.ignore_index = check_int("CrossEntropyLoss", "ignore_index", ignore_index)
        self.label_smoothing = check_float("CrossEntropyLoss", "label_smoothing",
                                           label_smoothing, 0.0, 1.0)

    def construct(self, logits, labels):
        name = "CrossEntropyLoss"
        check_float_tensor(name, "logits", logits)
        check_tensor(name, "labels", labels)
        ls, ys = tuple(logits.shape), tuple(labels.shape)
        if len(ls) < 2:
            raise ValueError(f"{name}: logits have shape {ls}; expected (N, C) or "
                             f"(N, C, d1, ...)")
        c = ls[1]
        if self.weight is not None and self.weight.shape != (c,):
            raise ValueError(f"{name}: weight has shape {self.weight.shape} but the logits "
                             f"have C={c} classes (dim 1 of shape {ls})")
        kind = labels.dtype.kind
        if kind in "iu":
            expected = ls[:1] + ls[2:]
            if ys != expected:
                raise ValueError(f"{name}: logits have shape {ls} and class-index labels "
                                 f"have shape {ys}; expected labels of shape {expected}")
            if is_abstract(labels):        # graph mode: label values are unknown here
                return self._traced_class_index_loss(logits, labels)
            return self._class_index_loss(logits, labels, np.asarray(labels), c)
        if kind == "f":
            if ys != ls:
                if ys == ls[:1] + ls[2:]:
                    raise TypeError(f"{name}: labels of shape {ys} and float dtype "
                                    f"{labels.dtype}: class indices must be integers (e.g. "
                                    f"Tensor(labels.astype(np.int32))); float labels are "
                                    f"class probabilities, of the logits' shape {ls}")
                raise ValueError(f"{name}: logits have shape {ls} and probability labels "
                                 f"have shape {ys}; they must be equal")
            if labels.dtype != logits.dtype:
                raise TypeError(f"{name}: logits have dtype {logits.dtype} but probability "
                                f"labels have dtype {labels.dtype}; they must match")
            return self._probability_loss(logits, labels, c)
        raise TypeError(f"{name}: labels have dtype {labels.dtype}; expected int class "
                        f"indices or float probabilities")

    def _traced_class_index_loss(self, logits, labels):
        if self.weight is not None or self.label_smoothing or len(labels.shape) != 1:
            raise ValueError("CrossEntropyLoss: in a compiled graph (ops.shard, AutoParallel, "
                             "GRAPH_MODE) only the plain form is supported: no weight, no "
                             "label_smoothing, labels of shape (N,); got weight="
                             f"{'set' if self.weight is not None else None}, label_smoothing="
                             f"{self.label_smoothing}, labels of shape {tuple(labels.shape)}")
        # the fused kernel; a label equal to ignore_index is out of range there and raises
        return self.get_loss(ops.sparse_softmax_cross_entropy(logits, labels))

    def _class_index_loss(self, logits, labels, lab, c):
        eps = self.label_smoothing
        valid = lab != self.ignore_index
        plain = self.weight is None and eps == 0.0 and valid.all()
        if plain and len(lab.shape) == 1:
            try:    # the fused kernel: softmax and its gradient in one pass
                return self.get_loss(ops.sparse_softmax_cross_entropy(logits, labels))
            except ValueError as e:
                raise ValueError(f"CrossEntropyLoss: {e}") from None
        kept = lab[valid]
        if kept.size and (kept.min() < 0 or kept.max() >= c):
            bad = kept.min() if kept.min() < 0 else kept.max()
            raise ValueError(f"CrossEntropyLoss: label {bad} is out of range; class indices "
                             f"must be in [0, {c}) or equal ignore_index={self.ignore_index}")
        dt = logits.dtype
        nd = len(logits.shape)
        w = np.ones(c, dt) if self.weight is None else self.weight.astype(dt)
        safe = np.where(valid, lab, 0)
        target_w = np.where(valid, w[safe], 0).astype(dt)            # (N, d...)
        hot = np.expand_dims(safe, 1) == np.arange(c).reshape(_class_shape(nd, c))
        # -sum_c coef * log p: (1 - eps) * weighted NLL + eps / C * weighted smoothing term
        coef = hot * np.expand_dims(target_w * (1.0 - eps), 1)
        if eps:
            coef = coef + (eps / c) * w.reshape(_class_shape(nd, c)) * \
                np.expand_dims(valid, 1)
        coef = coef.astype(dt, copy=False)
        loss = ops.neg(ops.reduce_sum(ops.mul(ops.log_softmax(logits, 1), coef), 1))
        if self.reduction == "mean":
            return ops.div(ops.reduce_sum(loss), float(target_w.sum()))
        return self.get_loss(loss)

    def _probability_loss(self, logits, labels, c):
        eps = self.label_smoothing
        nd = len(logits.shape)
        if eps:
            labels = ops.add(ops.mul(labels, 1.0 - eps), eps / c)
        if self.weight is not None:
            labels = ops.mul(labels, self.weight.astype(logits.dtype).reshape(
                _class_shape(nd, c)))
        loss = ops.neg(ops.reduce_sum(ops.mul(ops.log_softmax(logits, 1), labels), 1))
        return self.get_loss(loss)

    def extend_repr(self):
        return (f"reduction={self.reduction}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}")


class SoftmaxCrossEntropyWithLogits(LossBase):
    """Softmax cross entropy of logits (N, C) against one-hot/probability labels (N, C)
    or, with ``sparse=True``, int class labels (N,).

    Parameters
    ----------
    sparse : bool
        Labels are class indices (the fused kernel is used).
    reduction : {"mean", "sum", "none"}
        Default "mean" (MindSpore's default is "none").
    """

    def __init__(self, sparse: bool = False, reduction: str = "mean"):
        super().__init__(reduction)
        if not isinstance(sparse, bool):
            raise TypeError(f"SoftmaxCrossEntropyWithLogits: sparse must be a bool, got "
                            f"{sparse!r}")
        self.sparse = sparse
        # MindSpore's inner primitives, under its names, so that scripts can shard them
        # (``loss.softmax_cross_entropy.shard(((8, 1), (8, 1)))``)
        self.softmax_cross_entropy = ops.SoftmaxCrossEntropyWithLogits()
        self.sparse_softmax_cross_entropy = ops.SparseSoftmaxCrossEntropyWithLogits()
        self.one_hot = ops.OneHot()

    def construct(self, logits, labels):
        name = "SoftmaxCrossEntropyWithLogits"
        check_float_tensor(name, "logits", logits)
        check_tensor(name, "labels", labels)
        ls, ys = tuple(logits.shape), tuple(labels.shape)
        if len(ls) != 2:
            raise ValueError(f"{name}: logits have shape {ls}; expected (N, C)")
        if self.sparse:
            if labels.dtype.kind not in "iu":
                raise TypeError(f"{name}: sparse=True needs int class labels; labels have "
                                f"dtype {labels.dtype}")
            if ys != ls[:1]:
                raise ValueError(f"{name}: logits have shape {ls} and sparse labels have "
                                 f"shape {ys}; expected labels of shape {ls[:1]}")
            if self.reduction == "mean":      # the batch's mean, fused
                return self.sparse_softmax_cross_entropy(logits, labels)
            labels = self.one_hot(labels, ls[1], 1.0, 0.0)
            if labels.dtype != logits.dtype:
                labels = ops.cast(labels, logits.dtype)
        elif labels.dtype != logits.dtype or ys != ls:
            raise ValueError(f"{name}: sparse=False needs labels of the logits' shape and "
                             f"dtype ({ls}, {logits.dtype}); got {ys}, {labels.dtype} (use "
                             f"sparse=True for int class labels)")
        return self.get_loss(self.softmax_cross_entropy(logits, labels)[0])

    def extend_repr(self):
        return f"sparse={self.sparse}, reduction={self.reduction}"
