"""The table of supported MindSpore primitives and how each is sharded, made from the op
registry and the sharding rules themselves (so it cannot go stale): the user guide's
``docs/ops.md`` is its output, and a test checks that the page equals it.

    python -m dualmode.parallel.op_table > docs/ops.md
"""
from __future__ import annotations

import inspect
import re
import sys
from typing import List, Tuple

from ..ops import operations as P
from ..ops._registry import REGISTRY
from ..ops.collectives import _Collective
from ..ops.primitive import Primitive
from . import rules
from .sharding import RULES

__all__ = ["rows", "markdown"]

_TITLE = "# Supported MindSpore primitives and their sharding rules"


def _summary(module) -> str:
    """The first paragraph of `module`'s docstring, on one line."""
    doc = inspect.getdoc(module) or ""
    text = " ".join(doc.split("\n\n")[0].split()).replace("``", "`")
    return re.sub(r":(?:mod|func|class):`\.?([\w.]+)`", r"`\1`", text)


def rows() -> List[Tuple[str, str, str, str]]:
    """``(primitive, registered op, sharding rule, gradient)`` for every primitive class
    of ``dualmode.ops.operations``, by name."""
    out = []
    for name in sorted(P.__all__):
        cls = getattr(P, name)
        if not (isinstance(cls, type) and issubclass(cls, Primitive)) or cls is Primitive:
            continue
        if issubclass(cls, _Collective):
            out.append((name, "collective", "user collective over its group (hybrid "
                        "parallel code)", "yes"))
            continue
        op = REGISTRY.get(getattr(cls, "name", name))
        if op is None:
            out.append((name, "composite", "the rules of the ops it is written with", "yes"))
            continue
        rule = RULES.get(op.name)
        fam = rules.family_of(op)
        if fam is not None:
            how = f"family `{fam[0]}`"
        elif rule is not None:
            how = f"own rule (`rules/{rule.__module__.rsplit('.', 1)[-1]}.py`)"
        else:
            how = "none: inputs gathered, run whole"
        out.append((name, op.name, how, "yes" if op.backward is not None else "no"))
    return out


def markdown() -> str:
    """The page: the table, then what each family's rule does."""
    lines = [_TITLE, "",
             "Every primitive below runs eagerly on one device, sharded in PyNative mode "
             "(with `.shard(...)` under semi-auto or auto parallel) and in compiled graphs "
             "(`ops.shard`, `Cell.shard`, GRAPH_MODE), each tested against the single-device "
             "result. This page is generated from the op registry "
             "(`python -m dualmode.parallel.op_table`).", "",
             "| primitive | registered op | sharding rule | gradient |",
             "| --- | --- | --- | --- |"]
    lines += [f"| `ops.{p}` | {op} | {how} | {grad} |" for p, op, how, grad in rows()]
    lines += ["", "## The rules", ""]
    modules = [rules.elementwise, rules.reduce, rules.along_axis, rules.contract,
               rules.rowwise, rules.array, rules.conv, rules.norm]
    for module in modules:
        lines += [f"**`rules/{module.__name__.rsplit('.', 1)[-1]}.py`.** {_summary(module)}",
                  ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
