"""The layout stays readable: one room per concern, none too large to hold in one's head.

Limits: a Python module of ``indexer/`` or ``api/`` at most 600 lines, a class at most
400, a C file of ours at most 1,200 (the vendored ``xxhash.h`` is not ours). The import
rules between layers are import-linter's (``lint-imports``, contracts in pyproject.toml).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE, MAX_CLASS, MAX_C = 600, 400, 1200


def _ours(pattern: str) -> list[Path]:
    return sorted(p for top in ("indexer", "api") for p in (ROOT / top).rglob(pattern) if "vendor" not in p.parts)


def test_no_module_over_600_lines() -> None:
    over = {str(p.relative_to(ROOT)): n for p in _ours("*.py") if (n := len(p.read_text().splitlines())) > MAX_MODULE}
    assert over == {}


def test_no_class_over_400_lines() -> None:
    over = {}
    for p in _ours("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS:
                    over[f"{p.relative_to(ROOT)}:{node.name}"] = n
    assert over == {}


def test_no_c_file_over_1200_lines() -> None:
    files = _ours("*.c") + _ours("*.h")
    assert files, "no C sources found: the compiled core moved?"
    over = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_C}
    assert over == {}
