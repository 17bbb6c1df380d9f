"""The package's import graph, read from the sources with `ast` (imports inside functions
count: they run, and the rerun hashes follow them): no module imports one that imports it back,
a stage subpackage imports no later stage, and the shared helpers import no stage at all."""

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


# The stage subpackages in workflow order (workflow/rules/*.smk): a stage may import an earlier
# one and the top-level helpers, never a later one.
STAGES = ("target", "data", "extract", "train", "serve", "report")
# Top-level modules every stage shares: they import no stage subpackage (nor remote).
HELPERS = ("config", "errors", "stage", "codehash", "layers", "disk", "util", "engines", "drafts")
SUBPACKAGES = (*STAGES, "remote")
# (importer, imported) pairs allowed against the rules above, each with its reason.
ALLOWED = {
    # config.check's cross-field rules include the benchmark's own (bench.config_problems); the
    # import is inside check(), so parsing the Snakefile does not load the serve stage.
    ("eagleflow.config", "eagleflow.serve.bench"): "lazy, config's cross-field checks",
    ("eagleflow.config", "eagleflow.serve"): "the package of the import above",
}


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else None


def order_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points the wrong way: a stage importing a later stage, or a helper
    importing any stage subpackage (less ALLOWED)."""
    out = []
    for module, deps in sorted(graph.items()):
        own = _subpackage(module)
        helper = module.split(".")[-1] in HELPERS and module.count(".") == 1
        for dep in sorted(deps):
            other = _subpackage(dep)
            if other is None or (module, dep) in ALLOWED:
                continue
            if helper:
                out.append(f"helper {module} imports {dep}")
            elif own in STAGES and other in STAGES and STAGES.index(other) > STAGES.index(own):
                out.append(f"{module} (stage {own}) imports {dep} (later stage {other})")
    return out


def test_stages_import_only_earlier_stages_and_helpers_no_stage():
    graph = import_graph()
    assert {f"eagleflow.{s}" for s in SUBPACKAGES} <= set(graph)
    assert {f"eagleflow.{h}" for h in HELPERS} <= set(graph)
    assert order_violations(graph) == []


def test_the_order_check_finds_a_later_stage_and_a_helper_importing_a_stage():
    graph = import_graph()
    assert order_violations(graph) == []
    graph["eagleflow.data.prompts"] = graph["eagleflow.data.prompts"] | {"eagleflow.train.loop"}
    graph["eagleflow.util"] = graph["eagleflow.util"] | {"eagleflow.extract.hf"}
    graph["eagleflow.engines"] = graph["eagleflow.engines"] | {"eagleflow.serve.bench"}
    # an earlier stage, and a stage importing a helper, are fine
    graph["eagleflow.report.plots"] = graph["eagleflow.report.plots"] | {"eagleflow.target.prepare"}
    graph["eagleflow.train.loop"] = graph["eagleflow.train.loop"] | {"eagleflow.drafts"}
    assert sorted(order_violations(graph)) == [
        "eagleflow.data.prompts (stage data) imports eagleflow.train.loop (later stage train)",
        "helper eagleflow.engines imports eagleflow.serve.bench",
        "helper eagleflow.util imports eagleflow.extract.hf",
    ]
