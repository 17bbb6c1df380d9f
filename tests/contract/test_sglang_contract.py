"""eagleflow's SGLang flag rules against the real sglang package (run in .venv-sglang).

Every speculative config eagleflow accepts must resolve, in SGLang's own argument pipeline, to
exactly the values eagleflow says it runs; every config it refuses for a silent rewrite must be
rewritten by SGLang the way the refusal message says. A future SGLang release that changes a rule
fails here, not on a GPU host.
"""

import json

import pytest

from eagleflow import engines
from eagleflow.engines import SpecConfig
from tests.contract.probe import run_probe

pytestmark = pytest.mark.contract

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}
DRAFT = dict(
    LLAMA,
    architectures=["LlamaForCausalLMEagle3"],
    num_hidden_layers=1,
    draft_vocab_size=8192,
    eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
)

CASES = [
    SpecConfig("s1_16", 1, 1, 16),  # the mission's silent rewrite: 16 draft tokens become 2
    SpecConfig("s3_4", 3, 1, 4),
    SpecConfig("s3_none", 3, 1, None),
    SpecConfig("s7_8", 7, 1, 8),
    SpecConfig("s3_2", 3, 1, 2),
    SpecConfig("tree", 5, 4, 8),
    SpecConfig("auto"),
    SpecConfig("steps_no_topk", 3, None, None),
    SpecConfig("half_unset", None, 1, None),
]


def _raw_argv(spec, target, draft):
    """The flags as a user would write them (what SGLang gets without eagleflow's checks)."""
    argv = ["--model-path", str(target), "--device", "cuda"]
    argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft)]
    for flag, value in (
        ("--speculative-num-steps", spec.num_steps),
        ("--speculative-eagle-topk", spec.topk),
        ("--speculative-num-draft-tokens", spec.num_draft_tokens),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return argv


@pytest.fixture(scope="module")
def sglang_results(sglang_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    target, draft = root / "target", root / "draft"
    for folder, conf in ((target, LLAMA), (draft, DRAFT)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(conf))
    raw = [_raw_argv(s, target, draft) for s in CASES]
    ours = []
    for s in CASES:
        if engines.sglang_spec_problems(s):
            ours.append(None)
        else:
            cmd = engines.sglang_command(
                "python", str(target), s, {}, "127.0.0.1", 30000, str(draft)
            )
            ours.append(cmd[3:] + ["--device", "cuda"])  # drop `python -m sglang.launch_server`
    flags = raw + [a for a in ours if a is not None]
    result = run_probe(sglang_python, "sglang_probe.py", {"flags": flags})
    raw_res = result["flags"][: len(raw)]
    ours_iter = iter(result["flags"][len(raw) :])
    ours_res = [None if a is None else next(ours_iter) for a in ours]
    return result["version"], dict(
        zip([s.name for s in CASES], zip(raw_res, ours_res, strict=True), strict=True)
    )


def test_version_is_the_configured_default(sglang_results):
    from eagleflow import config as cfg

    version, _ = sglang_results
    assert version == cfg.fill_defaults({})["serve"]["sglang"]["version"]


@pytest.mark.parametrize("spec", CASES, ids=[s.name for s in CASES])
def test_rules_match_sglang(spec, sglang_results):
    _, results = sglang_results
    raw, ours = results[spec.name]
    problems = engines.sglang_spec_problems(spec)
    if not problems:
        # accepted: SGLang runs exactly what eagleflow says, for the user's flags and for ours
        expected = list(engines.resolve_sglang_spec(spec, "LlamaForCausalLM"))
        assert raw == {"resolved": expected}, (spec, raw)
        assert ours == {"resolved": expected}, (spec, ours)
        return
    # refused: SGLang either fails on it or silently runs something else
    if "silently" in problems[0]:
        s = spec.num_steps
        assert raw == {"resolved": [s, 1, s + 1]}, raw
        assert f"num_draft_tokens={s + 1}" in problems[0]
    elif "resolved" in raw:
        steps, topk, n = raw["resolved"]
        assert n is None or (steps, topk) != (spec.num_steps, spec.topk), raw
    else:
        assert "error" in raw


def test_mission_case_sixteen_draft_tokens_become_two(sglang_results):
    _, results = sglang_results
    raw, _ = results["s1_16"]
    assert raw == {"resolved": [1, 1, 2]}
