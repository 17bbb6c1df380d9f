"""`eagleflow clean`: bulk data under the data root that nothing current references.

Only two kinds of folder are ever candidates, the big ones: hidden-state extractions
(`data_root/extract/<key>/`) and training runs (`data_root/checkpoints/<key>/`). Kept, always:
- the extraction the current manifest (`results/extract/manifest.json`) points at;
- the best checkpoint (`best/`) and the newest `train.keep_checkpoints` resumable checkpoints
  of the run the current training summary (`results/train/summary.json`) names;
- every run trained on the current shards and layer ids (its checkpoints' provenance carries the
  current certificate's sha256): it may be the resume point of the current config;
- a run with no checkpoint yet, whose shards cannot be told;
- anything written to in the last `active_s` seconds (a job may be running there).
The rest is listed with its size and why; `--yes` deletes exactly that list.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from eagleflow import layout
from eagleflow.disk import folder_bytes, human_bytes
from eagleflow.target.prepare import sha256_file

# The rules' declared outputs these references live in (workflow/rules/extract.smk, train.smk).
PROVENANCE = "eagleflow_provenance.json"


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _last_write(folder: Path) -> float:
    times = [p.stat().st_mtime for p in folder.rglob("*")]
    return max([folder.stat().st_mtime, *times])


def plan(
    config: dict, workdir: str | Path = ".", active_s: float = 900, now: float | None = None
) -> dict:
    """{"remove": [{path, bytes, why}], "keep": [{path, why}]} for this config's data root."""
    workdir = Path(workdir)
    results = workdir / config["results_dir"]
    bulk = (workdir / config["data_root"]).resolve()
    return plan_folders(
        bulk / "extract",
        bulk / "checkpoints",
        results / layout.MANIFEST,
        results / layout.CERTIFICATE,
        results / layout.TRAIN_SUMMARY,
        int(config["train"]["keep_checkpoints"]),
        active_s,
        now,
    )


def plan_folders(
    extract_dir: Path,
    checkpoint_dir: Path,
    manifest_path: Path,
    cert_path: Path,
    summary_path: Path,
    n_keep: int,
    active_s: float = 900,
    now: float | None = None,
) -> dict:
    """The plan for these folders against these current references (see the module's doc)."""
    now = time.time() if now is None else now
    remove, keep = [], []

    def candidate(path: Path, why: str) -> None:
        age = now - _last_write(path)
        if age < active_s:
            why_kept = f"written {age:.0f} s ago: a job may be running"
            keep.append({"path": str(path), "why": why_kept})
        else:
            remove.append({"path": str(path), "bytes": folder_bytes(path), "why": why})

    manifest = _read(Path(manifest_path)) or {}
    current_root = Path(manifest["root"]).resolve() if manifest.get("root") else None
    for folder in sorted(Path(extract_dir).glob("*")):
        if not folder.is_dir():
            continue
        if folder.resolve() == current_root:
            keep.append({"path": str(folder), "why": "the current manifest's shards"})
        else:
            candidate(folder, f"shards no current manifest references ({layout.MANIFEST})")

    cert_sha = sha256_file(cert_path) if Path(cert_path).is_file() else None
    summary = _read(Path(summary_path)) or {}
    summary_run = Path(summary["run_dir"]).resolve() if summary.get("run_dir") else None
    for run in sorted(Path(checkpoint_dir).glob("*")):
        if not run.is_dir():
            continue
        epochs = sorted((p for p in run.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        provenances = [_read(p / PROVENANCE) or {} for p in [*epochs, run / "best"]]
        trained_on = {p.get("certificate_sha256") for p in provenances} - {None}
        if run.resolve() == summary_run:
            keep.append({"path": str(run / "best"), "why": "the current summary's best checkpoint"})
            kept = epochs[-n_keep:] if n_keep > 0 else []
            keep += [{"path": str(e), "why": "a resume point (newest checkpoints)"} for e in kept]
            for e in epochs[: len(epochs) - len(kept)]:
                candidate(e, f"checkpoint beyond train.keep_checkpoints ({n_keep})")
        elif not trained_on:
            keep.append({"path": str(run), "why": "no checkpoint yet: its shards cannot be told"})
        elif cert_sha in trained_on:
            keep.append({"path": str(run), "why": "trained on the current shards: a resume point"})
        else:
            candidate(run, "a run on shards or layer ids the current certificate does not cover")
    root = Path(extract_dir).resolve().parent
    return {"remove": remove, "keep": keep, "data_root": str(root)}


def report(p: dict) -> str:
    lines = [f"data root {p['data_root']}:"]
    for r in p["remove"]:
        lines.append(f"  remove {human_bytes(r['bytes']):>10}  {r['path']}  ({r['why']})")
    for k in p["keep"]:
        lines.append(f"  keep              {k['path']}  ({k['why']})")
    total = sum(r["bytes"] for r in p["remove"])
    lines.append(
        f"{len(p['remove'])} folder(s), {human_bytes(total)} referenced by nothing current"
    )
    return "\n".join(lines)


def apply(p: dict) -> int:
    """Delete exactly the plan's `remove` list; returns the bytes freed."""
    freed = 0
    for r in p["remove"]:
        shutil.rmtree(r["path"], ignore_errors=True)
        freed += r["bytes"]
    return freed
