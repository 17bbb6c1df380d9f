"""Layer-id convention: every translation row and every refusal (no torch, no engine)."""

import pytest

from eagleflow import config as cfg
from eagleflow import layers as lay
from eagleflow.cli import main as cli
from eagleflow.errors import ConfigError
from eagleflow.layers import LayerError
from tests.support.tiny import KIMI_K25, LLAMA_32, config_only

LLAMA = {"num_layers": 32, "family": "llama"}
DEEPSEEK = {"num_layers": 61, "family": "deepseek"}


@pytest.mark.parametrize(
    ("target", "value", "aux", "sglang"),
    [
        (LLAMA, "default", [2, 16, 29], [1, 15, 28]),
        (LLAMA, ["embed", 3, 31], [0, 3, 31], [-1, 2, 30]),  # embed: SGLang Llama writes -1
        (LLAMA, "embed,3,31", [0, 3, 31], [-1, 2, 30]),  # the CLI's spelling
        (LLAMA, [1, 2, 3], [1, 2, 3], [0, 1, 2]),
        (DEEPSEEK, "default", [2, 30, 58], [1, 29, 57]),  # first id 2: [1, ...], all releases
        (DEEPSEEK, [0, 3, 31], [0, 3, 31], [0, 3, 31]),  # >= 0.5.13: no offset unless first is 1
        (DEEPSEEK, [3, 31, 59], [3, 31, 59], [3, 31, 59]),
    ],
)
def test_translation_rows(target, value, aux, sglang):
    plan = lay.plan_layers(target, value, "0.5.23")
    assert plan.aux == aux
    assert plan.engine_ids == {"speculators": aux, "vllm": aux, "sglang": sglang}


def test_old_sglang_release_adds_one_everywhere():
    plan = lay.plan_layers(DEEPSEEK, [0, 3, 31], "0.5.12.post1")
    assert plan.sglang.written == [-1, 2, 30]
    assert lay.apply_rule(lay.RULE_PLUS_ONE, [-1, 2, 30], 61) == [0, 3, 31]


def test_release_dependent_ids_are_named_with_the_release_they_need():
    plan = lay.plan_layers(DEEPSEEK, [0, 3, 31], "0.5.23")
    assert plan.sglang.notes and "needs SGLang >= 0.5.13" in plan.sglang.notes[0]
    assert not lay.plan_layers(DEEPSEEK, [2, 30, 58], "0.5.23").sglang.notes


def test_release_range_spanning_the_rule_change_refuses_ambiguous_ids():
    with pytest.raises(LayerError) as e:
        lay.plan_layers(DEEPSEEK, [0, 3, 31], ">=0.5.10")
    msg = str(e.value)
    assert "SGLang < 0.5.13 needs [-1, 2, 30]" in msg and ">= 0.5.13 needs [0, 3, 31]" in msg
    assert "start the ids with 2" in msg
    # ids starting with 2 are read alike, so the same range is fine for them
    assert lay.plan_layers(DEEPSEEK, [2, 30, 58], ">=0.5.10").sglang.written == [1, 29, 57]


@pytest.mark.parametrize(
    ("target", "value", "needle"),
    [
        (LLAMA, [3, 3, 31], "repeat [3]"),
        (LLAMA, [31, 3], "not ascending; engines concatenate captures in ascending layer order"),
        (LLAMA, [2, 16, 32], "id 32 is the output of the last layer"),
        (LLAMA, [2, 16, 40], "does not exist: the target has 32 decoder layers"),
        (LLAMA, [-1, 3], "negative"),
        (LLAMA, [], "at least one"),
        ({"num_layers": 4, "family": "llama"}, "default", "'default' is [2, 2, 1] on this 4-layer"),
        (DEEPSEEK, [1, 3, 31], "cannot capture ids starting with 1"),
    ],
)
def test_refusals_name_value_and_alternative(target, value, needle):
    with pytest.raises(LayerError) as e:
        lay.plan_layers(target, value, "0.5.23")
    assert needle in str(e.value)
    if "4-layer" in needle:
        assert "[embed, 2, 3]" in str(e.value)  # a working alternative is offered


def test_sglang_only_problem_does_not_block_a_vllm_run():
    plan = lay.plan_layers(DEEPSEEK, [1, 3, 31], "0.5.23", engine="vllm")
    assert plan.sglang.written is None and plan.sglang.problems


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_suggestions_always_work(family):
    for n in range(3, 90):
        ids = lay.suggest_aux(n, family)
        assert not lay.aux_problems(ids, n, family), (n, ids)
        assert lay.plan_layers({"num_layers": n, "family": family}, ids, "0.5.23").aux == ids


def test_bad_version_string():
    with pytest.raises(LayerError, match="neither a release"):
        lay.sglang_releases("latest")


def test_config_rejects_unsorted_and_duplicate_ids_before_any_stage():
    for ids, needle in (([3, 1], "not ascending"), ([3, 3], "repeats")):
        with pytest.raises(ConfigError, match=needle):
            cfg.validate({"extract": {"aux_layers": ids}})
    with pytest.raises(ConfigError, match="neither a release"):
        cfg.validate({"serve": {"sglang": {"version": "newest"}}})


def test_cli_layers_table(tmp_path, capsys):
    target = config_only(tmp_path / "kimi", KIMI_K25)
    assert cli(["layers", "--target", str(target), "--layers", "embed,3,31"]) == 0
    out = capsys.readouterr().out
    assert "61 decoder layers" in out and "deepseek family" in out
    assert "SGLang draft config (eagle_config): [0, 3, 31]" in out
    assert "needs SGLang >= 0.5.13" in out
    assert "before the final norm (layer 60)" in out


def test_cli_layers_refusal_is_a_clean_error(tmp_path, capsys):
    target = config_only(tmp_path / "llama", LLAMA_32)
    assert cli(["layers", "--target", str(target), "--layers", "3,3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagleflow: error: aux layer ids") and "Traceback" not in err
