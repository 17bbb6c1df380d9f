"""Disk space, checked before the work: what a stage will write against what the disk has free.

A stage that fills the disk hours in fails late and leaves a half-written folder; these checks
run before its first byte, on the machine where the job runs (the remote host's data root under
the remote profile), and refuse with the numbers and the config keys that change them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from eagleflow.errors import DiskSpaceError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
TOKEN_ID_BYTES = 8  # int64 token ids beside the hidden states
FP8_SCALE_BYTES = 4  # fp8 shards: one float32 scale per token
# A shard's safetensors header: two tensor entries (~150 bytes of JSON; fp8's scales a third),
# padded to 8 bytes.
SHARD_HEADER_BYTES = 160
FP8_HEADER_BYTES = 240
MARGIN_FRACTION = 0.10  # kept free beyond the estimate: logs, temp files, other writers
MARGIN_MIN_BYTES = 1 << 20


def shard_bytes(tokens: int, slots: int, hidden: int, dtype: str) -> int:
    """Bytes of one hidden-state shard: [tokens, slots, hidden] in `dtype` plus the token ids
    (and fp8's per-token scales)."""
    if dtype == "fp8":
        per_token = slots * hidden + TOKEN_ID_BYTES + FP8_SCALE_BYTES
        return tokens * per_token + FP8_HEADER_BYTES
    return tokens * (slots * hidden * DTYPE_BYTES[dtype] + TOKEN_ID_BYTES) + SHARD_HEADER_BYTES


def extraction_bytes(lengths: Iterable[int], slots: int, hidden: int, dtype: str) -> int:
    """Bytes the shards of rows of these token lengths take."""
    return sum(shard_bytes(n, slots, hidden, dtype) for n in lengths)


def free_bytes(path: str | Path) -> tuple[int, Path]:
    """Free bytes of the filesystem `path` is (or will be) on, and the folder that was measured."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free, p


def human_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def check_free_space(path: str | Path, need: int, what: str, keys: str) -> dict:
    """Refuse (DiskSpaceError) unless `need` bytes plus a margin are free where `path` lives."""
    import socket

    free, measured = free_bytes(path)
    margin = max(MARGIN_MIN_BYTES, int(need * MARGIN_FRACTION))
    info = {"need": need, "margin": margin, "free": free, "path": str(measured)}
    if need + margin > free:
        raise DiskSpaceError(
            f"{what} needs {human_bytes(need)} (+ {human_bytes(margin)} margin) under {path} on "
            f"{socket.gethostname()}, but {measured} has {human_bytes(free)} free. Free space "
            f"there, point data_root at a larger disk, or change what is written: {keys}"
        )
    return info


def folder_bytes(path: str | Path) -> int:
    """Bytes of the files under `path` (0 if it does not exist)."""
    p = Path(path)
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.exists() else 0


def checkpoint_bytes(model, dtype: str, optimizer_states: int = 2) -> dict:
    """Bytes of one resumable checkpoint (every weight, plus `optimizer_states` tensors per
    trainable weight: AdamW's two moments) and of the best one (weights only), in `dtype`."""
    every = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers() if b.is_floating_point()
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    b = DTYPE_BYTES[dtype]
    return {"checkpoint": (every + optimizer_states * trainable) * b, "best": every * b}
