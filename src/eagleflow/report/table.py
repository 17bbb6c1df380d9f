"""Rule summarize: the summary table, computed from the raw records of the run.

`summarize` reads every benchmark record (`results/bench/<engine>/<config>.json`), the standalone
acceptance, the training summary and the extraction manifest, and writes one tidy table: a row
per (engine, config, concurrency). Every figure is recomputed from the per-run records, never
copied from a record's own summary, so the table cannot disagree with the raw data.

`plot_results` (`eagleflow.report.plots`) and `write_cards` (`eagleflow.report.cards`) read that
table back with `read_summary` (plus the standalone acceptance, the training metrics and the
extraction manifest): every number a plot or a card shows is one the table shows.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

from eagleflow.engines import BASELINE
from eagleflow.errors import EagleflowError
from eagleflow.serve.bench import (
    MISMATCH,
    consistency_verdict,
    standalone_accept_length,
    summarize_runs,
    temperatures,
)
from eagleflow.util import atomic_write_text

log = logging.getLogger(__name__)

COLUMNS = [
    "engine",
    "config",
    "num_steps",
    "topk",
    "num_draft_tokens",
    "temperature",
    "concurrency",
    "repeats",
    "throughput_median",
    "throughput_min",
    "throughput_max",
    "speedup",
    "speedup_min",
    "speedup_max",
    "accept_len_served",
    "accept_len_standalone",
    "accept_ratio",
    "accepted_ratio",
    "verdict",
    "ttft_mean_s",
    "step_ms",
    "step_cost",
    "same_answers",
    "output_tokens",
    "measured_at",
    "baseline_measured_at",
    "train_steps",
    "train_val_loss",
    "train_val_full_acc_0",
    "extract_tokens_per_s",
]


def _paths(value) -> list[str]:
    return [value] if isinstance(value, str | Path) else [str(v) for v in value]


def _read(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EagleflowError(f"cannot read {path}: {e}; rerun the rule that writes it") from None


def summary_rows(
    records: list[dict],
    acceptance: dict | None,
    bench_cfg: dict,
    train: dict | None = None,
    manifest: dict | None = None,
) -> list[dict]:
    """The table's rows from raw benchmark records (a row per engine x config x temperature x
    concurrency)."""
    min_ratio = float(bench_cfg.get("min_accept_ratio", 0.9))
    per = {}
    for rec in records:
        drafted = not (rec["config"] == BASELINE or rec.get("is_baseline"))
        for s in summarize_runs(rec["runs"], drafted).values():
            key = (rec["engine"], rec["config"], s["temperature"], s["concurrency"])
            per[key] = (rec, s)
    train = train or {}
    val = train.get("best_val") or {}
    extract_tps = ((manifest or {}).get("run") or {}).get("tokens_per_s")
    rows = []
    for (engine, name, temp, conc), (rec, s) in per.items():
        spec = rec.get("spec") or {}
        base = _baseline_of(per, rec, engine, temp, conc)
        base_tput = base[1]["throughput_tok_s"] if base else None
        base_step = base[1]["step_s"] if base else None
        is_base = name == BASELINE or rec.get("is_baseline")
        served = None if is_base else s["accept_length"]
        standalone = None
        check = {
            "accept_ratio": None,
            "accepted_ratio": None,
            "verdict": "baseline" if is_base else None,
        }
        if not is_base:
            standalone = standalone_accept_length(
                acceptance or {}, spec.get("num_steps"), temp, s.get("prompt_ids")
            )
            check = consistency_verdict(served, standalone, min_ratio, rec.get("draft"))
        lo, hi = s["throughput_min_max"]
        rows.append(
            {
                "engine": engine,
                "config": name,
                "num_steps": spec.get("num_steps"),
                "topk": spec.get("topk"),
                "num_draft_tokens": spec.get("num_draft_tokens"),
                "temperature": temp,
                "concurrency": conc,
                "repeats": s["repeats"],
                "throughput_median": s["throughput_tok_s"],
                "throughput_min": lo,
                "throughput_max": hi,
                "speedup": s["throughput_tok_s"] / base_tput if base_tput else None,
                "speedup_min": lo / base_tput if base_tput else None,
                "speedup_max": hi / base_tput if base_tput else None,
                "accept_len_served": served,
                "accept_len_standalone": standalone,
                "accept_ratio": check["accept_ratio"],
                "accepted_ratio": check["accepted_ratio"],
                "verdict": check["verdict"],
                "causes": check.get("causes", []),  # not a CSV column: the Markdown note's
                "ttft_mean_s": s["mean_ttft_s"],
                "step_ms": s["step_s"] * 1000 if s["step_s"] else None,
                # a step's cost in baseline decode steps: speedup ~ accept length / step_cost
                "step_cost": s["step_s"] / base_step if s["step_s"] and base_step else None,
                "same_answers": None if is_base else same_answers(s, base[1] if base else None),
                "output_tokens": s["output_tokens"],
                "measured_at": rec.get("measured_at"),
                "baseline_measured_at": base[0].get("measured_at") if base else None,
                "train_steps": train.get("steps"),
                "train_val_loss": val.get("loss"),
                "train_val_full_acc_0": val.get("full_acc_0"),
                "extract_tokens_per_s": extract_tps,
            }
        )
    # per engine: the baseline first, then the configs in their records' order, by temperature
    # and concurrency
    rank = {name: i for i, name in enumerate(dict.fromkeys(rec["config"] for rec in records))}
    rows.sort(
        key=lambda r: (
            r["engine"],
            r["config"] != BASELINE,
            rank[r["config"]],
            r["temperature"],
            r["concurrency"],
        )
    )
    return rows


def same_answers(level: dict, base: dict | None) -> float | None:
    """Greedy only: the share of prompts whose first answer equals the baseline's (a draft changes
    the speed, never the text); None when sampled or nothing to compare."""
    if not base or level["temperature"] != 0:
        return None
    ours, theirs = level.get("answers") or {}, base.get("answers") or {}
    common = set(ours) & set(theirs)
    if not common:
        return None
    return sum(ours[i] == theirs[i] for i in common) / len(common)


def _baseline_of(per: dict, rec: dict, engine: str, temp: float, conc: int):
    """The same-conditions baseline of a row: a managed run's is the same engine's baseline
    job; an endpoint's only the endpoint it names as `baseline` (none otherwise)."""
    if rec.get("endpoint"):
        name = rec.get("baseline_endpoint")
        return per.get((engine, name, temp, conc)) if name else None
    return per.get((engine, BASELINE, temp, conc))


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A GitHub Markdown table of `columns` (no extra dependency)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


