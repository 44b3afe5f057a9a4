"""The package's modules import each other without cycles (function-local imports
count: an import hidden in a function to dodge a cycle is still a cycle), and each
subpackage imports on its own in a fresh interpreter."""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "dualmode"


def _modules():
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _resolve(cur, is_pkg, level, name):
    if level == 0:
        return name
    base = cur.split(".") if is_pkg else cur.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph():
    """module -> the package modules it imports (anywhere in the file). ``import a.b``
    is an edge to a.b; ``from a import b`` to a.b when that is a module, else to a."""
    mods = _modules()
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(m, is_pkg, node.level, node.module or "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            edges[m].update(t for t in targets if t in mods and t != m)
    return edges


def cycles(edges):
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (function-local imports included):\n" + "\n".join(
        " -> ".join(c) for c in found)


@pytest.mark.parametrize("module", ["dualmode", "dualmode.ops", "dualmode.tensor",
                                    "dualmode.context", "dualmode.communication",
                                    "dualmode.parallel", "dualmode.dataset", "dualmode.nn",
                                    "dualmode.train"])
def test_module_imports_alone(module):
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
