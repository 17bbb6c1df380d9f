"""The GPU benchmarks keep working without a GPU: tiny shapes and sizes, on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_gpu_benchmarks_run_on_the_cpu_with_a_tiny_shape(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    src = REPO / "src" / "eagleflow"
    runs = {  # --before names the current modules: the before/after path runs, not old code
        "gpu_extract.py": ["--before", str(src / "extract" / "hf.py")],
        "gpu_train.py": [
            "--before",
            str(src / "train" / "loop.py"),
            "--bare-steps",
            "2",
            "--loader-workers",
            "0",
            "--online",
        ],
    }
    for script, extra in runs.items():
        proc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / script), "--shape", "tiny"]
            + ["--work", str(work), *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "| stage" in proc.stdout  # the table

    ex = json.loads((out / "extract-tiny.json").read_text())
    assert [r["label"] for r in ex["runs"]] == ["before", "after"]
    assert ex["identical_shards"] == "24 of 24"  # the same module twice: the same bytes
    after = ex["runs"][-1]
    assert after["tokens"] == ex["setup"]["tokens"] and after["tokens_per_s"] > 0
    assert after["bytes_per_token"] > 4 * 64 * 2  # 4 bf16 slots of 64
    assert ex["bare"]["tokens_per_s"] > 0 and ex["disk"]["fsync_gb_s"] > 0

    tr = json.loads((out / "train-tiny.json").read_text())
    assert tr["bare"]["tokens_per_s"] > 0 and tr["bare"]["trainer_loop"]["tokens_per_s"] > 0
    assert [r["label"] for r in tr["runs"]] == ["before", "after"]
    assert all(r["tokens_per_s"] > 0 and r["steady_steps"] >= 1 for r in tr["runs"])
    assert "fused needs Triton" in tr["fused_loss"]["refused"]
    assert tr["loader_only"][0]["tokens_per_s"] > 0 and tr["host_copy"]["pageable_gb_s"] > 0
    online = tr["online"]  # the target forward in the training process, its share of the time
    assert online["tokens_per_s"] > 0 and online["target_forwards"] > 0
    assert 0 < online["target_forward_fraction"] < 1 and tr["online_over_offline"] > 0
