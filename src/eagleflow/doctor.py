"""`eagleflow doctor`: what a draft checkpoint and a target disagree on for one engine.

Reads only config files (plus the draft's safetensors header and its small d2t/t2d tensors), so
it runs on a laptop for a trillion-parameter target. Three verdicts, each line with its evidence
and the fix or the check that would settle it:

- `MISMATCH` (exit 1): a proven disagreement, e.g. the engine will feed the draft other layers
  than it was trained on;
- `UNVERIFIED` (exit 3): nothing disagrees, but a named fact could not be checked, e.g. a
  downloaded draft whose config does not say which layers it was trained on;
- `OK` (exit 0). Bad input (no config.json, not a draft) exits 2.

What a config proves depends on who wrote it (`producer`): eagleflow's provenance block, the
top-level ids speculators writes, SpecForge's `eagle_config` ids (read by the SGLang release
that trained the draft), ModelOpt's exports, SafeAILab's original layout.

`init_draft_findings` holds a draft to fine-tune from (train.init_from) to the target, the layer
certificate and the train config the same way, before training starts.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from eagleflow import dflash, engines
from eagleflow import layers as lay
from eagleflow.drafts import SAFEAILAB_FORMAT, SGLANG_FORMAT, SPECULATORS, read_draft
from eagleflow.errors import EagleflowError
from eagleflow.target.prepare import describe_target

MISMATCH, UNVERIFIED, OK = "MISMATCH", "UNVERIFIED", "OK"
EXIT_STATUS = {OK: 0, MISMATCH: 1, UNVERIFIED: 3}  # 2: bad input

# Keys only ModelOpt's EAGLE-3 export writes into eagle_config (hf_spec_export.py's template).
MODELOPT_KEYS = (
    "use_input_layernorm_in_first_layer",
    "use_last_layernorm",
    "use_mtp_layernorm",
    "next_layer_regular",
    "parallel_draft_step",
)
DEFAULT_TRAINERS = (
    "SafeAILab's EAGLE-3 code, SpecForge, ModelOpt and speculators all default to the outputs of "
    "layers 1, N/2-1 and N-4"
)


@dataclass
class Finding:
    """One disagreement (MISMATCH) or one fact that could not be checked (UNVERIFIED)."""

    what: str
    fix: str
    verdict: str = MISMATCH

    def line(self) -> str:
        if self.verdict == UNVERIFIED:
            return f"UNVERIFIED {self.what}. To check: {self.fix}"
        return f"MISMATCH {self.what}. Fix: {self.fix}"


@dataclass
class Report:
    """Findings plus informational lines (what was read, which rule was applied)."""

    findings: list[Finding]
    info: list[str]

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def verdict(self) -> str:
        if any(f.verdict == MISMATCH for f in self.findings):
            return MISMATCH
        return UNVERIFIED if self.findings else OK

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]

    def summary(self) -> str:
        n_bad = sum(f.verdict == MISMATCH for f in self.findings)
        n_open = len(self.findings) - n_bad
        if self.verdict == OK:
            return "OK: no mismatch found, every fact checked"
        if self.verdict == UNVERIFIED:
            return f"UNVERIFIED: no mismatch found; {n_open} fact(s) could not be checked"
        extra = f", {n_open} fact(s) unverified" if n_open else ""
        return f"{n_bad} mismatch(es){extra}"


def _flag(config: dict, name: str):
    eagle = config.get("eagle_config") or {}
    return eagle.get(name, config.get(name))


def producer(config: dict, fmt: str) -> str:
    """Who wrote this draft config: eagleflow, speculators, modelopt, specforge or safeailab."""
    if config.get("eagleflow"):
        return "eagleflow"
    if fmt == SPECULATORS:
        return "speculators"
    if fmt == SAFEAILAB_FORMAT:
        return "safeailab"
    if any(k in (config.get("eagle_config") or {}) for k in MODELOPT_KEYS):
        return "modelopt"
    return "specforge"  # LlamaForCausalLMEagle3 + eagle_config: SpecForge's export layout


@dataclass
class Trained:
    """What a draft config proves about the layers it was trained on (internal ids).

    `cases` maps a training setting to the layers it captured: one entry when the config proves
    it, several when it depends on the SGLang release that trained the draft, none when the
    config does not say (then `assumed` is the trainers' common default).
    """

    producer: str
    cases: dict[str, list[int]]
    reason: str
    assumed: list[int] | None = None


def trained_layers(
    config: dict, fmt: str, target: dict | None = None, override: list[int] | None = None
) -> Trained:
    """The layers the draft was trained on, read as its producer writes them."""
    who = producer(config, fmt)
    if override is not None:
        return Trained(who, {"--trained-layers": list(override)}, "--trained-layers")
    prov = config.get("eagleflow") or {}
    if prov.get("trained_aux_layers") is not None:
        ids = list(prov["trained_aux_layers"])
        return Trained(who, {"eagleflow provenance": ids}, "eagleflow provenance (certificate)")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if top is not None:
        return Trained(
            who,
            {"top-level ids": list(top)},
            "top-level eagle_aux_hidden_state_layer_ids: the ids speculators' vLLM data "
            "generation captured (vLLM's convention, no offset)",
        )
    written = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    L = target["num_layers"] if target else None
    if written is None or L is None:
        assumed = lay.default_aux(L) if L else None
        return Trained(who, {}, f"{who} export without layer ids", assumed)
    written = list(written)
    if who == "modelopt":
        return Trained(
            who,
            {"ModelOpt": [w + 1 for w in written]},
            "ModelOpt export: eagle_config ids are outputs of those layers (a forward hook on "
            "each; its export writes them unshifted)",
        )
    # SpecForge: the HF backend hooks layer outputs; the SGLang backend reads the ids with the
    # training release's own rule (the DeepSeek-family rule changed in 0.5.13).
    cases: dict[str, list[int]] = {}
    for rule, releases in _rules(target["family"], None).items():
        ids = lay.apply_rule(rule, written, L)
        label = _range_label(releases, "SpecForge on SGLang")
        if rule == lay.RULE_PLUS_ONE:
            label = label.replace("SpecForge on ", "SpecForge's HF backend or ")
        cases.setdefault(_ids_key(ids), []).append(label)
    by_case = {" or ".join(labels): ids for ids, labels in _unkey(cases)}
    return Trained(
        who,
        by_case,
        "SpecForge export: eagle_config ids as the SGLang release (or HF backend) that trained "
        "the draft read them",
    )


def _ids_key(ids: list[int]) -> str:
    return json.dumps(ids)


def _unkey(cases: dict[str, list[str]]):
    return [(json.loads(k), v) for k, v in cases.items()]


def _rules(family: str, sglang_version: str | None) -> dict[str, list]:
    """SGLang's id rules over the releases `sglang_version` admits (None: every release)."""
    releases = lay.sglang_releases(sglang_version or ">=0")
    out: dict[str, list] = {}
    for r in releases:
        out.setdefault(lay.sglang_rule(family, r), []).append(r)
    return out


def _range_label(releases: list, who: str) -> str:
    """'SGLang 0.5.13 and later' style label for a run of releases."""
    lo, hi = min(releases), max(releases)
    boundary = lay.SGLANG_DEEPSEEK_CONDITIONAL
    if lo >= boundary:
        return f"{who} >= {boundary}"
    if hi < boundary:
        return f"{who} < {boundary}"
    return f"{who} (any release)"


def captured_layers(
    config: dict, fmt: str, engine: str, target: dict, sglang_version: str | None
) -> dict[str, tuple[list[int], str]]:
    """The layers (internal ids) the engine will feed this draft, per serving release range.

    vLLM has one reading. SGLang's depends on the release: the installed sglang's own code where
    it is importable and admitted, else the rule of each release range `sglang_version` admits
    (None: every release, since the user has not named the host's).
    """
    L = target["num_layers"]
    if engine == "vllm":
        top = config.get("eagle_aux_hidden_state_layer_ids")
        inner = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if top is not None:
            return {
                "vLLM": (list(top), "vLLM reads the top-level eagle_aux_hidden_state_layer_ids")
            }
        if inner is not None:
            why = "vLLM reads eagle_config's ids (no top-level key) as layer inputs, no offset"
            return {"vLLM": (list(inner), why)}
        return {"vLLM": (lay.default_aux(L), "no ids in the draft config: vLLM uses its default")}
    written = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    real = lay.sglang_capture_real(target["family"], written, L)
    if real is not None and (
        sglang_version is None or lay.Version(real[1]) in lay.sglang_releases(sglang_version)
    ):
        return {
            f"SGLang {real[1]}": (real[0], f"sglang {real[1]}'s own set_eagle3_layers_to_capture")
        }
    out: dict[str, tuple[list[int], str]] = {}
    rules = _rules(target["family"], sglang_version)
    for rule, releases in reversed(rules.items()):
        # the user's own words where they name one reading; a range label per reading otherwise
        label = _range_label(releases, "SGLang")
        if sglang_version is not None and len(rules) == 1:
            label = f"SGLang {releases[0] if len(releases) == 1 else sglang_version}"
        why = f"{label}, {target['family']}-family rule ({rule})"
        if written is None:
            why = (
                f"no eagle_config ids: {label} silently uses its default "
                f"{lay.format_ids(lay.default_aux(L))}"
            )
        out[label] = (lay.apply_rule(rule, written, L), why)
    return out


def _layer_findings(
    trained: Trained, captured: dict[str, tuple[list[int], str]], engine: str, fix_for
) -> tuple[list[Finding], list[str]]:
    """Trained vs captured layers: OK when every case agrees, MISMATCH when none can,
    UNVERIFIED when it hangs on an unknown (the trained layers, or the serving release)."""
    info = [f"{engine} will capture {lay.format_ids(ids)}: {why}" for ids, why in captured.values()]
    feeds = " or ".join(
        f"{lay.format_ids(ids)} ({label})" if len(captured) > 1 else lay.format_ids(ids)
        for label, (ids, _) in captured.items()
    )
    whys = "; ".join(why for _, why in captured.values())
    if not trained.cases:
        default = trained.assumed
        if default is not None and all(ids == default for ids, _ in captured.values()):
            what = (
                f"the draft config does not say which layers it was trained on ({trained.reason}); "
                f"{engine} will feed it {feeds}, the default ({DEFAULT_TRAINERS}), right only if "
                "it was trained on the default"
            )
        else:
            what = (
                f"cannot tell which layers the draft was trained on ({trained.reason}); {engine} "
                f"will feed it {feeds} ({whys})"
            )
        fix = (
            "pass --trained-layers with the ids from its training recipe or model card "
            "(internal convention: HF hidden_states index, e.g. embed,3,31)"
        )
        return [Finding(what, fix, UNVERIFIED)], info
    info.append(
        "trained on "
        + " or ".join(f"{lay.format_ids(ids)} ({label})" for label, ids in trained.cases.items())
        + f": {trained.reason}"
    )
    t_sets = list(trained.cases.values())
    c_sets = [ids for ids, _ in captured.values()]
    if all(t == c for t in t_sets for c in c_sets):
        return [], info
    trained_txt = " or ".join(
        f"{lay.format_ids(ids)} ({label})" if len(t_sets) > 1 else lay.format_ids(ids)
        for label, ids in trained.cases.items()
    )
    if not any(t == c for t in t_sets for c in c_sets):
        what = (
            f"layer ids: the draft was trained on hidden states of {trained_txt} but {engine} "
            f"will feed it {feeds} ({whys})"
        )
        return [Finding(what, fix_for(t_sets[0]))], info
    what = (
        f"layer ids depend on a release nobody named: the draft was trained on {trained_txt}, "
        f"{engine} will feed it {feeds}"
    )
    if engine == "sglang":
        needs = "; ".join(
            f"trained by {label}: serve on "
            + (" or ".join(c for c, (cids, _) in captured.items() if cids == ids) or "no release")
            for label, ids in trained.cases.items()
        )
        fix = (
            f"name the serving release with --sglang-version ({needs}), or pass "
            "--trained-layers if the draft's training release is known"
        )
    else:
        needs = "; ".join(
            f"trained by {label}: {engine} feeds "
            + ("those layers" if ids in c_sets else "other layers, a mismatch")
            for label, ids in trained.cases.items()
        )
        fix = f"pass --trained-layers with what the draft was trained on ({needs})"
    return [Finding(what, fix, UNVERIFIED)], info


def diagnose(
    target_dir: str | Path,
    draft_dir: str | Path,
    engine: str,
    server_args: str = "",
    sglang_version: str | None = None,
    trained: list[int] | None = None,
) -> Report:
    """All findings for serving `draft_dir` on `engine` with `target_dir` as the target.

    `sglang_version` is the serving host's release or range; None (not named) weighs every
    release whose reading of the ids differs. `trained` overrides what the config says.
    """
    if engine not in ("vllm", "sglang"):
        raise EagleflowError(f"--engine {engine!r}: expected vllm or sglang")
    target = describe_target(target_dir)
    cfg_path = Path(draft_dir, "config.json")
    native = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if dflash.NATIVE_ARCHITECTURE in (native.get("architectures") or []):
        from eagleflow import doctor_dflash

        argv = shlex.split(server_args or "")
        flags = {
            "--speculative-config": _str_flag(argv, "--speculative-config"),
            "--speculative-num-draft-tokens": _int_flag(argv, "--speculative-num-draft-tokens"),
        }
        found, info = doctor_dflash.diagnose(
            target, Path(draft_dir), native, engine, flags, trained
        )
        return Report([Finding(f.what, f.fix) for f in found], info)
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
    trained_info = trained_layers(config, fmt, target, trained)
    info.append(f"producer: {trained_info.producer}")
    captured = captured_layers(config, fmt, engine, target, sglang_version)
    found, lines = _layer_findings(
        trained_info,
        captured,
        engine,
        lambda ids: _ids_fix(ids, L, target, engine, sglang_version),
    )
    info += lines
    if trained_info.cases:
        for ids in {json.dumps(v): v for v in trained_info.cases.values()}.values():
            for p in lay.aux_problems(ids, L, target["family"]):
                findings.append(Finding(f"trained layer ids: {p}", "retrain on valid ids"))
    if not any("trained layer ids" in f.what for f in findings):
        findings += found
    all_captured = sorted({k for ids, _ in captured.values() for k in ids})
    bad = [k for k in all_captured if k < 0 or k >= L]
    if bad:
        findings.append(
            Finding(
                f"{engine} would capture layer ids {bad}, outside 0..{L - 1} of this {L}-layer "
                "target (the draft was made for another target, or the ids are shifted)",
                "write ids of this target's layers",
            )
        )
    if engine == "sglang" and fmt == SAFEAILAB_FORMAT:
        findings.append(
            Finding(
                "architectures is LlamaForCausalLM (SafeAILab's original upload): SGLang picks "
                "the draft's model class by architectures and maps no Llama draft architecture "
                "to its EAGLE-3 class (srt/configs/model_config.py), so it would build a plain "
                "LlamaForCausalLM",
                'set "architectures": ["LlamaForCausalLMEagle3"] in a copy of the draft '
                "(nothing else changes)",
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
    if sglang_version is None:  # the serving release was not named: one fix per reading
        rules = _rules(target["family"], None)
        parts = []
        for rule, releases in rules.items():
            label = _range_label(releases, "SGLang")
            w = lay.invert_rule(rule, trained)
            if w is None:
                parts.append(f"{label} cannot capture {lay.format_ids(trained)}")
            else:
                suffix = f" for {label}" if len(rules) > 1 else ""
                parts.append(f"set eagle_config.eagle_aux_hidden_state_layer_ids to {w}{suffix}")
        return "; ".join(parts)
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
    if config.get("vocab_size") not in (None, vocab) and "speculators_config" not in config:
        out.append(
            Finding(
                f"draft vocab_size {config.get('vocab_size')} differs from the target's {vocab}",
                "set the draft's vocab_size to the target's",
            )
        )
    return out + _map_findings(config, tensors, vocab)


def _map_findings(config: dict, tensors: dict, vocab: int) -> list[Finding]:
    """d2t / t2d against the draft vocabulary and a target vocabulary of `vocab` tokens."""
    out = []
    draft_vocab = config.get("draft_vocab_size")
    d2t, t2d = tensors["maps"].get("d2t"), tensors["maps"].get("t2d")
    if draft_vocab is None or draft_vocab == vocab:
        return out
    if d2t is None and not tensors.get("weights", True):
        out.append(
            Finding(
                f"draft_vocab_size {draft_vocab} < target vocab {vocab}, and the folder holds no "
                "*.safetensors (a config only): its d2t mapping could not be read",
                "point --draft at the whole download (config.json and its safetensors)",
                UNVERIFIED,
            )
        )
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
    """Launch flags the engine would rewrite or ignore (rules from `eagleflow.engines`)."""
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
        spec = engines.SpecConfig(
            "server-args",
            _int_flag(argv, "--speculative-num-steps"),
            _int_flag(argv, "--speculative-eagle-topk"),
            _int_flag(argv, "--speculative-num-draft-tokens"),
        )
        for p in engines.sglang_spec_problems(spec):
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


# ---------------------------------------------------------------------------------------------
# A draft to fine-tune from (train.init_from): does it fit this target, certificate and config?

INIT_NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def draft_facts(config: dict, fmt: str, target: dict, sglang_version: str = "0.5.23") -> dict:
    """What a draft was built for, read from its config in either format: hidden sizes, target
    vocabulary, draft vocabulary, layer count and type, norm flags, trained layer ids (and where
    each id list came from)."""
    if fmt == SPECULATORS:
        tl = config.get("transformer_layer_config") or {}
        hidden, vocab = tl.get("hidden_size"), tl.get("vocab_size")
        layers, model_type = tl.get("num_hidden_layers"), tl.get("model_type")
        flags = {f: bool(config.get(f, False)) for f in INIT_NORM_FLAGS}
        where = "config.json transformer_layer_config"
    else:
        hidden, vocab = config.get("hidden_size"), config.get("vocab_size")
        layers, model_type = config.get("num_hidden_layers", 1), config.get("model_type", "llama")
        # SGLang's reading of the flags; it has no norm_before_residual (false unless the
        # folder says it was trained with it)
        flags = {
            "norm_before_residual": bool(_flag(config, "norm_before_residual")),
            "norm_before_fc": bool(_flag(config, "norm_before_fc")),
            "fc_norm": bool(config.get("fc_norm") or config.get("use_aux_norm")),
            "norm_output": bool(config.get("norm_output")),
        }
        where = "config.json"
    trained = trained_layers(config, fmt, target)
    if len(trained.cases) == 1:
        aux, src = next(iter(trained.cases.values())), trained.reason
    elif fmt == SPECULATORS:
        aux, src = lay.default_aux(target["num_layers"]), "speculators' default (no ids written)"
    else:  # no ids, or ids whose reading depends on the release: the configured release's
        aux, why = next(
            iter(captured_layers(config, fmt, "sglang", target, sglang_version).values())
        )
        src = f"what SGLang captures for it: {why}"
    return {
        "hidden_size": hidden,
        "target_hidden_size": config.get("target_hidden_size") or hidden,
        "target_vocab_size": vocab,
        "draft_vocab_size": config.get("draft_vocab_size") or vocab,
        "num_layers": layers,
        "model_type": model_type,
        "flags": flags,
        "aux": aux,
        "aux_source": src,
        "where": where,
    }


def init_draft_findings(
    draft_dir: str | Path,
    target: dict,
    cert: dict | None = None,
    train_cfg: dict | None = None,
) -> list[Finding]:
    """Every difference that keeps `draft_dir` from initialising training for this target
    (target.json or describe_target), layer certificate and train config ([] = none).

    Reads the config and the safetensors headers (plus d2t / t2d) only, so it runs before any
    training work. Without `cert` the layer ids are not compared; without `train_cfg` neither
    are the draft's layer count, vocabulary size and norm flags.
    """
    config, fmt, tensors = read_draft(draft_dir)
    sg_version = ((cert or {}).get("ids_per_engine") or {}).get("sglang", {}).get("version")
    facts = draft_facts(config, fmt, target, sg_version or "0.5.23")
    H, V, L = int(target["hidden_size"]), int(target["vocab_size"]), int(target["num_layers"])
    other = "point train.init_from at a draft made for this target, or set it to null"
    out: list[Finding] = []
    hidden_key = next((k for k in ("hidden_size", "target_hidden_size") if facts[k] != H), None)
    if hidden_key is not None:
        out.append(
            Finding(
                f"{hidden_key.replace('_', ' ')}: the draft has {facts[hidden_key]} "
                f"({facts['where']} {hidden_key}), the target has {H}",
                other,
            )
        )
    if facts["target_vocab_size"] != V:
        out.append(
            Finding(
                f"target vocabulary: the draft was made for {facts['target_vocab_size']} tokens "
                f"({facts['where']} vocab_size), the target has {V}",
                other,
            )
        )
    t2d = tensors["maps"].get("t2d")
    if t2d is not None and t2d.numel() != V and facts["target_vocab_size"] == V:
        out.append(
            Finding(
                f"target vocabulary: the draft's t2d has {t2d.numel()} entries, the target has {V}",
                other,
            )
        )
    maps = _map_findings({**config, "draft_vocab_size": facts["draft_vocab_size"]}, tensors, V)
    d2t = tensors["maps"].get("d2t")
    if not maps and d2t is not None and d2t.numel() > 1:
        import torch

        ids = torch.arange(d2t.numel()) + d2t.long()
        if not bool((ids[1:] > ids[:-1]).all()):
            maps.append(
                Finding(
                    "d2t's target ids are not ascending: speculators picks the target head's "
                    "rows for the draft vocabulary in target-id order (through t2d), so they "
                    "would pair with other draft tokens",
                    "use a draft whose d2t lists target ids in ascending order (speculators' "
                    "and SafeAILab's mappings do)",
                )
            )
    out += maps
    prov_layers = (config.get("eagleflow") or {}).get("target_num_layers")
    if prov_layers not in (None, L):
        out.append(
            Finding(
                f"target layers: the draft was trained for a {prov_layers}-layer target, this "
                f"one has {L}",
                other,
            )
        )
    aux = facts["aux"]
    n_aux = len(aux)
    fc = tensors["shapes"].get("fc.weight")
    if fc is None:
        out.append(Finding("the draft has no fc.weight tensor (not an EAGLE-3 draft)", other))
    elif facts["hidden_size"] == H and list(fc) != [H, n_aux * H]:
        out.append(
            Finding(
                f"fc.weight is {list(fc)}, expected [{H}, {n_aux * H}] for {n_aux} aux layers of "
                f"hidden size {H}",
                other,
            )
        )
    if cert is not None and list(aux) != list(cert["aux_layers"]):
        proven = lay.format_ids(cert["aux_layers"])
        out.append(
            Finding(
                f"layer ids: the draft was trained on hidden states of {lay.format_ids(aux)} "
                f"[{facts['aux_source']}], the layer certificate proves {proven} for these shards",
                f"set extract.aux_layers to {lay.format_ids(aux)} (extraction and verify_layers "
                f"rerun for them), or point train.init_from at a draft trained on {proven}",
            )
        )
    if train_cfg is not None:
        out += _train_cfg_findings(facts, train_cfg)
    return out


def _train_cfg_findings(facts: dict, train_cfg: dict) -> list[Finding]:
    out = []
    if facts["model_type"] != "llama":
        out.append(
            Finding(
                f"the draft's layer is model_type {facts['model_type']!r}, eagleflow trains llama "
                "draft layers (what both engines' EAGLE-3 model files are)",
                "point train.init_from at a llama-layer EAGLE-3 draft, or set it to null",
            )
        )
    pairs = [("draft_layers", facts["num_layers"]), ("draft_vocab_size", facts["draft_vocab_size"])]
    pairs += list(facts["flags"].items())
    for key, have in pairs:
        want = train_cfg.get(key)
        if key in train_cfg and (
            bool(have) != bool(want) if key in INIT_NORM_FLAGS else have != want
        ):
            value = str(bool(have)).lower() if key in INIT_NORM_FLAGS else have
            out.append(
                Finding(
                    f"train.{key}: the draft has {value}, the config says "
                    f"{str(want).lower() if isinstance(want, bool) else want}",
                    f"set train.{key}: {value} (the draft's architecture is kept when fine-tuning)",
                )
            )
    return out
