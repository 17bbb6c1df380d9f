"""Rule plot_results: the plots, read from the summary table (`eagleflow.report.table`).

A plot whose data is missing says so in its panel.
"""

from __future__ import annotations

import logging
import math
import re
import textwrap
from pathlib import Path

from eagleflow.engines import BASELINE
from eagleflow.report.table import (
    _fixed,
    _full_accuracies,
    _range,
    _read,
    bench_settings,
    read_metrics,
    read_optional,
    read_summary,
    validation_accept_length,
)
from eagleflow.serve.bench import (
    MISMATCH,
    MISMATCH_CAUSES,
    standalone_accept_length,
    temperature_key,
)
from eagleflow.util import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)


# Names of the plot files (`<name>.<format>`) and what each shows; plots.rst keys on the names.
PLOTS = {
    "speedup": "speedup of each speculative config over the same engine's baseline",
    "accept_length": "accept length per config: served by the engine vs. the standalone check",
    "acceptance_by_position": "standalone acceptance rate by draft position, per num_steps",
    "training": "training loss and per-position full accuracy over optimizer steps",
    "throughput_concurrency": "throughput against concurrency, per config",
    "extraction": "hidden-state extraction tokens/s (and training tokens/s)",
    "data_size": "standalone accept length against training conversations (report.data_size)",
    "levers": "standalone accept length per training variant and num_steps (report.levers)",
}
LEVERS_TABLE = "levers.md"
INDEX = "plots.json"

_BLUE, _ORANGE, _RED = "#0072b2", "#e69f00", "#c0392b"


def _label(row: dict, engines: set, temps: set | None = None) -> str:
    name = row["config"] if len(engines) < 2 else f"{row['engine']}/{row['config']}"
    if temps and len(temps) > 1:  # greedy and sampled side by side
        t = float(row.get("temperature") or 0.0)
        name += " greedy" if t == 0 else f" T={t:g}"
    if row["config"] == BASELINE or row.get("num_steps") is None:
        return name
    return f"{name}\nk={row['num_steps']}, topk={row.get('topk') or 1}"


def _groups(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """Rows grouped by (engine, config, temperature), in table order, with x-axis labels."""
    engines = {r["engine"] for r in rows}
    temps = {float(r.get("temperature") or 0.0) for r in rows}
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["engine"], r["config"], float(r.get("temperature") or 0.0))
        out.setdefault(key, []).append(r)
    return [(_label(rs[0], engines, temps), rs) for rs in out.values()]


def _no_data(ax, why: str) -> None:
    """A panel that says what is missing instead of an empty or misleading chart."""
    import textwrap

    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_linestyle("--")
        spine.set_color("0.6")
    ax.set_facecolor("0.97")
    ax.text(
        0.5,
        0.5,
        textwrap.fill(f"no data: {why}", 58),
        ha="center",
        va="center",
        transform=ax.transAxes,
        fontsize=11,
        color="0.25",
    )


def _figure(ncols: int = 1, width: float = 8.0, height: float = 4.8):
    # Figure + Agg canvas, no pyplot: no global state, no display needed
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _heading(fig, title: str, context: str) -> None:
    fig.suptitle(title, fontsize=13, fontweight="bold")
    if context:
        # the run's identity under the heading: target/engine (report.title) and settings,
        # wrapped to the figure (~12 characters of 9 pt per inch) instead of cut at its edge
        width = int(fig.get_figwidth() * 12)
        context = textwrap.fill(context, width, break_on_hyphens=False)
        fig.get_axes()[0].set_title(context, fontsize=9, color="0.3", loc="left")


def _footnote(fig, text: str) -> None:
    # supxlabel, not fig.text: the constrained layout makes room for it below the axis label
    fig.supxlabel(text, x=0.99, ha="right", fontsize=7, color="0.4")


def _mismatch_tag(ax, x: float, y: float, above_pt: float) -> None:
    """The verdict, boxed in red, `above_pt` points over a bar (above its value label)."""
    ax.annotate(
        MISMATCH,
        (x, y),
        xytext=(0, above_pt),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize=8,
        fontweight="bold",
        color=_RED,
        bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": _RED},
    )


def _bar_text(ax, x: float, y: float, text: str, color: str = "0.15", **kw) -> None:
    ax.annotate(
        text,
        (x, y),
        xytext=(0, 3),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize=8,
        color=color,
        **kw,
    )