MD_COLUMNS = [
    "engine",
    "config",
    "temperature",
    "concurrency",
    "throughput_median",
    "throughput_min",
    "throughput_max",
    "speedup",
    "accept_len_served",
    "accept_len_standalone",
    "accept_ratio",
    "accepted_ratio",
    "verdict",
    "ttft_mean_s",
    "step_cost",
    "same_answers",
]


def summarize(inputs: dict, bench_cfg: dict, out_csv: str, out_md: str) -> list[dict]:
    """The summary table (CSV and Markdown) from the raw benchmark and acceptance records."""
    import pandas as pd

    records = [_read(p) for p in _paths(inputs["records"])]
    acceptance = _read(inputs["acceptance"]) if inputs.get("acceptance") else None
    train = _read(inputs["train"]) if inputs.get("train") else None
    manifest = _read(inputs["manifest"]) if inputs.get("manifest") else None
    rows = summary_rows(records, acceptance, bench_cfg, train, manifest)
    frame = pd.DataFrame(rows, columns=COLUMNS)
    atomic_write_text(out_csv, frame.to_csv(index=False))
    text = markdown_table(rows, MD_COLUMNS)
    for r in rows:
        if not r["causes"]:
            continue
        why = ""
        if r["verdict"] == MISMATCH:
            why = (
                f" the engine accepts fewer than {bench_cfg.get('min_accept_ratio', 0.9)} x the "
                "drafts the standalone check accepts for the same num_steps (accepted_ratio)."
            )
        text += (
            f"\n**{r['verdict']}** {r['engine']}/{r['config']}:{why} Likely causes:\n"
            + "".join(f"- {c}\n" for c in r["causes"])
        )
    for extra in (
        prompt_set_section(acceptance, heading="###"),
        validation_section(validation_vs_standalone(train, acceptance), heading="###"),
    ):
        if extra:
            text += "\n" + extra
    atomic_write_text(out_md, text)
    return rows


# ---------------------------------------------------------------------------------------------
# Reading the summary back (plots and cards read the table, not the raw records, so every figure
# they show is one the table shows)

_INT_COLUMNS = (
    "num_steps",
    "topk",
    "num_draft_tokens",
    "concurrency",
    "repeats",
    "output_tokens",
    "train_steps",
)
_STR_COLUMNS = ("engine", "config", "verdict", "measured_at", "baseline_measured_at")


