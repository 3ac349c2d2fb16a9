#!/usr/bin/env python3
"""The package's layout rules, read from the source with `ast` (nothing is imported or run).

- No import circle between kvcalib's modules, counting every import: module-level,
  function-local and `if TYPE_CHECKING:` ones alike. A package's `__init__` is a module of
  its own: `from kvcalib.calibrate import x` is an edge to kvcalib/calibration/__init__.py.
- The token report: code tokens (Python's tokens without docstrings, comments, newlines or
  indentation, so the measure is the code, not where the formatter breaks its lines) of the package,
  tests/ and scripts/, and the largest modules and functions. No cap: a cap invites code to be moved,
  not simplified; the report is read with the whole change at review.

Which way imports go between the layers (cli -> jobs -> hf -> core), and that typer and rich stay in
kvcalib.cli, are import-linter's contracts in pyproject.toml (`lint-imports`).

Prints the report and exits 1 when there is an import circle. CI runs it (scripts/test.sh).

    python scripts/check_layout.py [PACKAGE_DIR]
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path

TOP = 8  # modules and functions listed, largest first
_NOT_CODE = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(
    node: ast.ImportFrom | ast.Import, current: str, is_package: bool, modules: set[str]
) -> list[str]:
    """The kvcalib modules an import statement names (a `from X import y` may name module X.y)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = current.split(".") if is_package else current.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    found = []
    for alias in node.names:
        candidate = f"{stem}.{alias.name}"
        found.append(candidate if candidate in modules else stem)
    return found


def read_package(root: Path) -> tuple[dict[str, Path], dict[str, set[str]]]:
    """Modules by name and kvcalib import edges."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    edges: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in resolve(node, name, path.name == "__init__.py", modules):
                top = target.split(".")[0]
                if top == root.name:
                    while target not in modules and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target != name:
                        edges[name].add(target)
    return files, edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def code_token_lines(source: str) -> list[int]:
    """The line of each code token in `source` (docstrings, comments and layout tokens left out)."""
    out = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in _NOT_CODE:
            continue
        if token.type == tokenize.STRING and token.string.lstrip("rbuRBU").startswith(
            ('"""', "'''")
        ):
            continue
        out.append(token.start[0])
    return out


def functions(files: dict[str, Path]) -> list[tuple[int, str]]:
    """(code tokens, "module:qualname") of every function and method, nested ones counted in their outer one too."""
    out = []

    def walk(node: ast.AST, prefix: str, name: str, token_lines: list[int]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}{child.name}"
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                count = sum(start <= line <= child.end_lineno for line in token_lines)
                out.append((count, f"{name}:{qual}"))
                walk(child, qual + ".", name, token_lines)
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.", name, token_lines)

    for name, path in files.items():
        source = path.read_text(encoding="utf-8")
        walk(ast.parse(source), "", name, code_token_lines(source))
    return sorted(out, reverse=True)


def tokens(path: Path) -> int:
    return len(code_token_lines(path.read_text(encoding="utf-8")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "package", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent / "kvcalib"
    )
    root = parser.parse_args().package.resolve()
    files, edges = read_package(root)
    sizes = sorted(((tokens(path), name) for name, path in files.items()), reverse=True)
    found_circles = circles(edges)
    trees = [root] + [root.parent / d for d in ("tests", "scripts") if (root.parent / d).is_dir()]
    print(
        "code tokens: "
        + ", ".join(f"{t.name}/ {sum(tokens(p) for p in t.rglob('*.py')):,}" for t in trees)
        + f"; {len(files)} modules, {len(found_circles)} import circle(s)"
    )
    for title, rows in (("modules", sizes), ("functions", functions(files))):
        print(f"largest {title}: " + ", ".join(f"{where} {count:,}" for count, where in rows[:TOP]))
    for circle in found_circles:
        print(f"layout: import circle: {' -> '.join(circle)}")
    return 1 if found_circles else 0


if __name__ == "__main__":
    sys.exit(main())
