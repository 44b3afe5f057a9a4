"""Sharding rules, one file per family of ops.

Each rule receives the op's attrs, the input layouts over one device matrix (None for
scalars) and the input dtypes, and returns a :class:`~dualmode.parallel.sharding.ShardPlan`
(or None to let the caller gather the inputs instead). Ops without a rule are run on
gathered inputs, which is always correct; rules only make them cheaper.

An op declares its family once, at registration (``register(..., family=...)``; unary
and binary ops are elementwise by their kind), and gets that family's rule from here:

* :mod:`.elementwise` — unary and binary ops, with numpy broadcasting;
* :mod:`.reduce` — ReduceSum / Mean / Max / Min;
* :mod:`.along_axis` — ops computed along one axis or a few (Softmax, LogSoftmax,
  L2Normalize);
* :mod:`.contract` — einsum-style contractions (MatMul, BatchMatMul, BiasAdd, Transpose);
* :mod:`.rowwise` — row-independent ops (the losses).

Ops with a rule of their own register it in their family's file: :mod:`.array`
(Reshape, BroadcastTo, OneHot, Gather, Concat, Split, indexing, Dropout), :mod:`.conv`
(Conv2D, pooling) and :mod:`.norm` (BatchNorm, LayerNorm).
"""
from __future__ import annotations

from ..._core._tensor import KIND_BINARY, KIND_UNARY
from ...ops._registry import REGISTRY
from . import along_axis, contract, elementwise, reduce, rowwise

__all__ = ["FAMILIES", "family_of", "build_rule"]

#: family name -> the function registering an op's rule from its declaration
FAMILIES = {"elementwise": elementwise.rule, "reduce": reduce.rule,
            "along_axis": along_axis.rule, "contract": contract.rule,
            "rowwise": rowwise.rule}


def family_of(op):
    """The sharding family `op` declared at registration (unary and binary ops are
    elementwise by their kind), or None."""
    fam = op.extras.get("family")
    if fam is None and op.kind in (KIND_UNARY, KIND_BINARY):
        return ("elementwise",)
    return fam


def build_rule(op) -> None:
    """Build the sharding rule of `op` from the family its registration declares
    (nothing for an op without one). Every op registered when the rules load gets its
    rule so; an op registered later (by a module imported after this package) calls it."""
    fam = family_of(op)
    if fam is None:
        return
    if fam[0] not in FAMILIES:
        raise ValueError(f"register: op {op.name} declares sharding family {fam[0]!r}; "
                         f"known families: {sorted(FAMILIES)}")
    FAMILIES[fam[0]](op)


def _register_families():
    for op in list(REGISTRY.values()):
        build_rule(op)


_register_families()
from . import array, conv, norm  # noqa: E402,F401  (ops with rules of their own)
