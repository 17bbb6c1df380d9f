"""Rule export_dflash: the best DFlash checkpoint as the native folder both engines load.

speculators saves a DFlash draft as `DFlashSpeculator` with `aux_hidden_state_layer_ids` and
`sliding_window_non_causal: false`; vLLM's speculators adapter turns that flag into
`dflash_config.causal: true` for every layer, so a full-attention draft trained bidirectionally
inside its block would be served causally. The native (z-lab) layout has no such key: a flat
Qwen3 config with `architectures ["DFlashDraftModel"]`, `layer_types`, `block_size`, and
`dflash_config {target_layer_ids: id - 1, mask_token_id}` (the output of layer id - 1 is
eagleflow's id; `eagleflow.dflash`), plus vLLM's `eagle_aux_hidden_state_layer_ids` (eagleflow
ids, read first by vLLM). The weights are the checkpoint's, under the names it saved (vLLM
prefixes `model.`; a reduced vocabulary keeps `d2t` and `lm_head`).

Every check refuses before anything is written, and the folder replaces the output whole.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from eagleflow import dflash
from eagleflow import layers as lay
from eagleflow.doctor import diagnose
from eagleflow.errors import ExportError
from eagleflow.extract.certificate import require_certificate
from eagleflow.target.prepare import load_target_json, sha256_file
from eagleflow.train.export import _read_checkpoint, checkpoint_sha256, load_tensors, weight_files

log = logging.getLogger(__name__)

ARCHITECTURE = dflash.NATIVE_ARCHITECTURE
CARD = "README.md"


def native_config(ckpt: dict, target: dict, ids: list[int], provenance: dict) -> dict:
    """The native DFlash config.json of a speculators DFlash checkpoint config."""
    cfg = dict(ckpt["transformer_layer_config"])
    n = int(cfg["num_hidden_layers"])
    cfg.update(
        architectures=[ARCHITECTURE],
        model_type="qwen3",
        layer_types=cfg.get("layer_types") or ["full_attention"] * n,
        block_size=int(ckpt["block_size"]),
        num_target_layers=int(target["num_layers"]),
        target_hidden_size=int(ckpt.get("target_hidden_size") or target["hidden_size"]),
        draft_vocab_size=int(ckpt["draft_vocab_size"]),
        eagle_aux_hidden_state_layer_ids=list(ids),
        dflash_config={
            "target_layer_ids": dflash.dflash_target_layer_ids(ids),
            "mask_token_id": int(ckpt["mask_token_id"]),
        },
    )
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    if ckpt.get("dtype") or ckpt.get("torch_dtype"):
        cfg["dtype"] = ckpt.get("dtype") or ckpt.get("torch_dtype")
    cfg["eagleflow"] = provenance
    return cfg


def checkpoint_problems(ckpt: dict, tensors: dict, target: dict, train_cfg: dict) -> list[str]:
    """What makes a checkpoint not the DFlash draft this config trains for this target."""
    problems = []
    if ckpt.get("speculators_model_type") != dflash.ALGORITHM:
        problems.append(
            f"speculators_model_type is {ckpt.get('speculators_model_type')!r}, expected "
            "'dflash' (a DFlashDraftModel checkpoint)"
        )
    tl = ckpt.get("transformer_layer_config") or {}
    if tl.get("hidden_size") != target.get("hidden_size"):
        problems.append(
            f"the draft's hidden_size is {tl.get('hidden_size')}, the target's "
            f"{target.get('hidden_size')} (a draft for another target)"
        )
    kinds = set(tl.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        problems.append(
            f"layer_types {sorted(kinds)}: eagleflow exports full-attention DFlash drafts only "
            "(sliding layers are causal in vLLM and need its V2 runner when mixed)"
        )
    if ckpt.get("sample_from_anchor"):
        problems.append("sample_from_anchor is true; vLLM 0.26 drafts from mask tokens only")
    d = train_cfg["dflash"]
    want = {
        "block_size": int(d["block_size"]),
        "draft_vocab_size": int(train_cfg["draft_vocab_size"]),
    }
    if d["mask_token_id"] is not None:
        want["mask_token_id"] = int(d["mask_token_id"])
    for key, value in want.items():
        if ckpt.get(key) != value:
            problems.append(f"the checkpoint has {key} {ckpt.get(key)}, the config {value}")
    if ckpt.get("mask_token_id") is None:
        problems.append("the checkpoint has no mask_token_id (both engines need it)")
    if tl.get("num_hidden_layers") != int(d["layers"]):
        problems.append(
            f"the checkpoint has {tl.get('num_hidden_layers')} draft layers, "
            f"draft.dflash.layers is {d['layers']}"
        )
    ids = ckpt.get("aux_hidden_state_layer_ids") or []
    fc = tensors.get("fc.weight")
    hidden = int(target["hidden_size"])
    if fc is None or tuple(fc.shape) != (hidden, len(ids) * hidden):
        problems.append(
            f"fc.weight is {None if fc is None else tuple(fc.shape)}, expected "
            f"({hidden}, {len(ids) * hidden}) for {len(ids)} target layers of {hidden}"
        )
    reduced = int(ckpt.get("draft_vocab_size") or 0) != int(target["vocab_size"])
    for name in ("d2t", "lm_head.weight") if reduced else ():
        if name not in tensors:
            problems.append(f"a reduced draft vocabulary needs {name}, which is missing")
    return problems


def _card(target: dict, ids: list[int], ckpt: dict, summary: dict, out: Path) -> str:
    """A short model card: what the draft is and the commands that serve it."""
    k = int(ckpt["block_size"]) - 1
    spec = {"method": "dflash", "model": str(out.resolve()), "num_speculative_tokens": k}
    best = summary.get("best_val") or {}
    layers = ckpt["transformer_layer_config"]["num_hidden_layers"]
    return (
        f"# DFlash draft for {target.get('name')}\n\n"
        f"Block draft (speculators DFlashDraftModel, {layers} layer(s), full attention) trained "
        "by eagleflow on the target's layers "
        f"{lay.format_ids(ids)} (eagleflow ids: the input of decoder layer k; "
        f"`dflash_config.target_layer_ids` {dflash.dflash_target_layer_ids(ids)} name the same "
        f"states as layer outputs). Block size {ckpt['block_size']} (anchor + {k} masked "
        f"positions), mask token {ckpt['mask_token_id']}, draft vocabulary "
        f"{ckpt['draft_vocab_size']}.\n\n"
        f"Validation (best epoch {summary.get('best_epoch')}): expected accepted length "
        f"{best.get('eal', 0):.3f}, per position "
        + ", ".join(
            f"{best.get(f'position_{i}_acc', 0):.3f}" for i in range(1, int(ckpt["block_size"]))
        )
        + ".\n\n"
        f"vLLM: `vllm serve {target['path']} --speculative-config '{json.dumps(spec)}'` "
        f"(`num_speculative_tokens` at most {k}).\n"
    )


def export_dflash(
    target_json: str, certificate: str, summary: str, train_cfg: dict, target_name: str, out: str
) -> dict:
    """Write the native DFlash folder of the best checkpoint, or refuse and write nothing."""
    start = time.monotonic()
    target = load_target_json(target_json)
    run_summary, ckpt_dir, ckpt = _read_checkpoint(summary)
    ids = list(ckpt.get("aux_hidden_state_layer_ids") or [])
    cert = require_certificate(certificate, target, ids)
    problems = dflash.dflash_problems(ids, int(target["num_layers"]))
    if target_name not in ("", None, target.get("name")):
        problems.append(f"target.json describes {target.get('name')!r}, not {target_name!r}")
    tensors = load_tensors(ckpt_dir)
    problems += checkpoint_problems(ckpt, tensors, target, train_cfg)
    if problems:
        raise ExportError(
            f"checkpoint {ckpt_dir} cannot be exported as this config's DFlash draft:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nrerun train_draft for this config"
        )
    ckpt_sha = checkpoint_sha256(ckpt_dir)
    provenance = {
        "format": "dflash-native",
        "trained_aux_layers": ids,
        "final_slot": lay.FINAL_SLOT,
        "target_name": target.get("name"),
        "target_num_layers": int(target["num_layers"]),
        "target_config_sha256": target.get("config_sha256"),
        "target_weights_sha256": target.get("weights_sha256"),
        "certificate_sha256": sha256_file(certificate),
        "checkpoint_sha256": ckpt_sha,
        "certificate_passed": bool(cert.get("passed")),
    }
    out_dir = Path(out)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    try:
        for f in weight_files(ckpt_dir):
            shutil.copy2(f, tmp / f.name)
        index = ckpt_dir / "model.safetensors.index.json"
        if index.is_file():
            shutil.copy2(index, tmp / index.name)
        cfg = native_config(ckpt, target, ids, provenance)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / CARD).write_text(_card(target, ids, ckpt, run_summary, out_dir))
        found = diagnose(target["path"], tmp, "vllm").findings
        if found:
            raise ExportError(
                "doctor refused the DFlash export (nothing was written):\n"
                + "\n".join(f"  - {f.line()}" for f in found)
            )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "exported %s as a native DFlash draft %s (ids %s, dflash target_layer_ids %s, block %d, "
        "mask %d) in %.1f s",
        ckpt_dir,
        out_dir,
        lay.format_ids(ids),
        cfg["dflash_config"]["target_layer_ids"],
        cfg["block_size"],
        cfg["dflash_config"]["mask_token_id"],
        time.monotonic() - start,
    )
    return {"dflash": str(out_dir), "checkpoint_sha256": ckpt_sha}
