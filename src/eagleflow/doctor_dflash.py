"""`eagleflow doctor` for a native DFlash draft (`architectures ["DFlashDraftModel"]`).

What the engines read (`eagleflow.dflash`; tests/contract holds each reading to the engine's
code): vLLM takes `eagle_aux_hidden_state_layer_ids` (eagleflow ids k) when present, else
`dflash_config.target_layer_ids` + 1; SGLang takes `dflash_config.target_layer_ids` (t = k - 1)
and never the vLLM key. Both read `dflash_config.mask_token_id`; vLLM serves every layer causal
when `dflash_config.causal` is true; SGLang borrows the target's head and drops a reduced-vocab
`lm_head` / `d2t` without a word.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from eagleflow import dflash
from eagleflow.drafts import _tensor_summary


class Finding(NamedTuple):
    """A disagreement and its fix (`eagleflow.doctor` turns each into one of its MISMATCHes)."""

    what: str
    fix: str


def is_native(config: dict) -> bool:
    """A native DFlash draft config (eagleflow's export, z-lab's drafts)."""
    return dflash.NATIVE_ARCHITECTURE in (config.get("architectures") or [])


def read_ids(config: dict, engine: str) -> tuple[list[int] | None, str]:
    """(eagleflow ids the engine feeds the draft, the key it read) for a native config."""
    native = (config.get("dflash_config") or {}).get("target_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if engine == "vllm" and top:
        return list(top), "eagle_aux_hidden_state_layer_ids"
    if native is None:
        return None, "dflash_config.target_layer_ids"
    return dflash.ids_from_dflash_target_layer_ids(native), "dflash_config.target_layer_ids + 1"


def diagnose(
    target: dict,
    draft_dir,
    config: dict,
    engine: str,
    flags: dict,
    trained: list[int] | None = None,
) -> tuple[list[Finding], list[str]]:
    """(findings, info lines) for serving the native DFlash draft at `draft_dir` on `engine`.
    `flags`: the launch's `--speculative-config` (raw) and `--speculative-num-draft-tokens`;
    `trained`: the layers it was trained on, when its config's provenance does not say."""
    L, hidden, vocab = target["num_layers"], target["hidden_size"], target["vocab_size"]
    tensors = _tensor_summary(draft_dir)["shapes"]
    findings: list[Finding] = []
    ids, key = read_ids(config, engine)
    prov = config.get("eagleflow") or {}
    trained = trained if trained is not None else prov.get("trained_aux_layers")
    info = [
        f"target: {L} layers, hidden {hidden}, vocab {vocab}",
        f"draft {draft_dir}: native DFlash ({config.get('num_hidden_layers')} layers, block "
        f"{config.get('block_size')}); {engine} reads {key} = {ids}",
    ]
    if ids is None:
        findings.append(
            Finding(
                "the config names no target layers (dflash_config.target_layer_ids)",
                "write the layers the draft was trained on",
            )
        )
        ids = []
    top = config.get("eagle_aux_hidden_state_layer_ids")
    native = (config.get("dflash_config") or {}).get("target_layer_ids")
    if top and native is not None and list(top) != dflash.ids_from_dflash_target_layer_ids(native):
        findings.append(
            Finding(
                f"eagle_aux_hidden_state_layer_ids {list(top)} (what vLLM reads) and "
                f"dflash_config.target_layer_ids {list(native)} (SGLang: their outputs, ids "
                f"{dflash.ids_from_dflash_target_layer_ids(native)}) name other layers",
                "write target_layer_ids = id - 1 of the ids the draft was trained on",
            )
        )
    if trained is not None and list(trained) != ids:
        findings.append(
            Finding(
                f"{engine} feeds the draft layers {ids} ({key}), it was trained on {trained}",
                "export the draft again (eagleflow's export_dflash writes both keys)",
            )
        )
    findings += [Finding(p, "retrain on ids 1..L-1") for p in dflash.dflash_problems(ids, L)]
    if config.get("hidden_size") != hidden:
        findings.append(
            Finding(
                f"the draft's hidden_size is {config.get('hidden_size')}, the target's {hidden}",
                "use the target the draft was trained for",
            )
        )
    fc = tensors.get("fc.weight")
    if ids and fc is not None and tuple(fc) != (hidden, len(ids) * hidden):
        findings.append(
            Finding(
                f"fc.weight is {tuple(fc)}: {len(ids)} target layers of {hidden} need "
                f"({hidden}, {len(ids) * hidden})",
                "name as many target layers as the draft was trained on",
            )
        )
    mask = (config.get("dflash_config") or {}).get("mask_token_id", config.get("mask_token_id"))
    if mask is None or not 0 <= int(mask) < vocab:
        findings.append(
            Finding(
                f"mask_token_id {mask!r} is not a token of the target's {vocab}",
                "write the mask token the draft was trained with (the training summary has it)",
            )
        )
    kinds = set(config.get("layer_types") or ["full_attention"])
    if (config.get("dflash_config") or {}).get("causal") and "full_attention" in kinds:
        findings.append(
            Finding(
                "dflash_config.causal is true: vLLM serves every layer causal, but full-attention "
                "DFlash layers are trained bidirectional inside a block",
                "remove dflash_config.causal (eagleflow's export writes none)",
            )
        )
    if engine == "vllm" and len(kinds) > 1:
        findings.append(
            Finding(
                "mixed sliding and full draft layers need vLLM's V2 model runner",
                "launch with VLLM_USE_V2_MODEL_RUNNER=1 (a GPU build with Triton)",
            )
        )
    draft_vocab = int(config.get("draft_vocab_size") or config.get("vocab_size") or vocab)
    if draft_vocab != vocab:
        missing = [n for n in ("d2t", "lm_head.weight") if n not in tensors]
        if missing:
            findings.append(
                Finding(
                    f"draft_vocab_size {draft_vocab} < {vocab} but {missing} missing",
                    "export the reduced head and its map with the draft",
                )
            )
        if engine == "sglang":
            findings.append(
                Finding(
                    f"a reduced draft vocabulary ({draft_vocab} of {vocab}): SGLang's DFLASH "
                    "borrows the target's head and drops lm_head and d2t without a word",
                    "train with train.draft_vocab_size = the target's vocabulary for SGLang",
                )
            )
    findings += _flag_findings(engine, flags, config)
    return findings, info


