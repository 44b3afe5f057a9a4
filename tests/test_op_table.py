"""docs/ops.md, the table of supported primitives and their sharding rules, is the
registry's own account of itself: regenerate it with
``python -m dualmode.parallel.op_table > docs/ops.md`` when an op is added."""
import pathlib

from dualmode.ops import operations as P
from dualmode.parallel import op_table

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_docs_ops_page_is_the_generated_table():
    page = (ROOT / "docs" / "ops.md").read_text()
    assert page == op_table.markdown(), (
        "docs/ops.md is stale: run python -m dualmode.parallel.op_table > docs/ops.md")


def test_every_primitive_has_a_row_naming_its_rule():
    rows = {r[0]: r for r in op_table.rows()}
    assert set(rows) == {n for n in P.__all__ if n not in ("Primitive", "ReduceOp")}
    assert rows["MatMul"][2] == "family `contract`"
    assert rows["Gather"][2] == "own rule (`rules/array.py`)"
    assert rows["Conv2D"][2] == "own rule (`rules/conv.py`)"
    assert rows["AllReduce"][1] == "collective"