def _plot_speedup(rows: list[dict], context: str):
    from matplotlib.patches import Patch

    fig, (ax,) = _figure()
    _heading(fig, "Speedup over the baseline (same engine, same run)", context)
    spec = [r for r in rows if r["config"] != BASELINE]
    have = [r for r in spec if r.get("speedup") is not None]
    if not have:
        why = (
            "no speculative config was benchmarked"
            if not spec
            else "no baseline record of the same engine and concurrency to divide by"
        )
        _no_data(ax, why)
        return fig, {"no_data": why}
    groups = _groups(have)
    concs = sorted({r["concurrency"] for r in have})
    width = 0.8 / len(concs)
    colors = _shades(len(concs))
    bars = []
    top = 1.0
    for j, conc in enumerate(concs):
        for i, (_, rs) in enumerate(groups):
            r = next((r for r in rs if r["concurrency"] == conc), None)
            if r is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            y, lo, hi = r["speedup"], r["speedup_min"], r["speedup_max"]
            bad = r.get("verdict") == MISMATCH
            ax.bar(
                x,
                y,
                width * 0.9,
                yerr=[[y - lo], [hi - y]],
                capsize=4,
                color=colors[j],
                edgecolor=_RED if bad else "none",
                hatch="//" if bad else None,
                linewidth=1.5,
                label=f"concurrency {conc}" if len(concs) > 1 and i == 0 else None,
            )
            _bar_text(ax, x, hi, f"{y:.2f}×")
            if bad:
                _mismatch_tag(ax, x, hi, 16)
            top = max(top, hi * (1.3 if bad else 1.15))
            bars.append(
                {
                    "engine": r["engine"],
                    "config": r["config"],
                    "concurrency": conc,
                    "speedup": y,
                    "speedup_min": lo,
                    "speedup_max": hi,
                    "verdict": r.get("verdict"),
                    "marked": bad,
                }
            )
    ax.axhline(1.0, color="0.2", lw=1, ls="--")
    ax.annotate(
        "baseline = 1.0",
        (1.0, 1.0),
        xycoords=("axes fraction", "data"),
        xytext=(-4, 3),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        color="0.2",
    )
    ax.set_xticks(range(len(groups)), [g for g, _ in groups])
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_xlabel("speculative config (k = num_steps drafted tokens)")
    ax.set_ylabel("speedup (× baseline throughput)")
    handles = []
    if len(concs) > 1:
        handles = ax.get_legend_handles_labels()[0]
    if any(b["marked"] for b in bars):
        handles.append(Patch(facecolor="white", edgecolor=_RED, hatch="//", label=MISMATCH))
    if handles:
        ax.legend(handles=handles, fontsize=8, loc="upper left", ncol=min(4, len(handles)))
    ax.set_ylim(0, top * (1.15 if handles else 1.0))  # headroom for the legend
    _footnote(fig, "bars: median over repeats; whiskers: min–max repeat / baseline median")
    return fig, {"bars": bars}


def _shades(n: int) -> list:
    from matplotlib import colormaps

    if n == 1:
        return [_BLUE]
    cmap = colormaps["Blues"]
    return [cmap(0.45 + 0.5 * i / (n - 1)) for i in range(n)]