def _flag_findings(engine: str, flags: dict, config: dict) -> list[Finding]:
    """Launch flags against the block: at most block_size - 1 drafted tokens (vLLM), the whole
    block as SGLang's draft tokens."""
    block = int(config.get("block_size") or 0)
    out = []
    if engine == "vllm":
        raw = flags.get("--speculative-config")
        if raw is None:
            return []
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError as e:
            return [Finding(f"--speculative-config is not JSON ({e})", "quote it as JSON")]
        if spec.get("method") != dflash.ALGORITHM:
            out.append(
                Finding(
                    f"--speculative-config method {spec.get('method')!r} for a DFlash draft",
                    'set "method": "dflash"',
                )
            )
        k = spec.get("num_speculative_tokens")
        if block and k is not None and int(k) > block - 1:
            out.append(
                Finding(
                    f"num_speculative_tokens {k} exceeds the block's {block - 1} drafted "
                    "positions: the draft was never trained past them",
                    f"use num_speculative_tokens <= {block - 1}",
                )
            )
    else:
        n = flags.get("--speculative-num-draft-tokens")
        if block and n is not None and n != block:
            out.append(
                Finding(
                    f"--speculative-num-draft-tokens {n}: SGLang's DFLASH block is the draft's "
                    f"block_size {block} (anchor included)",
                    f"use --speculative-num-draft-tokens {block}, or leave it out",
                )
            )
    return out
