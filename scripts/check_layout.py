#!/usr/bin/env python3
"""The package's layout rules, read from the source with `ast` (nothing is imported or run).

- No import circle between kvcalib's modules, counting every import: module-level,
  function-local and `if TYPE_CHECKING:` ones alike. A package's `__init__` is a module of
  its own: `from kvcalib.calibrate import x` is an edge to kvcalib/calibration/__init__.py.
- No module over MAX_MODULE_TOKENS code tokens, no function over MAX_FUNCTION_TOKENS: Python's tokens
  without docstrings, comments, newlines or indentation, so the measure is the code, not where the
  formatter breaks its lines.

Which way imports go between the layers (cli -> jobs -> hf -> core), and that typer and rich stay in
kvcalib.cli, are import-linter's contracts in pyproject.toml (`lint-imports`).

Prints the numbers (modules, code tokens, circles, the biggest module, the longest function) and
exits 1 with the reasons when a rule is broken. CI runs it (scripts/test.sh).

    python scripts/check_layout.py [PACKAGE_DIR]
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path

MAX_MODULE_TOKENS = 4_000
MAX_FUNCTION_TOKENS = 750
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "package", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent / "kvcalib"
    )
    root = parser.parse_args().package.resolve()
    files, edges = read_package(root)
    sizes = {
        name: len(code_token_lines(path.read_text(encoding="utf-8")))
        for name, path in files.items()
    }
    found_circles = circles(edges)
    funcs = functions(files)
    biggest = max(sizes, key=sizes.get)
    packages = sorted({n for n, p in files.items() if p.name == "__init__.py" and n != root.name})
    print(
        f"{len(files)} modules, {sum(sizes.values())} code tokens, {len(packages)} subpackages, "
        f"{len(found_circles)} import circle(s)"
    )
    print(
        f"biggest module: {biggest} ({sizes[biggest]} code tokens); "
        f"longest function: {funcs[0][1]} ({funcs[0][0]} code tokens)"
    )
    problems = [f"import circle: {' -> '.join(c)}" for c in found_circles]
    problems += [
        f"{n}: {count} code tokens (at most {MAX_MODULE_TOKENS})"
        for n, count in sizes.items()
        if count > MAX_MODULE_TOKENS
    ]
    problems += [
        f"{where}: {count} code tokens (at most {MAX_FUNCTION_TOKENS})"
        for count, where in funcs
        if count > MAX_FUNCTION_TOKENS
    ]
    for problem in problems:
        print(f"layout: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
