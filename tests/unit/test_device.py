"""The device driver (eagleflow.device): staging, the run's state, records and landing them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from eagleflow import bundle, device
from tests.unit.test_bundle import make_wheel


@pytest.fixture
def parts(tmp_path):
    wheels = [make_wheel(tmp_path / "w", "ef_dev_a", payload=1_500_000)]
    bundle.pack(wheels, tmp_path / "bundle", part_mib=1, meta={})
    return tmp_path / "bundle"


def _carry(parts: Path, dest: Path, names: list[str]) -> Path:
    """What one call carries: some parts and the manifest."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in dest.iterdir():
        f.unlink()
    for n in [*names, bundle.MANIFEST]:
        (dest / n).write_bytes((parts / n).read_bytes())
    return dest


def test_stage_over_calls_then_install(tmp_path, parts):
    home = tmp_path / "home"
    first = device.stage(_carry(parts, tmp_path / "c", ["part-000"]), home)
    assert first["copied"] == ["part-000", "manifest.json"] and first["missing"] == ["part-001"]
    with pytest.raises(bundle.BundleError, match="missing part"):
        bundle.install(home / "stage", home / "site")
    second = device.stage(_carry(parts, tmp_path / "c", ["part-001"]), home)
    assert second["missing"] == []
    rec = device.install(home)  # no configfile: no flag check
    assert rec["wheels"] == 1 and (home / "site" / "ef_dev_a").is_dir()
    assert rec["probe"]["torch"]  # what the machine has is recorded


def test_stage_without_manifest_says_what_to_carry(tmp_path):
    (tmp_path / "c").mkdir()
    with pytest.raises(device.DeviceError, match="carries the bundle's manifest.json"):
        device.stage(tmp_path / "c", tmp_path / "home")


def test_start_refuses_without_an_installed_site(tmp_path):
    with pytest.raises(device.DeviceError, match="stage every part and run `install` first"):
        device.start("r1", "config/examples/gpu.yaml", tmp_path / "home")


def _fake_run(home: Path, run: str, code: str | None, log: str = "") -> Path:
    rdir = device.run_dir(run, home)
    rdir.mkdir(parents=True)
    (rdir / "run.json").write_text(json.dumps({"started_unix": time.time() - 5}))
    (rdir / "snakemake.log").write_text(log)
    if code is not None:
        (rdir / "exitcode").write_text(code)
    else:
        (rdir / "pid").write_text(str(os.getpid()))  # a live process: running
    return rdir


def _members(path: Path) -> set[str]:
    with tarfile.open(path) as tar:
        return {m.name for m in tar.getmembers()}


def test_poll_sends_new_records_and_resends_what_was_not_landed(tmp_path):
    home = tmp_path / "home"
    rdir = _fake_run(home, "r1", None, "3 of 18 steps (17%) done\n")
    res = rdir / "results"
    (res / "train").mkdir(parents=True)
    (res / "train" / "summary.json").write_text("{}")
    (res / "train" / "weights.safetensors").write_bytes(b"x" * 10)  # never a record
    (res / "big.json").write_bytes(b" " * (device.RECORD_MAX_BYTES + 1))  # too big to travel
    (res / "data").mkdir()
    (res / "data" / "regenerated.jsonl").write_text("{}\n")  # a dataset, not a record
    (res / "data" / "regenerated.stats.json").write_text("{}")
    out1 = tmp_path / "o1"
    st = device.poll("r1", 0, 0, home, out1)
    assert st["state"] == "running" and st["progress"] == "3 of 18 steps (17%) done"
    got = _members(out1 / "records-001.tar.gz")
    assert "results/train/summary.json" in got and "snakemake.log" in got
    assert not any("safetensors" in m or "big.json" in m or m.endswith(".jsonl") for m in got)
    assert "results/data/regenerated.stats.json" in got
    # the reply of call 1 was lost (never landed, so not acknowledged): call 2 sends it again
    st = device.poll("r1", 0, 0, home, tmp_path / "o2")
    assert "results/train/summary.json" in _members(tmp_path / "o2" / "records-002.tar.gz")
    # call 2 landed: call 3 sends only what changed since
    (res / "new.csv").write_text("a\n")
    device.poll("r1", 0, 2, home, tmp_path / "o3")
    got = _members(tmp_path / "o3" / "records-003.tar.gz")
    assert "results/new.csv" in got and "results/train/summary.json" not in got


