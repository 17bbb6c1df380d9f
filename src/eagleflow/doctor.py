"""`eagleflow doctor`: every mismatch between a draft checkpoint and a target for one engine.

Reads only config files (plus the draft's safetensors header and its small d2t/t2d tensors), so
it runs on a laptop for a trillion-parameter target. Each finding names what is wrong, what the
engine will do, and the fix; no findings means exit status 0.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from eagleflow import layers as lay
from eagleflow import serve
from eagleflow.errors import EagleflowError
from eagleflow.targets import describe_target

SPECULATORS = "speculators"
SGLANG_FORMAT = "sglang"  # SafeAILab layout: LlamaForCausalLMEagle3, midlayer.* / layers.0.*


@dataclass
class Finding:
    """One mismatch: what is wrong and how to fix it."""

    what: str
    fix: str

    def line(self) -> str:
        return f"MISMATCH {self.what}. Fix: {self.fix}"


@dataclass
class Report:
    """Findings plus informational lines (what was read, which rule was applied)."""

    findings: list[Finding]
    info: list[str]

    @property
    def ok(self) -> bool:
        return not self.findings


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
    else:
        raise EagleflowError(
            f"{cfg_path}: architectures {config.get('architectures')} is not an EAGLE-3 draft "
            "(expected Eagle3DraftModel or LlamaForCausalLMEagle3)"
        )
    return config, fmt, _tensor_summary(draft_dir)


def _tensor_summary(draft_dir: Path) -> dict:
    """Shapes of every tensor and the d2t / t2d values (tiny), read without loading weights."""
    from safetensors import safe_open

    shapes, maps = {}, {}
    for file in sorted(draft_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[name] = tuple(f.get_slice(name).get_shape())
                if name in ("d2t", "t2d"):
                    maps[name] = f.get_tensor(name)
    return {"shapes": shapes, "maps": maps}


def _flag(config: dict, name: str):
    eagle = config.get("eagle_config") or {}
    return eagle.get(name, config.get(name))


def trained_layers(config: dict, fmt: str) -> tuple[list[int] | None, str]:
    """The layers the draft was trained on, and where that came from."""
    prov = config.get("eagleflow") or {}
    if prov.get("trained_aux_layers") is not None:
        return list(prov["trained_aux_layers"]), "eagleflow provenance (layer certificate)"
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:
        return (
            list(config["eagle_aux_hidden_state_layer_ids"]),
            "top-level eagle_aux_hidden_state_layer_ids (speculators/vLLM convention)",
        )
    return None, "unknown"


def captured_layers(
    config: dict, fmt: str, engine: str, target: dict, sglang_version: str
) -> tuple[list[int], str]:
    """The layers (internal ids) the engine will feed this draft, and why."""
    L = target["num_layers"]
    if engine == "vllm":
        top = config.get("eagle_aux_hidden_state_layer_ids")
        inner = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if top is not None:
            return list(top), "vLLM reads the top-level eagle_aux_hidden_state_layer_ids"
        if inner is not None:
            return list(inner), "vLLM reads eagle_config's ids (no top-level key), no offset"
        return lay.default_aux(L), "no ids in the draft config: vLLM uses its default"
    written = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    releases = lay.sglang_releases(sglang_version)
    rule = lay.sglang_rule(target["family"], max(releases))
    real = lay.sglang_capture_real(target["family"], written, L)
    if real is not None:
        return real[0], f"sglang {real[1]}'s own set_eagle3_layers_to_capture"
    why = f"SGLang {sglang_version} {target['family']}-family rule ({rule})"
    if written is None:
        why = f"no eagle_config ids: SGLang silently uses its default ({why})"
    return lay.apply_rule(rule, written, L), why


def diagnose(
    target_dir: str | Path,
    draft_dir: str | Path,
    engine: str,
    server_args: str = "",
    sglang_version: str = "0.5.23",
    trained: list[int] | None = None,
) -> Report:
    """All findings for serving `draft_dir` on `engine` with `target_dir` as the target."""
    if engine not in ("vllm", "sglang"):
        raise EagleflowError(f"--engine {engine!r}: expected vllm or sglang")
    target = describe_target(target_dir)
    config, fmt, tensors = read_draft(draft_dir)
    L, hidden, vocab = target["num_layers"], target["hidden_size"], target["vocab_size"]
    findings: list[Finding] = []
    info = [
        f"target {target_dir}: {target['architecture']}, {L} layers, hidden {hidden}, "
        f"vocab {vocab}, family {target['family']}",
        f"draft {draft_dir}: {fmt} format",
    ]

    if engine == "sglang" and fmt == SPECULATORS:
        findings.append(
            Finding(
                "SGLang has no loader for speculators-format drafts (Eagle3DraftModel)",
                "export it to the SGLang format (eagleflow's export_draft writes both formats)",
            )
        )

    # Layer ids: what training used vs what the engine will capture.
    src = "--trained-layers"
    if trained is None:
        trained, src = trained_layers(config, fmt)
    captured, why = captured_layers(config, fmt, engine, target, sglang_version)
    info.append(f"{engine} will capture {lay.format_ids(captured)}: {why}")
    if engine == "sglang" and not (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    ):
        findings.append(
            Finding(
                "the draft config has no eagle_config.eagle_aux_hidden_state_layer_ids: SGLang "
                f"silently captures its default {lay.format_ids(captured)}",
                "write eagle_config.eagle_aux_hidden_state_layer_ids explicitly "
                "(eagleflow layers --target T --layers <trained ids> gives them)",
            )
        )
    if trained is None:
        findings.append(
            Finding(
                "cannot tell which layers the draft was trained on (no eagleflow provenance, no "
                "top-level eagle_aux_hidden_state_layer_ids)",
                "pass --trained-layers embed,3,31 (internal convention: HF hidden_states index)",
            )
        )
    else:
        info.append(f"trained on {lay.format_ids(trained)} ({src})")
        problems = lay.aux_problems(trained, L, target["family"])
        for p in problems:
            findings.append(Finding(f"trained layer ids: {p}", "retrain on valid ids"))
        if not problems and captured != trained:
            fix = _ids_fix(trained, L, target, engine, sglang_version)
            findings.append(
                Finding(
                    f"layer ids: the draft was trained on hidden states of "
                    f"{lay.format_ids(trained)} but {engine} will feed it "
                    f"{lay.format_ids(captured)} ({why})",
                    fix,
                )
            )
    bad = [k for k in captured if k < 0 or k >= L]
    if bad:
        findings.append(
            Finding(
                f"{engine} would capture layer ids {bad}, outside 0..{L - 1} of this {L}-layer "
                "target (the draft was made for another target, or the ids are shifted)",
                "write ids of this target's layers",
            )
        )

    # Norm flags the engine does not implement.
    if engine == "sglang" and _flag(config, "norm_before_residual"):
        findings.append(
            Finding(
                "norm_before_residual is true, but SGLang's llama_eagle3 has no such option: its "
                "first layer always keeps the pre-norm hidden state as the residual, so the draft "
                "runs differently from how it was trained",
                "retrain with norm_before_residual false (eagleflow's default), or serve on vLLM",
            )
        )

    findings += _size_findings(config, fmt, tensors, target)
    findings += _vocab_findings(config, tensors, vocab)
    findings += _flag_findings(engine, server_args, target)
    prov = config.get("eagleflow") or {}
    if prov.get("target_num_layers") not in (None, L):
        findings.append(
            Finding(
                f"the draft was trained for a {prov['target_num_layers']}-layer target; this one "
                f"has {L}",
                "use the target the draft was trained for",
            )
        )
    return Report(findings, info)


def _ids_fix(trained, L, target, engine, sglang_version) -> str:
    if engine == "vllm":
        return f"set the top-level eagle_aux_hidden_state_layer_ids to {trained}"
    try:
        sg = lay.sglang_ids(trained, L, target["family"], sglang_version)
    except EagleflowError as e:
        return str(e)
    if sg.written is None:
        return "; ".join(sg.problems)
    return f"set eagle_config.eagle_aux_hidden_state_layer_ids to {sg.written}" + (
        f" ({sg.notes[0]})" if sg.notes else ""
    )


def _size_findings(config: dict, fmt: str, tensors: dict, target: dict) -> list[Finding]:
    out = []
    hidden = target["hidden_size"]
    draft_target_hidden = config.get("target_hidden_size")
    if draft_target_hidden is None and fmt == SGLANG_FORMAT:
        draft_target_hidden = config.get("hidden_size")
    if draft_target_hidden not in (None, hidden):
        out.append(
            Finding(
                f"the draft expects target hidden size {draft_target_hidden}, the target has "
                f"{hidden}",
                "use the draft made for this target",
            )
        )
    fc = tensors["shapes"].get("fc.weight")
    n_aux = len(
        config.get("eagle_aux_hidden_state_layer_ids")
        or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        or [0, 0, 0]
    )
    if fc is not None and fc[1] != n_aux * hidden:
        out.append(
            Finding(
                f"fc.weight is {list(fc)}: it takes {fc[1]} inputs, but {n_aux} aux layers of "
                f"hidden {hidden} give {n_aux * hidden}",
                "the layer-id list length or the target does not match the checkpoint",
            )
        )
    return out


def _vocab_findings(config: dict, tensors: dict, vocab: int) -> list[Finding]:
    out = []
    draft_vocab = config.get("draft_vocab_size")
    d2t, t2d = tensors["maps"].get("d2t"), tensors["maps"].get("t2d")
    if config.get("vocab_size") not in (None, vocab) and "speculators_config" not in config:
        out.append(
            Finding(
                f"draft vocab_size {config.get('vocab_size')} differs from the target's {vocab}",
                "set the draft's vocab_size to the target's",
            )
        )
    if draft_vocab is None or draft_vocab == vocab:
        return out
    if d2t is None:
        out.append(
            Finding(
                f"draft_vocab_size {draft_vocab} < target vocab {vocab} but the checkpoint has no "
                "d2t tensor: draft token ids would be read as target ids",
                "export the draft with its d2t mapping",
            )
        )
        return out
    if d2t.numel() != draft_vocab:
        out.append(
            Finding(
                f"d2t has {d2t.numel()} entries, draft_vocab_size is {draft_vocab}",
                "re-export the draft",
            )
        )
        return out
    import torch

    target_ids = torch.arange(draft_vocab) + d2t.long()
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
        out.append(
            Finding(
                f"d2t maps draft ids to target ids outside 0..{vocab - 1}",
                "re-export the draft for this target's vocabulary",
            )
        )
    elif t2d is not None:
        t2d = t2d.bool()
        if t2d.numel() != vocab or int(t2d.sum()) != draft_vocab or not bool(t2d[target_ids].all()):
            out.append(
                Finding(
                    "t2d disagrees with d2t (a target id that d2t produces is not marked in t2d, "
                    f"or t2d has {int(t2d.sum())} marks for {draft_vocab} draft tokens)",
                    "re-export both maps from one vocab_map run",
                )
            )
    return out


def _flag_findings(engine: str, server_args: str, target: dict) -> list[Finding]:
    """Launch flags the engine would rewrite or ignore (rules from `eagleflow.serve`)."""
    if not server_args:
        return []
    argv = shlex.split(server_args)
    out = []
    if engine == "sglang":
        if any(a.split("=", 1)[0] == "--speculative-token-map" for a in argv):
            out.append(
                Finding(
                    "--speculative-token-map is ignored by SGLang for EAGLE3 (the draft's d2t "
                    "is used)",
                    "remove the flag; ship d2t in the draft",
                )
            )
        spec = serve.SpecConfig(
            "server-args",
            _int_flag(argv, "--speculative-num-steps"),
            _int_flag(argv, "--speculative-eagle-topk"),
            _int_flag(argv, "--speculative-num-draft-tokens"),
        )
        for p in serve.sglang_spec_problems(spec):
            out.append(
                Finding(
                    p.replace("serve.speculative[server-args]", "--server-args"),
                    "write the flags SGLang will actually run",
                )
            )
    else:
        raw = _str_flag(argv, "--speculative-config")
        if raw is not None:
            try:
                spec = json.loads(raw)
            except json.JSONDecodeError as e:
                return [Finding(f"--speculative-config is not JSON ({e})", "quote it as JSON")]
            if spec.get("method") not in ("eagle3", None):
                out.append(
                    Finding(
                        f"--speculative-config method {spec.get('method')!r} is not eagle3",
                        'set "method": "eagle3"',
                    )
                )
    return out


def _str_flag(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _int_flag(argv: list[str], flag: str) -> int | None:
    value = _str_flag(argv, flag)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise EagleflowError(f"{flag} {value!r} is not an integer") from None
