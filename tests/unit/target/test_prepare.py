"""Target description (config.json read as data) and prepare_target."""

import json

import pytest

from eagleflow.errors import EagleflowError
from eagleflow.target.prepare import describe_target, load_target_json, prepare_target

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "vocab_size": 256,
    "num_attention_heads": 2,
}
KIMI = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": {
        "model_type": "kimi_k2",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "vocab_size": 163840,
        "num_attention_heads": 64,
    },
}


def _folder(tmp_path, config, template=True):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if template:
        (d / "chat_template.jinja").write_text("{{ messages }}")
    return d


def test_describe_llama(tmp_path):
    info = describe_target(_folder(tmp_path, LLAMA))
    assert (info["num_layers"], info["hidden_size"], info["vocab_size"]) == (4, 64, 256)
    assert info["family"] == "llama" and info["head_dim"] == 32 and info["has_chat_template"]


def test_describe_custom_code_model_reads_text_config(tmp_path):
    info = describe_target(_folder(tmp_path, KIMI))
    assert info["num_layers"] == 61 and info["hidden_size"] == 7168
    assert info["family"] == "deepseek"  # SGLang serves it with the deepseek_v2 model file


def test_bad_targets_are_refused_clearly(tmp_path):
    cfg = {"name": "t", "path": str(tmp_path / "missing"), "dtype": "float32"}
    with pytest.raises(EagleflowError, match="is not a folder"):
        prepare_target(cfg, "", str(tmp_path / "t.json"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EagleflowError, match="has no config.json"):
        describe_target(empty)
    cfg["path"] = str(_folder(tmp_path, LLAMA, template=False))
    with pytest.raises(EagleflowError, match="no chat template"):
        prepare_target(cfg, "", str(tmp_path / "t.json"))
    assert not (tmp_path / "t.json").exists()


@pytest.mark.slow
def test_prepare_target_from_gguf(smollm2_target):
    info = load_target_json(smollm2_target)
    assert info["architecture"] == "LlamaForCausalLM"
    assert (info["num_layers"], info["hidden_size"], info["vocab_size"]) == (30, 576, 49152)
    assert info["source"]["kind"] == "gguf" and info["weights_sha256"]
    assert info["trust_remote_code"] is False  # target.trust_remote_code, for every loader
    config = json.loads((smollm2_target.parent / "model" / "config.json").read_text())
    assert "quantization_config" not in config  # a plain HF folder, not a GGUF stand-in


def test_weights_hash_of_a_sharded_model_sees_the_weights_not_only_the_index(tmp_path):
    """Two random inits of one architecture share their index file byte for byte; their
    weights_sha256 must differ, and the same weights saved twice must agree."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
    )
    hashes = {}
    for name, seed in (("a", 0), ("a_again", 0), ("b", 1)):
        torch.manual_seed(seed)
        LlamaForCausalLM(cfg).save_pretrained(tmp_path / name, max_shard_size="100KB")
        (tmp_path / name / "chat_template.jinja").write_text("{{ messages }}")
        hashes[name] = describe_target(tmp_path / name)["weights_sha256"]
    index = "model.safetensors.index.json"
    assert (tmp_path / "a" / index).read_bytes() == (tmp_path / "b" / index).read_bytes()
    assert hashes["a"] == hashes["a_again"] and hashes["a"] != hashes["b"]
