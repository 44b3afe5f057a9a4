"""The user's named-axis layouts (MindSpore's ``Layout``).

- ``Layout(device_matrix, alias_name)``: named axes of a device matrix. Axis 0 is the
  highest: ranks run row-major over the matrix, the last axis fastest
  (``Layout((2, 2, 2), ("dp", "sp", "mp"))``: rank = dp*4 + sp*2 + mp).
- ``LayoutSpec``: what calling a Layout returns, ``layout("mp", ("sp", "dp"), "None")``,
  one entry per tensor dim (an alias, a tuple of merged aliases with the first the outer
  split, or ``"None"``). It has no shape yet; ``spec.bind(shape)`` gives a
  :class:`~dualmode.parallel.tensor_layout.TensorLayout`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence, Tuple, Union

from ._layout_checks import NONE, LayoutError, check_layout_args, check_spec_entries
from .tensor_layout import TensorLayout

__all__ = ["Layout", "LayoutSpec"]

Axes = Tuple[int, ...]


# ============================================================================ Layout

class Layout:
    """Named axes of a device matrix (MindSpore's ``Layout``).

    Parameters
    ----------
    device_matrix : tuple of int
        Devices along each axis; axis 0 is the highest (varies slowest with the rank).
    alias_name : tuple of str
        One distinct, non-empty name per axis; ``"None"`` is reserved.

    Calling the layout with one entry per tensor dim gives a :class:`LayoutSpec`::

        layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
        x_spec = layout("mp", ("sp", "dp"))   # dim 0 on mp, dim 1 cut in sp*dp parts
    """

    __slots__ = ("_device_matrix", "_alias_name")

    def __init__(self, device_matrix: Sequence[int], alias_name: Sequence[str]):
        dm, alias = check_layout_args(device_matrix, alias_name)
        object.__setattr__(self, "_device_matrix", dm)
        object.__setattr__(self, "_alias_name", alias)

    def __setattr__(self, name, value):
        raise AttributeError(f"Layout is immutable; cannot set {name!r}")

    def __reduce__(self):
        return (Layout, (self._device_matrix, self._alias_name))

    @property
    def device_matrix(self) -> Tuple[int, ...]:
        return self._device_matrix

    @property
    def alias_name(self) -> Tuple[str, ...]:
        return self._alias_name

    @property
    def device_num(self) -> int:
        return math.prod(self._device_matrix)

    def axis(self, alias: str) -> int:
        """Index of the device-matrix axis named ``alias`` (0 = highest)."""
        if alias not in self._alias_name:
            raise LayoutError(f"{self!r}: unknown alias {alias!r}; valid aliases are "
                              f"{', '.join(map(repr, self._alias_name))}")
        return self._alias_name.index(alias)

    def __call__(self, *tensor_map: Union[str, Tuple[str, ...]]) -> "LayoutSpec":
        spec = check_spec_entries(repr(self), tensor_map, self._alias_name)
        return LayoutSpec(self, spec)

    def __eq__(self, other):
        if not isinstance(other, Layout):
            return NotImplemented
        return (self._device_matrix, self._alias_name) == \
            (other._device_matrix, other._alias_name)

    def __hash__(self):
        return hash((Layout, self._device_matrix, self._alias_name))

    def __repr__(self):
        return f"Layout({self._device_matrix}, {self._alias_name})"


# ============================================================================ LayoutSpec

@dataclass(frozen=True)
class LayoutSpec:
    """A Layout applied to a tensor's dims: ``layout("mp", ("sp", "dp"), "None")``.

    ``spec[i]`` is the tuple of aliases splitting dim ``i`` (outer first; ``()`` for
    ``"None"``). Bind it to a shape with :meth:`bind` to get slices and groups.
    """

    layout: Layout
    spec: Tuple[Tuple[str, ...], ...]
    is_layout_spec = True           # how lower modules recognise one (tensor_layout.py)

    @property
    def device_matrix(self) -> Tuple[int, ...]:
        return self.layout.device_matrix

    @property
    def alias_name(self) -> Tuple[str, ...]:
        return self.layout.alias_name

    @property
    def device_num(self) -> int:
        return self.layout.device_num

    @property
    def ndim(self) -> int:
        return len(self.spec)

    @cached_property
    def tensor_map(self) -> Tuple[Axes, ...]:
        """Per dim, the device-matrix axis indices splitting it (0 = highest, outer first)."""
        idx = {a: i for i, a in enumerate(self.alias_name)}
        return tuple(tuple(idx[a] for a in names) for names in self.spec)

    def bind(self, shape: Sequence[int]) -> "TensorLayout":
        """The TensorLayout of a tensor of global ``shape`` under this spec."""
        return TensorLayout.from_spec(self, shape)

    def device_slices(self, shape: Sequence[int]) -> list:
        """For each rank, the tuple of ``slice`` of the global tensor it holds (a dim
        that does not divide into its parts is cut as ``numpy.array_split`` cuts it)."""
        return self.bind(shape).device_slices()

    def local_shape(self, shape: Sequence[int], rank: Optional[int] = None) -> Tuple[int, ...]:
        """The shape of the largest piece of a tensor of global ``shape`` (every device's
        when the splits divide), or with ``rank`` that device's own piece."""
        lay = self.bind(shape)
        return lay.local_shape if rank is None else lay.local_shape_of(rank)

    def table(self, shape: Sequence[int], max_rows: Optional[int] = None) -> str:
        """The device-to-slice table for a tensor of global ``shape``."""
        return self.bind(shape).table(max_rows=max_rows)

    def to_dict(self) -> dict:
        """MindSpore's ``Layout.to_dict()`` form: device axes counted from the LAST
        (fastest) axis, ``-1`` for an unsplit dim, a tuple for merged axes."""
        n = len(self.device_matrix)
        tmap = []
        for axes in self.tensor_map:
            rev = tuple(n - 1 - a for a in axes)
            tmap.append(-1 if not rev else rev[0] if len(rev) == 1 else rev)
        return {"device_matrix": self.device_matrix, "tensor_map": tuple(tmap),
                "interleaved_parallel": False, "alias_name": self.alias_name}

    def __repr__(self):
        entries = ", ".join(repr(NONE) if not s else repr(s[0]) if len(s) == 1 else repr(s)
                            for s in self.spec)
        return f"{self.layout!r}({entries})"
