"""Run one of the SGLang probe scripts in the contract venv: JSON request in, JSON answer out."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def run_probe(sglang_python: Path, probe: str | Path, request: dict, timeout: int = 600):
    """The probe's answer: the last stdout line, parsed (SGLang may print before it)."""
    proc = subprocess.run(
        [str(sglang_python), str(Path(__file__).with_name(Path(probe).name))],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
