"""Rule train_draft's run folder: its file names and the rename that swaps a checkpoint in."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

HISTORY = "metrics.jsonl"  # per-run metric rows, append-only, cut back to a checkpoint on resume
STATE = "eagleflow_state.json"
PROVENANCE = "eagleflow_provenance.json"
BEST = "best"


def recover_swaps(run_dir: Path) -> None:
    """Finish what a kill inside `swap_in` left: the previous checkpoint back, partials gone."""
    for old in run_dir.glob(".partial-old-*"):
        final = run_dir / old.name.removeprefix(".partial-old-")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)
    for stale in run_dir.glob(".partial-*"):
        shutil.rmtree(stale, ignore_errors=True)


def swap_in(tmp: Path, final: Path) -> None:
    """Replace `final` by the complete folder `tmp`; a kill in between leaves one of them whole."""
    old = final.with_name(f".partial-old-{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
