"""Target model: build or check the HF folder, describe it in target.json (read as data).

`describe_target` reads only `config.json` (custom-code models such as Kimi-K2.5 nest the text
model under `text_config` and cannot be loaded without their code), so layer checks never need
weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

from eagleflow.errors import EagleflowError
from eagleflow.util import atomic_write_json

log = logging.getLogger(__name__)

WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# Families whose SGLang model file is deepseek_v2.py (its layer-id rule differs from Llama's).
DEEPSEEK_FAMILY_TYPES = {"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v32"}


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def package_file(spec: str) -> Path:
    """Resolve `pkg:PACKAGE/relative/path` (a file shipped by an installed package) or a path."""
    if not spec.startswith("pkg:"):
        return Path(spec)
    package, _, rel = spec[4:].partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise EagleflowError(
            f"{spec}: Python package {package!r} is not installed; install it (make venv installs "
            "the data packages of requirements/data.txt) or give a file path instead"
        )
    path = Path(list(found.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise EagleflowError(f"{spec}: package {package!r} has no file {rel!r} (looked at {path})")
    return path


def text_config(config: dict) -> dict:
    """The text model's config: `text_config` for multimodal wrappers (Kimi-K2.5), else itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and "num_hidden_layers" in inner else config


def describe_target(model_dir: str | Path) -> dict:
    """The facts later stages need about a target folder, read from its config.json."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise EagleflowError(
            f"target folder {model_dir} has no config.json; target.path must be a Hugging Face "
            "model folder (config.json, weights, tokenizer)"
        )
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise EagleflowError(f"{cfg_path} is not valid JSON: {e}") from None
    text = text_config(config)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
    if missing:
        raise EagleflowError(f"{cfg_path} lacks {', '.join(missing)}; is this a decoder LLM?")
    model_type = text.get("model_type", config.get("model_type", ""))
    architectures = config.get("architectures") or text.get("architectures") or []
    return {
        "path": str(model_dir.resolve()),
        "architecture": architectures[0] if architectures else None,
        "model_type": model_type,
        "family": "deepseek" if model_type in DEEPSEEK_FAMILY_TYPES else "llama",
        "num_layers": int(text["num_hidden_layers"]),
        "hidden_size": int(text["hidden_size"]),
        "vocab_size": int(text["vocab_size"]),
        "num_attention_heads": text.get("num_attention_heads"),
        "head_dim": text.get("head_dim")
        or (
            text["hidden_size"] // text["num_attention_heads"]
            if text.get("num_attention_heads")
            else None
        ),
        "dtype": text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype"),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "config_sha256": sha256_file(cfg_path),
        "weights_sha256": _weights_hash(model_dir),
        "has_chat_template": _has_chat_template(model_dir),
    }


SAMPLES_PER_SHARD = 16  # evenly spaced reads of SAMPLE_BYTES from each weight shard
SAMPLE_BYTES = 1 << 20


def _weights_hash(model_dir: Path) -> str | None:
    """Fingerprint of the weights: the single weights file's sha256; for a sharded model, the
    index plus each shard's name, size and 16 evenly spaced 1 MiB samples of its bytes.

    The index alone names tensors and files, the same for every model of one architecture (a
    fine-tune, another random init); reading every byte of a 1 TB target would take an hour.
    Another training run changes every tensor, so the samples tell such weights apart.
    """
    for name in WEIGHT_INDEXES:
        index = model_dir / name
        if index.is_file():
            digest = hashlib.sha256(index.read_bytes())
            files = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            for fname in files:
                path = model_dir / fname
                size = path.stat().st_size if path.is_file() else -1
                digest.update(f"\0{fname}\0{size}\0".encode())
                if size > 0:
                    with open(path, "rb") as f:
                        last = max(0, size - SAMPLE_BYTES)
                        for i in range(SAMPLES_PER_SHARD):
                            f.seek(last * i // (SAMPLES_PER_SHARD - 1))
                            digest.update(f.read(SAMPLE_BYTES))
            return digest.hexdigest()
    for name in SINGLE_WEIGHTS:
        if (model_dir / name).is_file():
            return sha256_file(model_dir / name)
    return None


def _has_chat_template(model_dir: Path) -> bool:
    if (model_dir / "chat_template.jinja").is_file() or (
        model_dir / "chat_template.json"
    ).is_file():
        return True
    tok_cfg = model_dir / "tokenizer_config.json"
    return tok_cfg.is_file() and "chat_template" in json.loads(tok_cfg.read_text())


def build_from_gguf(gguf: Path, out_dir: Path, dtype: str) -> None:
    """Dequantize a GGUF into a plain HF folder (weights, tokenizer, chat template), atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch_dtype
    )
    # A dequantized model must not claim to be quantized, or loaders look for the GGUF again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    log.info("built %s from %s in %.1f s", out_dir, gguf.name, time.monotonic() - start)


def prepare_target(target_cfg: dict, model_dir: str, out_json: str) -> None:
    """Build (from GGUF) or check (target.path) the target folder and write target.json."""
    if target_cfg.get("path"):
        folder = Path(target_cfg["path"])
        if not folder.is_dir():
            raise EagleflowError(
                f"target.path {folder} is not a folder on this host; point it at a Hugging Face "
                "model folder (on the GPU host when the remote profile runs this rule)"
            )
        source = {"kind": "path", "path": str(folder)}
    else:
        gguf = package_file(f"pkg:{target_cfg['gguf']['package']}/{target_cfg['gguf']['file']}")
        folder = Path(model_dir)
        gguf_sha = sha256_file(gguf)
        stamp = folder / ".eagleflow-source.json"
        wanted = {"gguf": str(gguf), "sha256": gguf_sha, "dtype": target_cfg["dtype"]}
        if not (stamp.is_file() and json.loads(stamp.read_text()) == wanted):
            build_from_gguf(gguf, folder, target_cfg["dtype"])
            stamp.write_text(json.dumps(wanted))
        else:
            log.info("reusing %s (built from the same GGUF)", folder)
        source = {"kind": "gguf", **wanted}
    info = describe_target(folder)
    if not info["has_chat_template"]:
        raise EagleflowError(
            f"target {folder} has no chat template; regeneration and loss masks need one "
            "(add chat_template.jinja or a tokenizer_config.json chat_template)"
        )
    info.update(
        name=target_cfg["name"],
        source=source,
        run_dtype=target_cfg["dtype"],
        # every later loader (tokenizer, transformers, vLLM) reads it from here
        trust_remote_code=bool(target_cfg.get("trust_remote_code", False)),
    )
    atomic_write_json(out_json, info)
    log.info(
        "target %s: %s, %d layers, hidden %d, vocab %d",
        info["name"],
        info["architecture"],
        info["num_layers"],
        info["hidden_size"],
        info["vocab_size"],
    )


def load_target_json(path: str | Path) -> dict:
    """Read a target.json written by prepare_target."""
    return json.loads(Path(path).read_text())
