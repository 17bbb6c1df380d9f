"""The package's import graph, read from the sources with `ast` (imports inside functions
count: they run, and the rerun hashes follow them): no module imports one that imports it back."""

import ast

from tests.conftest import REPO

PACKAGE = REPO / "src" / "eagleflow"


def import_graph() -> dict[str, set[str]]:
    """eagleflow module -> the eagleflow modules it imports, anywhere in its code."""
    modules = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in PACKAGE.rglob("*.py")
    }
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {d for d in deps if d in modules and d not in (name, "eagleflow")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    assert len(graph) > 25 and "eagleflow.train.loop" in graph
    assert cycles(graph) == []


def test_the_circle_check_finds_a_circle():
    graph = import_graph()
    graph["eagleflow.errors"] = graph["eagleflow.errors"] | {"eagleflow.train.loop"}
    found = cycles(graph)
    assert found and "eagleflow.errors" in found[0] and "eagleflow.train.loop" in found[0]
