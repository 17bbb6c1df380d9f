"""The results layout is written once: every rule's output path comes from eagleflow.layout."""

import re

from eagleflow import layout
from tests.conftest import REPO

RULES = REPO / "workflow" / "rules"
ENTRIES = {k: v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str)}


def _rules_text() -> str:
    return "\n".join(p.read_text() for p in sorted(RULES.glob("*.smk")))


def test_every_rule_path_is_a_layout_entry():
    """No rule types a path of its own: each `res(...)` names a layout entry."""
    calls = re.findall(r"\bres\(([^()]*(?:\([^()]*\))?[^()]*)\)", _rules_text())
    assert calls, "no res(...) call found: the rules no longer use common.smk's res"
    # (common.smk's own `def res(entry, **fields)` is the one call-like match that is no call)
    typed = [c for c in calls if not c.strip().startswith(("layout.", "entry"))]
    assert not typed, f"paths typed in the rules instead of eagleflow.layout: {typed}"


def test_every_layout_entry_is_used_by_a_rule():
    text = _rules_text()
    unused = [k for k in ENTRIES if f"layout.{k}" not in text]
    assert not unused, f"layout entries no rule writes: {unused}"


def test_path_fills_fields_and_keeps_wildcards_otherwise():
    assert layout.path("res", layout.BENCH, engine="vllm", config="s3").as_posix() == (
        "res/bench/vllm/s3.json"
    )
    assert layout.path("res", layout.BENCH).as_posix() == "res/bench/{engine}/{config}.json"
