"""The on-disk EAGLE-3 draft formats: reading a draft folder, its weight files, and the tensor
names of the SGLang layout against speculators' (what train, export and doctor share).
"""

from __future__ import annotations

import json
from pathlib import Path

from eagleflow.errors import EagleflowError, ExportError

SPECULATORS = "speculators"
SGLANG_FORMAT = "sglang"  # SafeAILab layout: LlamaForCausalLMEagle3, midlayer.* / layers.0.*
SAFEAILAB_FORMAT = "safeailab"  # SafeAILab's original upload: LlamaForCausalLM + draft_vocab_size


def read_draft(draft_dir: str | Path) -> tuple[dict, str, dict]:
    """(config, format, tensors-summary) of a draft folder; tensors summary needs no weights."""
    draft_dir = Path(draft_dir)
    cfg_path = draft_dir / "config.json"
    if not cfg_path.is_file():
        raise EagleflowError(
            f"draft folder {draft_dir} has no config.json; point --draft at a speculators or "
            "SGLang-format EAGLE-3 checkpoint folder"
        )
    config = json.loads(cfg_path.read_text())
    arch = (config.get("architectures") or [""])[0]
    if arch == "Eagle3DraftModel" or "speculators_config" in config:
        fmt = SPECULATORS
    elif arch.endswith("Eagle3") or "eagle_config" in config:
        fmt = SGLANG_FORMAT
    elif arch == "LlamaForCausalLM" and "draft_vocab_size" in config:
        fmt = SAFEAILAB_FORMAT  # same tensors as the SGLang layout, original architectures
    else:
        raise EagleflowError(
            f"{cfg_path}: architectures {config.get('architectures')} is not an EAGLE-3 draft "
            "(expected Eagle3DraftModel, LlamaForCausalLMEagle3, or SafeAILab's "
            "LlamaForCausalLM with a draft_vocab_size)"
        )
    return config, fmt, _tensor_summary(draft_dir)


def _tensor_summary(draft_dir: Path) -> dict:
    """Shapes of every tensor and the d2t / t2d values (tiny), read without loading weights."""
    from safetensors import safe_open

    shapes, maps = {}, {}
    files = sorted(draft_dir.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[name] = tuple(f.get_slice(name).get_shape())
                if name in ("d2t", "t2d"):
                    maps[name] = f.get_tensor(name)
    return {"shapes": shapes, "maps": maps, "weights": bool(files)}


def draft_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a draft folder (what doctor reads, too)."""
    return sorted(Path(folder).glob("*.safetensors"))


def draft_tensors(folder: str | Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in draft_files(folder):
        out.update(load_file(str(f)))
    return out


# ---------------------------------------------------------------------------------------------
# The SGLang tensor names (contract-tested against SGLang's own llama_eagle3.load_weights).


# Tensors the SGLang export leaves out, and why (both engines agree on each).
SGLANG_DROPPED = {
    "t2d": "skipped by both loaders (SGLang and vLLM use d2t)",
    "embed_tokens.weight": (
        "SGLang replaces the draft's embedding with the target's (eagle_worker_v2.init_lm_head "
        "calls set_embed); vLLM shares the target's when the draft has none"
    ),
    "verifier_lm_head.weight": "training-only (the target's head, for the loss)",
    "verifier_norm.weight": "training-only (the target's final norm, for the loss)",
}

_LAYER_TENSORS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "hidden_norm.weight",
)


def _layer_prefix(i: int, num_layers: int) -> str:
    # One layer: `midlayer`, the SafeAILab name every EAGLE-3 loader maps (SGLang's legacy map,
    # vLLM's hf_to_vllm_mapper, SGLang releases whose draft had a `midlayer` attribute).
    # Several: `layers.i`, the only names that address more than one layer.
    return "midlayer" if num_layers == 1 else f"layers.{i}"


def sglang_names(name: str, num_layers: int) -> list[str]:
    """The SGLang-format names checkpoint tensor `name` is written under ([] = left out).

    `layers.0.*` becomes `midlayer.*` for a one-layer draft. For layers i >= 1 the input norm
    is written twice: SGLang's later draft layers normalise with `hidden_norm`, vLLM's (like
    speculators') with `input_layernorm`, so each engine finds the trained weight where it
    reads it. Everything else keeps its name.
    """
    if name in SGLANG_DROPPED:
        return []
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        i = int(idx)
        prefix = _layer_prefix(i, num_layers)
        if i >= 1 and rest == "input_layernorm.weight":
            return [f"{prefix}.input_layernorm.weight", f"{prefix}.hidden_norm.weight"]
        return [f"{prefix}.{rest}"]
    return [name]


def sglang_expected_names(
    num_layers: int, num_aux: int, norm_before_fc: bool, fc_norm: bool, has_d2t: bool
) -> set[str]:
    """Every tensor SGLang's LlamaForCausalLMEagle3 (and vLLM's Eagle3 Llama) loads."""
    names = {"fc.weight", "norm.weight", "lm_head.weight"}
    for i in range(num_layers):
        names |= {f"{_layer_prefix(i, num_layers)}.{t}" for t in _LAYER_TENSORS}
    if norm_before_fc:
        names.add("input_norm.weight")
    if fc_norm:
        names |= {f"fc_norm.{j}.weight" for j in range(num_aux)}
    if has_d2t:
        names.add("d2t")
    return names


# SGLang's own legacy aliases (its llama_eagle3.load_weights maps them); never written here.
_SGLANG_LEGACY = {
    "aux_norm_low.": "fc_norm.0.",
    "aux_norm_mid.": "fc_norm.1.",
    "aux_norm_high.": "fc_norm.2.",
}


def speculators_name(name: str) -> str | None:
    """The speculators name of SGLang-format tensor `name`: the inverse of `sglang_names`.

    `midlayer.*` and `layers.0.*` both become `layers.0.*`. None marks the second copy of a later
    layer's input norm (`layers.i.hidden_norm.weight`, i >= 1), which `speculators_tensors`
    checks against `layers.i.input_layernorm.weight`.
    """
    if name.startswith("midlayer."):
        return "layers.0." + name.removeprefix("midlayer.")
    for legacy, new in _SGLANG_LEGACY.items():
        if name.startswith(legacy):
            return new + name.removeprefix(legacy)
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        if int(idx) >= 1 and rest == "hidden_norm.weight":
            return None
    return name


def speculators_tensors(tensors: dict) -> dict:
    """SGLang-format tensors under speculators' names (the inverse of `sglang_tensors`'s
    renaming; dtypes kept). Refuses names that collide and a later layer whose two input-norm
    copies differ (SGLang and vLLM would each run a different draft)."""
    import torch

    out: dict = {}
    problems = []
    copies = {}
    for name, t in tensors.items():
        new = speculators_name(name)
        if new is None:
            copies[name] = t
            continue
        if new in out:
            problems.append(f"two tensors become {new} (is {name} a duplicate?)")
        out[new] = t
    for name, t in copies.items():
        norm = name.replace(".hidden_norm.", ".input_layernorm.")
        if norm not in out:
            out[norm] = t  # SGLang's later layers normalise their input with hidden_norm
        elif not torch.equal(out[norm].to(t.dtype), t):
            problems.append(
                f"{name} and {norm} differ: SGLang normalises a later layer's input with the "
                "first, vLLM and speculators with the second"
            )
    if problems:
        raise ExportError(
            "the SGLang-format tensors do not map onto speculators' Eagle3DraftModel: "
            + "; ".join(problems)
            + "; use a draft with one tensor per parameter"
        )
    return out
