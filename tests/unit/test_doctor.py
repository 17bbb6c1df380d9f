"""`eagleflow doctor`: each mismatch class, the mission's regression, and clean drafts (exit 0)."""

import json

import torch
from safetensors.torch import save_file

from eagleflow.cli import main as cli
from eagleflow.doctor import diagnose
from tests.support.tiny import KIMI_K25, LLAMA_32, config_only

DRAFT_VOCAB = 32


def vocab_maps(target_vocab: int, n: int = DRAFT_VOCAB):
    target_ids = torch.arange(0, 2 * n, 2)  # every other target token
    d2t = target_ids - torch.arange(n)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


def sglang_draft(folder, target_cfg, eagle_ids, top_ids=None, tensors=None, **extra):
    text = target_cfg.get("text_config", target_cfg)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": text["hidden_size"],
        "target_hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "draft_vocab_size": DRAFT_VOCAB,
        "num_hidden_layers": 1,
        **extra,
    }
    if eagle_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": eagle_ids}
    if top_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = top_ids
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if tensors is None:
        d2t, t2d = vocab_maps(text["vocab_size"])
        tensors = {"d2t": d2t, "t2d": t2d}
    if tensors:
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_mission_regression_embed_3_31_vs_3_31_59(kimi, tmp_path, capsys):
    """Trained on [embed, 3, 31]; the draft config makes SGLang capture [3, 31, 59]."""
    draft = sglang_draft(tmp_path / "d", KIMI_K25, eagle_ids=[3, 31, 59], top_ids=[0, 3, 31])
    rc = cli(["doctor", "--target", str(kimi), "--draft", str(draft), "--engine", "sglang"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "trained on hidden states of [embed, 3, 31]" in out
    assert "will feed it [3, 31, 59]" in out
    assert "set eagle_config.eagle_aux_hidden_state_layer_ids to [0, 3, 31]" in out


def test_mission_regression_on_an_older_sglang(kimi, tmp_path):
    """Same failure through the old unconditional +1: [2, 30, 58] written, [3, 31, 59] read."""
    draft = sglang_draft(tmp_path / "d", KIMI_K25, eagle_ids=[2, 30, 58], top_ids=[0, 3, 31])
    report = diagnose(kimi, draft, "sglang", sglang_version="0.5.12")
    lines = [f.line() for f in report.findings]
    assert any("[embed, 3, 31]" in x and "[3, 31, 59]" in x for x in lines), lines
    assert any("[-1, 2, 30]" in x for x in lines), lines


def test_correct_sglang_draft_is_clean(kimi, tmp_path, capsys):
    draft = sglang_draft(tmp_path / "d", KIMI_K25, eagle_ids=[1, 29, 57], top_ids=[2, 30, 58])
    args = ["doctor", "--target", str(kimi), "--draft", str(draft), "--engine", "sglang"]
    args += [
        "--server-args",
        "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4",
    ]
    assert cli(args) == 0
    assert "OK: no mismatch found" in capsys.readouterr().out
    # and vLLM, reading the top-level key without offset, is fed the same layers
    assert diagnose(kimi, draft, "vllm").ok


def test_eagle_config_only_is_read_differently_by_the_engines(llama, tmp_path):
    draft = sglang_draft(tmp_path / "d", LLAMA_32, eagle_ids=[1, 15, 28])
    report = diagnose(llama, draft, "vllm", trained=[2, 16, 29])
    assert not report.ok  # vLLM reads [1, 15, 28] with no offset
    assert "set the top-level eagle_aux_hidden_state_layer_ids to [2, 16, 29]" in (
        report.findings[0].fix
    )
    assert diagnose(llama, draft, "sglang", trained=[2, 16, 29]).ok


def test_missing_eagle_config_is_a_silent_default(llama, tmp_path):
    draft = sglang_draft(tmp_path / "d", LLAMA_32, eagle_ids=None, top_ids=[0, 3, 31])
    report = diagnose(llama, draft, "sglang")
    text = " ".join(f.line() for f in report.findings)
    assert "no eagle_config" in text and "default [2, 16, 29]" in text


def test_norm_before_residual_is_ignored_by_sglang(llama, tmp_path):
    draft = sglang_draft(
        tmp_path / "d", LLAMA_32, [1, 15, 28], [2, 16, 29], norm_before_residual=True
    )
    text = " ".join(f.line() for f in diagnose(llama, draft, "sglang").findings)
    assert "norm_before_residual" in text
    assert diagnose(llama, draft, "vllm").ok  # vLLM honours the flag


def test_vocab_and_size_mismatches(llama, tmp_path):
    d2t, t2d = vocab_maps(128256)
    t2d_bad = t2d.clone()
    t2d_bad[2] = False
    cases = {
        "no d2t": ({"t2d": t2d}, "has no d2t"),
        "t2d disagrees": ({"d2t": d2t, "t2d": t2d_bad}, "t2d disagrees with d2t"),
        "d2t length": ({"d2t": d2t[:-1], "t2d": t2d}, "d2t has 31 entries"),
        "fc": (
            {"d2t": d2t, "t2d": t2d, "fc.weight": torch.zeros(4, 8)},
            "fc.weight is [4, 8]",
        ),
    }
    for i, (name, (tensors, needle)) in enumerate(cases.items()):
        draft = sglang_draft(tmp_path / f"d{i}", LLAMA_32, [1, 15, 28], [2, 16, 29], tensors)
        text = " ".join(f.line() for f in diagnose(llama, draft, "sglang").findings)
        assert needle in text, (name, text)
    other = dict(LLAMA_32, hidden_size=2048)
    draft = sglang_draft(tmp_path / "h", other, [1, 15, 28], [2, 16, 29])
    text = " ".join(f.line() for f in diagnose(llama, draft, "sglang").findings)
    assert "target hidden size 2048" in text


def test_server_flags_sglang_would_rewrite(kimi, tmp_path):
    draft = sglang_draft(tmp_path / "d", KIMI_K25, [1, 29, 57], [2, 30, 58])
    flags = "--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 16"
    report = diagnose(kimi, draft, "sglang", server_args=flags)
    assert len(report.findings) == 1
    assert "silently run with num_draft_tokens=2" in report.findings[0].what


def test_speculators_format_on_sglang(llama, tmp_path):
    folder = tmp_path / "spec"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Eagle3DraftModel"],
                "speculators_config": {"algorithm": "eagle3"},
                "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
                "draft_vocab_size": 128256,
            }
        )
    )
    text = " ".join(f.line() for f in diagnose(llama, folder, "sglang").findings)
    assert "SGLang has no loader for speculators-format drafts" in text
    assert diagnose(llama, folder, "vllm").ok


def test_unknown_training_layers_are_unverified_not_a_mismatch(llama, tmp_path, capsys):
    draft = sglang_draft(tmp_path / "d", LLAMA_32, eagle_ids=None)
    args = ["doctor", "--target", str(llama), "--draft", str(draft), "--engine", "vllm"]
    assert cli(args) == 3
    out = capsys.readouterr().out
    assert "UNVERIFIED the draft config does not say which layers" in out
    assert "--trained-layers" in out and "UNVERIFIED: no mismatch found" in out
    assert diagnose(llama, draft, "vllm", trained=[2, 16, 29]).ok
    # the user's override can still prove a mismatch
    assert diagnose(llama, draft, "vllm", trained=[0, 3, 31]).verdict == "MISMATCH"


def test_not_a_draft(tmp_path, llama, capsys):
    folder = config_only(tmp_path / "x", {"architectures": ["BertModel"]})
    assert cli(["doctor", "--target", str(llama), "--draft", str(folder), "--engine", "vllm"]) == 2
    assert "is not an EAGLE-3 draft" in capsys.readouterr().err
