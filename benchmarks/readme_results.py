"""Copy a finished run's table and key plots into the README (the "Results" block).

    .venv/bin/python benchmarks/readme_results.py [--results results]

Reads results/summary.md, results/train/summary.json, results/extract/manifest.json and
results/plots/*.png from a completed `make demo`; copies three plots to docs/results/ and
rewrites the README between the `<!-- results:start -->` and `<!-- results:end -->` markers with
the table, the figures that produced the draft and the machine the run came from. Nothing is
typed by hand: rerun it after a new run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import time
from pathlib import Path

from eagleflow import layout

REPO = Path(__file__).resolve().parents[1]
PLOTS = ("accept_length", "speedup", "training")
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _stage_seconds(results: Path) -> dict[str, float]:
    out = {}
    for tsv in sorted((results / "benchmarks").glob("*.tsv")):
        lines = tsv.read_text().splitlines()
        if len(lines) >= 2:
            out[tsv.stem] = float(lines[-1].split("\t")[0])
    return out


def block(results: Path, docs: Path, command: str = "make demo") -> str:
    table = (results / layout.SUMMARY_MD).read_text().strip()
    train = json.loads((results / layout.TRAIN_SUMMARY).read_text())
    manifest = json.loads((results / layout.MANIFEST).read_text())
    when = time.strftime("%Y-%m-%d", time.localtime((results / layout.SUMMARY_MD).stat().st_mtime))
    run = manifest.get("run") or {}
    val = train.get("best_val") or {}
    stages = _stage_seconds(results)
    lines = [
        START,
        f"Measured by `{command}` on {when}: {os.cpu_count()} cores of an {_cpu()}, no GPU "
        "(vLLM CPU, float32). Regenerate this block with "
        "`.venv/bin/python benchmarks/readme_results.py` after a run.",
        "",
        table,
        "",
        f"The draft: {train['steps']} steps ({train['tokens']:,} tokens) in "
        f"{train['seconds']:.0f} s, {train['steps_per_s']} steps/s, "
        f"{train['tokens_per_s']:,.0f} tok/s on {train['device']}; best validation loss "
        f"{val.get('loss', float('nan')):.2f}, full accuracy per position "
        + " / ".join(f"{val.get(f'full_acc_{i}', 0):.3f}" for i in range(3))
        + f". Hidden states: {manifest['num_tokens']:,} tokens, "
        f"{run.get('tokens_per_s', '–')} tok/s ({manifest['dtype']}, {manifest['backend']} "
        f"backend), {manifest['bytes'] / 1e9:.2f} GB of shards.",
        "",
        "Stage wall times (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in stages.items())
        + " (a stage that resumed earlier work shows only its last run).",
        "",
    ]
    for name in PLOTS:
        src = results / layout.PLOTS / f"{name}.png"
        if src.is_file():
            shutil.copy2(src, docs / f"{name}.png")
            lines.append(f"![{name}](docs/results/{name}.png)")
    lines += ["", END]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(REPO / "results"))
    ap.add_argument("--command", default="make demo", help="the command that made the run")
    args = ap.parse_args()
    docs = REPO / "docs" / "results"
    docs.mkdir(parents=True, exist_ok=True)
    readme = REPO / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} block to fill")
    new = block(Path(args.results), docs, args.command)
    text = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _m: new, text, flags=re.S)
    readme.write_text(text)
    print(f"README results block rewritten; plots in {docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
