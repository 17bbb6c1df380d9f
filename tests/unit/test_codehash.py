"""Code hashes follow imports: a script's hash covers exactly the eagleflow modules it reaches."""

import ast

import pytest

from eagleflow import codehash
from tests.conftest import REPO


def _deps(script: str) -> set[str]:
    """The files a script's hash covers, relative to the repository (subpackages included)."""
    return {p.relative_to(REPO).as_posix() for p in codehash.dependencies(REPO / script)}


def test_dependencies_follow_eagleflow_imports_transitively():
    deps = _deps("workflow/scripts/prepare_prompts.py")
    # script -> eagleflow.data.prompts -> eagleflow.target.prepare -> eagleflow.util,
    # eagleflow.stage -> eagleflow.errors, and the package __init__s (eagleflow, eagleflow.data)
    assert {
        "workflow/scripts/prepare_prompts.py",
        "src/eagleflow/data/prompts.py",
        "src/eagleflow/target/prepare.py",
        "src/eagleflow/util.py",
        "src/eagleflow/stage.py",
        "src/eagleflow/errors.py",
        "src/eagleflow/__init__.py",
        "src/eagleflow/data/__init__.py",
        "src/eagleflow/target/__init__.py",
    } <= deps
    assert "src/eagleflow/serve/acceptance.py" not in deps and "src/eagleflow/layers.py" not in deps
    # the regeneration half of the data stage is another module: prepare_prompts does not hash it
    assert "src/eagleflow/data/regenerate.py" not in deps and "src/eagleflow/engines.py" not in deps


def test_dependencies_follow_imports_between_modules_of_a_subpackage():
    deps = _deps("workflow/scripts/regenerate.py")
    # script -> eagleflow.data.regenerate -> eagleflow.data.prompts (a sibling) and
    # eagleflow.engines (imported inside a function counts too) -> eagleflow.errors
    assert {
        "src/eagleflow/data/regenerate.py",
        "src/eagleflow/data/prompts.py",
        "src/eagleflow/data/regenerate_hf.py",
        "src/eagleflow/engines.py",
        "src/eagleflow/data/__init__.py",
    } <= deps
    assert "src/eagleflow/data/tokenize.py" not in deps


DOC = '"""Doc."""\n'


def test_hash_follows_meaning_not_comments_docstrings_or_layout(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(DOC + "import json\n\n\ndef f(x):\n    " + DOC + "    return x + 1\n")
    before = codehash.code_hash(script)
    same = [
        '"""Other doc."""\nimport json  # a comment\n\ndef f(x):\n    return x + 1\n',
        "import json\ndef f( x ):\n    '''Changed.'''\n    return (x + 1)\n",
    ]
    for text in same:
        script.write_text(text)
        assert codehash.code_hash(script) == before, text
    changed = [
        DOC + "import json\n\n\ndef f(x):\n    " + DOC + "    return x + 2\n",
        DOC + "import json\n\n\ndef g(x):\n    " + DOC + "    return x + 1\n",
        DOC + "import json\n\n\ndef f(x):\n    " + DOC + '    "a string statement"\n'
        "    return x + 1\n",
    ]
    for text in changed:
        script.write_text(text)
        assert codehash.code_hash(script) != before, text


HASHED = sorted((REPO / "src/eagleflow").rglob("*.py")) + sorted(
    (REPO / "workflow/scripts").glob("*.py")
)


@pytest.mark.parametrize("path", HASHED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_module_ignores_a_comment_and_a_docstring_edit(path, tmp_path):
    """What an edit that changes no behaviour does to each file the rules hash: nothing."""
    text = path.read_text()
    doc = ast.get_docstring(ast.parse(text), clean=False)
    edited = "# an added comment\n" + text + "\n# another\n"
    if doc:
        edited = edited.replace(doc, doc + "\n\nAn added paragraph.", 1)
    else:
        edited = '"""An added docstring."""\n' + edited
    copy = tmp_path / path.name
    copy.write_text(edited)
    assert codehash.meaning(copy) == codehash.meaning(path)
    copy.write_text(text + "\nCHANGED = 1\n")  # and a change of meaning is seen
    assert codehash.meaning(copy) != codehash.meaning(path)


def test_a_check_only_import_is_not_part_of_the_hash():
    """regenerate's early layer-id check: layers.py edits must not rerun regeneration."""
    deps = _deps("workflow/scripts/regenerate.py")
    assert "src/eagleflow/layers.py" not in deps and "src/eagleflow/data/regenerate.py" in deps
    assert "check_layers" in (REPO / "workflow/scripts/regenerate.py").read_text()
