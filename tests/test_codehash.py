"""Code hashes follow imports: a script's hash covers exactly the eagleflow modules it reaches."""

import ast

import pytest

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


@pytest.mark.parametrize("path", HASHED, ids=lambda p: p.name)
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
    deps = {p.name for p in codehash.dependencies(REPO / "workflow/scripts/regenerate.py")}
    assert "layers.py" not in deps and "data.py" in deps
    assert "check_layers" in (REPO / "workflow/scripts/regenerate.py").read_text()
