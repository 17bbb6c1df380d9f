"""`eagleflow doctor` on published EAGLE-3 drafts (tests/data/published-drafts, sources in its
README): each gets the verdict its producer's code implies; an unknown is UNVERIFIED, never a
MISMATCH, and the mission's case stays a MISMATCH."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from eagleflow.cli import main as cli
from eagleflow.doctor import MISMATCH, OK, UNVERIFIED, diagnose, producer
from eagleflow.drafts import read_draft
from tests.conftest import REPO
from tests.support.tiny import config_only

PUBLISHED = REPO / "tests" / "data" / "published-drafts"
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "vocab_size": 129280,
    "num_attention_heads": 128,
}


def published(tmp_path, name, target_vocab, maps=("d2t", "t2d"), **overrides):
    """A draft folder: the published config.json (plus overrides) and vocab maps as the
    producer's export writes them (no weights: doctor reads headers and the maps only)."""
    folder = tmp_path / name.split("__")[0]
    folder.mkdir()
    config = json.loads((PUBLISHED / name).read_text())
    for key, value in overrides.items():
        if isinstance(value, dict):
            config[key] = {**(config.get(key) or {}), **value}
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    n = config["draft_vocab_size"]
    target_ids = torch.arange(n) * 2
    tensors = {"d2t": target_ids - torch.arange(n), "t2d": torch.zeros(target_vocab, dtype=bool)}
    tensors["t2d"][target_ids] = True
    save_file({k: v for k, v in tensors.items() if k in maps}, str(folder / "model.safetensors"))
    return folder


def verdicts(report):
    return [f.verdict for f in report.findings]


@pytest.fixture
def deepseek(tmp_path):
    return config_only(tmp_path / "deepseek", DEEPSEEK_V3)


@pytest.mark.parametrize(
    "name",
    [
        "specforge-specbundle__AQ-MedAI_Kimi-K2-Instruct-eagle3.config.json",
        "specforge__AQ-MedAI_Kimi-K25-eagle3.config.json",
        "specforge-repo-template__configs_kimi-k2-eagle3.config.json",
    ],
)
def test_specforge_kimi_depends_on_the_sglang_release(kimi, tmp_path, name, capsys):
    """[2, 30, 58] in eagle_config: SpecForge's HF backend and SGLang < 0.5.13 read outputs of
    2, 30, 58 (internal [3, 31, 59]); SGLang >= 0.5.13 reads [2, 30, 58]. The draft needs the
    serving release to read them as its training did: unknown, so UNVERIFIED, with both named."""
    draft = published(tmp_path, name, 163840)
    assert producer(*read_draft(draft)[:2]) == "specforge"
    rc = cli(["doctor", "--target", str(kimi), "--draft", str(draft), "--engine", "sglang"])
    out = capsys.readouterr().out
    assert rc == 3, out
    assert "UNVERIFIED layer ids depend on a release nobody named" in out
    assert "[3, 31, 59] (SGLang < 0.5.13)" in out and "[2, 30, 58] (SGLang >= 0.5.13)" in out
    assert "--sglang-version" in out
    # a named range across 0.5.13 keeps both readings
    ranged = diagnose(kimi, draft, "sglang", sglang_version=">=0.5.10,<0.6").findings[0].what
    assert "(SGLang < 0.5.13)" in ranged and "(SGLang >= 0.5.13)" in ranged
    # naming the release does not settle it either: the training release is still unknown
    assert verdicts(diagnose(kimi, draft, "sglang", sglang_version="0.5.23")) == [UNVERIFIED]
    # ... unless the user knows it: trained on SGLang 0.5.12 (outputs of 2, 30, 58)
    on_old = diagnose(kimi, draft, "sglang", sglang_version="0.5.12", trained=[3, 31, 59])
    assert on_old.verdict == OK
    on_new = diagnose(kimi, draft, "sglang", sglang_version="0.5.23", trained=[3, 31, 59])
    assert on_new.verdict == MISMATCH


def test_specforge_deepseek_ids_starting_with_1_are_read_alike(deepseek, tmp_path):
    """[1, 29, 57]: every SGLang release adds 1 when the first id is 1, so training and serving
    agree on [2, 30, 58] (OK); vLLM reads the same ids as layer inputs, one layer early."""
    name = "specforge-repo-template__configs_deepseek-v3-671b-eagle3.config.json"
    draft = published(tmp_path, name, 129280)
    assert diagnose(deepseek, draft, "sglang").verdict == OK
    report = diagnose(deepseek, draft, "vllm")
    assert verdicts(report) == [MISMATCH]
    assert "trained on hidden states of [2, 30, 58] but vllm will feed it [1, 29, 57]" in (
        report.findings[0].what
    )
    assert "top-level eagle_aux_hidden_state_layer_ids to [2, 30, 58]" in report.findings[0].fix