def read_summary(path: str | Path) -> list[dict]:
    """summary.csv's rows as dicts: empty cells None, count columns int."""
    import pandas as pd

    try:
        frame = pd.read_csv(
            path,
            keep_default_na=False,
            na_values=[""],
            dtype={c: str for c in _STR_COLUMNS},
        )
    except (OSError, ValueError) as e:
        raise EagleflowError(f"cannot read {path}: {e}; rerun the summarize rule") from None
    rows = []
    for rec in frame.to_dict("records"):
        row = {}
        for k, v in rec.items():
            if v is None or (isinstance(v, float) and math.isnan(v)):
                v = None
            elif k in _INT_COLUMNS:
                v = int(v)
            row[k] = v
        rows.append(row)
    return rows


def read_metrics(path: str | Path) -> list[dict]:
    """results/train/metrics.csv as dicts: numbers as floats, empty cells None."""
    import csv

    out = []
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            row = {}
            for k, v in rec.items():
                if k == "split":
                    row[k] = v
                    continue
                try:
                    row[k] = float(v) if v not in ("", None) else None
                except ValueError:
                    row[k] = None
            out.append(row)
    return out


def sampling_text(bench_cfg: dict) -> str:
    """E.g. "greedy (temperature 0)", "temperature 0.7 (sampled)", or both joined by "and"."""

    temps = temperatures(bench_cfg)
    sampled = [f"{t:g}" for t in temps if t > 0]
    parts = (["greedy (temperature 0)"] if 0.0 in temps else []) + (
        [f"temperature {', '.join(sampled)} (sampled)"] if sampled else []
    )
    return " and ".join(parts)


def bench_settings(bench_cfg: dict | None) -> str:
    """One line naming the benchmark settings (prompts, max_tokens, sampling, repeats)."""
    if not bench_cfg:
        return ""
    sets = "+".join(bench_cfg.get("prompt_sets") or []) or "prompts"
    return ", ".join(
        [
            f"{sets} × {bench_cfg.get('num_prompts') or 'all'} prompts",
            f"max_tokens {bench_cfg.get('max_tokens')}",
            sampling_text(bench_cfg),
            levels_text(bench_cfg),
        ]
    )


def levels_text(bench_cfg: dict) -> str:
    """The measured levels: `benchmark.runs` where set (each its own repeats and prompt count),
    else `benchmark.repeats` repeats at every `benchmark.concurrency` level."""
    runs = bench_cfg.get("runs")
    if not runs:
        conc = ", ".join(str(c) for c in bench_cfg.get("concurrency") or [])
        return f"{bench_cfg.get('repeats')} repeats" + (f" at concurrency {conc}" if conc else "")

    def one(r: dict) -> str:
        n = r.get("num_prompts")
        reps = f"{r['repeats']} repeat{'s' if r['repeats'] != 1 else ''}"
        return f"concurrency {r['concurrency']} × {reps}" + (f" on {n} prompts" if n else "")

    return "; ".join(one(r) for r in runs)


def read_optional(path) -> dict | None:
    return _read(path) if path and Path(path).is_file() else None


def _fixed(v, digits: int) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _range(mid, lo, hi, digits: int, suffix: str = "") -> str:
    if mid is None:
        return "–"
    return f"{_fixed(mid, digits)}{suffix} ({_fixed(lo, digits)}–{_fixed(hi, digits)})"


# ---------------------------------------------------------------------------------------------
# The validation estimate beside the standalone check


def _is_dflash(train_summary: dict | None) -> bool:
    return ((train_summary or {}).get("draft") or {}).get("algorithm") == "dflash"


def _full_accuracies(train_summary: dict | None) -> list[float]:
    """Per-position validation accuracies: EAGLE-3's full accuracy per TTT step, or a DFlash
    draft's accuracy at each block position 1..block_size-1."""
    best = (train_summary or {}).get("best_val") or {}
    pattern = r"position_\d+_acc" if _is_dflash(train_summary) else r"full_acc_\d+"
    keys = [k for k in best if re.fullmatch(pattern, k)]
    return [best[k] for k in sorted(keys, key=lambda k: int(re.findall(r"\d+", k)[0]))]


def validation_accept_length(train_summary: dict | None) -> float | None:
    """The accept length the validation set predicts (an estimate, not a decoding run): 1 + the
    best validation's full accuracies over the TTT positions at num_steps = ttt_steps, or a
    DFlash draft's `eal` (a block's accepted run + 1) at num_steps = block_size - 1."""
    if _is_dflash(train_summary):
        return ((train_summary or {}).get("best_val") or {}).get("eal")
    accs = _full_accuracies(train_summary)
    return 1 + sum(accs) if accs else None