def test_states_failed_and_lost_say_what_to_run(tmp_path):
    home = tmp_path / "home"
    _fake_run(home, "bad", "1", "Error in rule train_draft:\n    jobid: 7\n")
    st = device.status("bad", home)
    assert st["state"] == "failed" and st["failed_rules"] == ["train_draft"]
    assert "results/logs/train_draft*.log" in st["message"] and "start" in st["message"]
    # a restart that fails elsewhere names only its own failed rule
    log = device.run_dir("bad", home) / "snakemake.log"
    log.write_text(log.read_text() + f"{device.START_MARKER} now\nError in rule export_draft:\n")
    assert device.status("bad", home)["failed_rules"] == ["export_draft"]
    assert device.status("ok", home)["state"] == "lost"
    _fake_run(home, "ok", "0")
    assert device.status("ok", home)["state"] == "succeeded"
    lost = device.status("gone", home)
    assert lost["state"] == "lost" and "Stage the parts again" in lost["message"]
    with pytest.raises(device.DeviceError, match="run name"):
        device.run_dir("../x", home)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


def _repo(repo: Path) -> Path:
    """An empty git repository to land into."""
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@t")
    _git(repo, "config", "user.name", "t")
    return repo


def test_land_commits_the_records_and_nothing_half(tmp_path):
    repo = _repo(tmp_path / "repo")
    (repo / "unrelated.txt").write_text("not staged by land\n")
    home = tmp_path / "home"
    rdir = _fake_run(home, "r1", "0")
    (rdir / "results" / "logs").mkdir(parents=True)
    (rdir / "results" / "logs" / "train_draft.log").write_text("trained\n")
    out = tmp_path / "out"
    device.poll("r1", 0, 0, home, out)
    st = device.land(out, "r1", repo=repo)
    assert st["state"] == "succeeded"
    landed = repo / "docs" / "results" / "r1"
    assert (landed / "results" / "logs" / "train_draft.log").read_text() == "trained\n"
    assert (landed / "device" / "status.json").is_file()
    assert "device records: r1, call 1 (succeeded)" in _git(repo, "log", "--format=%s")
    assert "unrelated.txt" in _git(repo, "status", "--short")  # only the records were committed
    # a broken reply lands nothing: no partial folder, the earlier records untouched
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "records-002.tar.gz").write_bytes(b"not a tarball")
    with pytest.raises(tarfile.TarError):
        device.land(bad, "r1", repo=repo)
    assert not list((repo / "docs" / "results").glob(".landing-*"))
    assert (landed / "results" / "logs" / "train_draft.log").is_file()


def test_plan_carries_one_part_a_call(parts, tmp_path):
    calls = device.plan(parts, "gpu-default", ["config/examples/gpu.yaml"])
    assert [c["carry"][0].rsplit("/", 1)[1] for c in calls[:-1]] == ["part-000", "part-001"]
    assert all(c["carry"][1].endswith("manifest.json") for c in calls[:-1])
    assert "install --configfile config/examples/gpu.yaml" in calls[-2]["command"]
    assert "start --run gpu-default" in calls[-2]["command"] and calls[-1].get("repeat")


