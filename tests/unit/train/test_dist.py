"""train_draft on several processes (torchrun, speculators' DDP) with gloo on the CPU.

No multi-GPU machine is lent here: these tests run the same launch, rank handling and rank-0
outputs with two CPU processes (`train.processes: 2`, `train.gpus: 0`); NCCL on GPUs differs only
in the backend and the device each rank takes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagleflow.errors import TrainError
from eagleflow.train.loop import train_draft
from eagleflow.train.settings import resolve_settings
from tests.conftest import REPO
from tests.unit.train.test_loop import TRAIN, training_inputs

pytestmark = pytest.mark.slow

RUNNER = """
import json, sys
from eagleflow.errors import EagleflowError
from eagleflow.train.loop import train_draft
inputs, cfg, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
try:
    train_draft(inputs, cfg, out + "/ckpt", out + "/summary.json", out + "/metrics.csv")
except EagleflowError as e:
    print(f"eagleflow: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(3)
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return training_inputs(tmp_path_factory.mktemp("dist"))[0]


def test_process_settings_are_checked():
    with pytest.raises(TrainError, match=r"train.gpus 2 but 1 CUDA device\(s\) are visible"):
        resolve_settings({**TRAIN, "gpus": 2}, cuda_available=True, device_count=1)
    with pytest.raises(TrainError, match="train.processes 3 with train.gpus 2: .* one process"):
        resolve_settings({**TRAIN, "gpus": 2, "processes": 3}, True, device_count=2)
    with pytest.raises(TrainError, match="train.processes 2 with train.gpus 1: .* train.gpus 2"):
        resolve_settings({**TRAIN, "gpus": 1, "processes": 2}, True, device_count=1)
    assert resolve_settings({**TRAIN, "gpus": 2}, True, device_count=2)["processes"] == 2
    assert resolve_settings({**TRAIN, "processes": 2}, False)["processes"] == 2
    assert resolve_settings(TRAIN, False)["processes"] == 1


def test_two_gloo_processes_train_like_one(inputs, tmp_path):
    one = train_draft(
        inputs, TRAIN, str(tmp_path / "c1"), str(tmp_path / "s1.json"), str(tmp_path / "m1.csv")
    )
    cfg = {**TRAIN, "processes": 2}
    two = train_draft(
        inputs, cfg, str(tmp_path / "c2"), str(tmp_path / "s2.json"), str(tmp_path / "m2.csv")
    )
    print(
        f"1 process: {one['steps']} steps, {one['tokens']} tokens, val loss "
        f"{one['final_val']['loss']:.4f}; 2 processes: {two['steps']} steps, {two['tokens']} "
        f"tokens, val loss {two['final_val']['loss']:.4f}"
    )
    assert two["settings"]["processes"] == 2 and one["settings"]["processes"] == 1
    # each step takes a batch on each rank: half the steps, the same data (the distributed
    # sampler may pack a few tokens differently), the tokens of both ranks counted
    assert two["steps"] == pytest.approx(one["steps"] / 2, abs=1)
    assert two["tokens"] == pytest.approx(one["tokens"], rel=0.05)
    # the same loss curve within noise: validation loss falls, and ends close to one process's
    vals = [
        json.loads(r) for r in (Path(two["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    val = [r["loss"] for r in vals if r["split"] == "val"]
    assert val[-1] < val[0]
    assert two["final_val"]["loss"] == pytest.approx(one["final_val"]["loss"], rel=0.15)
    # rank 0 alone wrote the history: one row per step and epoch, none twice
    ids = [r["id"] for r in vals]
    assert len(ids) == len(set(ids)) == two["steps"] + two["epochs"]
    # another process count is another run (another effective batch); one process keeps its key
    assert Path(two["run_dir"]).name != Path(one["run_dir"]).name
    best = Path(two["best_checkpoint"])
    assert (best / "model.safetensors").is_file() and not (best / "module").exists()


def test_sigterm_stops_every_rank_at_one_step_and_the_rerun_resumes(inputs, tmp_path):
    cfg = {**TRAIN, "processes": 2, "epochs": 60, "save_every_steps": 1000}
    args = [sys.executable, "-c", RUNNER, json.dumps(inputs), json.dumps(cfg), str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    rows = 0
    while rows < 8 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
        hist = list((tmp_path / "ckpt").glob("*/metrics.jsonl"))
        rows = len(hist[0].read_text().splitlines()) if hist else 0
    assert proc.poll() is None, f"training ended before the signal: {proc.stderr.read()[-3000:]}"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 3, err[-3000:]
    line = [ln for ln in err.splitlines() if ln.startswith("eagleflow: TrainingInterrupted")]
    assert line and "checkpoint saved" in line[0] and "resume" in line[0], err[-3000:]
    stopped = int(line[0].split(" at step ")[1].split(":")[0])
    assert not (tmp_path / "summary.json").exists()  # no output that passes for complete

    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(f"stopped at step {stopped}, resumed from {summary['resumed_from_step']}")
    assert summary["resumed_from_step"] == stopped > 0
    assert summary["steps"] > stopped and summary["settings"]["processes"] == 2
    assert len(list((tmp_path / "ckpt").iterdir())) == 1  # the same run folder, resumed