def validation_vs_standalone(train: dict | None, acceptance: dict | None) -> dict | None:
    """The trainer's validation estimate beside the standalone check at num_steps = ttt_steps.

    Validation position k's full accuracy (the draft's first k+1 tokens all equal the data's,
    teacher-forced on held-out training conversations) is what the standalone check measures as
    position k's acceptance rate (steps that accepted k+1 or more drafts, over steps) on the
    benchmark's prompts: the gap is the distance between the training data's distribution and
    the served one, plus what teacher forcing hides. None without both records."""
    accs = _full_accuracies(train)
    if not accs or not acceptance:
        return None
    ttt = len(accs)
    stand = (acceptance.get("by_num_steps") or {}).get(str(ttt))
    if validation_accept_length(train) is None:
        return None
    out = {
        "ttt_steps": ttt,
        "dflash": _is_dflash(train),
        "validation": validation_accept_length(train),
        "standalone": None,
        "gap": None,
        "relative_gap": None,
        "per_position": [{"position": k + 1, "validation": a, "standalone": None}
                         for k, a in enumerate(accs)],
    }  # fmt: skip
    if stand and stand.get("accept_length") is not None:
        out["standalone"] = stand["accept_length"]
        out["gap"] = out["validation"] - out["standalone"]
        out["relative_gap"] = out["gap"] / out["standalone"]
        rates = stand.get("acceptance_rate_per_position") or []
        for row, rate in zip(out["per_position"], rates, strict=False):
            row["standalone"] = rate
    return out


def validation_section(cmp: dict | None, heading: str = "##") -> str:
    """Markdown: the validation estimate, the standalone figure and the gap, per position."""
    if not cmp:
        return ""
    ttt = cmp["ttt_steps"]
    dflash = cmp.get("dflash")
    how, key = (
        ("the best validation's expected accepted length per block, eal", "block_size - 1")
        if dflash
        else ("1 + the best validation's full accuracies", "train.ttt_steps")
    )
    lines = [f"{heading} Validation estimate vs standalone check", ""]
    if cmp["standalone"] is None:
        lines.append(
            f"Validation estimate at {ttt} draft steps: {cmp['validation']:.3f} ({how}). The "
            f"standalone check did not run at num_steps = {ttt} ({key}), so there is no "
            "measured figure to hold it against."
        )
        return "\n".join(lines) + "\n"
    column = (
        "validation accuracy at the block position (earlier positions not required)"
        if dflash
        else "validation full accuracy"
    )
    lines += [
        f"At {ttt} draft steps ({key}) the trainer's validation predicts an accept "
        f"length of **{cmp['validation']:.3f}**; the standalone check measured "
        f"**{cmp['standalone']:.3f}** on the benchmark's prompts: the estimate runs "
        f"{cmp['gap']:+.3f} ({cmp['relative_gap']:+.1%}) from the measurement. Validation is "
        "teacher-forced on held-out training conversations; the standalone check drafts on the "
        "benchmark's prompts as an engine does, so the measured figure is the one to quote.",
        "",
        f"| position | {column} | standalone acceptance | gap |",
        "|---|---|---|---|",
    ]
    for row in cmp["per_position"]:
        v, s = row["validation"], row["standalone"]
        gap = "–" if s is None else f"{v - s:+.3f}"
        lines.append(f"| {row['position']} | {v:.3f} | {_fixed(s, 3)} | {gap} |")
    return "\n".join(lines) + "\n"


def prompt_set_section(acceptance: dict | None, heading: str = "##") -> str:
    """Markdown: the standalone accept length of each evaluation set on its own, per num_steps
    (greedy), when the benchmark ran more than one set; else empty."""
    by_steps = (acceptance or {}).get("by_num_steps") or {}
    sets = sorted({name for r in by_steps.values() for name in r.get("by_prompt_set") or {}})
    if len(sets) < 2:
        return ""
    steps = sorted(by_steps, key=int)
    lines = [
        f"{heading} Standalone accept length per evaluation set",
        "",
        "Greedy, the same draft and settings; each set's verification steps on their own "
        "(prompts of one kind can accept far more than another: code repeats its context).",
        "",
        "| set | prompts | " + " | ".join(f"{k} steps" for k in steps) + " |",
        "|---|---|" + "---|" * len(steps),
    ]
    for name in [*sets, None]:
        rows = [by_steps[k] if name is None else (by_steps[k].get("by_prompt_set") or {}).get(name)
                for k in steps]  # fmt: skip
        cells = [_fixed((r or {}).get("accept_length"), 3) for r in rows]
        if name is None:
            n = len(by_steps[steps[0]].get("per_prompt") or []) or None
        else:
            n = next((r.get("prompts") for r in rows if r), None)
        lines.append(f"| {name or 'all'} | {n or '–'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