def test_plan_refuses_a_call_over_what_a_call_takes_in(parts, monkeypatch):
    tree = device.tree_bytes(device.REPO)
    part = max(p.stat().st_size for p in parts.glob("part-*"))
    monkeypatch.setattr(device, "CALL_MAX_BYTES", tree + part // 2)
    with pytest.raises(device.DeviceError, match=r"takes .* MiB in .*PART_MIB="):
        device.plan(parts, "gpu-default", ["config/examples/gpu.yaml"])
    monkeypatch.setattr(device, "CALL_MAX_BYTES", tree + 4 * part)
    assert device.plan(parts, "gpu-default", ["config/examples/gpu.yaml"])


@pytest.mark.timeout(300)
def test_start_runs_the_real_workflow_in_its_own_session(tmp_path, parts):
    """The driver's start/poll around a real Snakemake (a dry run of the GPU overlay)."""
    home = tmp_path / "home"
    device.stage(_carry(parts, tmp_path / "c", ["part-000", "part-001"]), home)
    bundle.install(home / "stage", home / "site")
    info = device.start("dry", "config/examples/gpu.yaml", home, extra=["-n"])
    assert info["command"][1:3] == ["-m", "snakemake"]
    st = device.poll("dry", 240, 0, home, tmp_path / "out")
    assert st["state"] == "succeeded", (home / "runs" / "dry" / "snakemake.log").read_text()[-2000:]
    log = (home / "runs" / "dry" / "snakemake.log").read_text()
    assert "serve_and_benchmark" in log  # the overlay's jobs were planned
    sid = os.getsid(0)
    assert int((home / "runs" / "dry" / "pid").read_text()) != sid
    # Targets after `--` reach Snakemake as targets, not as --config entries (found on the lent
    # GPU: `--config` took them and Snakemake refused them as "name=value" pairs).
    target = home / "runs" / "dry" / "results" / "acceptance" / "standalone.json"
    device.start("dry", "config/examples/gpu.yaml", home, extra=[str(target), "-n"])
    st = device.poll("dry", 240, 0, home, tmp_path / "out2")
    last = (home / "runs" / "dry" / "snakemake.log").read_text().split(device.START_MARKER)[-1]
    assert st["state"] == "succeeded", last[-2000:]
    assert "check_acceptance" in last and "serve_and_benchmark" not in last


def test_main_exit_status_of_a_lost_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(device, "HOME", tmp_path / "home")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(
        device, "poll", lambda run, wait, ack: device.status(run, tmp_path / "home")
    )
    assert device.main(["poll", "--run", "x", "--wait", "0"]) == 2
    assert '"state": "lost"' in capsys.readouterr().out
    assert sys.executable


def test_resume_files_travel_between_holds_but_are_never_committed(tmp_path, monkeypatch):
    """A hold's regeneration resume files come back beside the records (until landed), land
    under .device/carry/<run>/ (not committed), and the next hold's start puts them in place."""
    repo = _repo(tmp_path / "repo")
    (repo / ".gitignore").write_text("/.device/\n")
    home = tmp_path / "home"
    rdir = _fake_run(home, "q", None)
    resume = rdir / "bulk" / device.CARRY_DIR / "abc.jsonl"
    resume.parent.mkdir(parents=True)
    resume.write_text('{"id": "p0"}\n' * 1000)
    st = device.poll("q", 0, 0, home, tmp_path / "o1")
    assert st["carry"]["sent"] and (tmp_path / "o1" / "carry-001.tar.gz").is_file()
    # not landed: sent again; landed: not again until the file grows
    device.poll("q", 0, 0, home, tmp_path / "o2")
    assert (tmp_path / "o2" / "carry-002.tar.gz").is_file()
    device.land(tmp_path / "o2", "q", repo=repo)
    carried = repo / ".device" / "carry" / "q" / device.CARRY_DIR / "abc.jsonl"
    assert carried.read_text() == resume.read_text()
    assert ".device" not in _git(repo, "show", "--stat", "HEAD")
    device.poll("q", 0, 2, home, tmp_path / "o3")
    assert not (tmp_path / "o3" / "carry-003.tar.gz").exists()
    with resume.open("a") as f:
        f.write('{"id": "p1"}\n')
    assert device.poll("q", 0, 3, home, tmp_path / "o4")["carry"]["files"] == 1
    # too big to travel: said, not sent
    monkeypatch.setattr(device, "CARRY_MAX_BYTES", 10)
    with resume.open("a") as f:
        f.write('{"id": "p2"}\n')
    st = device.poll("q", 0, 4, home, tmp_path / "o5")
    assert not st["carry"]["sent"] and "over" in st["carry"]["why"]
    assert not (tmp_path / "o5" / "carry-005.tar.gz").exists()
    # the next hold: a fresh machine gets them before Snakemake starts
    new_home = tmp_path / "home2"
    (new_home / "site").mkdir(parents=True)
    monkeypatch.setattr(device.subprocess, "Popen", _NoProcess)
    monkeypatch.setattr(device, "_commit", lambda: None)  # (git through subprocess.run)
    monkeypatch.setattr(device, "tree_bytes", lambda repo: 0)  # (git ls-files, likewise)
    info = device.start("q", "config/examples/gpu.yaml", new_home, carry_in=carried.parents[1])
    assert info["carried_in"] == ["abc.jsonl"]
    placed = device.run_dir("q", new_home) / "bulk" / device.CARRY_DIR / "abc.jsonl"
    assert placed.read_text() == carried.read_text()
    with pytest.raises(device.DeviceError, match="no regenerate/ folder"):
        device.start("q2", "config/examples/gpu.yaml", new_home, carry_in=tmp_path)
    calls = device.plan(
        _plan_bundle(tmp_path), "q", ["config/examples/gpu.yaml"], carry_in=carried.parents[1]
    )
    assert "--carry-in" in calls[-2]["command"] and len(calls[-2]["carry"]) == 3


class _NoProcess:
    """Stands in for the Snakemake process start (the run itself is tested above)."""

    pid = 0

    def __init__(self, *args, **kwargs):
        pass


def _plan_bundle(tmp_path: Path) -> Path:
    wheels = [make_wheel(tmp_path / "pw", "ef_plan", payload=10)]
    bundle.pack(wheels, tmp_path / "pb", part_mib=1, meta={})
    return tmp_path / "pb"
