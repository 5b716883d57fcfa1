"""README.md as GitHub renders it (markdown-it-py with GitHub's table rule): at most 150 lines; its first block the two
commands; every table row with its header's number of cells, on one line each, and no cell over 300 characters; every
local link and image pointing at a file of the repository."""
import re

import pytest
from markdown_it import MarkdownIt

from conftest import ROOT

README = ROOT / "README.md"
MD = MarkdownIt("commonmark").enable("table")


def _cells(line: str) -> list[str]:
    """A table row's cells as GitHub splits them: on pipes not escaped, the outer pipes dropped."""
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return re.split(r"(?<!\\)\|", inner)


def _tables(text: str) -> list[tuple[int, int]]:
    """(first line, end line) of each table the parser finds."""
    return [tuple(t.map) for t in MD.parse(text) if t.type == "table_open"]


def test_length_and_the_two_commands_first():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    fence = next(t for t in MD.parse(text) if t.type == "fence")
    assert fence.content.splitlines()[:2] == [
        line for line in fence.content.splitlines() if line.startswith(("bash scripts/bench.sh", "bash scripts/test.sh"))]


def test_every_table_row_renders_as_one_row_of_its_headers_width():
    text = README.read_text()
    lines = text.splitlines()
    tables = _tables(text)
    assert len(tables) >= 4
    for start, end in tables:
        rows = lines[start:end]
        width = len(_cells(rows[0]))
        assert all(r.lstrip().startswith("|") and len(_cells(r)) == width for r in rows), rows
        # the line after a table is not a row that fell out of it (a cell broken over two lines)
        assert end >= len(lines) or not lines[end].strip() or lines[end].lstrip().startswith(("#", "!")), lines[end]
    tokens = MD.parse(text)
    cells = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type in ("td_open", "th_open")]
    assert cells and max(map(len, cells)) <= 300, max(cells, key=len)


@pytest.mark.parametrize("bad", ["| a | b |\n|---|---|\n| one | two |\nbroken on | the next line |\n",
                                 "| a | b |\n|---|---|\n| one | two | three |\n"])
def test_the_check_finds_a_broken_table(bad):
    lines = bad.splitlines()
    (start, end), = _tables(bad)
    rows = lines[start:end]
    width = len(_cells(rows[0]))
    assert not all(r.lstrip().startswith("|") and len(_cells(r)) == width for r in rows) or \
        (end < len(lines) and lines[end].strip())


def test_local_links_point_at_files():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local and all((ROOT / t).exists() for t in local), [t for t in local if not (ROOT / t).exists()]
