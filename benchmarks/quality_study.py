"""The data-size study of a committed quality chain: the report's data_size plot from its records.

Reads a chain folder under docs/results/smollm2-quality/ (the main run's summary.json and
study/n<N>/summary.json, with acceptance records beside them where they exist:
standalone.json, study/n<N>/standalone.json), draws the report's `data_size` plot into it and
prints the points (the standalone accept length and the validation estimate per size):

    .venv/bin/python benchmarks/quality_study.py docs/results/smollm2-quality/h100-2026-12-06 \
        --conversations 2998
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def main() -> None:
    from eagleflow.report import plots as report_plots
    from eagleflow.report import table as report_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("chain", help="a chain's folder of records")
    ap.add_argument("--conversations", type=int, required=True,
                    help="the main run's training conversations (tokenize's count)")  # fmt: skip
    ap.add_argument("--title", default="eagleflow quality run on SmolLM2-135M-Instruct")
    args = ap.parse_args()
    root = Path(args.chain)

    read = report_table.read_optional  # None where a record is absent
    study = []
    for d in sorted((root / "study").glob("n*"), key=lambda p: int(p.name[1:])):
        train = read(d / "summary.json")
        n = _conversations(root, d)
        study.append({"conversations": n, "train": train,
                      "acceptance": read(d / "standalone.json")})  # fmt: skip
    fig, data = report_plots.plot_data_size(
        read(root / "standalone.json"),
        {"num_samples": args.conversations},
        read(root / "summary.json"),
        study,
        args.title,
    )
    fig.savefig(root / "data_size.png", format="png", dpi=120)
    print(json.dumps(data, indent=1))


def _conversations(root: Path, study_dir: Path) -> int:
    """A study training's sample count from the chain's log (tokenize's line), else its N."""
    log = root / "chain.log"
    n = int(study_dir.name[1:])
    if log.is_file():
        counts = [int(m) for m in re.findall(r"tokenized (\d+) samples", log.read_text())]
        near = [c for c in counts if abs(c - n) <= max(2, n // 100)]
        if near:
            return near[0]
    return n


if __name__ == "__main__":
    main()
