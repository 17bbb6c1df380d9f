"""Draft exports: speculators format (vLLM) and SGLang format, each with a model card.

Both are written from the best training checkpoint (speculators' `save_pretrained` layout), with
the layer ids the layer certificate gives for each engine, and both are checked by `doctor`
before they replace the outputs.

speculators format (`Eagle3DraftModel`, what vLLM loads natively): the checkpoint's files as
saved, its config.json with the certificate's vLLM ids in `eagle_aux_hidden_state_layer_ids`,
every norm flag written out (vLLM's speculators reader defaults a missing
`norm_before_residual` to true, speculators to false) and an `eagleflow` provenance block.

SGLang format (`LlamaForCausalLMEagle3`, the SafeAILab layout): a Llama config of the draft
layer with `draft_vocab_size`, `target_hidden_size`, `eagle_config` (SGLang's ids, which it
offsets by +1, and `use_aux_hidden_state`), the top-level id key in vLLM's convention (vLLM
reads it before `eagle_config`), so the one folder serves correctly on both engines; tensors in
bfloat16 under the names of `sglang_names`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from eagleflow import engines
from eagleflow import layers as lay
from eagleflow.doctor import diagnose
from eagleflow.drafts import sglang_expected_names, sglang_names
from eagleflow.errors import ExportError
from eagleflow.extract.certificate import require_certificate
from eagleflow.target.prepare import load_target_json, sha256_file, text_config

log = logging.getLogger(__name__)

EXPORT_VERSION = 1
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
CARD = "README.md"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Checkpoint files the speculators export carries (config.py is speculators' auto_map source);
# optimizer / scheduler / RNG state and training bookkeeping stay in the data root.
SPECULATORS_FILES = ("config.json", "config.py", "generation_config.json", WEIGHTS_INDEX)
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


# ---------------------------------------------------------------------------------------------
# Reading the checkpoint.


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (one file, or the shards of its index)."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    return [folder / WEIGHTS]


def checkpoint_sha256(folder: str | Path) -> str:
    """What the train summary records for a checkpoint: sha256 of its weights (or index)."""
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX
    return sha256_file(index if index.is_file() else folder / WEIGHTS)


def load_tensors(folder: str | Path) -> dict:
    """All tensors of a checkpoint folder, by name."""
    from safetensors.torch import load_file

    out = {}
    for f in weight_files(Path(folder)):
        out.update(load_file(str(f)))
    return out


def _read_checkpoint(summary_path: str) -> tuple[dict, Path, dict]:
    summary = json.loads(Path(summary_path).read_text())
    folder = Path(summary.get("best_checkpoint") or "")
    rerun = "rerun train_draft (its checkpoints live in data_root)"
    if not summary.get("best_checkpoint") or not (folder / "config.json").is_file():
        raise ExportError(
            f"train summary {summary_path} names best_checkpoint {str(folder)!r}, which holds "
            f"no config.json on this host; {rerun}"
        )
    missing = [str(f) for f in weight_files(folder) if not f.is_file()]
    if missing:
        raise ExportError(f"checkpoint {folder} lacks {', '.join(missing)}; {rerun}")
    want, have = summary.get("best_checkpoint_sha256"), checkpoint_sha256(folder)
    if want != have:
        raise ExportError(
            f"checkpoint {folder} changed since training: its weights have sha256 {have[:12]}, "
            f"the train summary recorded {str(want)[:12]}; {rerun}"
        )
    return summary, folder, json.loads((folder / "config.json").read_text())


# ---------------------------------------------------------------------------------------------
# Checks: everything that refuses happens before anything is written.


def _check_checkpoint(ckpt: dict, folder: Path, target: dict, train_cfg: dict) -> None:
    problems = []
    if ckpt.get("speculators_model_type") != "eagle3":
        problems.append(
            f"speculators_model_type is {ckpt.get('speculators_model_type')!r}, expected "
            "'eagle3' (an Eagle3DraftModel checkpoint)"
        )
    tl = ckpt.get("transformer_layer_config") or {}
    for key, want in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size")):
        if tl.get(key) != target.get(want):
            problems.append(
                f"transformer_layer_config.{key} is {tl.get(key)}, the target's {want} is "
                f"{target.get(want)} (a draft for another target)"
            )
    for flag in NORM_FLAGS:
        if flag in train_cfg and bool(ckpt.get(flag, False)) != bool(train_cfg[flag]):
            problems.append(
                f"the checkpoint was trained with {flag}={bool(ckpt.get(flag, False))}, but "
                f"train.{flag} is {train_cfg[flag]}"
            )
    if (
        "draft_vocab_size" in train_cfg
        and ckpt.get("draft_vocab_size") != train_cfg["draft_vocab_size"]
    ):
        problems.append(
            f"the checkpoint has draft_vocab_size {ckpt.get('draft_vocab_size')}, "
            f"train.draft_vocab_size is {train_cfg['draft_vocab_size']}"
        )
    if "draft_layers" in train_cfg and tl.get("num_hidden_layers") != train_cfg["draft_layers"]:
        problems.append(
            f"the checkpoint has {tl.get('num_hidden_layers')} draft layers, train.draft_layers "
            f"is {train_cfg['draft_layers']}"
        )
    if problems:
        raise ExportError(
            f"checkpoint {folder} does not match the target and train config:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nrerun train_draft for this config"
        )


def sglang_problems(ckpt: dict, cert: dict) -> list[str]:
    """Why SGLang would serve this draft differently from how it was trained ([] = it would not)."""
    problems = []
    sg = cert["ids_per_engine"]["sglang"]
    if sg.get("eagle_config_ids") is None:
        problems.append(
            "the layer certificate has no SGLang ids for these layers: "
            + ("; ".join(sg.get("problems") or []) or "no reason recorded")
        )
    if ckpt.get("norm_before_residual"):
        problems.append(
            "norm_before_residual is true, but SGLang's llama_eagle3 has no such option (its "
            "first layer always keeps the pre-norm hidden state as the residual), and no "
            "rewrite of the weights is equivalent; retrain with train.norm_before_residual "
            "false (the default), or serve this draft on vLLM only"
        )
    if ckpt.get("embed_requires_grad"):
        problems.append(
            "embed_requires_grad is true (the draft trained its own embedding), but SGLang "
            "always replaces the draft's embedding with the target's; retrain with a frozen "
            "embedding"
        )
    tl = ckpt.get("transformer_layer_config") or {}
    if tl.get("model_type") != "llama":
        problems.append(
            f"the draft layer is model_type {tl.get('model_type')!r}; SGLang's "
            f"{SGLANG_ARCHITECTURE} is a Llama layer (a {tl.get('model_type')} layer's extra "
            "tensors, e.g. q_norm/k_norm, would be dropped silently); train a llama draft layer"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if tl.get(flag):
            problems.append(
                f"transformer_layer_config.{flag} is true, but SGLang's draft layer has no "
                "biases (its loader would drop them silently); train without biases"
            )
    return problems


# ---------------------------------------------------------------------------------------------
# The two configs.


def _provenance(ckpt, target, cert, cert_path, ckpt_sha, fmt) -> dict:
    sg = cert["ids_per_engine"]["sglang"]
    return {
        "export_version": EXPORT_VERSION,
        "format": fmt,
        "trained_aux_layers": list(cert["aux_layers"]),
        "trained_aux_layers_text": lay.format_ids(cert["aux_layers"]),
        "final_slot": lay.FINAL_SLOT,
        "target_name": target.get("name"),
        "target_num_layers": int(target["num_layers"]),
        "target_config_sha256": target.get("config_sha256"),
        "target_weights_sha256": target.get("weights_sha256"),
        "certificate_sha256": sha256_file(cert_path),
        "checkpoint_sha256": ckpt_sha,
        "engine_ids": {
            "vllm": list(cert["ids_per_engine"]["vllm"]),
            "sglang_eagle_config": sg.get("eagle_config_ids"),
            "sglang_version": sg.get("version"),
            "sglang_family": sg.get("family"),
        },
    }


def speculators_config(ckpt: dict, cert: dict, provenance: dict) -> dict:
    """The checkpoint's config with the certificate's vLLM ids and every norm flag explicit."""
    cfg = json.loads(json.dumps(ckpt))
    cfg["eagle_aux_hidden_state_layer_ids"] = list(cert["ids_per_engine"]["vllm"])
    for flag in NORM_FLAGS:
        # speculators' own default is false; vLLM's speculators reader defaults a missing
        # norm_before_residual to TRUE, so an absent key would be served wrongly.
        cfg[flag] = bool(ckpt.get(flag, False))
    cfg["eagleflow"] = provenance
    return cfg


def sglang_config(ckpt: dict, target: dict, cert: dict, provenance: dict) -> dict:
    """`LlamaForCausalLMEagle3` config: the draft layer's Llama fields plus EAGLE-3's keys."""
    tl = dict(ckpt["transformer_layer_config"])
    for key in ("architectures", "auto_map", "_attn_implementation", "transformers_version"):
        tl.pop(key, None)
    nbf = bool(ckpt.get("norm_before_fc", False))
    cfg = {
        **tl,
        "architectures": [SGLANG_ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": int(target["vocab_size"]),
        # The draft's lm_head is its own (draft vocabulary rows); tied would make SGLang use
        # the embedding as the head.
        "tie_word_embeddings": False,
        "draft_vocab_size": int(ckpt["draft_vocab_size"]),
        "target_hidden_size": int(target["hidden_size"]),
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        # vLLM reads this key first, as HF hidden-state indices; SGLang never reads it.
        "eagle_aux_hidden_state_layer_ids": list(cert["ids_per_engine"]["vllm"]),
        # SGLang reads only eagle_config's ids (and offsets them); vLLM reads its
        # use_aux_hidden_state and norm_before_fc too.
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(
                cert["ids_per_engine"]["sglang"]["eagle_config_ids"]
            ),
            "use_aux_hidden_state": True,
            "norm_before_fc": nbf,
        },
        # Top level: where vLLM reads all four and SGLang reads fc_norm and norm_output (and
        # norm_before_fc as a fallback). norm_before_residual is always false here.
        "norm_before_residual": False,
        "norm_before_fc": nbf,
        "fc_norm": bool(ckpt.get("fc_norm", False)),
        "norm_output": bool(ckpt.get("norm_output", False)),
        "eagleflow": provenance,
    }
    return cfg


def sglang_tensors(tensors: dict, ckpt: dict) -> dict:
    """The checkpoint's tensors under SGLang-format names, floating ones in bfloat16."""
    import torch

    num_layers = int(ckpt["transformer_layer_config"]["num_hidden_layers"])
    num_aux = len(ckpt["eagle_aux_hidden_state_layer_ids"])
    out = {}
    for name, t in tensors.items():
        for new in sglang_names(name, num_layers):
            out[new] = (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
    want = sglang_expected_names(
        num_layers,
        num_aux,
        bool(ckpt.get("norm_before_fc")),
        bool(ckpt.get("fc_norm")),
        "d2t" in tensors,
    )
    extra, missing = sorted(set(out) - want), sorted(want - set(out))
    if int(ckpt["draft_vocab_size"]) != int(ckpt["transformer_layer_config"]["vocab_size"]) and (
        "d2t" not in tensors
    ):
        missing.append("d2t (draft_vocab_size < target vocab needs the draft-to-target map)")
    if extra or missing:
        raise ExportError(
            "the checkpoint's tensors do not fit SGLang's LlamaForCausalLMEagle3: "
            + (f"its loader would silently drop {extra}; " if extra else "")
            + (f"it would leave unset {missing}; " if missing else "")
            + "train a standard speculators Eagle3 llama draft"
        )
    # safetensors refuses tensors that share memory; the duplicated norms of layers >= 1 do.
    seen: dict[int, str] = {}
    for k, t in out.items():
        if t.data_ptr() in seen:
            out[k] = t.clone()
        seen[t.data_ptr()] = k
    return out


# ---------------------------------------------------------------------------------------------
# Model card.


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _serve_commands(target: dict, ckpt: dict, spec_dir: str, sglang_dir: str) -> dict:
    steps = _speculative_tokens(ckpt)
    spec = engines.SpecConfig("card", steps, 1, steps + 1)
    vllm_opts = {}
    max_pos = _target_max_positions(target)
    if max_pos is not None and max_pos < 8192:
        vllm_opts["max_model_len"] = max_pos
    name = target.get("name") or "target"
    return {
        "vllm_speculators": engines.vllm_command(
            "python", target["path"], spec, vllm_opts, "127.0.0.1", 8000, spec_dir, name
        ),
        "vllm_sglang": engines.vllm_command(
            "python", target["path"], spec, vllm_opts, "127.0.0.1", 8000, sglang_dir, name
        ),
        "sglang": engines.sglang_command(
            "python", target["path"], spec, {}, "127.0.0.1", 30000, sglang_dir
        ),
    }


def _speculative_tokens(ckpt: dict) -> int:
    methods = (ckpt.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens") or 3)


def _target_max_positions(target: dict) -> int | None:
    cfg_path = Path(target["path"]) / "config.json"
    if not cfg_path.is_file():
        return None
    value = text_config(json.loads(cfg_path.read_text())).get("max_position_embeddings")
    return int(value) if value else None


def model_card(
    fmt: str,
    target: dict,
    cert: dict,
    summary: dict,
    ckpt: dict,
    provenance: dict,
    commands: dict,
) -> str:
    """README.md of one export: target, layers, data, training metrics, serve commands."""
    sg = cert["ids_per_engine"]["sglang"]
    sg_ids = sg.get("eagle_config_ids")
    tl = ckpt["transformer_layer_config"]
    title = "speculators format (vLLM)" if fmt == "speculators" else "SGLang format"
    lines = [
        f"# EAGLE-3 draft for {target.get('name')} — {title}",
        "",
        "Written by eagleflow's `export_draft` from the best training checkpoint. Measured "
        "accept lengths and speedups are not part of this folder: the report stage writes "
        "them to separate cards under `results/`.",
        "",
        "## Target",
        "",
        "| | |",
        "|---|---|",
        f"| name | {target.get('name')} |",
        f"| path | `{target.get('path')}` |",
        f"| architecture | {target.get('architecture')} ({target.get('family')} family) |",
        f"| decoder layers / hidden / vocab | {target['num_layers']} / "
        f"{target['hidden_size']} / {target['vocab_size']} |",
        f"| config sha256 | `{target.get('config_sha256')}` |",
        f"| weights sha256 | `{target.get('weights_sha256')}` |",
        "",
        "## Layers",
        "",
        "Trained on aux layers "
        f"{lay.format_ids(cert['aux_layers'])} (eagleflow convention: id k = HF "
        "`hidden_states[k]`, the input of decoder layer k) plus the final slot, the "
        f"{lay.FINAL_SLOT}. Proven on the target by the layer certificate "
        f"(sha256 `{provenance['certificate_sha256'][:16]}…`).",
        "",
        "| slot | internal id | holds | speculators / vLLM id | SGLang `eagle_config` id |",
        "|---|---|---|---|---|",
    ]
    for i, k in enumerate(cert["aux_layers"]):
        lines.append(
            f"| {i} | {lay.format_ids([k])[1:-1]} | {lay.describe_id(k)} | "
            f"{cert['ids_per_engine']['vllm'][i]} | {sg_ids[i] if sg_ids else '-'} |"
        )
    lines += [
        f"| {len(cert['aux_layers'])} | final | {lay.FINAL_SLOT} | last slot | last slot |",
        "",
        f"SGLang ids follow SGLang {sg.get('version')}'s {sg.get('family')}-family rule. "
        + (
            "This folder carries both keys: top-level `eagle_aux_hidden_state_layer_ids` "
            "(vLLM's convention, read first by vLLM) and `eagle_config."
            "eagle_aux_hidden_state_layer_ids` (SGLang's), so it serves correctly on both."
            if fmt == "sglang"
            else "SGLang has no loader for this format: serve the `sglang` export there."
        ),
        *[f"Note: {n}" for n in cert.get("notes") or []],
        "",
        "## Draft",
        "",
        "| | |",
        "|---|---|",
        f"| draft layers | {tl.get('num_hidden_layers')} (Llama layer, hidden "
        f"{tl.get('hidden_size')}, {tl.get('num_attention_heads')} heads) |",
        f"| draft vocabulary | {ckpt.get('draft_vocab_size')} of {target['vocab_size']} |",
        "| norm flags | "
        + ", ".join(f"{f}={bool(ckpt.get(f, False))}".lower() for f in NORM_FLAGS)
        + " |",
        f"| trained speculative tokens (TTT steps) | {_speculative_tokens(ckpt)} |",
        f"| checkpoint sha256 | `{provenance['checkpoint_sha256']}` |",
        "",
        "## Data and training",
        "",
        "| | |",
        "|---|---|",
    ]
    manifest = cert.get("manifest") or {}
    rows = [
        ("training samples (hidden-state shards)", manifest.get("num_samples")),
        ("hidden-state dtype", manifest.get("dtype")),
        ("tokens trained on", summary.get("tokens")),
        ("steps / epochs", f"{_fmt(summary.get('steps'))} / {_fmt(summary.get('epochs'))}"),
        (
            "best checkpoint",
            f"epoch {_fmt(summary.get('best_epoch'))}, step {_fmt(summary.get('best_step'))}",
        ),
        ("training time", f"{_fmt(summary.get('seconds'))} s on {_fmt(summary.get('device'))}"),
        (
            "throughput",
            f"{_fmt(summary.get('steps_per_s'))} steps/s, "
            f"{_fmt(summary.get('tokens_per_s'))} tok/s",
        ),
    ]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows]
    for key, label in (("best_val", "best validation"), ("final_val", "final validation")):
        metrics = summary.get(key) or {}
        if metrics:
            lines += ["", f"{label} metrics:", "", "| metric | value |", "|---|---|"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in metrics.items()]
    sglang_cmd = engines.format_command(commands["sglang"])
    lines += [
        "",
        "## Serve",
        "",
        "vLLM:",
        "",
        "```sh",
        engines.format_command(
            commands["vllm_speculators" if fmt == "speculators" else "vllm_sglang"]
        ),
        "```",
        "",
        "SGLang (the `sglang` export):" if fmt == "speculators" else "SGLang:",
        "",
        "```sh",
        sglang_cmd,
        "```",
        "",
        "`num_steps` is the trained TTT depth; eagleflow's benchmark sweeps the configured "
        "speculative settings.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The stage.


def _doctor(target_path: str, folder: Path, engines: list[str], sglang_version: str) -> list[str]:
    out = []
    for engine in engines:
        report = diagnose(target_path, folder, engine, sglang_version=sglang_version)
        out += [f"{engine}: {f.line()}" for f in report.findings]
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def export_draft(
    target_json: str,
    certificate: str,
    summary: str,
    train_cfg: dict,
    target_name: str,
    out_speculators: str,
    out_sglang: str,
) -> dict:
    """Write the speculators and SGLang exports of the best checkpoint, each doctored.

    Both are built in temporary folders next to the outputs and renamed into place only when
    every check passed, so a failure leaves no half-written export. Returns a small summary.
    """
    from safetensors.torch import save_file

    start = time.monotonic()
    target = load_target_json(target_json)
    if target_name and target.get("name") not in (None, target_name):
        raise ExportError(
            f"target.json {target_json} describes {target.get('name')!r}, the config's target "
            f"is {target_name!r}; rerun prepare_target"
        )
    target.setdefault("name", target_name)
    run_summary, ckpt_dir, ckpt = _read_checkpoint(summary)
    trained = ckpt.get("eagle_aux_hidden_state_layer_ids")
    if not trained:
        raise ExportError(
            f"checkpoint {ckpt_dir} has no eagle_aux_hidden_state_layer_ids, so the layers it "
            "was trained on are unknown; rerun train_draft (eagleflow writes them explicitly)"
        )
    cert = require_certificate(certificate, target, list(trained))
    if list(cert["ids_per_engine"]["speculators"]) != list(trained):
        raise ExportError(
            f"checkpoint {ckpt_dir} was trained on ids {trained}, the certificate gives "
            f"speculators ids {cert['ids_per_engine']['speculators']}; rerun train_draft"
        )
    _check_checkpoint(ckpt, ckpt_dir, target, train_cfg)
    problems = sglang_problems(ckpt, cert)
    if problems:
        raise ExportError(
            f"the SGLang export of {ckpt_dir} is refused (SGLang would serve it differently "
            "from how it was trained):\n" + "\n".join(f"  - {p}" for p in problems)
        )
    if not Path(target["path"], "config.json").is_file():
        raise ExportError(
            f"target folder {target['path']} (target.json) has no config.json on this host; "
            "export_draft checks each export against it with doctor, so run it where the "
            "target folder is"
        )
    ckpt_sha = checkpoint_sha256(ckpt_dir)
    tensors = load_tensors(ckpt_dir)
    sg_tensors = sglang_tensors(tensors, ckpt)
    prov = {
        fmt: _provenance(ckpt, target, cert, certificate, ckpt_sha, fmt)
        for fmt in ("speculators", "sglang")
    }
    out_spec, out_sg = Path(out_speculators), Path(out_sglang)
    commands = _serve_commands(target, ckpt, str(out_spec.resolve()), str(out_sg.resolve()))
    sglang_version = cert["ids_per_engine"]["sglang"].get("version") or "0.5.23"

    tmps: list[Path] = []
    replaced: list[Path] = []
    try:
        for out in (out_spec, out_sg):
            out.parent.mkdir(parents=True, exist_ok=True)
            tmps.append(Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-")))
        tmp_spec, tmp_sg = tmps

        for name in SPECULATORS_FILES[1:]:
            if (ckpt_dir / name).is_file():
                shutil.copy2(ckpt_dir / name, tmp_spec / name)
        for f in weight_files(ckpt_dir):
            shutil.copy2(f, tmp_spec / f.name)
        _write_json(tmp_spec / "config.json", speculators_config(ckpt, cert, prov["speculators"]))
        card = model_card(
            "speculators", target, cert, run_summary, ckpt, prov["speculators"], commands
        )
        (tmp_spec / CARD).write_text(card)

        _write_json(tmp_sg / "config.json", sglang_config(ckpt, target, cert, prov["sglang"]))
        save_file(sg_tensors, str(tmp_sg / WEIGHTS), metadata={"format": "pt"})
        card = model_card("sglang", target, cert, run_summary, ckpt, prov["sglang"], commands)
        (tmp_sg / CARD).write_text(card)

        findings = [
            f"speculators export: {x}"
            for x in _doctor(target["path"], tmp_spec, ["vllm"], sglang_version)
        ]
        findings += [
            f"sglang export: {x}"
            for x in _doctor(target["path"], tmp_sg, ["sglang", "vllm"], sglang_version)
        ]
        if findings:
            raise ExportError(
                "doctor refused the exports (nothing was written):\n"
                + "\n".join(f"  - {f}" for f in findings)
            )
        for tmp, out in ((tmp_spec, out_spec), (tmp_sg, out_sg)):
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
            replaced.append(out)
    except BaseException:
        # Neither export survives a failure: one without the other would look complete.
        for path in tmps + replaced:
            shutil.rmtree(path, ignore_errors=True)
        raise
    result = {
        "speculators": str(out_spec),
        "sglang": str(out_sg),
        "checkpoint_sha256": ckpt_sha,
        "sglang_tensors": sorted(sg_tensors),
    }
    size = {p: sum(f.stat().st_size for f in Path(p).iterdir()) for p in (out_spec, out_sg)}
    log.info(
        "exported %s (trained on %s): speculators %s (%.1f MB), sglang %s (%.1f MB, bf16, "
        "eagle_config ids %s); doctor clean for vllm and sglang; %.1f s",
        ckpt_dir,
        lay.format_ids(cert["aux_layers"]),
        out_spec,
        size[out_spec] / 1e6,
        out_sg,
        size[out_sg] / 1e6,
        cert["ids_per_engine"]["sglang"]["eagle_config_ids"],
        time.monotonic() - start,
    )
    return result
