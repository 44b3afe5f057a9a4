"""MindSpore's ``parallel.shard`` module: :class:`Layout`, :func:`shard` (the function
form of ``ops.shard``) and :func:`reshard` (a tensor moved into a layout)::

    from dualmode.parallel.shard import Layout
    layout = Layout((2, 4), ("dp", "mp"))
    y = dm.reshard(x, layout("dp", "None"))     # x's rows over dp, replicated over mp
"""
from __future__ import annotations

from ..ops import shard
from ..ops.primitive import Primitive
from ..tensor import Tensor
from .layout_spec import Layout

__all__ = ["Layout", "shard", "reshard"]


class _Reshard(Primitive):
    """The identity, carrying the layout its output must have as its out_strategy."""
    name = "reshard"

    def construct(self, x):
        return x


def reshard(tensor, layout):
    """`tensor` with the layout `layout` (a :class:`Layout` applied to the tensor's dims,
    e.g. ``layout("dp", "None")``, or a strategy tuple such as ``(2, 1)``): in PyNative
    mode it is moved there at once, inside a compiled graph the layout is a constraint
    the compiler plans around (and moves into); the value is unchanged, and gradients
    flow through. In stand-alone mode it is `tensor` itself."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"reshard: tensor must be a Tensor, got {type(tensor).__name__}")
    if isinstance(layout, list):
        layout = tuple(layout)
    if not (isinstance(layout, tuple) or hasattr(layout, "tensor_map")):
        raise TypeError(f"reshard: layout must be a Layout applied to the tensor's dims "
                        f"(e.g. layout('dp', 'None')) or a strategy tuple, got {layout!r}")
    return _Reshard().shard(None, (layout,))(tensor)
