"""The GPU host's vLLM (the device lock's pin, 0.26 on the lent GPU) parses the launch commands
eagleflow builds for the GPU overlay, with its own server parser.

`make test` unpacks that release's Python files into .device/vllm-src (`make vllm-gpu-src`). Its
CUDA build infers no device on this machine, so the probe sets vLLM's CPU platform before the
parser is built: the flags and their checks are the release's own code. The lent GPU runs the
same check before serving (`eagleflow.device install --configfile ...`, recorded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagleflow import bundle
from tests.conftest import REPO

SRC = REPO / ".device" / "vllm-src"
PROBE = r"""
import json, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()  # the CUDA build finds no device here
import vllm
from eagleflow import config as cfg, engines
from eagleflow.engines import SpecConfig
full = cfg.load_layers([cfg.REPO_ROOT / "config" / "config.yaml",
                        cfg.REPO_ROOT / "config" / "examples" / "gpu.yaml"])
opts = full["serve"]["vllm"]
out = {"version": vllm.__version__, "file": vllm.__file__, "commands": {}}
for spec in engines.spec_configs(full):
    cmd = engines.vllm_command("py", "/m", spec, opts, "127.0.0.1", 5,
                             None if spec.is_baseline else "/d")
    out["commands"][spec.name] = engines.vllm_flag_problems(cmd)
bad = engines.vllm_command("py", "/m", SpecConfig("s3", 3, 1),
                         {**opts, "extra_args": ["--no-such-flag"]}, "127.0.0.1", 5, "/d")
out["bad"] = engines.vllm_flag_problems(bad)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.contract
@pytest.mark.timeout(600)
def test_the_gpu_hosts_vllm_parses_the_gpu_overlays_commands():
    pin = next(p for p in bundle.read_pins(REPO / "requirements" / "device-lock.txt")
               if p.startswith("vllm=="))  # fmt: skip
    assert (SRC / "vllm" / "__init__.py").is_file(), "run `make vllm-gpu-src` (make test does)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(REPO / "src")]))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=540
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(line[len("RESULT ") :])
    assert got["version"] == pin.split("==")[1] and got["file"].startswith(str(SRC))
    assert got["commands"] == {"baseline": [], "s3": [], "s5": [], "s7": []}
    assert len(got["bad"]) == 1 and "--no-such-flag" in got["bad"][0]
    assert got["bad"][0].startswith(f"vLLM {pin.split('==')[1]} refused")
