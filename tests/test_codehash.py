"""Code hashes follow imports: a script's hash covers exactly the eagleflow modules it reaches."""

from eagleflow import codehash
from tests.conftest import REPO


def test_dependencies_follow_eagleflow_imports_transitively():
    deps = {p.name for p in codehash.dependencies(REPO / "workflow/scripts/prepare_prompts.py")}
    # script -> eagleflow.data -> eagleflow.targets, eagleflow.serve (imported inside a function
    # counts too), eagleflow.stage -> eagleflow.errors, and the package __init__
    assert {
        "prepare_prompts.py",
        "data.py",
        "targets.py",
        "serve.py",
        "stage.py",
        "errors.py",
        "__init__.py",
    } <= deps
    assert "acceptance.py" not in deps and "layers.py" not in deps


def test_hash_changes_with_content_not_mtime(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import json\n")
    before = codehash.code_hash(script)
    script.write_text("import json  # edited\n")
    assert codehash.code_hash(script) != before
    script.write_text("import json\n")
    assert codehash.code_hash(script) == before
