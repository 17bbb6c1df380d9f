"""Rule write_cards: model cards with the measured figures, read from the summary table
(`eagleflow.report.table`); cards go to results/cards, never into an export.
"""

from __future__ import annotations

import logging
from pathlib import Path

from eagleflow.errors import EagleflowError
from eagleflow.report.table import (
    _cell,
    _fixed,
    _range,
    levels_text,
    read_optional,
    read_summary,
    sampling_text,
    validation_section,
    validation_vs_standalone,
)
from eagleflow.serve.bench import (
    MISMATCH,
    MISMATCH_CAUSES,
    temperatures,
)
from eagleflow.target.prepare import sha256_file
from eagleflow.util import atomic_write_text

log = logging.getLogger(__name__)


EXPORT_CARD = "README.md"  # what export_draft writes into each export folder
CARD_COLUMNS = [
    ("config", "config"),
    ("num_steps", "num_steps"),
    ("topk", "topk"),
    ("temperature", "temperature"),
    ("concurrency", "concurrency"),
    ("throughput", "throughput tok/s, median (min–max)"),
    ("speedup", "speedup, median (min–max)"),
    ("accept_len_served", "accept length served"),
    ("accept_len_standalone", "accept length standalone"),
    ("accept_ratio", "served / standalone"),
    ("verdict", "verdict"),
    ("ttft_mean_s", "mean TTFT s"),
    ("measured_at", "measured at"),
]


def measured_section(
    rows: list[dict], bench_cfg: dict | None, sources: dict, doctor: dict | None = None
) -> str:
    """The card's "Measured" section: the summary's rows for the draft and how they were made.

    `doctor` may name the `target` and `draft` paths for the doctor command a mismatch prints.
    """
    doctor = doctor or {}

    engines = sorted({r["engine"] for r in rows})
    dates = sorted({d for r in rows for d in (r.get("measured_at"),) if d})
    lines = [
        "## Measured",
        "",
        "Written by eagleflow's report stage (`write_cards`) from the run's summary table; the "
        "export folder above is not modified by it, so a benchmark rerun never rewrites an "
        "export. Speedup is a config's median throughput over the median throughput of the "
        "same engine's baseline at the same concurrency, measured in the same workflow run; "
        "accept lengths count the bonus token (tokens per verification step), and the "
        "standalone figure is the in-process check on the same prompts with the same num_steps.",
        "",
        "| | |",
        "|---|---|",
        f"| engine | {', '.join(engines) or '–'} |",
        f"| measured | {dates[0] if dates else '–'}"
        + (f" … {dates[-1]}" if len(dates) > 1 else "")
        + " |",
    ]
    if bench_cfg:
        lines += [
            f"| prompts | {', '.join(bench_cfg.get('prompt_sets') or [])}, "
            f"{bench_cfg.get('num_prompts') or 'all'} per set (first turns) |",
            f"| max_tokens | {bench_cfg.get('max_tokens')} |",
            f"| sampling | {sampling_text(bench_cfg)} |",
            f"| levels | {levels_text(bench_cfg)} |",
            f"| warmup requests | {bench_cfg.get('warmup_requests')} |",
            f"| mismatch threshold (served / standalone) | "
            f"{bench_cfg.get('min_accept_ratio', 0.9)} |",
        ]
    for key, value in sources.items():
        lines.append(f"| {key} | {value} |")
    lines += [
        "",
        "| " + " | ".join(h for _, h in CARD_COLUMNS) + " |",
        "|" + "---|" * len(CARD_COLUMNS),
    ]
    for r in rows:
        cells = {
            **r,
            "throughput": _range(
                r["throughput_median"], r["throughput_min"], r["throughput_max"], 1
            ),
            "speedup": _range(r.get("speedup"), r.get("speedup_min"), r.get("speedup_max"), 2, "×"),
            "accept_len_served": _fixed(r.get("accept_len_served"), 2),
            "accept_len_standalone": _fixed(r.get("accept_len_standalone"), 2),
            "accept_ratio": _fixed(r.get("accept_ratio"), 2),
            "ttft_mean_s": _fixed(r.get("ttft_mean_s"), 3),
        }
        if r["verdict"] == MISMATCH:
            cells["verdict"] = f"**{MISMATCH}**"
        lines.append("| " + " | ".join(_cell(cells.get(k)) for k, _ in CARD_COLUMNS) + " |")
    bad = [r for r in rows if r["verdict"] == MISMATCH]
    if bad:
        names = ", ".join(f"{r['config']} (c={r['concurrency']})" for r in bad)
        lines += [
            "",
            f"**{MISMATCH}** {names}: the engine accepts far fewer drafted tokens than the same "
            "draft does in the standalone check, so it is not running the draft the way it was "
            "trained. Likely causes:",
            "",
            *[f"- {c}" for c in MISMATCH_CAUSES],
            "",
            f"Check the draft with `eagleflow doctor --target {doctor.get('target', '<target>')} "
            f"--draft {doctor.get('draft', '<draft>')} --engine {', '.join(engines)}`.",
        ]

    if bench_cfg and any(t > 0 for t in temperatures(bench_cfg)):
        lines += [
            "",
            f"Sampled rows ({sampling_text(bench_cfg)}): accept lengths under sampling are "
            "lower than greedy ones; compare them with the standalone figure of the same "
            "temperature (the expected acceptance under the engines' verification rule), not "
            "with greedy figures.",
        ]
    return "\n".join(lines) + "\n"


def write_cards(inputs: dict, report_cfg: dict, out: str, bench_cfg: dict | None = None) -> str:
    """Model card with the measured figures: the export's README plus a Measured section.

    Written under results/ only; the export folder is read, never written (its card stays the
    one export_draft wrote, so a benchmark rerun does not touch or invalidate an export).
    """

    export = Path(inputs["speculators"])
    readme = export / EXPORT_CARD
    if not readme.is_file():
        raise EagleflowError(
            f"{readme} is missing: the export has no model card to extend; rerun export_draft "
            "(snakemake --forcerun export_draft)"
        )
    rows = read_summary(inputs["summary"])
    sources = {
        "summary": f"`{inputs['summary']}` (sha256 `{sha256_file(inputs['summary'])[:16]}…`)",
        "export": f"`{export}` (README sha256 `{sha256_file(readme)[:16]}…`)",
    }
    cert = read_optional(inputs.get("certificate"))
    if cert:
        sources["layer certificate"] = (
            f"aux layers {cert.get('aux_layers_text') or cert.get('aux_layers')} + final slot, "
            f"{'passed' if cert.get('passed') else 'NOT passed'}"
        )
    if report_cfg.get("title"):
        sources["report"] = report_cfg["title"]
    doctor = {"draft": str(export)}
    if (cert or {}).get("target", {}).get("path"):
        doctor["target"] = cert["target"]["path"]
    text = readme.read_text().rstrip("\n") + "\n\n"
    text += measured_section(rows, bench_cfg, sources, doctor)
    cmp = validation_vs_standalone(
        read_optional(inputs.get("train")), read_optional(inputs.get("acceptance"))
    )
    if cmp:
        text += "\n" + validation_section(cmp)
    atomic_write_text(out, text)
    bad = [r["config"] for r in rows if r["verdict"] == MISMATCH]
    log.info(
        "model card %s: %d measured rows%s",
        out,
        len(rows),
        f", WIRING MISMATCH? for {', '.join(bad)}" if bad else "",
    )
    return text
