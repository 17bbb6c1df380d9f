"""Hashes of what a rule's code means, for Snakemake params (exact reruns, and only those).

Snakemake's `code` trigger is mtime-based for `script:` rules and misses a content edit with an
old mtime. A params entry holding the hash of the script and of every `eagleflow` module it
imports (transitively) reruns the rules an edit invalidates. Each file is hashed as its syntax
tree without docstrings (`meaning`), so a comment, docstring or formatting edit reruns nothing,
while any change to what the code does (a name, a constant, a statement) reruns its rules.
"""

from __future__ import annotations

import ast
import hashlib
from functools import cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _module_file(name: str) -> Path | None:
    """The source file of `eagleflow.x.y`, or None for anything outside the package."""
    parts = name.split(".")
    if parts[0] != "eagleflow":
        return None
    base = PACKAGE_DIR.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


# An import marked so on its line is a check that cannot change the rule's outputs (e.g.
# regenerate refusing bad layer ids early): its module is not part of the rule's hash.
CHECK_ONLY = "# codehash: check only"


@cache
def _imports(path: Path) -> tuple[str, ...]:
    """Names of the eagleflow modules `path` imports, at any depth of its code (less the
    imports marked CHECK_ONLY)."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text, filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and CHECK_ONLY in lines[node.lineno - 1]:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from eagleflow.serve import bench` imports the submodule eagleflow.serve.bench
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return tuple(sorted(n for n in names if n.split(".")[0] == "eagleflow"))


def dependencies(script: str | Path) -> list[Path]:
    """The script plus every eagleflow module file it reaches through imports, sorted."""
    seen: dict[Path, None] = {}
    todo = [Path(script).resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = None
        for name in _imports(path):
            # importing eagleflow.a.b also runs eagleflow/__init__.py and eagleflow/a/__init__.py
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                dep = _module_file(".".join(parts[:i]))
                if dep is not None and dep not in seen:
                    todo.append(dep)
    return sorted(seen)


_DOC_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _canonical(node) -> str:
    """A stable text of a syntax tree: node types and non-empty fields, no positions.

    Fields that are None or empty lists are left out, so the text does not change between
    Python versions that add such fields (3.12's `type_params`) or print them differently
    (`ast.dump` in 3.13 hides them)."""
    if isinstance(node, ast.AST):
        body = getattr(node, "body", None)
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if name == "body" and isinstance(node, _DOC_OWNERS) and body and _is_docstring(body[0]):
                value = body[1:]
            if value is None or value == []:
                continue
            fields.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(x) for x in node) + "]"
    return repr(node)


def meaning(path: str | Path) -> str:
    """The file's syntax tree without docstrings, comments or layout, as stable text."""
    return _meaning_of(Path(path).read_text())


@cache
def _meaning_of(text: str) -> str:  # every rule hashes the shared modules again: parse once
    return _canonical(ast.parse(text))


def code_hash(script: str | Path) -> str:
    """sha256 over what the script and the eagleflow modules it imports mean (`meaning`), each
    labelled by its path relative to the package's parent, in sorted order."""
    h = hashlib.sha256()
    root = PACKAGE_DIR.parent
    for path in dependencies(script):
        try:
            label = path.relative_to(root)
        except ValueError:
            label = Path(path.name)
        h.update(str(label).encode() + b"\0" + meaning(path).encode() + b"\0")
    return h.hexdigest()
