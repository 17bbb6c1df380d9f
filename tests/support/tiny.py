"""Tiny random targets and tokenized datasets built inside tests (no download, seconds on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 256


def tiny_llama(folder: Path, num_layers: int = 4, seed: int = 0, hidden: int = 64) -> dict:
    """A random LlamaForCausalLM (head_dim 64, which vLLM CPU supports) saved as an HF folder.

    The final norm's weight is random, not ones, so a post-norm value can never pass for the
    pre-norm final slot. Returns target.json content (describe_target + run dtype).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)
    return _save(model, folder)


def tiny_deepseek_v3(folder: Path, num_layers: int = 6, seed: int = 0) -> dict:
    """A random DeepseekV3ForCausalLM (MLA + MoE, the Kimi-K2 layout) saved as an HF folder."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=32,
        n_group=1,
        topk_group=1,
        max_position_embeddings=512,
    )
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)
    return _save(model, folder)


def _save(model, folder: Path) -> dict:
    from eagleflow.target.prepare import describe_target

    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)  # engines (vLLM) need one to start
    info = describe_target(folder)
    info.update(name=folder.name, run_dtype="float32")
    (folder.parent / f"{folder.name}.target.json").write_text(json.dumps(info))
    return info


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocab ("t0".."t255"), enough for vLLM to start."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2"
    )


def target_json(folder: Path) -> str:
    """Path of the target.json `_save` wrote next to the folder."""
    return str(folder.parent / f"{folder.name}.target.json")


def tiny_dataset(folder: Path, lengths=(12, 7, 20, 5, 16, 9), seed: int = 0) -> str:
    """A tokenized dataset in the tokenize stage's layout (input_ids, loss_mask, seq_len)."""
    import datasets
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    ds = datasets.Dataset.from_dict(
        {"input_ids": ids, "loss_mask": masks, "seq_len": list(lengths)}
    )
    ds.save_to_disk(str(folder))
    return str(folder)


def config_only(folder: Path, config: dict) -> Path:
    """A target folder holding only config.json (what `layers` and `doctor` need)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


KIMI_K25 = {
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
LLAMA_32 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "vocab_size": 128256,
    "num_attention_heads": 32,
}


def tiny_custom_code_llama(folder: Path, num_layers: int = 4) -> dict:
    """tiny_llama's weights behind a model type of its own, with its code in the folder (as
    Kimi-K2.5 ships): transformers loads it only with trust_remote_code."""
    info = tiny_llama(folder, num_layers=num_layers)
    (folder / "configuration_tinyef.py").write_text(
        "from transformers import LlamaConfig\n\n\n"
        "class TinyEfConfig(LlamaConfig):\n    model_type = 'tinyef'\n"
    )
    (folder / "modeling_tinyef.py").write_text(
        "from transformers import LlamaForCausalLM\n\n"
        "from .configuration_tinyef import TinyEfConfig\n\n\n"
        "class TinyEfForCausalLM(LlamaForCausalLM):\n    config_class = TinyEfConfig\n"
    )
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(
        model_type="tinyef",
        architectures=["TinyEfForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tinyef.TinyEfConfig",
            "AutoModelForCausalLM": "modeling_tinyef.TinyEfForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    return info


def packed_batch(manifest, masks: dict, num_aux: int, vocab: int = 64) -> dict:
    """Shards `masks` (row -> loss mask) packed into one batch the way speculators' collate
    builds it for training: {hidden_states, input_ids, document_ids, loss_mask, position_ids,
    verifier_last_hidden_states}."""
    import torch
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    from eagleflow.extract.hf import load_shard

    samples = []
    for row, mask in masks.items():
        shard = load_shard(manifest, row)
        hs, n = shard["hidden_states"], len(mask)
        samples.append(
            {
                "hidden_states": hs[:, :-1].flatten(1),
                "input_ids": shard["token_ids"],
                "verifier_last_hidden_states": hs[:, -1],
                "loss_mask": torch.tensor(mask),
                "lengths": torch.tensor([n]),
                "position_ids": torch.arange(n),
            }
        )
    total = sum(len(m) for m in masks.values())
    batch = CollateFn(total, vocab, num_aux, torch.float32, preprocess=shift_batch)(samples)
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids")
    return {k: batch[k] for k in (*keys, "verifier_last_hidden_states")}
