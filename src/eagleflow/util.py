"""Small file helpers: atomic writes, so no half-written output ever looks complete."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file (fsynced) and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file owner-only; give it the mode a plain open() would
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file and a rename."""
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj) -> None:
    """Write `obj` as indented JSON, atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    """Write rows as JSON lines, atomically; returns the row count."""
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return len(lines)


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a JSON-lines file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# An assistant message the dataset wrote (a tool call whose results follow): context, not
# trained. Set by data's prompt preparation, read by both regeneration backends.
FROM_DATASET = "from_dataset"


def fsync_append(f, row: dict) -> None:
    """Append one JSON line to an open file and fsync it (a resume file survives a kill)."""
    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def read_jsonl_resumable(path: str | Path, key: str) -> dict:
    """Rows of an append-only progress file by `key`; a torn last line (SIGKILL) is cut off."""
    path = Path(path)
    done: dict = {}
    if not path.exists():
        return done
    data = path.read_bytes()
    good = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        done[row[key]] = row
        good += len(line)
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
        log.warning("%s: dropped a torn last record (%d bytes)", path, len(data) - good)
    return done
