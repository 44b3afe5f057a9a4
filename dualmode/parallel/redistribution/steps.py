"""The steps of a redistribution plan and the plan itself (immutable values)."""
from __future__ import annotations

from operator import itemgetter
from typing import Tuple

from ..._core import _redist
from ..tensor_layout import TensorLayout


#: Expansions of the search before it settles for the direct plan (both planners).
SEARCH_BUDGET = _redist.DEFAULT_BUDGET

# step kind codes, in the kernel's order (_redist.NAMES)
_SLICE, _GATHER, _A2A, _RS, _AR = range(5)
_TRACE_KIND = (None, "AllGather", "AlltoAll", "ReduceScatter", "AllReduce")


class RedistributionError(ValueError):
    """A redistribution that cannot be planned (shapes, devices, partial sums)."""


# ============================================================================ steps

class Step(tuple):
    """One step of a plan: ``(kind, dims, axes, parts, bytes)``, immutable and hashable.

    ``axes`` are axes of the plan's (unified) ``device_matrix``, outer first; ``parts``
    is the number of devices in each group (the product of their sizes); ``bytes`` the
    bytes each device moves (0 for :class:`LocalSlice`).
    """

    __slots__ = ()
    kind = property(itemgetter(0), doc="The step's name, e.g. 'AllGather'.")
    dims = property(itemgetter(1), doc="The tensor dims it works on.")
    axes = property(itemgetter(2), doc="The device axes it works over, outer first.")
    parts = property(itemgetter(3), doc="Devices per group.")
    bytes = property(itemgetter(4), doc="Bytes moved per device.")
    communicates = True

    def _args(self) -> str:
        return f"axes={self[2]}"

    def __repr__(self) -> str:
        b = self[4]
        nb = f"{b:.0f}" if b == int(b) else f"{b:g}"
        return f"{self[0]}({self._args()}, parts={self[3]}, bytes={nb})"

    def __reduce__(self):
        return (_rebuild, (type(self), tuple(self)))


def _rebuild(cls, items):
    return tuple.__new__(cls, items)


class LocalSlice(Step):
    """Each device keeps its block of ``dim`` along ``axes`` (free axes): no communication."""

    __slots__ = ()
    communicates = False
    dim = property(lambda self: self[1][0])

    def __new__(cls, dim: int, axes, parts: int, bytes: float = 0.0):
        return tuple.__new__(cls, ("LocalSlice", (dim,), tuple(axes), parts, float(bytes)))

    def _args(self):
        return f"dim={self[1][0]}, axes={self[2]}"


class AllGather(Step):
    """Concatenate the blocks of ``dim`` over ``axes`` (its innermost splits)."""

    __slots__ = ()
    dim = property(lambda self: self[1][0])

    def __new__(cls, dim: int, axes, parts: int, bytes: float):
        return tuple.__new__(cls, ("AllGather", (dim,), tuple(axes), parts, float(bytes)))

    def _args(self):
        return f"dim={self[1][0]}, axes={self[2]}"


class AllToAll(Step):
    """Move the innermost splits ``axes`` of ``src_dim`` to the inner end of ``dst_dim``."""

    __slots__ = ()
    src_dim = property(lambda self: self[1][0])
    dst_dim = property(lambda self: self[1][1])

    def __new__(cls, src_dim: int, dst_dim: int, axes, parts: int, bytes: float):
        return tuple.__new__(cls, ("AllToAll", (src_dim, dst_dim), tuple(axes), parts,
                                   float(bytes)))

    def _args(self):
        return f"src_dim={self[1][0]}, dst_dim={self[1][1]}, axes={self[2]}"


class ReduceScatter(Step):
    """Sum the pending partial values over ``axes`` and split ``dim`` by them."""

    __slots__ = ()
    dim = property(lambda self: self[1][0])

    def __new__(cls, dim: int, axes, parts: int, bytes: float):
        return tuple.__new__(cls, ("ReduceScatter", (dim,), tuple(axes), parts,
                                   float(bytes)))

    def _args(self):
        return f"dim={self[1][0]}, axes={self[2]}"


class AllReduce(Step):
    """Sum the pending partial values over ``axes``; every device gets the sum."""

    __slots__ = ()

    def __new__(cls, axes, parts: int, bytes: float):
        return tuple.__new__(cls, ("AllReduce", (), tuple(axes), parts, float(bytes)))


class Remesh(Step):
    """Re-express a replicated tensor over another device matrix of the same ranks
    (only in plans between device matrices that do not nest). Moves nothing."""

    __slots__ = ()
    communicates = False
    device_matrix = property(lambda self: self[5])

    def __new__(cls, device_matrix):
        return tuple.__new__(cls, ("Remesh", (), (), 1, 0.0, tuple(device_matrix)))

    def __repr__(self):
        return f"Remesh(device_matrix={self[5]})"


_KINDS = (LocalSlice, AllGather, AllToAll, ReduceScatter, AllReduce)
_NAMES = tuple(k.__name__ for k in _KINDS)
_BY_NAME = {k.__name__: k for k in _KINDS}


# ============================================================================ Plan

class Plan(tuple):
    """An immutable tuple of :class:`Step` that moves a tensor from ``src`` to ``dst``.

    Attributes
    ----------
    src, dst : TensorLayout
    device_matrix : tuple of int
        The unified device matrix the steps' axes refer to (until a :class:`Remesh`).
    itemsize : int
        Bytes per element the byte counts assume.
    bytes : float
        Bytes moved per device by the whole plan.
    """

    def __new__(cls, steps, src, dst, device_matrix, itemsize):
        self = tuple.__new__(cls, steps)
        total = 0.0
        for s in steps:
            total += s[4]
        d = self.__dict__
        d["src"] = src
        d["dst"] = dst
        d["device_matrix"] = tuple(device_matrix)
        d["itemsize"] = itemsize
        d["bytes"] = total
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"Plan is immutable; cannot set {name!r}")

    def __reduce__(self):
        return (Plan, (tuple(self), self.src, self.dst, self.device_matrix, self.itemsize))

    @property
    def steps(self) -> Tuple[Step, ...]:
        return tuple(self)

    @property
    def kinds(self) -> Tuple[str, ...]:
        return tuple(s[0] for s in self)

    def collectives(self) -> int:
        """Number of steps that communicate."""
        return sum(1 for s in self if s.communicates)

    @property
    def communicates(self) -> bool:
        """Whether some step communicates (kept: the executor asks on every call)."""
        found = self.__dict__.get("_communicates")
        if found is None:
            found = self.__dict__["_communicates"] = any(s.communicates for s in self)
        return found

    def _mesh(self, device_matrix) -> TensorLayout:
        """A replicated scalar layout over ``device_matrix`` (for groups and coordinates),
        built once per plan."""
        meshes = self.__dict__.setdefault("_meshes", {})
        m = meshes.get(device_matrix)
        if m is None:
            m = meshes[device_matrix] = TensorLayout(device_matrix, (), ())
        return m

    def __repr__(self):
        return (f"Plan({self.src!r} -> {self.dst!r}: {len(self)} steps, "
                f"{self.bytes:g} bytes per device over device matrix {self.device_matrix})")

    def __str__(self):
        lines = [repr(self)]
        for i, s in enumerate(self):
            lines.append(f"  {i}: {s!r}")
        return "\n".join(lines)
