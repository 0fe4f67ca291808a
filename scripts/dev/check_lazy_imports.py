"""First-party imports sit at module top unless a comment says why one is lazy.

A function-level import of a first-party package (``FIRST_PARTY`` below) needs, on
its own line or on a comment line right above its group of imports, a comment starting
``# lazy:`` and a reason. A module whose every verb imports lazily (the command line) may say
so once, in a top-level comment ``# lazy imports: <reason>``. Run by ``make test``; prints
each import without one and exits 1.

    python scripts/dev/check_lazy_imports.py [PATH ...]
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

FIRST_PARTY = (
    "syshax",
    "controlplane",
    "agents",
    "router",
    "sim",
    "loadgen",
    "hetero",
    "kvbench",
    "common",
    "kvconnector",
    "testbed",
)
ROOTS = FIRST_PARTY
LAZY = re.compile(r"#\s*lazy:\s*\S")
MODULE_WAIVER = re.compile(r"^#\s*lazy imports:\s*\S", re.MULTILINE)


def _first_party(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").split(".")[0] in FIRST_PARTY
    return any(alias.name.split(".")[0] in FIRST_PARTY for alias in node.names)


def _import_runs(tree: ast.Module) -> Iterator[list[ast.Import | ast.ImportFrom]]:
    """Runs of consecutive import statements inside function bodies (at any depth)."""
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for block in ast.walk(fn):
            for field in ("body", "orelse", "finalbody", "handlers"):
                run: list[ast.Import | ast.ImportFrom] = []
                stmts = getattr(block, field, None)
                for stmt in stmts if isinstance(stmts, list) else ():
                    if isinstance(stmt, ast.Import | ast.ImportFrom):
                        run.append(stmt)
                        continue
                    if run:
                        yield run
                    run = []
                if run:
                    yield run


def problems(path: Path) -> list[str]:
    text = path.read_text()
    if MODULE_WAIVER.search(text):
        return []
    lines = text.splitlines()
    found: dict[int, str] = {}
    for run in _import_runs(ast.parse(text, str(path))):
        above = lines[run[0].lineno - 2] if run[0].lineno >= 2 else ""
        said = above.strip().startswith("#") and LAZY.search(above)
        for node in run:
            if _first_party(node) and not (said or LAZY.search(lines[node.lineno - 1])):
                found[node.lineno] = f"{path}:{node.lineno}: {lines[node.lineno - 1].strip()}"
    return [found[k] for k in sorted(found)]


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [Path(r) for r in ROOTS]
    files = sorted(
        p
        for root in roots
        for p in ([root] if root.is_file() else root.rglob("*.py"))
        if "migrations" not in p.parts
    )
    found = [line for path in files for line in problems(path)]
    for line in found:
        print(line)
    if found:
        print(
            f"{len(found)} function-level first-party imports without a '# lazy: <reason>' "
            "comment: move them to the module top, or say why they cannot be there",
            file=sys.stderr,
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
