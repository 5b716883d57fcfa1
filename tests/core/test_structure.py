"""The shape of core/: small classes and functions, every private upstream name behind core/upstream, excepts that
name what they catch, and the plugin imported one way (as a package, never `core` on its own)."""
import ast
import re
import sys
from pathlib import Path

from conftest import ROOT

CORE = sorted((ROOT / "core").rglob("*.py"))
MAX_CLASS, MAX_FUNCTION = 150, 60


def _defs(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node, node.end_lineno - node.lineno + 1


def test_no_class_over_150_lines_no_function_over_60():
    big = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({lines} lines)" for p in CORE for n, lines in _defs(p)
           if lines > (MAX_CLASS if isinstance(n, ast.ClassDef) else MAX_FUNCTION)]
    assert not big, big


def test_broad_excepts_say_why():
    """`except Exception` only where any failure must be survived, with the reason on the line (noqa: BLE001)."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in CORE + sorted((ROOT / "nodes").glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"except (Exception|BaseException)\b|except:", line) and "noqa: BLE001 --" not in line]
    assert not found, found


def test_the_plugin_is_imported_as_one_package():
    """Tests, tools and probes import fluxaccel.core..., never a top-level core (which would be a second copy)."""
    files = [p for d in ("tests", "tools", "bench") for p in (ROOT / d).rglob("*.py")]
    top_level = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.match(r"\s*(from core[. ]|import core\b)", line)]
    assert not top_level, top_level
    import fluxaccel.core.errors

    assert Path(fluxaccel.core.errors.__file__) == ROOT / "core" / "errors.py"
    assert "core" not in sys.modules, "a top-level `core` import made a second copy of the plugin's modules"