def _plot_accept_length(rows: list[dict], context: str):
    from matplotlib.patches import Patch

    fig, (ax,) = _figure()
    _heading(fig, "Accept length: served vs. standalone (same prompts, same num_steps)", context)
    spec = [r for r in rows if r["config"] != BASELINE]
    if not spec:
        why = "no speculative config was benchmarked"
        _no_data(ax, why)
        return fig, {"no_data": why}
    if all(
        r.get("accept_len_served") is None and r.get("accept_len_standalone") is None for r in spec
    ):
        why = "neither the engine nor the standalone check reported an accept length"
        _no_data(ax, why)
        return fig, {"no_data": why}
    groups = _groups(spec)
    concs = sorted({r["concurrency"] for r in spec})
    n = 1 + len(concs)
    width = 0.8 / n
    served_colors = _shades(len(concs))
    top = 1.5
    points = []
    for i, (_, rs) in enumerate(groups):
        first = rs[0]
        k = first.get("num_steps")
        standalone = first.get("accept_len_standalone")
        x0 = i - 0.4 + width / 2
        if standalone is not None:
            ax.bar(
                x0,
                standalone,
                width * 0.9,
                color=_ORANGE,
                label="standalone (in-process check)" if i == 0 else None,
            )
            _bar_text(ax, x0, standalone, f"{standalone:.2f}")
            top = max(top, standalone * 1.25)
        else:
            _bar_text(ax, x0, 0, "no\nstandalone", color="0.4")
        for j, conc in enumerate(concs):
            r = next((r for r in rs if r["concurrency"] == conc), None)
            if r is None:
                continue
            x = x0 + width * (j + 1)
            served = r.get("accept_len_served")
            bad = r.get("verdict") == MISMATCH
            if served is not None:
                label = "served by the engine" + (f", c={conc}" if len(concs) > 1 else "")
                ax.bar(
                    x,
                    served,
                    width * 0.9,
                    color=_RED if bad else served_colors[j],
                    edgecolor=_RED if bad else "none",
                    hatch="xx" if bad else None,
                    alpha=0.85 if bad else 1.0,
                    label=label if i == 0 else None,
                )
                ratio = r.get("accept_ratio")
                _bar_text(
                    ax,
                    x,
                    served,
                    f"{served:.2f}" + (f"\n({ratio:.0%})" if ratio else ""),
                    color=_RED if bad else "0.15",
                )
                if bad:
                    _mismatch_tag(ax, x, served, 28)
                top = max(top, served * (1.6 if bad else 1.25))
            else:
                _bar_text(ax, x, 0, "not\nreported", color="0.4")
            points.append(
                {
                    "engine": r["engine"],
                    "config": r["config"],
                    "num_steps": k,
                    "concurrency": conc,
                    "served": served,
                    "standalone": standalone,
                    "ratio": r.get("accept_ratio"),
                    "verdict": r.get("verdict"),
                    "marked": bad,
                }
            )
        if k is not None:
            ax.hlines(
                k + 1,
                i - 0.45,
                i + 0.45,
                colors="0.3",
                linestyles=":",
                lw=1.2,
                label="upper bound: num_steps + 1" if i == 0 else None,
            )
            top = max(top, (k + 1) * 1.08)
    ax.axhline(1.0, color="0.2", lw=0.8, ls="--")
    ax.set_xticks(range(len(groups)), [g for g, _ in groups])
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylim(0, top * 1.2)  # headroom for the legend
    ax.set_xlabel("speculative config (k = num_steps drafted tokens)")
    ax.set_ylabel("accept length (tokens per verify step)")
    handles, _ = ax.get_legend_handles_labels()
    if any(p["marked"] for p in points):
        handles.append(
            Patch(
                facecolor=_RED,
                edgecolor=_RED,
                hatch="xx",
                alpha=0.85,
                label=f"{MISMATCH} (served far below standalone)",
            )
        )
    ax.legend(handles=handles, fontsize=8, loc="upper left", ncol=2)
    _footnote(
        fig,
        "accept length counts the bonus token; (%) = served / standalone; "
        "1.0 = no draft token accepted",
    )
    return fig, {"configs": points}


