"""Manifests for bulk artifacts that stay on the host that made them.

A manifest is the small Snakemake output of a stage whose real product is too large to move
(hidden-state shards): shard paths relative to a root, byte sizes, sha256, counts, the producing
host. Consumers call `load_manifest` before reading, which fails with a message naming the first
missing or altered shard instead of letting a trainer read half a dataset.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from eagleflow.errors import ManifestError
from eagleflow.target.prepare import sha256_file
from eagleflow.util import atomic_write_json

KIND_HIDDEN_STATES = "hidden_states"


def write_manifest(path: str | Path, root: str | Path, shards: list[dict], **meta) -> dict:
    """Write a manifest atomically; `shards` rows hold at least path (relative), bytes, sha256."""
    body = {
        "kind": meta.pop("kind", KIND_HIDDEN_STATES),
        "host": socket.gethostname(),
        "root": str(Path(root).resolve()),
        **meta,
        "num_shards": len(shards),
        "bytes": sum(int(s["bytes"]) for s in shards),
        "shards": shards,
    }
    atomic_write_json(path, body)
    return body


def load_manifest(path: str | Path, verify: str = "size", rows: list[int] | None = None) -> dict:
    """Read a manifest and check its shards: verify = none | size | sha256 (of `rows` or all)."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {path} does not exist; run the stage that writes it")
    try:
        body = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"manifest {path} is not valid JSON ({e}); rerun its stage") from None
    for key in ("root", "shards"):
        if key not in body:
            raise ManifestError(f"manifest {path} lacks '{key}'; rerun the stage that wrote it")
    if verify == "none":
        return body
    root = Path(body["root"])
    if not root.is_dir():
        raise ManifestError(
            f"manifest {path}: shard folder {root} is not on this host ({socket.gethostname()}; "
            f"the shards were written on {body.get('host')}). Run the consumer on that host "
            "(the remote profile does), or rerun extraction here"
        )
    if rows is None:
        shards = body["shards"]
    else:  # by row: a stream manifest lists only its probe rows
        by_row = {int(s.get("row", i)): s for i, s in enumerate(body["shards"])}
        shards = [by_row[r] for r in rows if r in by_row]
    fix = "rerun the producing stage (snakemake --forcerun <rule>) to rewrite it"
    for shard in shards:
        file = root / shard["path"]
        if not file.is_file():
            raise ManifestError(f"manifest {path}: shard {file} is missing; {fix}")
        size = file.stat().st_size
        if size != int(shard["bytes"]):
            raise ManifestError(
                f"manifest {path}: shard {file} has {size} bytes, the manifest says "
                f"{shard['bytes']}: it was altered or truncated; {fix}"
            )
        if verify == "sha256" and sha256_file(file) != shard["sha256"]:
            raise ManifestError(
                f"manifest {path}: shard {file} does not match its sha256 (altered after "
                f"extraction); {fix}"
            )
    return body
