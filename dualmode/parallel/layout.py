"""Layouts: which device holds which slice of a tensor — the entry point that
re-exports the two concepts, each in its own module:

- :mod:`.layout_spec` — the user's named-axis ``Layout`` and the ``LayoutSpec`` it gives
  when applied to a tensor's dims (MindSpore's API);
- :mod:`.tensor_layout` — ``TensorLayout``, the immutable value every layer below the
  API works with, and strategy tuples as its shorthand.
"""
from ._layout_checks import IndivisibleError, LayoutError
from .layout_spec import Layout, LayoutSpec
from .tensor_layout import TensorLayout, format_table, is_layout_spec, stand_in

__all__ = ["Layout", "LayoutSpec", "TensorLayout", "LayoutError", "IndivisibleError",
           "format_table", "stand_in", "is_layout_spec"]