def _plot_positions(acceptance: dict | None, context: str):
    fig, (ax,) = _figure()
    _heading(fig, "Standalone acceptance rate by draft position", context)
    by = (acceptance or {}).get("by_num_steps") or {}
    if acceptance is None:
        why = "the standalone acceptance check wrote no results (check_acceptance did not run)"
    elif not by:
        why = "standalone.json holds no per-num_steps results"
    else:
        why = None
    if why:
        _no_data(ax, why)
        return fig, {"no_data": why}
    series = []
    kmax = 1
    for j, k in enumerate(sorted(by, key=int)):
        got = by[k]
        rates = [float("nan") if v is None else v for v in got["acceptance_rate_per_position"]]
        xs = list(range(1, len(rates) + 1))
        kmax = max(kmax, len(rates))
        al = got.get("accept_length")
        label = f"num_steps={k}" + (f" (accept length {al:.2f})" if al is not None else "")
        color = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#56b4e9", "#e69f00"][j % 6]
        ax.plot(xs, rates, marker="o", color=color, label=label)
        if len(rates) <= 10:
            for x, v in zip(xs, rates, strict=True):
                if not math.isnan(v):
                    ax.annotate(
                        f"{v:.0%}",
                        (x, v),
                        xytext=(0, 6),
                        textcoords="offset points",
                        ha="center",
                        fontsize=7,
                        color=color,
                    )
        series.append(
            {"num_steps": int(k), "accept_length": al, "rates": got["acceptance_rate_per_position"]}
        )
    ax.set_xticks(range(1, kmax + 1))
    ax.set_ylim(0, 1.08)
    ax.yaxis.set_major_formatter(_percent())
    ax.set_xlabel("draft position (1 = first drafted token)")
    ax.set_ylabel("acceptance rate (accepted / proposed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    n = len(acceptance.get("prompts") or [])
    _footnote(
        fig,
        f"greedy verification on {n or 'the'} benchmark prompts, target + draft "
        "in-process (no server); a position counts as accepted when it and every earlier one "
        "were",
    )
    return fig, {"series": series}


def _percent():
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(1.0, decimals=0)


def _smooth(ys: list[float]) -> list[float]:
    """Trailing mean over ~5% of the points: the trend of a noisy per-step curve."""
    w = max(1, len(ys) // 20)
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= w:
            acc -= ys[i - w]
        out.append(acc / min(i + 1, w))
    return out


def _plot_training(metrics: list[dict] | None, context: str):
    fig, (ax_loss, ax_acc) = _figure(ncols=2, width=11.0)
    _heading(fig, "Draft training: loss and per-position full accuracy", context)
    rows = metrics or []
    train = [r for r in rows if r.get("split") == "train" and r.get("step") is not None]
    val = [r for r in rows if r.get("split") == "val" and r.get("step") is not None]
    cols = sorted(
        {k for r in rows for k in r if re.fullmatch(r"full_acc_\d+", k)},
        key=lambda c: int(c.rsplit("_", 1)[1]),
    )
    if not train and not val:
        why = "metrics.csv holds no training or validation rows"
        _no_data(ax_loss, why)
        _no_data(ax_acc, why)
        return fig, {"no_data": why}
    data = {"train_steps": len(train), "val_points": len(val)}
    palette = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#56b4e9", "#e69f00", "#f0e442"]

    def series(rs, key):
        pts = [(r["step"], r[key]) for r in rs if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    xs, ys = series(train, "loss")
    if xs:
        ax_loss.plot(xs, ys, color=_BLUE, alpha=0.3, lw=0.8, label="train (per step)")
        if len(xs) >= 20:
            ax_loss.plot(xs, _smooth(ys), color=_BLUE, lw=1.8, label="train (running mean)")
    vx, vy = series(val, "loss")
    if vx:
        ax_loss.plot(vx, vy, color=_RED, marker="D", ms=5, lw=1.2, label="validation (epoch end)")
    if not xs and not vx:
        _no_data(ax_loss, "no loss values in metrics.csv")
    else:
        ax_loss.set_xlabel("optimizer step")
        ax_loss.set_ylabel("loss (sum over TTT positions)")
        ax_loss.grid(alpha=0.3)
        ax_loss.legend(fontsize=8)
    data["val_loss"] = vy
    if not val:
        data["note"] = "no validation rows"
        for ax in (ax_loss, ax_acc):
            ax.text(
                0.98,
                0.97,
                "no validation rows",
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize=8,
                color=_RED,
            )
    plotted = False
    for i, col in enumerate(cols):
        color = palette[i % len(palette)]
        pos = int(col.rsplit("_", 1)[1])
        xs, ys = series(train, col)
        if xs:
            ys = _smooth(ys) if len(ys) >= 20 else ys
            ax_acc.plot(xs, ys, color=color, lw=1.5, label=f"position {pos + 1} (train)")
            plotted = True
        vx, vy = series(val, col)
        if vx:
            ax_acc.plot(
                vx,
                vy,
                color=color,
                marker="D",
                ms=5,
                ls="--",
                lw=0.8,
                label=f"position {pos + 1} (validation)",
            )
            plotted = True
        data[f"val_{col}"] = vy
    if plotted:
        ax_acc.set_ylim(0, 1.02)
        ax_acc.yaxis.set_major_formatter(_percent())
        ax_acc.set_xlabel("optimizer step")
        ax_acc.set_ylabel("full accuracy (draft top-1 = target token)")
        ax_acc.grid(alpha=0.3)
        ax_acc.legend(fontsize=7, ncol=2 if len(cols) > 3 else 1, loc="lower right")
    else:
        _no_data(ax_acc, "no full_acc_<position> columns in metrics.csv")
    return fig, data


def _plot_concurrency(rows: list[dict], context: str):
    fig, (ax,) = _figure()
    _heading(fig, "Throughput vs. concurrency", context)
    concs = sorted({r["concurrency"] for r in rows})
    if len(concs) < 2:
        why = (
            "no benchmark rows"
            if not concs
            else f"only concurrency {concs[0]} was measured; list more levels in "
            "benchmark.concurrency (e.g. [1, 4, 16]) to see how throughput scales"
        )
        _no_data(ax, why)
        return fig, {"no_data": why, "concurrency": concs}
    lines = []
    palette = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#56b4e9", "#e69f00"]
    engines = {r["engine"] for r in rows}
    for j, (_, rs) in enumerate(_groups(rows)):
        rs = sorted(rs, key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        ys = [r["throughput_median"] for r in rs]
        err = [
            [y - r["throughput_min"] for y, r in zip(ys, rs, strict=True)],
            [r["throughput_max"] - y for y, r in zip(ys, rs, strict=True)],
        ]
        base = rs[0]["config"] == BASELINE
        name = rs[0]["config"] if len(engines) < 2 else f"{rs[0]['engine']}/{rs[0]['config']}"
        if not base and rs[0].get("num_steps") is not None:
            name += f" (k={rs[0]['num_steps']})"
        ax.errorbar(
            xs,
            ys,
            yerr=err,
            marker="o",
            capsize=3,
            ls="--" if base else "-",
            color="0.2" if base else palette[j % len(palette)],
            label=name,
        )
        lines.append({"engine": rs[0]["engine"], "config": rs[0]["config"], "x": xs, "y": ys})
    if concs[-1] / concs[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concs, [str(c) for c in concs])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("throughput (generated tok/s, all requests)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _footnote(fig, "points: median over repeats; whiskers: min–max")
    return fig, {"lines": lines}


def _plot_extraction(
    manifest: dict | None, rows: list[dict], metrics: list[dict] | None, context: str
):
    fig, (ax,) = _figure(height=3.6)
    _heading(fig, "Hidden-state extraction throughput", context)
    run = (manifest or {}).get("run") or {}
    tps = run.get("tokens_per_s")
    if tps is None and manifest is None:
        tps = next((r["extract_tokens_per_s"] for r in rows if r.get("extract_tokens_per_s")), None)
    if tps is None:
        if manifest is not None and run:
            why = (
                f"the last extract_hidden_states run extracted {run.get('new_tokens', 0)} new "
                "tokens (every shard was reused), so it measured no rate"
            )
        else:
            why = "no extraction figures (no manifest run and no extract_tokens_per_s)"
        _no_data(ax, why)
        return fig, {"no_data": why}
    backend = (manifest or {}).get("backend")
    dtype = (manifest or {}).get("dtype")
    bars = [("extract_hidden_states" + (f"\n({backend}, {dtype})" if backend else ""), tps)]
    steady = [r for r in (metrics or []) if r.get("split") == "train" and r.get("step_ms")][1:]
    train_tps = None
    if steady:
        ms = sum(r["step_ms"] for r in steady)
        train_tps = sum(r.get("tokens") or 0 for r in steady) / ms * 1000 if ms else None
        if train_tps:
            bars.append(("train_draft\n(steady steps)", train_tps))
    ys = list(range(len(bars)))[::-1]
    ax.barh(ys, [b[1] for b in bars], height=0.55, color=[_BLUE, _ORANGE][: len(bars)])
    for y, (_, v) in zip(ys, bars, strict=True):
        ax.annotate(
            f"{v:,.0f} tok/s",
            (v, y),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
        )
    ax.set_yticks(ys, [b[0] for b in bars])
    ax.set_xlim(0, max(b[1] for b in bars) * 1.25)
    ax.set_xlabel("tokens of training data per second")
    ax.grid(axis="x", alpha=0.3)
    if run:
        parts = [f"{run.get('new_tokens') or 0:,} new tokens in {run.get('seconds') or 0:.1f} s"]
        if run.get("host"):
            parts.append(f"on {run['host']}")
        if manifest.get("num_tokens"):
            parts.append(
                f"{manifest['num_tokens']:,} tokens / {manifest.get('num_samples')} "
                f"samples in the manifest, {manifest.get('bytes_per_token')} B/token"
            )
        _footnote(fig, "extraction: " + ", ".join(parts))
    return fig, {"extract_tokens_per_s": tps, "train_tokens_per_s": train_tps, "run": run}


def data_size_points(
    acceptance: dict | None, manifest: dict | None, train: dict | None, study: list[dict]
) -> dict:
    """The data-size study's points, two series: `standalone` (check_acceptance's accept
    length at the smallest num_steps every such record measured) and `validation` (1 + the
    best validation's full accuracies, `validation_accept_length`).

    `study` holds `report.data_size` entries with their records read ({conversations,
    acceptance?, train?}); this run joins as its own point (conversations = the extraction
    manifest's num_samples).
    """
    runs = [dict(e, run=f"{e['conversations']:,} (study)") for e in study]
    if (manifest or {}).get("num_samples") and (acceptance or train):
        runs.append({"conversations": int(manifest["num_samples"]), "acceptance": acceptance,
                     "train": train, "run": "this run"})  # fmt: skip
    have = [r for r in runs if r.get("acceptance")]
    common = None
    for r in have:
        ks = {int(k) for k in (r["acceptance"].get("by_num_steps") or {})}
        common = ks if common is None else common & ks
    k = min(common) if common else None
    standalone = [
        {
            "conversations": r["conversations"],
            "run": r["run"],
            "accept_length": r["acceptance"]["by_num_steps"][str(k)]["accept_length"],
        }  # fmt: skip
        for r in (have if k is not None else [])
    ]
    validation = []
    for r in runs:
        al = validation_accept_length(r.get("train"))
        if al is not None:
            ttt = len(_full_accuracies(r["train"]))
            validation.append({"conversations": r["conversations"], "run": r["run"],
                               "accept_length": round(al, 4), "ttt_steps": ttt})  # fmt: skip
    key = lambda p: p["conversations"]  # noqa: E731
    return {"num_steps": k, "standalone": sorted(standalone, key=key),
            "validation": sorted(validation, key=key)}  # fmt: skip


def plot_data_size(
    acceptance: dict | None, manifest: dict | None, train: dict | None, study: list[dict],
    context: str,
):  # fmt: skip
    fig, (ax,) = _figure()
    _heading(fig, "Accept length against training-set size", context)
    data = data_size_points(acceptance, manifest, train, study)
    why = None
    if not study:
        why = "no data-size study (report.data_size lists the records of other sizes)"
    elif len(data["standalone"]) < 2 and len(data["validation"]) < 2:
        why = "fewer than two sizes with a standalone record or a validation figure"
    if why:
        _no_data(ax, why)
        return fig, {"no_data": why}
    xs = sorted({p["conversations"] for s in ("standalone", "validation") for p in data[s]})
    ys = []
    series = [
        ("standalone", _BLUE, "o", "-",
         f"standalone check, num_steps={data['num_steps']} (greedy, benchmark prompts)"),
        ("validation", _ORANGE, "D", "--",
         "validation estimate: 1 + full accuracy summed over the TTT positions"),
    ]  # fmt: skip
    for name, color, marker, style, label in series:
        pts = data[name]
        if not pts:
            continue
        px, py = [p["conversations"] for p in pts], [p["accept_length"] for p in pts]
        ys += py
        ax.plot(px, py, marker=marker, linestyle=style, color=color, label=label)
        for x, y in zip(px, py, strict=True):
            ax.annotate(f"{y:.2f}", (x, y), xytext=(0, 7), textcoords="offset points",
                        ha="center", fontsize=8, color=color)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.minorticks_off()
    ax.set_ylim(1, max(ys) * 1.15)
    ax.set_xlabel("training conversations (log scale)")
    ax.set_ylabel("accept length (1 + accepted drafts per step)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    _footnote(fig, "same recipe and draft vocabulary, the first N conversations of the run's "
              "data; validation sets differ per size (the last rows of each)")  # fmt: skip
    return fig, data


def lever_rows(acceptance: dict | None, train: dict | None, levers: list[dict]) -> dict:
    """The levers table: one row per training variant (`report.levers`, records read, then this
    run), its standalone accept length at every (temperature, num_steps) any variant measured,
    and its validation estimate (1 + full accuracies, at num_steps = its ttt_steps)."""
    runs = [dict(e) for e in levers]
    if acceptance or train:
        runs.append({"name": "this run", "acceptance": acceptance, "train": train,
                     "command": None, "note": None})  # fmt: skip
    cols = set()
    for r in runs:
        acc = r.get("acceptance") or {}
        temps = acc.get("by_temperature") or {
            temperature_key(float(acc.get("temperature") or 0.0)): acc
        }
        for t in temps.values():
            temp = float(t.get("temperature") or 0.0)
            cols |= {(temp, int(k)) for k in t.get("by_num_steps") or {}}
    cols = sorted(cols)
    rows = []
    for r in runs:
        acc = r.get("acceptance")
        rows.append({
            "name": r["name"],
            "accept_length": {
                f"T={t:g} k={k}": standalone_accept_length(acc, k, t) if acc else None
                for t, k in cols
            },
            "validation": validation_accept_length(r.get("train")),
            "ttt_steps": len(_full_accuracies(r.get("train"))) or None,
            "command": r.get("command"),
            "note": r.get("note"),
        })  # fmt: skip
    return {"columns": [f"T={t:g} k={k}" for t, k in cols], "rows": rows}


def levers_markdown(data: dict) -> str:
    """The levers table as Markdown (each variant's command and note under it)."""
    cols = data["columns"]
    lines = [
        "| variant | " + " | ".join(cols) + " | validation estimate |",
        "|---|" + "---|" * (len(cols) + 1),
    ]
    for r in data["rows"]:
        est = "–" if r["validation"] is None else f"{r['validation']:.3f} (k={r['ttt_steps']})"
        cells = [_fixed(r["accept_length"][c], 3) for c in cols]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {est} |")
    notes = [r for r in data["rows"] if r["command"] or r["note"]]
    if notes:
        lines.append("")
    for r in notes:
        cmd = f" `{r['command']}`" if r["command"] else ""
        lines.append(f"- **{r['name']}**:{cmd}{' — ' + r['note'] if r['note'] else ''}")
    return "\n".join(lines) + "\n"


def plot_levers(acceptance: dict | None, train: dict | None, levers: list[dict], context: str):
    fig, (ax,) = _figure(width=9.0)
    _heading(fig, "Accept length per training variant", context)
    data = lever_rows(acceptance, train, levers)
    if not levers:
        why = "no levers (report.levers lists the records of other training variants)"
        _no_data(ax, why)
        return fig, {**data, "no_data": why}
    cols, rows = data["columns"], data["rows"]
    width = 0.8 / max(1, len(cols) + 1)
    palette = [_BLUE, "#56b4e9", "#009e73", "#cc79a7", "#d55e00", "#999999"]
    top = 1.0
    for j, col in enumerate(cols):
        xs = [i + (j - len(cols) / 2) * width for i in range(len(rows))]
        ys = [r["accept_length"][col] or 0 for r in rows]
        top = max(top, *ys)
        ax.bar(xs, ys, width, label=f"standalone {col}", color=palette[j % len(palette)])
        for x, y in zip(xs, ys, strict=True):
            if y:
                ax.annotate(f"{y:.2f}", (x, y), xytext=(0, 2), textcoords="offset points",
                            ha="center", fontsize=7)  # fmt: skip
    vx = [i + (len(cols) / 2) * width for i, r in enumerate(rows) if r["validation"]]
    vy = [r["validation"] for r in rows if r["validation"]]
    if vy:
        top = max(top, *vy)
        ax.scatter(vx, vy, marker="D", color=_ORANGE, zorder=3,
                   label="validation estimate (k = ttt_steps)")  # fmt: skip
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=20, ha="right")
    ax.set_ylim(1, top * 1.15)
    ax.set_ylabel("accept length (1 + accepted drafts per step)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    _footnote(fig, "same data and seed per variant; T = temperature of the standalone check, "
              "k = num_steps; the table is levers.md beside the plot")  # fmt: skip
    return fig, data


def summary_html(rows: list[dict], title: str, settings: str) -> str:
    """The summary table as one self-contained HTML page (the report shows HTML inline, not CSV).

    A WIRING MISMATCH? row is highlighted and explained under the table.
    """
    from html import escape

    cols = [
        ("engine", "engine", None),
        ("config", "config", None),
        ("num_steps", "num_steps", None),
        ("temperature", "temperature", None),
        ("concurrency", "concurrency", None),
        ("throughput", "throughput tok/s median (min–max)", None),
        ("speedup", "speedup (min–max)", None),
        ("accept_len_served", "accept length served", 2),
        ("accept_len_standalone", "accept length standalone", 2),
        ("accept_ratio", "served / standalone", 2),
        ("verdict", "verdict", None),
        ("ttft_mean_s", "mean TTFT s", 3),
        ("measured_at", "measured at", None),
    ]
    head = "".join(f"<th>{escape(h)}</th>" for _, h, _ in cols)
    body = []
    for r in rows:
        cells = {
            **r,
            "throughput": _range(
                r["throughput_median"], r["throughput_min"], r["throughput_max"], 1
            ),
            "speedup": _range(r.get("speedup"), r.get("speedup_min"), r.get("speedup_max"), 2, "×"),
        }
        tds = []
        for key, _, digits in cols:
            v = cells.get(key)
            text = _fixed(v, digits) if digits is not None else ("–" if v is None else str(v))
            tds.append(f"<td>{escape(text)}</td>")
        row_class = ' class="mismatch"' if r["verdict"] == MISMATCH else ""
        body.append(f"<tr{row_class}>{''.join(tds)}</tr>")
    bad = [r for r in rows if r["verdict"] == MISMATCH]
    note = ""
    if bad:
        names = ", ".join(f"{r['engine']}/{r['config']} (c={r['concurrency']})" for r in bad)
        causes = "".join(f"<li>{escape(c)}</li>" for c in MISMATCH_CAUSES)
        note = (
            f'<p class="alert"><b>{escape(MISMATCH)}</b> {escape(names)}: the served accept '
            "length is far below the standalone one for the same num_steps, so the engine does "
            f"not run the draft the way it was trained. Likely causes:</p><ul>{causes}</ul>"
            "<p>Check with <code>eagleflow doctor --target &lt;target&gt; --draft &lt;draft&gt; "
            "--engine &lt;engine&gt;</code>.</p>"
        )
    style = (
        "body{font-family:sans-serif;font-size:13px;margin:1em}"
        "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:3px 6px}"
        "th{background:#f2f2f2;text-align:left}td{text-align:right}"
        "td:nth-child(-n+2),td:nth-child(10){text-align:left}"
        "tr.mismatch td{background:#fbe3e0;color:#922;font-weight:bold}"
        ".alert{color:#922}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"<style>{style}</style></head><body><h3>{escape(title or 'Summary')}</h3>"
        f"<p>{escape(settings)}</p><table><tr>{head}</tr>{''.join(body)}</table>{note}"
        "</body></html>\n"
    )


def _run_records(entry: dict) -> dict:
    """An earlier run's records a `report.data_size` or `report.levers` entry names, read."""
    return {
        "acceptance": _read(entry["acceptance"]) if entry.get("acceptance") else None,
        "train": _read(entry["train_summary"]) if entry.get("train_summary") else None,
    }


def plot_results(
    inputs: dict,
    report_cfg: dict,
    out_dir: str,
    bench_cfg: dict | None = None,
    out_table: str | None = None,
) -> dict:
    """Every plot of the report (per `report.formats`) and plots.json, the data each one drew.

    A plot whose data is missing (one concurrency level, no validation, no standalone check) is
    drawn as a panel saying so, never as an empty image. The folder is built next to `out_dir`
    and renamed into place, so a failure leaves no half set. `out_table` gets the summary table
    as HTML, for the report (which offers a CSV only as a download).
    """
    import shutil

    formats = list(report_cfg.get("formats") or ["png", "svg"])
    rows = read_summary(inputs["summary"])
    acceptance = read_optional(inputs.get("acceptance"))
    metrics_path = inputs.get("metrics")
    metrics = read_metrics(metrics_path) if metrics_path and Path(metrics_path).is_file() else None
    manifest = read_optional(inputs.get("manifest"))
    study = [
        {"conversations": int(e["conversations"]), **_run_records(e)}
        for e in report_cfg.get("data_size") or []
    ]
    train = read_optional(inputs.get("train"))
    levers = [
        {"name": e["name"], "command": e.get("command"), "note": e.get("note"), **_run_records(e)}
        for e in report_cfg.get("levers") or []
    ]
    title = report_cfg.get("title") or ""
    settings = bench_settings(bench_cfg)
    engines = ", ".join(sorted({r["engine"] for r in rows}))
    bench_context = " · ".join(
        p for p in (title, f"engine {engines}" if engines else "", settings) if p
    )
    plots = {
        "speedup": lambda: _plot_speedup(rows, bench_context),
        "accept_length": lambda: _plot_accept_length(rows, bench_context),
        "acceptance_by_position": lambda: _plot_positions(acceptance, title),
        "training": lambda: _plot_training(metrics, title),
        "throughput_concurrency": lambda: _plot_concurrency(rows, bench_context),
        "extraction": lambda: _plot_extraction(manifest, rows, metrics, title),
        "data_size": lambda: plot_data_size(acceptance, manifest, train, study, title),
        "levers": lambda: plot_levers(acceptance, train, levers, title),
    }
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    index = {"title": title, "benchmark": settings, "formats": formats, "plots": []}
    for name, draw in plots.items():
        fig, data = draw()
        files = []
        for fmt in formats:
            fig.savefig(tmp / f"{name}.{fmt}", format=fmt, dpi=120)
            files.append(f"{name}.{fmt}")
        index["plots"].append(
            {
                "name": name,
                "shows": PLOTS[name],
                "files": files,
                "no_data": data.pop("no_data", None),
                "data": data,
            }
        )
    lever = next(p for p in index["plots"] if p["name"] == "levers")
    if not lever["no_data"]:
        atomic_write_text(tmp / LEVERS_TABLE, levers_markdown(lever["data"]))
    atomic_write_json(tmp / INDEX, index)
    if out_table:
        atomic_write_text(out_table, summary_html(rows, title, f"engine {engines}; {settings}"))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    empty = [p["name"] for p in index["plots"] if p["no_data"]]
    log.info(
        "wrote %d plots (%s) to %s%s",
        len(plots),
        "+".join(formats),
        out,
        f"; no data for {', '.join(empty)}" if empty else "",
    )
    return index
