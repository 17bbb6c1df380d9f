"""The remote-gpu profile against a real sshd: staging, reruns, cancel, failures, bulk, security.

The sshd (tests/support/sshd.py) runs in a mount namespace of its own with a tmpfs over
`remote_root`: whatever the GPU rules write there is visible only through ssh, so "it ran remotely"
is proven by the remote side, not assumed. The tiny pipeline (tests/support/tiny_pipeline.py: the
real rules, from prepare_target to extract_hidden_states, verify_layers and train_draft, on a tiny
random target; only regenerate's script is a stand-in, to spare a vLLM start) runs once, through the
literal `snakemake --profile remote-gpu`, with the profile installed by `eagleflow remote
install-profile` into a private XDG_CONFIG_HOME; the tests after it edit it in order. Its local
workdir has a space in its path and its remote dir a space and a `; touch INJECTED`. A toy workflow
with one waiting remote job serves the cancel, kill, connection-cut (sshd stopped and its sessions
killed, then started again in the same mount namespace) and failure tests.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagleflow.errors import RemoteError
from eagleflow.remote import agent as remote_agent
from eagleflow.remote import client as remote
from eagleflow.remote import jobs as remote_jobs
from eagleflow.remote import jobscript as remote_jobscript
from eagleflow.remote import settings as remote_settings
from eagleflow.remote import transport as remote_transport
from tests.conftest import SNAKEMAKE, copy_workflow
from tests.support.sshd import TestSshd

BIN = Path(sys.executable).parent
EAGLEFLOW = str(BIN / "eagleflow")
ACTIVATE = f". {shlex.quote(str(BIN / 'activate'))}"
# Non-local rules: the host runs them. train_draft asks for gpu=0 here (train.gpus 0, CPU) and
# still goes to the host, where its shards and checkpoints are, with no GPU: export_draft's case.
REMOTE_RULES = {
    "prepare_target",  # gpu=0: the target folder is where the GPU rules run
    "regenerate",
    "tokenize",  # gpu=0: it reads the target's tokenizer
    "extract_hidden_states",
    "verify_layers",
    "train_draft",
}
LOCAL_RULES = {"prepare_prompts", "vocab_map", "summarize_tiny"}
GPU0_RULES = {"prepare_target", "tokenize", "train_draft"}  # remote, no GPU
TIMINGS: dict[str, float] = {}


# ---------------------------------------------------------------------------------------------
# unit tests (no sshd)


def test_settings_env_overrides_and_refused_values(tmp_path):
    env = {
        "EAGLEFLOW_REMOTE_HOST": "gpu1",
        "EAGLEFLOW_REMOTE_PORT": "2222",
        "EAGLEFLOW_REMOTE_GPUS": "0,1,2",
        "EAGLEFLOW_REMOTE_ENV": "HF_HUB_OFFLINE=1,OMP_NUM_THREADS=4",
    }
    s = remote_settings.load_settings(environ=env)  # the shipped settings file, overridden
    assert (s.host, s.port, s.gpus) == ("gpu1", 2222, "0,1,2")
    assert s.env == {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "4"}
    assert s.origin["port"] == "EAGLEFLOW_REMOTE_PORT"
    text = remote_transport.ssh_config_text(s, tmp_path)
    assert "StrictHostKeyChecking yes" in text and "BatchMode yes" in text
    assert not re.search(r"StrictHostKeyChecking\s+(no|accept-new)", text)
    for key, value, why in [
        ("SSH_OPTIONS", "StrictHostKeyChecking=no", "host keys are always checked"),
        ("SSH_OPTIONS", "UserKnownHostsFile=/dev/null", "known_hosts"),
        ("HOST", "gpu1\n  ProxyCommand touch /tmp/x", "not a host"),
        ("IDENTITY", 'key"\n  ProxyCommand x', "refused"),
        ("HOST", "-oProxyCommand=x", "not a host"),
        ("PORT", "99999", "not a TCP port"),
    ]:
        with pytest.raises(RemoteError, match=why):
            remote_settings.load_settings(environ={**env, f"EAGLEFLOW_REMOTE_{key}": value})


def test_shared_connection_is_keyed_by_identity_and_known_hosts(tmp_path):
    base = {"EAGLEFLOW_REMOTE_HOST": "gpu1", "EAGLEFLOW_REMOTE_SSH_CONFIG": ""}
    paths = set()
    for extra in (
        {},
        {"EAGLEFLOW_REMOTE_IDENTITY": "/k2"},
        {"EAGLEFLOW_REMOTE_KNOWN_HOSTS": "/kh"},
    ):
        text = remote_transport.ssh_config_text(
            remote_settings.load_settings(environ={**base, **extra}), Path("/cm")
        )
        paths.add(re.search(r"ControlPath (\S+)", text).group(1))
    assert len(paths) == 3, "a login with other credentials must not reuse a connection"
    # a socket path too long for a Unix socket would break every ssh call: no sharing then
    text = remote_transport.ssh_config_text(
        remote_settings.load_settings(environ=base), tmp_path / ("d" * 60)
    )
    assert "ControlPath" not in text and "ControlMaster" not in text


HOSTILE = "/tmp/wd with space; touch INJECTED"


def _jobscript(workdir: str, configfile: str) -> str:
    props = {
        "type": "single",
        "rule": "extract",
        "input": ["results/a.json"],
        "output": ["results/b.json"],
        "log": ["results/logs/b.log"],
        "resources": {"gpu": 1},
        "params": {"serve": {"api_key": "s3cret-token"}},  # params stay on the laptop
        "jobid": 3,
    }
    args = [
        "--snakefile",
        "Snakefile",
        "--target-jobs",
        "extract:",
        "--wait-for-files",
        f"{workdir}/.snakemake/tmp.abc",
        f"{workdir}/results/a.json",
        "--configfiles",
        configfile,
        "config/config.yaml",
        "--cores",
        "2",
        "--mode",
        "remote",
    ]
    return (
        f"#!/bin/sh\n# properties = {json.dumps(props)}\ncd {shlex.quote(workdir)} && "
        f"python -m snakemake {shlex.join(args)} && exit 0 || exit 1\n"
    )


def test_jobscript_rewrite_keeps_hostile_paths_quoted(tmp_path):
    over = tmp_path / "over lay; rm -rf x.yaml"
    over.write_text("x: 1\n")
    js = remote_jobscript.parse_jobscript(_jobscript(HOSTILE, str(over)))
    assert js.workdir == Path(HOSTILE) and js.rule == "extract"
    args, stage = remote_jobscript.rewrite_args(js.args, js.workdir)
    assert not any(HOSTILE in a for a in args), "local paths must not reach the host"
    i = args.index("--wait-for-files")
    assert args[i + 1] == "results/a.json" and ".snakemake/tmp." not in " ".join(args)
    staged = args[args.index("--configfiles") + 1]
    assert staged.startswith(".snakemake/remote-gpu/configfiles/") and staged.endswith(over.name)
    assert (over, staged) in stage
    assert args[args.index("--cores") + 1] == "all"  # the host's cores, not the laptop's
    text = remote_jobscript.job_script_text(js, args)
    assert "s3cret-token" not in text and '"gpu": 1' in text
    cmd = text.strip().splitlines()[-1]
    assert shlex.split(cmd) == ["python", "-m", "snakemake", *args]  # one word per argument


def test_wait_for_files_file_is_inlined_with_host_paths(tmp_path):
    # above 20 files Snakemake lists them in a local file, which the host cannot read
    wd = tmp_path / "wd"
    listing = tmp_path / "jobscript.sh.waitforfilesfile.txt"
    files = [f"{wd}/.snakemake/tmp.x1"] + [f"{wd}/results/in{i}.json" for i in range(25)]
    listing.write_text("\n".join(files) + "\n")
    args, _ = remote_jobscript.rewrite_args(
        ["--wait-for-files-file", str(listing), "--nocolor"], wd
    )
    assert args == ["--wait-for-files", *[f"results/in{i}.json" for i in range(25)], "--nocolor"]


def test_bulk_refs_name_shard_roots_and_target_folders(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps({"root": "/data/x", "shards": [], "host": "h1"}))
    (tmp_path / "t.json").write_text(json.dumps({"path": "/models/t", "config_sha256": "0"}))
    (tmp_path / "other.json").write_text(json.dumps({"path": "/nope"}))
    refs = remote_jobs.bulk_refs(tmp_path, ["m.json", "t.json", "other.json", "missing.json"])
    assert [(r["path"], r.get("made_on")) for r in refs] == [("/data/x", "h1"), ("/models/t", None)]


def test_gpu_locks_are_exclusive_and_stale_ones_reclaimed(tmp_path):
    locks = str(tmp_path / "locks")
    host = remote_agent.socket.gethostname()
    a = remote_agent.try_lock_gpus(
        locks, ["0", "1"], 1, {"job": "a", "pid": os.getpid(), "host": host}
    )
    b = remote_agent.try_lock_gpus(
        locks, ["0", "1"], 1, {"job": "b", "pid": os.getpid(), "host": host}
    )
    assert (a, b) == (["0"], ["1"])
    assert (
        remote_agent.try_lock_gpus(locks, ["0", "1"], 1, {"job": "c", "pid": 1, "host": host})
        is None
    )
    remote_agent.release_gpus(locks, a, "a")
    # a lock whose owner died (SIGKILL: no release) is taken over
    dead = subprocess.Popen(["true"])
    dead.wait()
    remote_agent.release_gpus(locks, b, "b")
    assert remote_agent.try_lock_gpus(locks, ["0"], 1, {"job": "d", "pid": dead.pid, "host": host})
    assert remote_agent.try_lock_gpus(
        locks, ["0"], 1, {"job": "e", "pid": os.getpid(), "host": host}
    ) == ["0"]


def _wait_for(what, check, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def test_agent_attaches_the_same_work_and_refuses_other_work_on_the_same_outputs(tmp_path):
    # A killed Snakemake leaves its remote job running; a fresh submission (e.g. after
    # --rerun-incomplete) of the same work (same key) gets that job's id back and starts nothing;
    # one of other work (an edited script: another key) that writes the same outputs is refused
    # while the first runs; once it ends, it starts. The host's agent runs here in-process (it is
    # standard-library code, no ssh needed for this).
    base = {
        "remote_dir": str(tmp_path / "remote dir"),
        "gpus": "0,1",
        "gpu_lock_dir": str(tmp_path / "locks"),
        "activate": "true",
        "env": {},
        "require": [],
        "gpu": 1,
        "rule": "r",
        "wildcards": {"x": "1"},
        "outputs": ["out.txt"],
        "logs": [],
        "agent": remote_transport.AGENT_FILE.read_text(),
    }
    jobs = Path(base["remote_dir"]) / ".eagleflow" / "jobs"
    go = tmp_path / "go"
    wait = f"while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.1; done; echo old > out.txt\n"
    old = remote_agent.op_start({**base, "key": "k1", "job_id": "old", "job_script": wait})
    assert old["ok"] and "attached" not in old
    _wait_for("the old job", lambda: remote_agent._state(str(jobs / "old"))["state"] == "running")
    gpus = remote_agent._state(str(jobs / "old"))["gpus"]
    again = {**base, "key": "k1", "job_id": "again", "job_script": "echo again > out.txt\n"}
    assert remote_agent.op_find(again)["attach"]["id"] == "old"
    ans = remote_agent.op_start(again)
    assert ans["attached"]["id"] == "old" and ans["attached"]["gpus"] == gpus == ["0"]
    assert not (jobs / "again").exists()  # nothing new started
    owner = json.loads((tmp_path / "locks" / "gpu0" / "owner.json").read_text())
    assert owner["job"] == "old"  # it keeps its GPU
    edited = {**base, "key": "k2", "job_id": "edited", "job_script": "echo new > out.txt\n"}
    found = remote_agent.op_find(edited)
    assert found["attach"] is None and [c["id"] for c in found["conflict"]] == ["old"]
    refused = remote_agent.op_start(edited)
    assert not refused["ok"] and refused["conflict"][0]["rule"] == "r"
    assert not (jobs / "edited").exists()
    msg = remote_jobs._conflict_message(
        remote_settings.Settings(), "gpu1", "r", refused["conflict"]
    )
    assert "old (rule r, running since" in msg and "eagleflow remote cancel old" in msg
    go.touch()
    _wait_for(
        "the old job's end", lambda: remote_agent._state(str(jobs / "old"))["state"] == "success"
    )
    # finished while nobody collected it: the same work still attaches (its outputs get pulled)
    assert remote_agent.op_find(again)["attach"]["id"] == "old"
    remote_agent.op_status({**base, "ids": ["old"]})  # a Snakemake saw it end: collected
    assert remote_agent.op_find(again)["attach"] is None
    new = remote_agent.op_start(edited)  # nothing runs now: the other work starts
    assert new["ok"] and "attached" not in new
    _wait_for(
        "the new job", lambda: remote_agent._state(str(jobs / "edited"))["state"] == "success"
    )
    assert (Path(base["remote_dir"]) / "out.txt").read_text() == "new\n"
    # an uncollected success whose outputs a later job rewrote is not the same outputs any more
    st = json.loads((jobs / "old" / "state.json").read_text())
    st.pop("collected")
    (jobs / "old" / "state.json").write_text(json.dumps(st))
    assert remote_agent.op_find(again)["attach"] is None


def test_job_key_changes_with_params_inputs_and_wildcards_only(tmp_path):
    (tmp_path / "in.txt").write_text("a")
    props = {
        "type": "single",
        "rule": "r",
        "input": ["in.txt"],
        "output": ["out/q.txt"],
        "wildcards": {"x": "q"},
        "params": {"code": "abc", "n": 3},
        "resources": {"gpu": 1},
        "jobid": 4,
    }

    def key(**over):
        js = remote_jobscript.JobScript({**props, **over}, tmp_path, [])
        return remote_jobscript.job_key(js)

    k = key()
    assert key(jobid=9, resources={"gpu": 2}) == k  # another run's job number, GPU count
    assert key(params={"code": "abd", "n": 3}) != k  # an edited script (its code hash)
    assert key(wildcards={"x": "r"}) != k
    (tmp_path / "in.txt").write_text("b")
    assert key() != k  # an input's content


# ---------------------------------------------------------------------------------------------
# fixtures with a real sshd


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = TestSshd(tmp_path_factory.mktemp("sshd")).start()
    yield server
    # end job processes the tests may have left, by pid, before sshd goes
    for line in _marked_processes(server):  # all of them
        server.ssh(f"kill -9 {line.split()[0]}", check=False)
    server.stop()


def _env(sshd: TestSshd, remote_dir: str, workdir: Path, xdg: Path | None = None, **over):
    env = dict(
        os.environ,
        PYTHONPATH=str(workdir / "src"),
        EAGLEFLOW_REMOTE_ACTIVATE=ACTIVATE,
        EAGLEFLOW_REMOTE_ENV="HF_HUB_OFFLINE=1,HF_DATASETS_OFFLINE=1",  # the env setting
    )
    env.update(sshd.env(remote_dir, **over))
    if xdg is not None:
        env["XDG_CONFIG_HOME"] = str(xdg)
    env.pop("SNAKEMAKE_PROFILE", None)
    return env


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = 300, check: bool = True):
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    proc.seconds = time.monotonic() - start
    if check and proc.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _jobs(env: dict) -> list[dict]:
    """Job records on the remote side (read through ssh by the agent)."""
    return remote.list_jobs(remote_settings.load_settings(environ=env), last=1000)


def _ran(out: str) -> set[str]:
    return set(re.findall(r"^\S*rule (\w+):", out, flags=re.M))


def _marked_processes(
    sshd: TestSshd, env: dict | None = None, ids: list[str] | None = None
) -> list[str]:
    """Live processes of remote jobs (the agent marks them in their environment), as
    "pid cmdline" lines; only the jobs of `env`'s remote dir (or the jobs `ids`) when given.
    Zombies have an empty environ and do not count."""
    grep = f"grep -qs '^{remote_agent.JOB_ENV}='"
    if env is not None or ids is not None:
        ids = ids if ids is not None else [j["id"] for j in _jobs(env)["jobs"]]
        marks = [f"{remote_agent.JOB_ENV}={i}" for i in ids] or ["-"]
        grep = "grep -qsxF " + " ".join(f"-e {shlex.quote(n)}" for n in marks)
    script = (
        f"for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f 2>/dev/null | "
        f"{grep} || continue; "
        'p=${f#/proc/}; p=${p%/environ}; echo "$p $(tr "\\0" " " < /proc/$p/cmdline)"; done'
    )
    return sshd.ssh(script, check=False).stdout.splitlines()


@pytest.fixture(scope="module")
def tiny(sshd, tmp_path_factory):
    """The tiny pipeline run once through the literal `snakemake --profile remote-gpu`."""
    from tests.support.tiny_pipeline import TARGETS, make_tiny_pipeline

    base = tmp_path_factory.mktemp("tiny")
    workdir = base / "tiny wf"
    workdir.mkdir()
    copy_workflow(workdir)
    # the target exists on both machines at the same path, as two separate copies: the local
    # one under remote_root (hidden from the remote by the tmpfs), the remote one pushed there
    target = sshd.remote_root / "models" / "tiny target"
    overlay = make_tiny_pipeline(base / "inputs", workdir, target)
    rsync_e = shlex.join(sshd.ssh_base()[:-1])
    subprocess.run(
        ["rsync", "-rlt", "--mkpath", "-e", rsync_e, f"{target}/", f"root@127.0.0.1:{target}/"],
        check=True,
    )
    remote_dir = str(sshd.remote_root / "tiny work; touch INJECTED")
    xdg = base / "xdg"
    env = _env(sshd, remote_dir, workdir, xdg)
    # the repository's eagleflow (the copy has no profiles/): what a user's checkout runs
    repo_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    link = _run([EAGLEFLOW, "remote", "install-profile"], workdir, repo_env)
    assert (xdg / "snakemake" / "remote-gpu").resolve() == remote_settings.PROFILE_DIR
    cmd = [SNAKEMAKE, "--profile", "remote-gpu", *TARGETS, "--configfile", str(overlay)]
    proc = _run(cmd, workdir, env, timeout=600)
    TIMINGS["full run (s)"] = proc.seconds
    yield SimpleNamespace(
        workdir=workdir,
        env=env,
        cmd=cmd,
        overlay=overlay,
        remote_dir=remote_dir,
        proc=proc,
        target=target,
        link=link,
        base=base,
        repo_env=repo_env,
    )
    remote_transport.Remote(remote_settings.load_settings(environ=env)).close()


@pytest.fixture(scope="module", autouse=True)
def _report_timings():
    """The measured figures (README's), printed at the end (pytest -s) and written to
    $EAGLEFLOW_REMOTE_TIMINGS when set."""
    yield
    if TIMINGS:
        print("\nremote-gpu timings: " + ", ".join(f"{k} {v:.2f}" for k, v in TIMINGS.items()))
        if os.environ.get("EAGLEFLOW_REMOTE_TIMINGS"):
            Path(os.environ["EAGLEFLOW_REMOTE_TIMINGS"]).write_text(json.dumps(TIMINGS, indent=1))


# ---------------------------------------------------------------------------------------------
# the tiny pipeline through the profile (in order: each test leaves it complete)


@pytest.mark.slow
def test_full_run_gpu_rules_remote_cpu_rules_local_outputs_back(tiny, sshd):
    out = tiny.proc.stdout + tiny.proc.stderr
    assert "Using profile" in out and "remote-gpu" in out
    assert _ran(out) == REMOTE_RULES | LOCAL_RULES
    assert set(re.findall(r"^localrule (\w+):", out, flags=re.M)) == LOCAL_RULES
    ans = _jobs(tiny.env)
    # proven from the remote side: the host's job records hold exactly the non-local rules, the
    # gpu=1 ones with one GPU index each, the gpu=0 ones (prepare_target, tokenize, and
    # train_draft with train.gpus 0) with none; all finished
    assert sorted(j["rule"] for j in ans["jobs"]) == sorted(REMOTE_RULES)
    for job in ans["jobs"]:
        gpus = [] if job["rule"] in GPU0_RULES else ["0"]
        assert job["state"] == "success" and job["gpus"] == gpus, job
    assert not any(ans["procs"].values()) and not ans["locks"], "processes or GPU locks left"
    assert _marked_processes(sshd, tiny.env) == []
    # the stand-in regenerate ran in the remote dir (a tmpfs only the sshd's namespace sees)
    stats = json.loads((tiny.workdir / "results/data/regenerated.stats.json").read_text())
    assert stats["cwd"] == tiny.remote_dir and stats["cuda_visible_devices"] == "0"
    assert stats["remote_job"].split("-")[2] == "regenerate" and stats["hf_hub_offline"] == "1"
    # outputs came back with the right contents
    res = tiny.workdir / "results"
    cert = json.loads((res / "layers/layers.certificate.json").read_text())
    assert cert["passed"] is True and cert["aux_layers"] == [1, 2, 3]
    man = json.loads((res / "extract/manifest.json").read_text())
    assert man["num_shards"] == 6 and man["root"].startswith(tiny.remote_dir + "/results/bulk/")
    # the real train_draft ran on the host, on its CPU, from the shards in place there
    train = json.loads((res / "train/summary.json").read_text())
    assert train["steps"] == 4 and train["settings"]["cpu"] is True
    assert train["run_dir"].startswith(tiny.remote_dir + "/results/bulk/checkpoints/")
    assert "step" in (res / "train/metrics.csv").read_text().splitlines()[0]
    summary = json.loads((res / "tiny/summary.json").read_text())
    assert summary == {
        "title": "tiny",
        "shards": 6,
        "root": man["root"],
        "cert_keys": sorted(cert),
        "train_steps": 4,
        "train_device": train["device"],
    }
    for name in REMOTE_RULES:
        assert "done in" in (res / "logs" / f"{name}.log").read_text()  # logs came back
    for name in ("extract_hidden_states", "train_draft"):
        assert (res / f"benchmarks/{name}.tsv").read_text().startswith("s\t")
    staging = re.findall(r"staged in ([\d.]+) s", out)
    pulls = re.findall(r"pulled \d+ bytes in ([\d.]+) s", out)
    assert len(staging) == len(pulls) == len(REMOTE_RULES)
    TIMINGS["per-job staging: submit (s, mean)"] = sum(map(float, staging)) / len(staging)
    TIMINGS["per-job staging: pull (s, mean)"] = sum(map(float, pulls)) / len(pulls)
    for job in ans["jobs"]:  # on the host: the job's Snakemake start-up plus its script
        TIMINGS[f"on the host: {job['rule']} (s)"] = job["finished"] - job["started"]


@pytest.mark.slow
def test_bulk_stays_remote_local_side_holds_manifests(tiny, sshd):
    from eagleflow.extract.manifest import ManifestError, load_manifest

    local_shards = [p for p in tiny.workdir.rglob("*.safetensors")]
    assert local_shards == [], f"shards were pulled: {local_shards[:3]}"
    assert not (tiny.workdir / "results/bulk").exists()
    local_view = {p.name for p in sshd.remote_root.iterdir()}
    assert local_view <= {"models", "laptop-bulk"}  # the local view: no remote dirs at all
    man = json.loads((tiny.workdir / "results/extract/manifest.json").read_text())
    listing = sshd.ssh(f"ls {shlex.quote(man['root'])}").stdout.split()
    assert len([n for n in listing if n.startswith("hs_")]) == 6  # ... they are on the host
    with pytest.raises(ManifestError, match=r"is not on this host .*written on"):
        load_manifest(tiny.workdir / "results/extract/manifest.json")
    # the training checkpoints too: on the host, not here
    run_dir = json.loads((tiny.workdir / "results/train/summary.json").read_text())["run_dir"]
    assert not Path(run_dir).exists()
    found = sshd.ssh(f"find {shlex.quote(run_dir)} -name model.safetensors").stdout.split()
    assert found, f"no checkpoint under {run_dir} on the host"


@pytest.mark.slow
def test_no_quoting_break_no_injection_no_secrets(tiny, sshd):
    # wherever a broken quote would have run `touch INJECTED`: the remote home (ssh's and the
    # agent's cwd), the remote dir's parent and the job cwd (inside remote_root), /tmp
    found = sshd.ssh(
        f"find ~ /tmp -maxdepth 2 -name INJECTED 2>/dev/null; "
        f"find {sshd.remote_root} -name INJECTED",
        check=False,
    ).stdout
    assert found.strip() == ""
    assert not list(Path("/").glob("*/INJECTED")) and not list(tiny.base.rglob("INJECTED"))
    key = (sshd.keys / "client_key").read_text().splitlines()[1]  # a line of the private key
    q = shlex.quote(tiny.remote_dir)
    remote_hits = sshd.ssh(f"grep -rlF -e {shlex.quote(key)} -e 'PRIVATE KEY' {q}", check=False)
    assert remote_hits.stdout.strip() == "", "key material in a remote job file or log"
    for f in [*(tiny.workdir / "results").rglob("*"), *(tiny.workdir / ".snakemake").rglob("*")]:
        if f.is_file() and f.stat().st_size < 10 << 20:
            data = f.read_bytes()
            assert key.encode() not in data and b"PRIVATE KEY" not in data, f
    cfg = remote_transport.Remote(
        remote_settings.load_settings(environ=tiny.env)
    ).config.read_text()
    assert "StrictHostKeyChecking yes" in cfg and "PRIVATE" not in cfg


@pytest.mark.slow
def test_no_change_runs_nothing(tiny):
    before = len(_jobs(tiny.env)["jobs"])
    dry = _run([*tiny.cmd, "-n"], tiny.workdir, tiny.env)
    TIMINGS["no-op dry run through the profile (s)"] = dry.seconds
    proc = _run(tiny.cmd, tiny.workdir, tiny.env)
    TIMINGS["no-op run through the profile (s)"] = proc.seconds
    for p in (dry, proc):
        assert "Nothing to be done" in p.stdout + p.stderr
    assert len(_jobs(tiny.env)["jobs"]) == before


def _scheduled(tiny, *extra: str) -> set[str]:
    return _ran(_run([*tiny.cmd, *extra, "-n"], tiny.workdir, tiny.env).stdout)


def _job_pids(sshd: TestSshd, job_id: str) -> list[str]:
    return [line.split()[0] for line in _marked_processes(sshd, ids=[job_id])]


@pytest.mark.slow
def test_gpu_script_edit_reruns_downstream_remotely_and_a_killed_snakemake_reattaches(tiny, sshd):
    """A content edit of extraction's script reruns exactly it and what follows, remotely. The
    local Snakemake is killed (-9) while that real extraction runs on the host (held there with
    SIGSTOP so it is surely still running); the next run (--rerun-incomplete: Snakemake forgets
    the job, submits it again) attaches to it by its key: one extraction ran, one start line."""
    script = tiny.workdir / "workflow/scripts/extract_hidden_states.py"  # a gpu=1 rule's script
    st = script.stat()
    script.write_text(script.read_text() + "\n_EDITED = 1  # an edit of behaviour\n")
    os.utime(script, ns=(st.st_atime_ns, st.st_mtime_ns))  # old mtime: only the hash sees it
    downstream = {"extract_hidden_states", "verify_layers", "train_draft", "summarize_tiny"}
    assert _scheduled(tiny) == downstream  # not tokenize, vocab_map, regenerate, ...
    remote_log = f"{shlex.quote(tiny.remote_dir)}/results/logs/extract_hidden_states.log"
    sshd.ssh(f"rm -f {remote_log}")
    before = {j["id"] for j in _jobs(tiny.env)["jobs"]}
    t0 = time.monotonic()
    out1 = tiny.base / "killed.out"
    proc = subprocess.Popen(
        tiny.cmd, cwd=tiny.workdir, env=tiny.env, stdout=open(out1, "w"), stderr=subprocess.STDOUT
    )

    def extraction():
        new = [j for j in _jobs(tiny.env)["jobs"] if j["id"] not in before]
        return [j for j in new if j["rule"] == "extract_hidden_states" and j["state"] == "running"]

    job = _wait_for("extraction running on the host", extraction, 120)[0]
    _wait_for(
        "its start line",
        lambda: "started on" in sshd.ssh(f"cat {remote_log}", check=False).stdout,
        60,
    )
    pids = _job_pids(sshd, job["id"])
    assert pids, "no process of the extraction job"
    sshd.ssh(f"kill -STOP {' '.join(pids)}")
    proc.kill()  # SIGKILL: no cancel, no cleanup; the remote job keeps running
    proc.wait()
    _run([*tiny.cmd, "--unlock"], tiny.workdir, tiny.env)
    t1 = time.monotonic()
    rerun = subprocess.Popen(
        [*tiny.cmd, "--rerun-incomplete"],
        cwd=tiny.workdir,
        env=tiny.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = ""
    for line in rerun.stdout:
        out += line
        if f"attached to {job['id']}" in line:
            TIMINGS["attach on restart: run start to attached (s)"] = time.monotonic() - t1
            m = re.search(r"in ([\d.]+) s\)", line)
            TIMINGS["attach on restart: the submit call (s)"] = float(m.group(1))
            sshd.ssh(f"kill -CONT {' '.join(pids)}")
    assert rerun.wait() == 0, out
    assert f"attached to {job['id']}" in out, out
    TIMINGS["edit + kill -9 + reattach, until done (s)"] = time.monotonic() - t0
    assert _ran(out) == downstream
    new = [j for j in _jobs(tiny.env)["jobs"] if j["id"] not in before]
    assert sorted(j["rule"] for j in new) == [
        "extract_hidden_states",
        "train_draft",
        "verify_layers",
    ]
    assert all(j["state"] == "success" for j in new)
    log = sshd.ssh(f"cat {remote_log}").stdout
    assert log.count("extract_hidden_states started on") == 1, log
    local = (tiny.workdir / "results/logs/extract_hidden_states.log").read_text()
    assert local.count("started on") == 1 and "done in" in local
    man = json.loads((tiny.workdir / "results/extract/manifest.json").read_text())
    listing = sshd.ssh(f"ls {shlex.quote(man['root'])}").stdout.split()
    assert man["num_shards"] == 6 == len([n for n in listing if n.startswith("hs_")])
    assert json.loads((tiny.workdir / "results/layers/layers.certificate.json").read_text())[
        "passed"
    ]
    assert _marked_processes(sshd, tiny.env) == []


@pytest.mark.slow
def test_local_config_change_reruns_only_local_rules(tiny, tmp_path):
    overlay = tmp_path / "title.yaml"
    overlay.write_text("report:\n  title: renamed\n")
    extra = ("--configfile", str(tiny.overlay), str(overlay))
    cmd = [*tiny.cmd[: tiny.cmd.index("--configfile")], *extra]
    assert _ran(_run([*cmd, "-n"], tiny.workdir, tiny.env).stdout) == {"summarize_tiny"}
    before = len(_jobs(tiny.env)["jobs"])
    proc = _run(cmd, tiny.workdir, tiny.env)
    assert _ran(proc.stdout + proc.stderr) == {"summarize_tiny"}
    assert len(_jobs(tiny.env)["jobs"]) == before, "a local-only change submitted remote jobs"
    assert (
        json.loads((tiny.workdir / "results/tiny/summary.json").read_text())["title"] == "renamed"
    )


@pytest.mark.slow
def test_export_draft_runs_on_the_host_without_gpu(tiny):
    # export_draft is not a localrule and asks for gpu=0: the profile sends it to the host (it
    # reads the best checkpoint there) and the host gives it no GPU; both exports come back
    before = {j["id"] for j in _jobs(tiny.env)["jobs"]}
    cmd = [*tiny.cmd[:3], "export_draft", *tiny.cmd[-2:]]
    proc = _run(cmd, tiny.workdir, tiny.env)
    out = proc.stdout + proc.stderr
    assert re.search(r"^rule export_draft:$", out, flags=re.M), out  # "localrule" if local
    new = [j for j in _jobs(tiny.env)["jobs"] if j["id"] not in before]
    assert [(j["rule"], j["gpus"], j["state"]) for j in new] == [("export_draft", [], "success")]
    for fmt in ("speculators", "sglang"):
        assert (tiny.workdir / "results/export" / fmt / "config.json").is_file(), fmt
    assert "done in" in (tiny.workdir / "results/logs/export_draft.log").read_text()


@pytest.mark.slow
def test_remote_check_reports_what_is_missing(tiny):
    proc = _run([EAGLEFLOW, "remote", "check"], tiny.workdir, tiny.repo_env, check=False)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert re.search(r"^OK +ssh: root@127\.0\.0\.1:\d+ is ", out, flags=re.M)
    assert re.search(r"^OK +python: 3\.\d+", out, flags=re.M)
    assert re.search(r"^MISSING torch GPUs: torch .* sees 0 GPU\(s\), needs >= 1$", out, re.M)
    assert re.search(r"^MISSING sglang: not importable \(ModuleNotFoundError", out, flags=re.M)
    assert "fix: make remote-setup" in out
    assert out.strip().splitlines()[-1].endswith("missing: torch GPUs, sglang")
    assert re.search(r"^OK +rsync on the host: version 3", out, flags=re.M)
    dry = _run([EAGLEFLOW, "remote", "setup", "--dry-run"], tiny.workdir, tiny.repo_env).stdout
    assert "pip install -e '.[gpu-host]'" in dry and "-m venv .venv" in dry
    status = _run([EAGLEFLOW, "remote", "status"], tiny.workdir, tiny.repo_env).stdout
    assert re.search(r"^  success +verify_layers +- +started ", status, flags=re.M), status
    # GPU use (this host has no nvidia-smi) and the data root's usage per stage, from the host
    assert "GPUs:\n  nvidia-smi not found on this host" in status
    assert f"data root {tiny.remote_dir}/results/bulk:" in status
    for stage in ("extract/", "checkpoints/"):
        assert re.search(rf"^  {stage} +[\d.]+ (KiB|MiB)$", status, flags=re.M), status
    extract = status.split("  extract/", 1)[1].split("\n  checkpoints/", 1)[0]
    files = [int(n) for n in re.findall(r"^    \S+ +[\d.]+ \S+  (\d+) files$", extract, re.M)]
    assert files and max(files) >= 6, status  # the 6 shards of the current extraction


# ---------------------------------------------------------------------------------------------
# a toy workflow for cancel, kill, failures and bulk checks (fast remote jobs)

TOY = r"""
rule wait_for_go:
    output: "res/waited.txt"
    log: "res/logs/wait.log"
    resources: gpu=1
    shell:
        "for i in $(seq 900); do [ -e go ] && break; sleep 0.1; done; "
        "[ -e go ] && echo ran > {output}"

rule slow_log:
    output: "res/slow.txt"
    log: "res/logs/slow.log"
    resources: gpu=1
    shell:
        "echo first line > {log}; "
        "for i in $(seq 900); do [ -e go ] && break; sleep 0.1; done; echo second line >> {log}; "
        "for i in $(seq 900); do [ -e go2 ] && break; sleep 0.1; done; echo last line >> {log}; "
        "echo ok > {output}"

rule local_manifest:
    output: "res/local.manifest.json"
    localrule: True
    run:
        import json, os
        root = config["local_bulk"]  # a folder the GPU host cannot see
        os.makedirs(root, exist_ok=True)
        json.dump({"root": root, "host": "laptop", "shards": [{"path": "hs_0.safetensors",
                   "bytes": 1, "sha256": "0"}]}, open(output[0], "w"))

rule needs_bulk:
    input: rules.local_manifest.output
    output: "res/bulk_used.txt"
    resources: gpu=1
    shell: "cp {input} {output}"
"""


@pytest.fixture
def toy(sshd, tmp_path):
    workdir = tmp_path / "toy wf"
    workdir.mkdir()
    (workdir / "Snakefile").write_text(TOY)
    remote_dir = str(sshd.remote_root / f"toy-{tmp_path.name}")
    env = _env(sshd, remote_dir, workdir, EAGLEFLOW_REMOTE_SOURCES="Snakefile")
    # the profile by its path (the lookup is the tiny fixture's test); status checks every
    # second instead of 2 s: these tests measure no per-job figure and wait for many job ends
    cmd = [
        SNAKEMAKE,
        "--profile",
        str(remote_settings.PROFILE_DIR),
        "--seconds-between-status-checks",
        "1",
    ]
    return SimpleNamespace(workdir=workdir, env=env, cmd=cmd, remote_dir=remote_dir)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(toy, *targets: str) -> tuple[subprocess.Popen, Path]:
    log = toy.workdir.parent / f"snakemake-{time.monotonic_ns()}.out"
    proc = subprocess.Popen(
        [*toy.cmd, *targets],
        cwd=toy.workdir,
        env=toy.env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        # Ctrl-C as a user's shell delivers it. A suite started as a background job of a
        # non-interactive shell (`make test &` in a script, some CI runners) has SIGINT ignored,
        # and children inherit that: Snakemake was then deaf to SIGINT and ran its job to the end
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + 120
    while "Submitted job" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    return proc, log


def _wait_running(toy, sshd) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        jobs = _jobs(toy.env)["jobs"]
        if jobs and jobs[-1]["state"] == "running" and _marked_processes(sshd, toy.env):
            return jobs[-1]
        time.sleep(0.3)
    raise AssertionError(f"remote job did not start: {_jobs(toy.env)}")


def _ctrl_c(toy, sshd, *extra: str) -> dict:
    """Start the waiting job, Ctrl-C Snakemake once it runs remotely; no remote process left."""
    proc, _log = _start(toy, "res/waited.txt", *extra)
    job = _wait_running(toy, sshd)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    assert proc.wait(timeout=180) != 0  # a bound on a hang (it takes seconds; TIMINGS has it)
    name = "missed by Snakemake's cancel" if extra else "Snakemake's cancel"
    TIMINGS[f"Ctrl-C to local exit, {name} (s)"] = time.monotonic() - t0
    deadline = time.monotonic() + 15
    while _marked_processes(sshd, toy.env) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _marked_processes(sshd, toy.env) == [], "remote processes survived the cancel"
    TIMINGS[f"Ctrl-C to no remote process, {name} (s)"] = time.monotonic() - t0
    ans = _jobs(toy.env)
    assert ans["jobs"][-1]["state"] == "cancelled" and not ans["locks"]
    return job


@pytest.mark.slow
def test_ctrl_c_leaves_no_remote_process_and_rerun_completes(toy, sshd):
    job = _ctrl_c(toy, sshd)
    # a later run resumes the job Snakemake has on record: it is started again and finishes
    sshd.ssh(f"touch {shlex.quote(toy.remote_dir)}/go")
    rerun = _run([*toy.cmd, "res/waited.txt"], toy.workdir, toy.env)
    TIMINGS["rerun after Ctrl-C, job restarted (s)"] = rerun.seconds
    assert f"restarted {job['id']}" in rerun.stderr + rerun.stdout
    assert (toy.workdir / "res/waited.txt").read_text() == "ran\n"
    assert _marked_processes(sshd, toy.env) == []


@pytest.mark.slow
def test_ctrl_c_cancels_even_when_snakemakes_cancel_call_misses_the_job(toy, sshd):
    # Snakemake passes the cancel command no job while a status round holds them; the run's
    # watcher cancels what the run left when Snakemake ends. Here Snakemake's cancel does nothing.
    _ctrl_c(toy, sshd, "--cluster-generic-cancel-cmd", "true")


@pytest.mark.slow
def test_killed_snakemake_then_rerun_resumes_the_remote_job(toy, sshd):
    proc, log = _start(toy, "res/waited.txt")
    job = _wait_running(toy, sshd)
    proc.kill()  # SIGKILL: no cancel; the remote job keeps running
    proc.wait()
    assert _jobs(toy.env)["jobs"][-1]["state"] == "running"
    sshd.ssh(f"touch {shlex.quote(toy.remote_dir)}/go")  # it finishes while nobody watches
    _run([*toy.cmd, "--unlock"], toy.workdir, toy.env)  # a SIGKILLed Snakemake leaves its lock
    rerun = _run([*toy.cmd, "res/waited.txt"], toy.workdir, toy.env)
    out = rerun.stdout + rerun.stderr
    assert f"Resuming incomplete job 0 with external jobid '{job['id']}'" in out
    assert (toy.workdir / "res/waited.txt").read_text() == "ran\n"
    assert [j["id"] for j in _jobs(toy.env)["jobs"]] == [job["id"]]  # not run twice
    assert _marked_processes(sshd, toy.env) == []


def _cut_while_running(toy, sshd, restore_when, **env) -> tuple[subprocess.Popen, Path, dict]:
    """Start the waiting job; once it runs remotely, cut the connection (sshd stopped, its
    sessions killed) until `restore_when(proc, log)` is true, then bring sshd back."""
    toy.env.update(env)
    proc, log = _start(toy, "res/waited.txt")
    job = _wait_running(toy, sshd)
    # `eagleflow remote status` shows the running job, its rule and GPU
    status = _run([EAGLEFLOW, "remote", "status", "--running"], toy.workdir, toy.env).stdout
    assert re.search(rf"^  running +wait_for_go .* gpus=0 .*{job['id']}$", status, re.M), status
    sshd.cut()
    cut_at = time.monotonic()
    try:
        _wait_for(
            "the moment to restore sshd",
            lambda: restore_when(proc, log, time.monotonic() - cut_at),
            60,
        )
    finally:
        sshd.restore()
    return proc, log, job


@pytest.mark.slow
def test_connection_cut_longer_than_a_status_interval_then_back(toy, sshd):

    def failed_and_5_s(proc, log, cut_for):  # longer than several status intervals (1 s here)
        return proc.poll() is not None or ("unknown for now" in log.read_text() and cut_for > 5)

    proc, log, job = _cut_while_running(toy, sshd, failed_and_5_s)
    assert proc.poll() is None, log.read_text()  # within the grace period: still waiting
    sshd.ssh(f"touch {shlex.quote(toy.remote_dir)}/go")
    assert proc.wait(timeout=120) == 0, log.read_text()
    out = log.read_text()
    fails = re.findall(rf"status of {job['id']} unknown for now \(check (\d+) failed", out)
    assert len(fails) >= 2 and "cannot reach the GPU host" in out, out
    TIMINGS["connection cut for 5 s: failed status checks"] = len(fails)
    assert (toy.workdir / "res/waited.txt").read_text() == "ran\n"
    assert [j["id"] for j in _jobs(toy.env)["jobs"]] == [job["id"]]  # no second copy
    assert _marked_processes(sshd, toy.env) == []


@pytest.mark.slow
def test_contact_lost_past_the_grace_period_fails_clearly_and_a_rerun_attaches(toy, sshd):
    # the connection stays cut until Snakemake has given the job up
    proc, log, job = _cut_while_running(
        toy,
        sshd,
        lambda proc, _log, _s: proc.poll() is not None,
        EAGLEFLOW_REMOTE_STATUS_GRACE_S="3",
    )
    assert proc.wait() != 0
    out = log.read_text()
    assert f"lost contact with root@127.0.0.1:{sshd.port}" in out, out
    assert "status_grace_s = 3" in out and "was not cancelled and may still run" in out
    assert not (toy.workdir / "res/waited.txt").exists()  # nothing local looks complete
    assert _jobs(toy.env)["jobs"][-1]["state"] == "running"  # a lost connection is no cancel
    sshd.ssh(f"touch {shlex.quote(toy.remote_dir)}/go")
    rerun = _run([*toy.cmd, "res/waited.txt"], toy.workdir, toy.env)
    assert f"attached to {job['id']}" in rerun.stdout + rerun.stderr
    TIMINGS["rerun that attaches to a job that finished meanwhile (s)"] = rerun.seconds
    assert (toy.workdir / "res/waited.txt").read_text() == "ran\n"
    assert [j["id"] for j in _jobs(toy.env)["jobs"]] == [job["id"]]  # not run twice


def _status_seconds(job_id: str, settings, workdir: Path, n: int = 6) -> tuple[float, float]:
    """Mean seconds of one status call for a running job: (no log mirror, a log mirror each
    time), interleaved so that neither gets the warmer connection."""
    took = {0: 0.0, 1: 0.0}
    for i in range(2 * n):
        settings.log_mirror_s = i % 2
        remote_jobs._mirror_file(workdir, job_id).unlink(
            missing_ok=True
        )  # due: the whole log again
        t0 = time.monotonic()
        assert remote_jobs.status(job_id, settings, workdir)[0] == "running"
        took[i % 2] += time.monotonic() - t0
    return took[0] / n, took[1] / n


@pytest.mark.slow
def test_live_log_mirrored_while_running_and_remote_logs_follow(toy, sshd, tmp_path, monkeypatch):
    toy.env["EAGLEFLOW_REMOTE_LOG_MIRROR_S"] = "1"
    local_log = toy.workdir / "res/logs/slow.log"
    proc, _log = _start(toy, "res/slow.txt")
    job = _wait_running(toy, sshd)
    _wait_for("the first line here", lambda: local_log.is_file() and local_log.read_text(), 30)
    first = local_log.read_text()
    assert first == "first line\n" and _jobs(toy.env)["jobs"][-1]["state"] == "running"
    shown = _run([EAGLEFLOW, "remote", "logs", "slow_log"], toy.workdir, toy.env)
    assert shown.stdout == "first line\n" and f"{job['id']} (slow_log, running)" in shown.stderr
    follow = subprocess.Popen(
        [EAGLEFLOW, "remote", "logs", job["id"], "--follow"],
        cwd=toy.workdir,
        env=toy.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # the overhead: status calls of this running job from here (another local folder, no run)
    monkeypatch.setattr(remote_jobs, "register", lambda *a: None)
    settings = remote_settings.load_settings(environ=toy.env)
    plain, mirrored = _status_seconds(job["id"], settings, tmp_path)
    TIMINGS["status call of a running job (s)"] = plain
    TIMINGS["status call with a log mirror (s)"] = mirrored
    assert (tmp_path / "res/logs/slow.log").read_text() == "first line\n"
    q = shlex.quote(toy.remote_dir)
    sshd.ssh(f"touch {q}/go")
    _wait_for("the second line here", lambda: "second" in local_log.read_text(), 30)
    second = local_log.read_text()
    assert _jobs(toy.env)["jobs"][-1]["state"] == "running", "the job must still run"
    assert second == "first line\nsecond line\n" and len(second) > len(first)
    assert follow.poll() is None, "--follow ended while the job runs"
    sshd.ssh(f"touch {q}/go2")
    assert proc.wait(timeout=60) == 0
    out, err = follow.communicate(timeout=30)
    assert follow.returncode == 0 and out == "first line\nsecond line\nlast line\n", err
    assert f"{job['id']} ended: success" in err
    assert local_log.read_text() == out  # the final pull
    assert not remote_jobs._mirror_file(toy.workdir, job["id"]).exists()


@pytest.mark.slow
def test_unreachable_host_and_failed_logins_fail_fast_and_clearly(toy, sshd):
    from tests.support.sshd import free_port

    env = dict(toy.env, EAGLEFLOW_REMOTE_PORT=str(free_port()))
    proc = _run([*toy.cmd, "res/waited.txt"], toy.workdir, env, timeout=120, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "cannot reach the GPU host" in out, out
    assert f"127.0.0.1:{env['EAGLEFLOW_REMOTE_PORT']}" in out
    TIMINGS["unreachable host: snakemake exits (s)"] = proc.seconds
    assert proc.seconds < 30
    silent = socket.socket()  # accepts TCP connections, never says a word: a hung host
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    hung = {
        "EAGLEFLOW_REMOTE_PORT": str(silent.getsockname()[1]),
        "EAGLEFLOW_REMOTE_CONNECT_TIMEOUT_S": "3",
    }
    cases = [
        (hung, "cannot reach the GPU host (Connection timed out during banner exchange"),
        ({"EAGLEFLOW_REMOTE_IDENTITY": str(sshd.keys / "stranger_key")}, "login failed"),
        (
            {"EAGLEFLOW_REMOTE_KNOWN_HOSTS": str(sshd.keys / "empty_known_hosts")},
            "host key is unknown or changed",
        ),
    ]
    for over, msg in cases:
        check = _run(
            [EAGLEFLOW, "remote", "check"],
            toy.workdir,
            {**toy.env, **over},
            timeout=60,
            check=False,
        )
        assert check.returncode == 1 and msg in check.stdout, check.stdout + check.stderr
        assert check.seconds < 15
    silent.close()


@pytest.mark.slow
def test_remote_job_needing_bulk_that_is_only_local_fails_early(toy, sshd):
    # under remote_root locally: the host sees its tmpfs there instead
    local_root = str(sshd.remote_root / "laptop-bulk")
    cmd = [*toy.cmd, "res/bulk_used.txt", "--config", f"local_bulk={local_root}"]
    proc = _run(cmd, toy.workdir, toy.env, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "rule needs_bulk cannot run on 127.0.0.1" in out
    assert (
        f"shards of manifest res/local.manifest.json: {local_root} does not exist on 127.0.0.1"
        in out
    )
    assert "made on laptop" in out
    assert _jobs(toy.env)["jobs"] == [], "the job must fail before anything starts remotely"


def _watchers(base: Path) -> list[int]:
    """Live `eagleflow.remote.client watch` processes of these tests (their cwd is under `base`)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if b"eagleflow.remote.client" in args and b"watch" in args and cwd.startswith(str(base)):
            found.append(int(proc.name))
    return found


@pytest.mark.slow
def test_every_runs_watcher_has_ended(tmp_path_factory):
    # the last test here: each Snakemake run above started a watcher; all of those runs are over
    base = tmp_path_factory.getbasetemp()
    deadline = time.monotonic() + 10
    while _watchers(base) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _watchers(base)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], "watchers outlived their runs"
