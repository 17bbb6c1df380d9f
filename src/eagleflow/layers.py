"""Layer ids: eagleflow's one convention and its translation for every consumer.

Convention: aux id k is HF `hidden_states[k]`, the residual stream *entering* decoder layer k
(k = 0 is the embedding output, written `embed` in config). The final slot that EAGLE-3 also
trains on is the output of the last decoder layer *before* the final norm; it is not an aux id.

What each consumer writes for internal id k (read in the engines' source):
- speculators (training data and checkpoint) and vLLM (top-level
  `eagle_aux_hidden_state_layer_ids` of the draft config): k, no offset.
- SGLang, Llama-family model files: `eagle_config.eagle_aux_hidden_state_layer_ids` = k - 1
  (`srt/models/llama.py` captures `[i + 1 for i in ids]`).
- SGLang, DeepSeek-V2/V3/Kimi-K2.x model files (`srt/models/deepseek_v2.py`): releases before
  0.5.13 add 1 to every id; 0.5.13 and later (sgl-project/sglang#25454) add 1 only when the
  first id is 1. A list whose first internal id is 2 is written [1, ...] and read alike by both.

This module needs no torch and no engine: `eagleflow layers` and `doctor` run on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from eagleflow import layout
from eagleflow.errors import LayerError

EMBED = "embed"
# First SGLang release whose deepseek_v2.py adds 1 only when the first id is 1 (PR #25454;
# checked by reading the 0.5.12.post1 and 0.5.13 wheels).
SGLANG_DEEPSEEK_CONDITIONAL = Version("0.5.13")
RULE_PLUS_ONE = "+1 always"
RULE_PLUS_ONE_IF_FIRST_1 = "+1 only when the first id is 1"
FINAL_SLOT = "output of the last decoder layer before the final norm"
# Releases used to decide which rules a version specifier admits (any release grid works as long
# as it has points on both sides of the rule change).
_RELEASE_GRID = [Version(f"0.{m}.{p}") for m in range(3, 7) for p in range(0, 40)] + [
    Version(v) for v in ("0.5.12.post1", "1.0", "2.0", "99.0")
]


def default_aux(num_layers: int) -> list[int]:
    """SGLang's and vLLM's (and speculators') default capture: inputs of [2, L//2, L-3]."""
    return [2, num_layers // 2, num_layers - 3]


def describe_id(k: int) -> str:
    """What internal id k holds, in words."""
    return "embeddings (input of layer 0)" if k == 0 else f"input of layer {k} (output of {k - 1})"


def format_ids(ids: list[int] | None) -> str:
    """[embed, 3, 31] style, so a user sees the embedding slot by name."""
    if ids is None:
        return "None"
    return "[" + ", ".join(EMBED if k == 0 else str(k) for k in ids) + "]"


def parse_aux_value(value) -> list[int] | str:
    """Config value (`default`, ints, `embed`, or a "embed,3,31" string) to ids or 'default'."""
    if value is None or value == "default":
        return "default"
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    out = []
    for v in value:
        if v == EMBED:
            out.append(0)
        elif isinstance(v, int) or (isinstance(v, str) and v.lstrip("-").isdigit()):
            out.append(int(v))
        else:
            raise LayerError(
                f"aux layer id {v!r} is not an integer or 'embed'; write ids like [embed, 3, 31]"
            )
    return out


def suggest_aux(num_layers: int, family: str = "llama") -> list[int]:
    """Distinct ids every engine captures alike: the default where it works, else spread out."""
    default = default_aux(num_layers)
    if len(set(default)) == 3 and default == sorted(default):
        return default  # first id 2: also read alike by every SGLang DeepSeek rule
    if num_layers >= 3:
        return [0, num_layers // 2, num_layers - 1]
    return list(range(num_layers))


def aux_problems(ids: list[int], num_layers: int, family: str = "llama") -> list[str]:
    """Every reason these ids cannot be the training and serving layers of this target."""
    problems = []
    alt = format_ids(suggest_aux(num_layers, family))
    last = num_layers - 1
    if not ids:
        problems.append(f"no aux layer ids; EAGLE-3 needs at least one, e.g. {alt}")
    if len(set(ids)) != len(ids):
        dups = sorted({k for k in ids if ids.count(k) > 1})
        problems.append(
            f"aux layer ids {format_ids(ids)} repeat {format_ids(dups)} on this "
            f"{num_layers}-layer target (tiny models make the default [2, L//2, L-3] collide); "
            f"use distinct ids such as {alt}"
        )
    elif ids != sorted(ids):
        problems.append(
            f"aux layer ids {format_ids(ids)} are not ascending; engines concatenate captures "
            f"in ascending layer order, so write {format_ids(sorted(ids))}"
        )
    for k in ids:
        if k < 0:
            problems.append(f"aux layer id {k} is negative; ids range over 0 ({EMBED})..{last}")
        elif k == num_layers:
            problems.append(
                f"aux layer id {k} is the output of the last layer: HF's hidden_states[{k}] is "
                "after the final norm, vLLM's id is before it, and SGLang cannot capture it. "
                f"The final slot already holds the pre-norm output; use ids in 0..{last}"
            )
        elif k > num_layers:
            problems.append(
                f"aux layer id {k} does not exist: the target has {num_layers} decoder layers "
                f"(ids 0..{last}); use e.g. {alt}"
            )
    return problems


def sglang_releases(version: str) -> list[Version]:
    """The SGLang releases that `serve.sglang.version` admits (an exact version or a range)."""
    try:
        return [Version(version)]
    except InvalidVersion:
        pass
    try:
        spec = SpecifierSet(version)
    except InvalidSpecifier:
        raise LayerError(
            f"serve.sglang.version {version!r} is neither a release (0.5.23) nor a range "
            "(>=0.5.13,<0.6); write the SGLang release the GPU host runs"
        ) from None
    admitted = [v for v in _RELEASE_GRID if v in spec]
    if not admitted:
        raise LayerError(f"serve.sglang.version {version!r} admits no SGLang release")
    return admitted


def sglang_rule(family: str, release: Version) -> str:
    """The id offset rule of the SGLang model file for this target family and release."""
    if family == "deepseek" and release >= SGLANG_DEEPSEEK_CONDITIONAL:
        return RULE_PLUS_ONE_IF_FIRST_1
    return RULE_PLUS_ONE


def apply_rule(rule: str, written: list[int] | None, num_layers: int) -> list[int]:
    """Layers SGLang captures (internal ids) for the ids written in the draft's eagle_config."""
    if written is None:  # no eagle_config: SGLang silently uses its default, no offset
        return default_aux(num_layers)
    if rule == RULE_PLUS_ONE or (written and written[0] == 1):
        return [w + 1 for w in written]
    return list(written)


def invert_rule(rule: str, ids: list[int]) -> list[int] | None:
    """What to write so SGLang captures `ids`; None when that rule cannot express them."""
    if rule == RULE_PLUS_ONE:
        return [k - 1 for k in ids]
    if ids[0] == 2:
        return [k - 1 for k in ids]  # [1, ...]: +1 applies, and older releases read it alike
    if ids[0] == 1:
        return None  # writing 1 triggers +1, writing 0 does not: layer 1's input is unreachable
    return list(ids)


@dataclass
class SglangIds:
    """The eagle_config ids to write for SGLang, per rule the configured releases use."""

    family: str
    version: str
    written: list[int] | None
    rules: dict[str, list[int] | None]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def sglang_ids(ids: list[int], num_layers: int, family: str, version: str) -> SglangIds:
    """Translate internal ids for SGLang, refusing ids its releases would read differently."""
    releases = sglang_releases(version)
    by_rule: dict[str, list[Version]] = {}
    for r in releases:
        by_rule.setdefault(sglang_rule(family, r), []).append(r)
    rules = {rule: invert_rule(rule, ids) for rule in by_rule}
    out = SglangIds(family, version, None, rules)
    for written in rules.values():
        if written is None:
            out.problems.append(
                f"SGLang >= {SGLANG_DEEPSEEK_CONDITIONAL} (serve.sglang.version {version!r}) on a "
                f"DeepSeek-family target cannot capture ids starting "
                f"with 1 ({format_ids(ids)}): its deepseek_v2.py adds 1 only when the first "
                "written id is 1. Start the ids with 0 or 2 instead, e.g. "
                f"{format_ids([0] + ids[1:])} or {format_ids(suggest_aux(num_layers, family))}"
            )
    writable = {tuple(w) for w in rules.values() if w is not None}
    if len(writable) > 1:
        v = SGLANG_DEEPSEEK_CONDITIONAL
        need = {r: f"{'>=' if r == RULE_PLUS_ONE_IF_FIRST_1 else '<'} {v}" for r in rules}
        detail = "; ".join(f"SGLang {need[r]} needs {w}" for r, w in rules.items())
        out.problems.append(
            f"aux ids {format_ids(ids)} must be written differently for the SGLang releases "
            f"serve.sglang.version {version!r} admits ({detail}). Pin serve.sglang.version to "
            "the release the GPU host runs, or start the ids with 2, which all releases read alike"
        )
    if not out.problems:
        out.written = list(next(iter(writable)))
        old = apply_rule(RULE_PLUS_ONE, out.written, num_layers)
        new = apply_rule(RULE_PLUS_ONE_IF_FIRST_1, out.written, num_layers)
        if family == "deepseek" and old != new:
            side = ">=" if new == ids else "<"
            out.notes.append(
                f"eagle_config ids {out.written} capture {format_ids(new)} on SGLang >= "
                f"{SGLANG_DEEPSEEK_CONDITIONAL} but {format_ids(old)} on older releases: this "
                f"draft needs SGLang {side} {SGLANG_DEEPSEEK_CONDITIONAL}; ids starting with 2 "
                "would serve on both"
            )
    return out


@dataclass
class LayerPlan:
    """Resolved aux ids for one target and what every consumer must be told."""

    num_layers: int
    family: str
    aux: list[int]
    sglang: SglangIds
    from_default: bool

    @property
    def engine_ids(self) -> dict:
        """Ids to write per consumer (the certificate's `ids_per_engine`)."""
        return {
            "speculators": list(self.aux),
            "vllm": list(self.aux),
            "sglang": self.sglang.written,
        }

    def table(self) -> list[dict]:
        """One row per captured slot: internal id, meaning, and each consumer's id."""
        rows = []
        for i, k in enumerate(self.aux):
            rows.append(
                {
                    "slot": i,
                    "id": format_ids([k])[1:-1],
                    "holds": describe_id(k),
                    "hf_hidden_states": k,
                    "speculators": k,
                    "vllm": k,
                    "sglang": self.sglang.written[i] if self.sglang.written else None,
                }
            )
        rows.append(
            {
                "slot": len(self.aux),
                "id": "final",
                "holds": f"{FINAL_SLOT} (layer {self.num_layers - 1})",
                "hf_hidden_states": f"hook on layers[{self.num_layers - 1}] (not "
                f"hidden_states[{self.num_layers}], which is after the norm)",
                "speculators": "last slot",
                "vllm": "last slot",
                "sglang": "last slot",
            }
        )
        return rows


def plan_layers(
    target: dict,
    aux_value,
    sglang_version: str,
    engine: str | None = "sglang",
) -> LayerPlan:
    """Resolve config ids for a target (target.json / describe_target), refusing bad ones.

    SGLang-only problems refuse only when `engine` is sglang (or None: every engine); otherwise
    they are kept in `plan.sglang.problems` and the SGLang export refuses later.
    """
    num_layers, family = int(target["num_layers"]), target.get("family", "llama")
    parsed = parse_aux_value(aux_value)
    from_default = parsed == "default"
    ids = default_aux(num_layers) if from_default else parsed
    problems = aux_problems(ids, num_layers, family)
    if from_default and problems:
        problems = [
            f"extract.aux_layers 'default' is {format_ids(ids)} on this {num_layers}-layer "
            f"target, which cannot work: write explicit ids such as "
            f"{format_ids(suggest_aux(num_layers, family))}"
        ] + problems
    if problems:
        raise LayerError(_bullets("aux layer ids", problems))
    sg = sglang_ids(ids, num_layers, family, sglang_version)
    if sg.problems and engine in (None, "sglang"):
        raise LayerError(_bullets("aux layer ids for SGLang", sg.problems))
    return LayerPlan(num_layers, family, ids, sg, from_default)


def _bullets(what: str, problems: list[str]) -> str:
    return f"{what}:\n" + "\n".join(f"  - {p}" for p in problems)


def sglang_capture_real(family: str, written: list[int] | None, num_layers: int):
    """Ask the installed sglang's own `set_eagle3_layers_to_capture`; None if not importable.

    Returns (captured internal ids, sglang version). Used where sglang is installed (the GPU
    host, the contract venv), so the certificate and doctor report the release they consulted.
    """
    import types

    try:
        import sglang

        if family == "deepseek":
            from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM as cls
        else:
            from sglang.srt.models.llama import LlamaForCausalLM as cls
    except Exception:  # not installed, or a CUDA-only import chain
        return None
    ns = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(is_last_rank=True),
        config=types.SimpleNamespace(num_hidden_layers=num_layers),
        model=types.SimpleNamespace(layers_to_capture=[]),
    )
    cls.set_eagle3_layers_to_capture(ns, None if written is None else list(written))
    return list(ns.model.layers_to_capture), sglang.__version__


def config_problems(config: dict) -> list[str]:
    """Layer-id problems visible without the target (the rest wait for its config.json)."""
    problems = []
    try:
        sglang_releases(config["serve"]["sglang"]["version"])
    except LayerError as e:
        problems.append(str(e))
    ids = parse_aux_value(config["extract"]["aux_layers"])
    if ids != "default":
        if len(set(ids)) != len(ids):
            problems.append(f"extract.aux_layers {format_ids(ids)} repeats an id; use distinct ids")
        elif ids != sorted(ids):
            problems.append(
                f"extract.aux_layers {format_ids(ids)} is not ascending; engines concatenate "
                f"captures in ascending layer order, so write {format_ids(sorted(ids))}"
            )
    return problems


def check_layers(config: dict, target_json: str | Path | None = None) -> None:
    """`extract.aux_layers` against the prepared target, the moment its target.json exists.

    Resolves the ids as extraction will (every engine's convention, the SGLang release rules)
    from `target_json` (default: `<results_dir>/target/target.json`), so a bad id fails in
    seconds after `prepare_target` instead of after regeneration. Nothing to check while that
    file is missing, unreadable or describes another target (prepare_target reruns first).
    """
    import json

    path = Path(target_json or layout.path(config["results_dir"], layout.TARGET))
    if not path.is_file():
        return
    try:
        target = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # not a finished target.json: prepare_target writes it again, extraction checks
    if not isinstance(target, dict) or target.get("name") != config["target"]["name"]:
        return
    try:
        plan_layers(
            target,
            config["extract"]["aux_layers"],
            config["serve"]["sglang"]["version"],
            config["serve"]["engine"],
        )
    except LayerError as e:
        raise LayerError(
            f"extract.aux_layers {config['extract']['aux_layers']!r} does not fit the target "
            f"{target['name']} ({target['num_layers']} decoder layers, {path}): {e}"
        ) from None
