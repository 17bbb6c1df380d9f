"""The Slurm workflow profile (profiles/slurm) against a real one-node Slurm cluster.

tests/support/slurm.py starts munged, slurmctld and slurmd on this machine (two fake GPUs, private
mount namespace, own ports). The tiny pipeline (tests/support/tiny_pipeline.py: the real rules up to
train_draft on a tiny random target; regenerate's script is a stand-in) runs through the literal
`snakemake --workflow-profile profiles/slurm`; the tests after the first one edit it in order. The
only settings the tests add on the command line are the partition (as a user would) and shorter
status polling (the profile's 15 s suits GPU jobs of hours, not seconds). Slurm's own records
(`scontrol show job`) are the evidence of where and how each job ran.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, SNAKEMAKE, copy_workflow
from tests.support import slurm as slurm_mod

pytestmark = pytest.mark.skipif(
    slurm_mod.available() is not None, reason=str(slurm_mod.available())
)

PROFILE = REPO / "profiles" / "slurm"
FAST = [
    "--seconds-between-status-checks", "1",
    "--slurm-init-seconds-before-status-checks", "1",
    "--default-resources", "slurm_partition=main",
]  # fmt: skip
SLURM_RULES = {"prepare_target", "regenerate", "tokenize", "extract_hidden_states"}
SLURM_RULES |= {"verify_layers", "train_draft"}
LOCAL_RULES = {"prepare_prompts", "vocab_map", "summarize_tiny"}
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = slurm_mod.TestSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _snakemake(tiny, *args, check=True, timeout=600, **popen) -> subprocess.CompletedProcess:
    cmd = [SNAKEMAKE, "--workflow-profile", str(PROFILE), *args, *FAST]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=tiny.workdir, env=tiny.env, capture_output=True, text=True, timeout=timeout
    )
    proc.seconds = time.monotonic() - t0
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-8000:]}\n"
            + tiny.cluster.diagnostics()
        )
    return proc


def _log_jobs(workdir: Path) -> dict[str, list[str]]:
    """rule -> Slurm job ids named in its log (one per run of the job)."""
    out = {}
    for log in (workdir / "results" / "logs").glob("*.log"):
        out[log.stem] = re.findall(r"started on \S+ \(pid \d+\) \[slurm job (\d+)", log.read_text())
    return out


def _submitted(out: str) -> set[str]:
    return set(re.findall(r"rule (\w+):", out)) & SLURM_RULES


@pytest.fixture(scope="module")
def tiny(cluster, tmp_path_factory):
    from tests.support.tiny_pipeline import TARGETS, make_tiny_pipeline

    base = tmp_path_factory.mktemp("tiny-slurm")
    workdir = base / "work"
    workdir.mkdir()
    copy_workflow(workdir)
    overlay = make_tiny_pipeline(base / "inputs", workdir, base / "models" / "tiny")
    env = {**cluster.env(), "PYTHONPATH": str(workdir / "src"), "OMP_NUM_THREADS": "1"}
    t = SimpleNamespace(workdir=workdir, env=env, overlay=overlay, base=base, cluster=cluster)
    t.args = [*TARGETS, "--configfile", str(overlay)]
    t.first = _snakemake(t, *t.args)
    TIMINGS["full run through Slurm (s)"] = t.first.seconds
    return t


@pytest.fixture(scope="module", autouse=True)
def _report_timings():
    yield
    if TIMINGS:
        print("\nSlurm timings: " + ", ".join(f"{k} {v:.1f}" for k, v in TIMINGS.items()))


@pytest.mark.slow
def test_gpu_rules_run_as_slurm_jobs_found_in_slurms_records(tiny, cluster):
    jobs = _log_jobs(tiny.workdir)
    for rule in SLURM_RULES:
        assert len(jobs.get(rule, [])) == 1, (rule, jobs)
        rec = cluster.job(jobs[rule][0])
        assert rec["Comment"] == f"rule_{rule}", rec  # the plugin's tag, in Slurm's record
        assert rec["JobState"] == "COMPLETED" and rec["Partition"] == "main", rec
        # the profile's memory reached sbatch although --default-resources was also given
        want_mem = {"regenerate": "125G", "extract_hidden_states": "250G"}.get(rule)
        if want_mem:
            assert rec["MinMemoryNode"] == want_mem, rec
    # per-job overhead: the jobs' time in Slurm beyond what the stages themselves report
    own = slurm_time = 0.0
    for rule in SLURM_RULES:
        text = (tiny.workdir / "results" / "logs" / f"{rule}.log").read_text()
        own += float(re.findall(r"done in ([\d.]+) s", text)[-1])
        rec = cluster.job(jobs[rule][0])
        h, m, sec = (int(x) for x in rec["RunTime"].split("-")[-1].split(":"))
        slurm_time += 3600 * h + 60 * m + sec
    n = len(SLURM_RULES)
    for rule in sorted(SLURM_RULES, key=lambda r: cluster.job(jobs[r][0])["SubmitTime"]):
        rec = cluster.job(jobs[rule][0])
        print(rule, rec["SubmitTime"], rec["StartTime"], rec["EndTime"])
    TIMINGS["stages' own time (s)"] = own
    TIMINGS["Slurm job run time beyond the stage, per job (s)"] = (slurm_time - own) / n
    TIMINGS["wall beyond the stages, per job (s)"] = (tiny.first.seconds - own) / n
    for rule in LOCAL_RULES:
        log = tiny.workdir / "results" / "logs" / f"{rule}.log"
        assert not jobs.get(rule), f"local rule {rule} ran as a Slurm job: {jobs.get(rule)}"
        assert log.is_file() or rule == "summarize_tiny"
    # GPU rules asked Slurm for a GPU; train_draft (train.gpus 0) for none, with its time limit
    gpu_rec = cluster.job(jobs["regenerate"][0])
    assert "gpu:1" in gpu_rec.get("TresPerJob", ""), gpu_rec
    train = cluster.job(jobs["train_draft"][0])
    assert "gpu" not in train.get("TresPerJob", "") and train["TimeLimit"] == "2-00:00:00", train
    stats = json.loads((tiny.workdir / "results" / "data" / "regenerated.stats.json").read_text())
    assert stats["cuda_visible_devices"] in ("0", "1")
    summary = json.loads((tiny.workdir / "results" / "tiny" / "summary.json").read_text())
    assert summary["train_steps"] == 4 and summary["shards"] >= 1
    assert summary["root"].startswith(str(tiny.workdir / "results" / "bulk"))  # shared fs


@pytest.mark.slow
def test_no_change_submits_nothing(tiny, cluster):
    before = len(cluster.jobs())
    proc = _snakemake(tiny, *tiny.args)
    TIMINGS["no-op run (s)"] = proc.seconds
    assert "Nothing to be done" in proc.stdout + proc.stderr
    assert len(cluster.jobs()) == before


@pytest.mark.slow
def test_gpu_script_edit_resubmits_that_rule_and_downstream(tiny, cluster):
    script = tiny.workdir / "workflow" / "scripts" / "verify_layers.py"
    script.write_text(script.read_text() + "\n_EDITED = 1  # an edit of behaviour\n")
    before = _log_jobs(tiny.workdir)
    proc = _snakemake(tiny, *tiny.args)
    after = _log_jobs(tiny.workdir)
    # Snakemake starts a job's log afresh: a rerun rule's log names a new job id
    rerun = {r for r in SLURM_RULES if after.get(r) != before.get(r)}
    assert rerun == {"verify_layers", "train_draft"}, proc.stderr[-3000:]
    for rule in rerun:
        assert cluster.job(after[rule][-1])["Comment"] == f"rule_{rule}"


def _wait(what, check, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_scancel_of_training_fails_clearly_and_the_rerun_resumes(tiny, cluster):
    long = tiny.base / "long.yaml"
    long.write_text(
        json.dumps({"train": {"epochs": 400, "max_steps": 120, "save_every_steps": 10}})
    )
    args = [*tiny.args, str(long)]
    cmd = [SNAKEMAKE, "--workflow-profile", str(PROFILE), *args, *FAST]
    proc = subprocess.Popen(
        cmd, cwd=tiny.workdir, env=tiny.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    ckpt = tiny.workdir / "results" / "bulk" / "checkpoints"
    before = _log_jobs(tiny.workdir).get("train_draft")

    def running_with_history():
        ids = _log_jobs(tiny.workdir).get("train_draft")
        if not ids or ids == before:
            return None
        rows = 0
        for hist in ckpt.glob("*/metrics.jsonl"):
            if time.time() - hist.stat().st_mtime < 5:
                rows = max(rows, len(hist.read_text().splitlines()))
        return ids[-1] if rows >= 3 else None  # a few steps in: the checkpoint's step is > 0

    try:
        job = _wait("training to run and write history", running_with_history, timeout=240)
        assert cluster.job(job)["JobState"] == "RUNNING"
        cluster.cmd("scancel", job)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert f"SLURM-job '{job}'" in out or job in out, out[-3000:]
    assert "CANCELLED" in out, out[-3000:]
    log = (tiny.workdir / "results" / "logs" / "train_draft.log").read_text()
    stopped = re.findall(r"SIGTERM at step (\d+): checkpoint saved", log)
    assert stopped, log[-3000:]
    assert not (tiny.workdir / "results" / "train" / "summary.json").exists()

    assert "/train/summary.json" in log  # the message names the target to ask for
    # the earlier run's downstream outputs still exist, so the rerun names training's output
    done = _snakemake(tiny, "results/train/summary.json", *args)
    assert "rule train_draft:" in done.stdout + done.stderr
    summary = json.loads((tiny.workdir / "results" / "train" / "summary.json").read_text())
    print(f"scancel at step {stopped[-1]}; the rerun resumed from {summary['resumed_from_step']}")
    assert summary["resumed_from_step"] == int(stopped[-1]) > 0, done.stderr[-3000:]


TOY = r"""
import json, os, subprocess, time
from eagleflow.train import dist as train_dist

