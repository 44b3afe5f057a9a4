"""MindSpore's ``ops.operations`` namespace: every primitive class and collective, as
MindSpore scripts import them (``from dualmode.ops import operations as P``;
``P.MatMul().shard(((2, 4), (4, 1)))``). The names are those of :mod:`dualmode.ops`'
primitives, read from there (nothing is declared twice)."""
from . import collectives as _collectives
from . import primitives as _primitives
from .collectives import ReduceOp
from .primitive import Primitive

__all__ = ["Primitive", "ReduceOp"]
for _module in (_primitives, _collectives):
    for _name, _value in vars(_module).items():
        if not _name.startswith("_") and isinstance(_value, type) \
                and issubclass(_value, Primitive) and _value is not Primitive:
            globals()[_name] = _value
            __all__.append(_name)
del _module, _name, _value
