"""eagleflow's SGLang layer-id translations against SGLang's own `set_eagle3_layers_to_capture`.

For every translation row (Llama and DeepSeek-family model files, embed / first id 1 / first id
2 / later ids, SGLang's default when no ids are written) the layers SGLang 0.5.23 captures for the
ids eagleflow writes must be exactly the layers eagleflow trained on.
"""

from pathlib import Path

import pytest

from eagleflow import layers as lay
from eagleflow.layers import RULE_PLUS_ONE, RULE_PLUS_ONE_IF_FIRST_1
from tests.contract.probe import run_probe

pytestmark = pytest.mark.contract
PROBE = Path(__file__).with_name("sglang_probe.py")

# (family, num_layers, internal ids) covering every row of the translation table
ROWS = [
    ("llama", 30, [2, 15, 27]),
    ("llama", 30, [0, 15, 29]),  # embed: SGLang Llama needs -1 written
    ("llama", 32, [1, 15, 28]),
    ("llama", 4, [0, 2, 3]),
    ("deepseek", 61, [2, 30, 58]),  # first id 2: [1, ...] written, read alike by every release
    ("deepseek", 61, [0, 3, 31]),  # embed first: current rule, written as is
    ("deepseek", 61, [3, 31, 59]),
    ("deepseek", 8, [0, 4, 7]),
]


def _run(sglang_python, request: dict) -> dict:
    return run_probe(sglang_python, PROBE, request)


@pytest.fixture(scope="module")
def captures(sglang_python):
    cases = []
    for family, n, ids in ROWS:
        sg = lay.sglang_ids(ids, n, family, "0.5.23")
        assert sg.written is not None, sg.problems
        cases.append({"family": family, "num_layers": n, "written": sg.written})
    # every rule row applied to raw written lists, including first id 1 and none written
    raw = [
        {"family": f, "num_layers": 32, "written": w}
        for f in ("llama", "deepseek")
        for w in ([1, 15, 28], [2, 16, 29], [0, 5, 9], [-1, 3, 7], None)
    ]
    result = _run(sglang_python, {"capture": cases + raw})
    return result["version"], result["capture"][: len(cases)], raw, result["capture"][len(cases) :]


@pytest.mark.parametrize("row", range(len(ROWS)), ids=[f"{f}-{n}-{i}" for f, n, i in ROWS])
def test_written_ids_capture_the_trained_layers(row, captures):
    _, got, _, _ = captures
    family, n, ids = ROWS[row]
    assert got[row] == ids


def test_rule_table_matches_sglang_on_raw_lists(captures):
    version, _, raw, got = captures
    for case, captured in zip(raw, got, strict=True):
        rule = lay.sglang_rule(case["family"], lay.sglang_releases(version)[0])
        assert lay.apply_rule(rule, case["written"], case["num_layers"]) == captured, case


def test_rules_of_this_release(captures):
    version, _, _, _ = captures
    release = lay.sglang_releases(version)[0]
    assert lay.sglang_rule("llama", release) == RULE_PLUS_ONE
    assert lay.sglang_rule("deepseek", release) == RULE_PLUS_ONE_IF_FIRST_1


def test_first_id_one_is_unreachable_on_deepseek(captures):
    """The refusal is real: neither candidate list makes SGLang capture [1, ...]."""
    _, _, raw, got = captures
    deepseek = {
        tuple(c["written"] or []): g
        for c, g in zip(raw, got, strict=True)
        if c["family"] == "deepseek"
    }
    assert deepseek[(1, 15, 28)] == [2, 16, 29]  # writing 1 triggers +1
    assert deepseek[(0, 5, 9)] == [0, 5, 9]  # writing 0 does not
    with pytest.raises(lay.LayerError, match="cannot capture ids starting with 1"):
        lay.plan_layers({"num_layers": 32, "family": "deepseek"}, [1, 15, 28], "0.5.23")


def test_eagleflow_layers_consults_installed_sglang(sglang_python):
    """Where sglang is importable, `eagleflow layers` reports what that release captures."""
    cases = [["deepseek", [1, 29, 57], 61], ["llama", [-1, 14, 26], 30]]
    got = run_probe(sglang_python, "eagleflow_layers_probe.py", {"cases": cases})
    assert got == [[[2, 30, 58], "0.5.23"], [[0, 15, 27], "0.5.23"]]
