"""Content hashes of a rule's code, for Snakemake params (exact reruns on any content edit).

Snakemake's `code` trigger is mtime-based for `script:` rules and misses a content edit with an
old mtime. A params entry holding the sha256 of the script and of every `eagleflow` module it
imports (transitively) reruns exactly the rules an edit invalidates.
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


@cache
def _imports(path: Path) -> tuple[str, ...]:
    """Names of the eagleflow modules `path` imports, at any depth of its code."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from eagleflow import serve` imports the submodule eagleflow.serve
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


def code_hash(script: str | Path) -> str:
    """sha256 over the script and the eagleflow modules it imports (paths relative, sorted)."""
    h = hashlib.sha256()
    root = PACKAGE_DIR.parent
    for path in dependencies(script):
        try:
            label = path.relative_to(root)
        except ValueError:
            label = Path(path.name)
        h.update(str(label).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
