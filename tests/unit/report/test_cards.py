"""The model card on hand-built raw records: measured rows, and the export folder left alone.

The records and the shared `run` come from _fixtures.py and conftest.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eagleflow.report import cards as report_cards
from eagleflow.serve.bench import MISMATCH
from tests.unit.report._fixtures import BENCH, REPORT


def make_export(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "README.md").write_text(
        "# EAGLE-3 draft for test-target — speculators format (vLLM)\n\n"
        "Written by eagleflow's `export_draft`.\n\n"
        "## Layers\n\nTrained on aux layers [2, 15, 27].\n"
    )
    (folder / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2]}))
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 8)


def _snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).digest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    } | {"__dir_mtime__": folder.stat().st_mtime_ns}


def test_card_has_measured_rows_and_leaves_the_export_alone(run, tmp_path):
    export = tmp_path / "export" / "speculators"
    make_export(export)
    cert = tmp_path / "certificate.json"
    cert.write_text(
        json.dumps({"passed": True, "aux_layers": [2, 15, 27], "target": {"path": "/models/t"}})
    )
    before = _snapshot(export)
    out = tmp_path / "cards" / "test-target-eagle3.md"
    train = tmp_path / "train.json"
    train.write_text(json.dumps({"best_val": {f"full_acc_{i}": 0.6 for i in range(3)}}))
    inputs = {"summary": run["paths"]["summary"], "speculators": str(export), "certificate": cert,
              "acceptance": run["paths"]["acceptance"], "train": str(train)}  # fmt: skip
    report_cards.write_cards(inputs, REPORT, str(out), BENCH)
    assert _snapshot(export) == before, "write_cards touched the export folder"
    card = out.read_text()
    assert card.startswith((export / "README.md").read_text().rstrip("\n"))
    measured = card.split("## Measured", 1)[1]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in measured.splitlines()}
    assert f"**{MISMATCH}**" in rows["s5"] and "| 1.15 | 3.00 | 0.38 |" in rows["s5"]
    assert "1.52× (1.43–1.62)" in rows["s3"] and "| 2.50 | 2.60 | 0.96 | ok |" in rows["s3"]
    assert "160.0 (150.0–170.0)" in rows["s3"]
    assert "| baseline |" in measured and "2026-12-04T10:01:00" in rows["s3"]
    assert "| max_tokens | 64 |" in measured and "greedy (temperature 0)" in measured
    assert "mtbench, 3 per set" in measured and "aux layers [2, 15, 27]" in measured
    assert f"eagleflow doctor --target /models/t --draft {export} --engine vllm" in measured
    # the trainer's estimate (1 + 3 x 0.6) beside the standalone figure at 3 steps (2.6)
    assert "## Validation estimate vs standalone check" in card
    assert "**2.800**" in card and "**2.600**" in card and "+0.200 (+7.7%)" in card