def test_the_issue_example_specforge_llama_is_ok_on_sglang(llama, tmp_path):
    """A correct SpecForge export for a 32-layer Llama: eagle_config [1, 15, 28], no top-level
    ids, no provenance. SGLang reads them as its trainer did: OK, not 'cannot tell'."""
    name = "specforge-repo-template__configs_llama3-8B-eagle3.hf-mirror-FasterDFlash.config.json"
    ids = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}
    draft = published(tmp_path, name, 128256, eagle_config=ids)
    report = diagnose(llama, draft, "sglang")
    assert report.verdict == OK, [f.line() for f in report.findings]
    assert any("trained on [2, 16, 29]" in line for line in report.info)
    assert diagnose(llama, draft, "vllm").verdict == MISMATCH  # vLLM: one layer early


@pytest.mark.parametrize(
    "name",
    [
        "specforge-repo-template__configs_llama3-8B-eagle3.fork-yubofredwang.config.json",
        "specforge-repo-template__configs_llama3-8B-eagle3.hf-mirror-FasterDFlash.config.json",
    ],
)
def test_no_ids_anywhere_is_unverified_on_both_engines(llama, tmp_path, name):
    draft = published(tmp_path, name, 128256)
    for engine in ("sglang", "vllm"):
        report = diagnose(llama, draft, engine)
        assert verdicts(report) == [UNVERIFIED], (engine, [f.line() for f in report.findings])
        assert "feed it [2, 16, 29], the default" in report.findings[0].what


def test_speculators_converted_without_ids(llama, tmp_path):
    name = "speculators__nm-testing_EAGLE3-LLaMA3.1-Instruct-8B-converted.config.json"
    draft = published(tmp_path, name, 128256)
    assert producer(*read_draft(draft)[:2]) == "speculators"
    assert verdicts(diagnose(llama, draft, "vllm")) == [UNVERIFIED]
    on_sglang = diagnose(llama, draft, "sglang")  # no SGLang loader: proven, whatever the layers
    assert MISMATCH in verdicts(on_sglang)
    assert "no loader for speculators-format" in " ".join(f.what for f in on_sglang.findings)


def test_speculators_with_top_level_ids_is_proven(llama, tmp_path):
    name = "speculators__nm-testing_EAGLE3-LLaMA3.1-Instruct-8B-converted.config.json"
    draft = published(tmp_path, name, 128256, eagle_aux_hidden_state_layer_ids=[2, 16, 29])
    assert diagnose(llama, draft, "vllm").verdict == OK


def test_modelopt_ids_are_layer_outputs(llama, tmp_path):
    """ModelOpt hooks the outputs of the eagle_config layers and exports the ids unshifted:
    SGLang (+1) agrees, vLLM (no offset) is one layer early. Its export writes d2t, no t2d."""
    name = "modelopt__RECONSTRUCTED_llama_eagle_template_from_export_code.config.json"
    filled = {
        "hidden_size": 4096,
        "num_hidden_layers": 1,
        "vocab_size": 128256,
        "draft_vocab_size": 32000,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]},
    }
    draft = published(tmp_path, name, 128256, maps=("d2t",), **filled)
    assert producer(*read_draft(draft)[:2]) == "modelopt"
    assert diagnose(llama, draft, "sglang").verdict == OK
    report = diagnose(llama, draft, "vllm")
    assert verdicts(report) == [MISMATCH]
    assert "set the top-level eagle_aux_hidden_state_layer_ids to [2, 16, 29]" in (
        report.findings[0].fix
    )


def test_safeailab_original_layout(llama, tmp_path):
    name = "safeailab-format-proxy__appleeji_eagle-training-code.config.json"
    draft = published(tmp_path, name, 128256)
    assert producer(*read_draft(draft)[:2]) == "safeailab"
    assert verdicts(diagnose(llama, draft, "vllm")) == [UNVERIFIED]
    on_sglang = diagnose(llama, draft, "sglang")
    assert on_sglang.verdict == MISMATCH
    assert any("LlamaForCausalLMEagle3" in f.fix for f in on_sglang.findings)


def test_seed_case_stays_a_mismatch_on_every_release(kimi, tmp_path):
    """Trained on [embed, 3, 31] of a 61-layer target; the draft config makes SGLang capture
    [3, 31, 59] (>= 0.5.13) or [4, 32, 60] (older): no release feeds what it was trained on."""
    name = "specforge-specbundle__AQ-MedAI_Kimi-K2-Instruct-eagle3.config.json"
    draft = published(
        tmp_path, name, 163840, eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 31, 59]}
    )
    report = diagnose(kimi, draft, "sglang", trained=[0, 3, 31])
    assert verdicts(report) == [MISMATCH]
    assert "will feed it [3, 31, 59] (SGLang >= 0.5.13) or [4, 32, 60]" in report.findings[0].what


def test_fixtures_are_all_read(tmp_path):
    """Every published config in the folder parses and is recognised as a draft."""
    names = sorted(p.name for p in PUBLISHED.glob("*.config.json"))
    assert len(names) == 9
    for i, name in enumerate(names):
        folder = tmp_path / str(i)
        folder.mkdir()
        shutil.copy(PUBLISHED / name, folder / "config.json")
        config, fmt, _ = read_draft(folder)
        assert producer(config, fmt) in ("specforge", "speculators", "modelopt", "safeailab")
