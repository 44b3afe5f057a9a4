"""Every code block in docs/ and README.md runs: the ```python blocks of one page in
order in one namespace (in a temporary directory, parallel context restored after), so
a later block may use what an earlier one defined. A block preceded by the marker
``<!-- doctest: skip: reason -->`` is reported as skipped with that reason; blocks
tagged as data or output (json, text, untagged) are not code. Shell blocks must carry
a marker (they start processes or install packages)."""
import pathlib
import re
import tempfile

import pytest

from dualmode.parallel.check import parallel_settings

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARKER = re.compile(r"<!--\s*doctest:\s*skip:\s*(.+?)\s*-->")
SHELL = {"bash", "sh", "shell", "console"}
# README.md is edited by another engineer; its shell blocks (install, the test run, the
# MPI launch) await their doctest markers there
UNMARKED_README_SHELL = "README.md shell block (install / test run / MPI launch)"


def _blocks(path):
    """[(line, language, code, skip reason or None)] of the fenced blocks of `path`."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2).lower(), i
        body = []
        i += 1
        while i < len(lines) and not (FENCE.match(lines[i]) and
                                      lines[i].strip() == "```"):
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line)
            i += 1
        i += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = MARKER.search(prev)
        out.append((start + 1, lang, "\n".join(body) + "\n", mark.group(1) if mark else None))
    return out


def _page_id(p):
    return str(p.relative_to(ROOT))


SKIPPED = [(p, line, lang, reason) for p in PAGES for line, lang, _code, reason in _blocks(p)
           if reason is not None
           or (lang in SHELL and p.name == "README.md" and p.parent == ROOT)]


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_python_blocks_run(page, tmp_path, monkeypatch, capsys):
    blocks = [(line, code) for line, lang, code, reason in _blocks(page)
              if lang == "python" and reason is None]
    if not blocks:
        pytest.skip(f"{_page_id(page)}: no runnable Python block")
    work, system_tmp = tmp_path / "work", tmp_path / "system_tmp"
    work.mkdir()
    system_tmp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))    # what tempfile hands out
    namespace = {"__name__": "__doc_snippet__"}
    with parallel_settings():
        for line, code in blocks:
            try:
                exec(compile(code, f"{_page_id(page)}:{line}", "exec"), namespace)
            except Exception as e:
                pytest.fail(f"{_page_id(page)}, block at line {line}: "
                            f"{type(e).__name__}: {e}")
    left = sorted(p.name for p in system_tmp.iterdir())
    assert not left, f"{_page_id(page)}: its code leaves temporary files behind: {left}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_shell_blocks_are_marked(page):
    if page.name == "README.md" and page.parent == ROOT:
        pytest.skip(UNMARKED_README_SHELL)
    bad = [line for line, lang, _code, reason in _blocks(page)
           if lang in SHELL and reason is None]
    assert not bad, (f"{_page_id(page)}: shell block(s) at line(s) {bad} have no "
                     f"'<!-- doctest: skip: reason -->' marker")


@pytest.mark.parametrize("page, line, lang, reason", SKIPPED,
                         ids=[f"{_page_id(p)}:{line}" for p, line, _l, _r in SKIPPED])
def test_marked_blocks_are_skipped_visibly(page, line, lang, reason):
    pytest.skip(f"{lang or 'text'} block: {reason or UNMARKED_README_SHELL}")
