"""Shared fixtures: paths, a copy of the workflow to run Snakemake in, the SGLang contract venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SNAKEMAKE = str(BIN / "snakemake")
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"


def copy_workflow(dest: Path) -> Path:
    """A private copy of the workflow and package sources (tests may edit it freely)."""
    for name in ("Snakefile", "workflow", "config", "src"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def snakemake(workdir: Path, *args: str, check: bool = True, timeout: int = 600):
    """Run Snakemake in `workdir`, importing eagleflow from the copy's src/."""
    env = dict(os.environ, PYTHONPATH=str(workdir / "src"))
    proc = subprocess.run(
        [SNAKEMAKE, *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def workflow_copy(tmp_path: Path) -> Path:
    return copy_workflow(tmp_path)


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The contract venv's interpreter; `make test` builds it, so its absence is a failure."""
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run `make sglang-venv` (make test builds it)")
    return SGLANG_PYTHON
