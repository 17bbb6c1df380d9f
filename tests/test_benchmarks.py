"""The GPU benchmarks keep working without a GPU: tiny shapes and sizes, on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_gpu_benchmarks_run_on_the_cpu_with_a_tiny_shape(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    src = REPO / "src" / "eagleflow"
    runs = {  # --before names the current modules: the before/after path runs, not old code
        "gpu_extract.py": ["--before", str(src / "extract.py")],
        "gpu_train.py": [
            "--before",
            str(src / "train.py"),
            "--bare-steps",
            "2",
            "--loader-workers",
            "0",
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


TINY_QUALITY = [  # the quality overlay at sizes a 2-core CPU runs in about a minute
    "data.num_samples=16",
    "regenerate.max_tokens=24",
    "regenerate.hf_batch_size=8",
    "regenerate.hf_dtype=float32",
    "regenerate.hf_static_cache=false",
    "tokenize.max_seq_len=512",
    "extract.dtype=float32",
    "train.gpus=0",
    "train.num_workers=0",
    "train.max_steps=3",
    "train.epochs=1",
    "train.total_seq_len=1024",
    "train.draft_vocab_size=128",
    "train.val_fraction=0.25",
    "benchmark.num_prompts=2",
    "benchmark.max_tokens=12",
    "benchmark.standalone_batch_size=4",
]
STAGES = [
    "prepare_target",
    "regenerate",
    "tokenize",
    "extract_hidden_states",
    "verify_layers",
    "vocab_map",
    "train_draft",
    "export_draft",
    "eval_answers",
    "check_acceptance",
]


@pytest.mark.slow
def test_quality_chain_runs_every_stage_resumes_and_brings_the_draft_back(tmp_path):
    """gpu_quality.py on the real SmolLM2 at tiny sizes: every stage of the main run and of a
    study size, what travels back fits the device's limits, the draft reassembled here is
    byte-identical to the export, and a second start skips every finished stage."""
    from eagleflow import config as efconfig
    from eagleflow.data import prepare_prompts

    data = efconfig.load_layers([REPO / "config" / "config.yaml"])["data"]
    data["sources"][0]["max_records"] = 300
    data["num_samples"] = 16
    prompts = tmp_path / "prompts.jsonl"
    prepare_prompts(data, str(prompts), str(tmp_path / "prompts.stats.json"))
    res, out = tmp_path / "results", tmp_path / "out"
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_quality.py"), "--results", str(res),
           "--data-root", str(tmp_path / "bulk"), "--prompts", str(prompts), "--study", "8",
           "--out", str(out), "--set", *TINY_QUALITY]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="", TQDM_DISABLE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(json.loads((res / "stages.json").read_text())) == STAGES
    study = json.loads((res / "study" / "n8" / "stages.json").read_text())
    assert set(STAGES) - set(study) == {"prepare_target", "regenerate", "vocab_map", "eval_answers"}
    acc = json.loads((res / "acceptance" / "standalone.json").read_text())
    assert sorted(acc["by_num_steps"], key=int) == ["3", "5", "7"]
    assert len(acc["prompts"]) == 4 and acc["prompts"][1].endswith(":turn2")  # both turns
    assert acc["standalone_batch_size"] == 4 and acc["greedy_output_checked_on"] == 2
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all((out / f).stat().st_size <= 16 << 20 for f in files)
    assert sum((out / f).stat().st_size for f in files) <= 64 << 20
    with tarfile.open(out / "checks.tar.gz") as tar:  # the checks' records, in one file
        assert {"answers.json", "standalone.json", "stages.json", "standalone.n8.json"} <= set(
            tar.getnames()
        )

    here = tmp_path / "here"
    here.mkdir()
    with tarfile.open(out / "results.tar.gz") as tar:
        tar.extractall(here, filter="data")
    names = {p.relative_to(here).as_posix() for p in here.rglob("*") if p.is_file()}
    assert "export/speculators/model.safetensors" not in names  # the weights travel in parts
    assert {"train/metrics.csv", "layers/layers.certificate.json", "eval/answers.json"} <= names
    unpack = [sys.executable, str(REPO / "benchmarks" / "gpu_quality.py"), "--results",
              str(here), "--data-root", "-", "--prompts", "-", "--unpack", str(out),
              "--target-json", str(res / "target" / "target.json")]  # fmt: skip
    got = subprocess.run(unpack, env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0 and "sha256 equal" in got.stdout, got.stdout + got.stderr[-2000:]
    exported = res / "export" / "speculators" / "model.safetensors"
    back = here / "export" / "speculators" / "model.safetensors"
    assert back.read_bytes() == exported.read_bytes()

    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    skipped = again.stderr.count("outputs exist, skipped")
    # every stage once, and prepare_target once more: the checks' own process prepares it again
    assert skipped == len(STAGES) + len(study) + 1, again.stderr[-3000:]
    assert again.stderr.count("prepare_target: outputs exist, skipped") == 2