def record(path, **extra):
    with open(path, "w") as f:
        gpus = os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS")
        json.dump({"job": os.environ.get("SLURM_JOB_ID"), "gpus": gpus, "start": time.time(),
                   "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), **extra}, f)

rule all:
    input: expand("one_{i}.json", i=[1, 2]), "two.json"

rule one_gpu:
    output: "one_{i}.json"
    resources: gpu=1, mem_mb=100, runtime=5
    run:
        start = time.time()
        time.sleep(8)
        record(output[0], start=start, end=time.time())

rule two_gpus:
    output: "two.json"
    resources: gpu=2, mem_mb=100, runtime=5
    run:
        os.makedirs("ranks", exist_ok=True)
        env = dict(os.environ, PROBE_DIR=os.path.abspath("ranks"))
        cmd = train_dist.torchrun_command(2, "tests.support.gpu_probe")
        subprocess.run(cmd, check=True, env=env)
        ranks = [json.load(open(f"ranks/rank{r}.json")) for r in range(2)]
        record(output[0], ranks=ranks)
"""


@pytest.mark.slow
def test_concurrent_gpu_jobs_get_disjoint_gpus_and_a_two_gpu_job_runs_a_rank_per_gpu(
    cluster, tmp_path
):
    (tmp_path / "Snakefile").write_text(TOY)
    env = {**cluster.env(), "PYTHONPATH": f"{REPO / 'src'}:{REPO}", "OMP_NUM_THREADS": "1"}
    cmd = [SNAKEMAKE, "--workflow-profile", str(PROFILE), *FAST, "--jobs", "3"]
    # the one-GPU pair first, then the two-GPU job: submitted together, Slurm may queue the
    # two-GPU job between them and the pair never overlaps (seen on a loaded machine)
    for targets in (["one_1.json", "one_2.json"], ["two.json"]):
        proc = subprocess.run([*cmd, *targets], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-5000:] + cluster.diagnostics()
    one = [json.loads((tmp_path / f"one_{i}.json").read_text()) for i in (1, 2)]
    # both held their allocations at once (Slurm's own times; the node has two GPUs), on
    # different GPUs
    recs = [cluster.job(rec["job"]) for rec in one]
    assert recs[0]["StartTime"] < recs[1]["EndTime"], recs
    assert recs[1]["StartTime"] < recs[0]["EndTime"], recs
    assert {one[0]["gpus"], one[1]["gpus"]} == {"0", "1"}, one
    for rec in recs:
        assert "gpu:1" in rec.get("TresPerJob", "")
    two = json.loads((tmp_path / "two.json").read_text())
    assert "gpu:2" in cluster.job(two["job"]).get("TresPerJob", "")
    ranks = two["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world"] for r in ranks} == {2}
    assert len({r["pid"] for r in ranks}) == 2  # two processes
    assert sorted(r["gpu"] for r in ranks) == sorted(two["cuda"].split(",")) == ["0", "1"]
    assert all(r["slurm_job"] == two["job"] for r in ranks)  # inside the job's allocation


def test_profile_asks_for_memory_time_and_a_signal_before_the_limit():
    import yaml

    prof = yaml.safe_load((PROFILE / "config.yaml").read_text())
    assert prof["executor"] == "slurm" and prof["slurm-status-command"] == "squeue"
    assert {"mem_mb", "runtime"} <= set(prof["default-resources"])
    heavy = prof["set-resources"]
    for rule in ("extract_hidden_states", "train_draft", "serve_and_benchmark"):
        assert {"mem_mb", "runtime"} <= set(heavy[rule]), rule
    sig = re.search(r"--signal=TERM@(\d+)", heavy["train_draft"]["slurm_extra"])
    assert sig and int(sig.group(1)) < heavy["train_draft"]["runtime"] * 60
    # the rules it names exist, and no heavy rule is left to the defaults
    names = set(re.findall(r"^rule (\w+):", "".join(
        p.read_text() for p in (REPO / "workflow" / "rules").glob("*.smk")), re.M))  # fmt: skip
    assert set(heavy) <= names
