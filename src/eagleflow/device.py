"""The device driver: the real workflow on a lent GPU machine reached only by short calls.

The machine starts bare, takes at most 64 MiB in and 8 files out per call, keeps what is written
outside the working tree only while it stays warm (30 s between calls, 30 minutes of hold at
most), and reaches no package index. So one hold is a sequence of calls, each short:

1. `stage`: each call carries one part of the offline bundle (`make device-bundle`) and copies it
   into the machine's stage folder; the manifest says what is still missing.
2. `install`: checks every part against the manifest, installs the wheels into a site folder
   (all or nothing, `eagleflow.bundle`) and records what the machine has (GPU, torch, vLLM, and
   the benchmark's vLLM launch commands parsed by the installed vLLM's own argument parser).
3. `start`: copies the working tree into the run's folder and starts
   `snakemake --cores all --resources gpu=1 --configfile <overlay>` in its own process session,
   so it outlives the call.
4. `poll`: waits (up to `--wait` s) and returns the records written since the last landed call
   (small files of `results_dir`, compressed) with the run's state.

Here, `land` unpacks what a call returned into `docs/results/<run>/` and commits it before the next
call is made (records left in /tmp have been lost with a machine). This module imports only the
standard library (and `eagleflow.bundle`, which does too): the device runs it before anything is
installed, as `python3 src/eagleflow/device.py ...`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

try:
    from eagleflow import bundle
except ImportError:  # run as a file on the device, before eagleflow is installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from eagleflow import bundle

REPO = Path(__file__).resolve().parents[2]
HOME = Path(os.environ.get("EAGLEFLOW_DEVICE_HOME", "/root/eagleflow-device"))
# What a run copies from the working tree (the sources the workflow needs, as the remote profile).
# docs/results: committed records a config may read (report.data_size's earlier trainings).
SOURCES = ("Snakefile", "workflow", "config", "src", "profiles", "pyproject.toml", "docs/results")
# Records: the small files of results_dir. Weights, arrays and datasets stay on the machine.
RECORD_SUFFIXES = {
    ".json",
    ".csv",
    ".md",
    ".png",
    ".log",
    ".txt",
    ".tsv",
    ".html",
    ".yaml",
    ".jsonl",
}
RECORD_MAX_BYTES = 8 << 20
START_MARKER = "=== eagleflow.device start"
# Datasets are not records: the prompts and the regenerated conversations stay (their stats travel).
RECORD_EXCLUDE = ("data/prompts.jsonl", "data/regenerated.jsonl")
# What outlives a hold besides the records: regeneration's resume files (bulk/regenerate/*.jsonl,
# named by prompts, target and settings), so the next hold's `regenerate` starts no engine for
# what is answered. Data, not records: landed under .device/carry/<run>/, never committed.
CARRY_DIR = "regenerate"
CARRY_MAX_BYTES = 15 * 1024 * 1024  # one returned file is at most 16 MiB
CALL_MAX_BYTES = 64 << 20  # what one call takes in: the working tree plus what it carries
RUN_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "TQDM_MININTERVAL": "30",
    # vLLM 0.26's sampler imports flashinfer (left out of the bundle) unless told not to.
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}


class DeviceError(Exception):
    """What went wrong and what to run next."""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _out() -> Path:
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="eagleflow-out-"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def run_env(home: Path, repo: Path) -> dict:
    """The environment of every workflow process: the bundle's site and the run's sources first."""
    site = home / "site"
    env = dict(os.environ, **RUN_ENV)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(repo / "src"), str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env["PATH"] = os.pathsep.join([str(site / "bin"), env.get("PATH", "")])
    return env


# ---------------------------------------------------------------------------------------------
# Device side


def stage(src: Path, home: Path = HOME) -> dict:
    """Copy the carried parts (and manifest) in `src` into the stage folder; report the missing."""
    dest = home / "stage"
    dest.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    copied = []
    for f in sorted(Path(src).glob(bundle.PART_PREFIX + "*")) + [Path(src) / bundle.MANIFEST]:
        if f.is_file():
            tmp = dest / (f.name + ".partial")
            shutil.copyfile(f, tmp)
            os.replace(tmp, dest / f.name)  # a cut copy never looks like a part
            copied.append(f.name)
    if not (dest / bundle.MANIFEST).is_file():
        raise DeviceError(
            f"no {bundle.MANIFEST} carried in {src} nor staged before: every stage call carries "
            "the bundle's manifest.json beside its part (`eagleflow device plan` lists the calls)."
        )
    manifest = bundle.load_manifest(dest)
    have = {p.name for p in dest.glob(bundle.PART_PREFIX + "*") if not p.name.endswith(".partial")}
    missing = [p["name"] for p in manifest["parts"] if p["name"] not in have]
    return {
        "at": _now(),
        "copied": copied,
        "seconds": round(time.monotonic() - started, 2),
        "parts": len(manifest["parts"]),
        "missing": missing,
        "bundle_sha256": manifest["whole"]["sha256"],
    }


_PROBE = r"""
import json, importlib, importlib.util
from importlib import metadata
out = {}
for dist in ("torch", "transformers", "vllm", "speculators", "snakemake", "datasets", "triton"):
    try:
        out[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        out[dist] = None
import torch
out["cuda"] = torch.version.cuda
out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
try:
    import vllm  # noqa: F401
    out["vllm_import"] = "ok"
except Exception as e:  # noqa: BLE001
    out["vllm_import"] = f"{type(e).__name__}: {e}"
out["vllm_extract_hidden_states"] = (
    importlib.util.find_spec("vllm.v1.spec_decode.extract_hidden_states") is not None
    if out["vllm_import"] == "ok" else None
)
print(json.dumps(out))
"""


def install(home: Path = HOME, configfile: list[str] | None = None) -> dict:
    """Install the staged bundle into `home/site` and record what the machine then has."""
    started = time.monotonic()
    manifest = bundle.install(home / "stage", home / "site", python=sys.executable)
    record = {
        "at": _now(),
        "install_s": round(time.monotonic() - started, 1),
        "wheels": len(manifest["wheels"]),
        "bundle_sha256": manifest["whole"]["sha256"],
        "bundle_mib": round(manifest["whole"]["bytes"] / 2**20, 1),
    }
    env = run_env(home, REPO)
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    record["probe"] = json.loads(probe.stdout) if probe.returncode == 0 else probe.stderr[-3000:]
    if configfile:  # the benchmark's launch commands, parsed by the installed vLLM itself
        started = time.monotonic()
        check = subprocess.run(
            [sys.executable, "-m", "eagleflow.cli", "serve-command", "--configfile", *configfile,
             "--check-flags"],
            env=env, capture_output=True, text=True, timeout=600, cwd=REPO,
        )  # fmt: skip
        record["flag_check"] = {
            "rc": check.returncode,
            "seconds": round(time.monotonic() - started, 1),
            "output": (check.stdout + check.stderr)[-4000:],
        }
    return record


def run_dir(run: str, home: Path = HOME) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", run):
        raise DeviceError(f"run name {run!r}: expected letters, digits, '.', '_' or '-'")
    return home / "runs" / run


def _running(rdir: Path) -> int | None:
    """The pid of the run's live process session, if any."""
    try:
        pid = int((rdir / "pid").read_text())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    try:  # a zombie is not running
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
    except OSError:
        pass
    return pid


def start(
    run: str,
    configfile: str | list[str],
    home: Path = HOME,
    extra: list[str] | None = None,
    carry_in: Path | None = None,
) -> dict:
    """Start the workflow in its own process session; a finished or failed run starts again
    where Snakemake left it (its results and bulk data are kept). `carry_in`: a folder an
    earlier hold's `land` filled (its regenerate/*.jsonl resume files go into the run's bulk
    data first; a longer file already there is kept)."""
    rdir = run_dir(run, home)
    if not (home / "site").is_dir():
        raise DeviceError(
            f"nothing installed at {home / 'site'}: stage every part and run `install` first "
            "(a machine that went back since then starts bare)."
        )
    if (pid := _running(rdir)) is not None:
        raise DeviceError(f"run {run} is still running (pid {pid}); poll it, don't start it twice")
    configfiles = [configfile] if isinstance(configfile, str) else list(configfile)
    for f in configfiles:
        if not (REPO / f).is_file():
            raise DeviceError(f"--configfile {f}: no such file in the working tree")
    repo = rdir / "repo"
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.is_file():
            shutil.copy2(src, repo / name)
    (rdir / "exitcode").unlink(missing_ok=True)
    carried = _place_carry(carry_in, rdir / "bulk" / CARRY_DIR) if carry_in else []
    # What ran, exactly: the copied sources' hash (the machine's git metadata may be stale).
    digest = hashlib.sha256()
    for f in sorted(p for p in repo.rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(repo)).encode() + b"\0" + f.read_bytes())
    # Extra arguments (targets) go first: --configfile and --config take every word after them.
    cmd = [
        sys.executable, "-m", "snakemake", *(extra or []), "--cores", "all", "--resources",
        "gpu=1", "--configfile", *configfiles, "--show-failed-logs", "--rerun-incomplete",
        "--config", f"results_dir={rdir / 'results'}", f"data_root={rdir / 'bulk'}",
    ]  # fmt: skip
    with open(rdir / "snakemake.log", "a") as f:  # a restart's state is read after its marker
        f.write(f"{START_MARKER} {_now()}\n")
    log, code = _q(rdir / "snakemake.log"), _q(rdir / "exitcode")
    shell = f"{' '.join(map(_q, cmd))} >> {log} 2>&1; echo $? > {code}"
    proc = subprocess.Popen(
        ["/bin/sh", "-c", shell],
        cwd=repo,
        env=run_env(home, repo),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    (rdir / "pid").write_text(str(proc.pid))
    info = {"run": run, "configfile": configfiles, "started": _now(), "started_unix": time.time(),
            "command": cmd, "commit": _commit(), "sources_sha256": digest.hexdigest(),
            "carried_in": carried}  # fmt: skip
    _write_json(rdir / "run.json", info)
    return info


def _place_carry(src: Path, dest: Path) -> list[str]:
    """Copy carried resume files into the run's bulk data (a longer one already there stays)."""
    folder = Path(src) / CARRY_DIR
    if not folder.is_dir():
        raise DeviceError(
            f"--carry-in {src}: no {CARRY_DIR}/ folder in it; carry the folder `land` filled "
            f"(.device/carry/<run>) or leave --carry-in out"
        )
    dest.mkdir(parents=True, exist_ok=True)
    placed = []
    for f in sorted(folder.glob("*.jsonl")):
        target = dest / f.name
        if target.is_file() and target.stat().st_size >= f.stat().st_size:
            continue
        tmp = target.with_suffix(".carry-tmp")
        shutil.copy2(f, tmp)
        os.replace(tmp, target)
        placed.append(f.name)
    return placed


def _q(x) -> str:
    import shlex

    return shlex.quote(str(x))


def _commit() -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return None
    return proc.stdout.strip() or None


def _progress(log: str) -> str | None:
    found = re.findall(r"(\d+ of \d+ steps \(\d+%\) done)", log)
    return found[-1] if found else None


def status(run: str, home: Path = HOME) -> dict:
    """The run's state: running, succeeded, failed (with the failed rules) or lost."""
    rdir = run_dir(run, home)
    if not (rdir / "run.json").is_file():
        return {
            "run": run,
            "state": "lost",
            "message": (
                f"no run {run} on this machine: it is not the machine the run started on (a "
                "machine goes back 30 s after a call and after 30 minutes of hold). Its bulk data "
                "(shards, checkpoints) is gone; what was landed is in docs/results/"
                f"{run}/. Stage the parts again, install, and start: Snakemake redoes the rest."
            ),
        }
    info = json.loads((rdir / "run.json").read_text())
    log = (
        (rdir / "snakemake.log").read_text(errors="replace")
        if (rdir / "snakemake.log").is_file()
        else ""
    ).rsplit(START_MARKER, 1)[-1]  # this start's part: an earlier failure is not this one's
    st = {
        "run": run,
        "elapsed_s": round(time.time() - info["started_unix"], 1),
        "progress": _progress(log),
    }
    code = (rdir / "exitcode").read_text().strip() if (rdir / "exitcode").is_file() else None
    if code is None:
        if _running(rdir) is None:
            st.update(
                state="failed",
                message="the workflow's process is gone and left no exit code (killed?)",
            )
        else:
            st.update(state="running")
        return st
    failed = sorted(set(re.findall(r"Error in rule (\w+):", log)))
    if code == "0":
        st.update(state="succeeded", exitcode=0)
    else:
        logs = ", ".join(f"results/logs/{r}*.log" for r in failed) or "snakemake.log"
        st.update(
            state="failed",
            exitcode=int(code),
            failed_rules=failed,
            message=(
                f"the workflow failed (exit {code}) in {', '.join(failed) or 'Snakemake itself'}: "
                f"read {logs} under docs/results/{run}/ once landed. Fix it, then call `start` "
                "again while the machine is warm: Snakemake goes on from the failed rule."
            ),
        )
    return st


def _records(results: Path) -> list[Path]:
    if not results.is_dir():
        return []
    return sorted(
        p for p in results.rglob("*")
        if p.is_file() and p.suffix in RECORD_SUFFIXES and p.stat().st_size <= RECORD_MAX_BYTES
        and ".snakemake" not in p.parts
        and p.relative_to(results).as_posix() not in RECORD_EXCLUDE
    )  # fmt: skip


def poll(run: str, wait_s: float, ack: int, home: Path = HOME, out: Path | None = None) -> dict:
    """Wait until the run ends or `wait_s` passes, then write the records changed since the landed
    call `ack` into `out` (records-<seq>.tar.gz) with the state (status.json)."""
    out = out or _out()
    out.mkdir(parents=True, exist_ok=True)
    rdir = run_dir(run, home)
    deadline = time.monotonic() + wait_s
    while status(run, home)["state"] == "running" and time.monotonic() < deadline:
        time.sleep(3)
    st = status(run, home)
    if st["state"] == "lost":
        _write_json(out / "status.json", st)
        return st
    sent_path = rdir / "sent.json"
    sent = (
        json.loads(sent_path.read_text())
        if sent_path.is_file()
        else {"seq": 0, "acked": {}, "pending": {}}
    )
    # What the last landed call carried is acknowledged; what a lost reply carried is sent again.
    if ack and str(ack) in sent["pending"]:
        sent["acked"].update(sent["pending"].pop(str(ack)))
    if ack and str(ack) in sent.get("carry_pending", {}):
        sent["carry"] = sent["carry_pending"][str(ack)]
    sent["pending"], sent["carry_pending"] = {}, {}
    seq = sent["seq"] + 1
    results = rdir / "results"
    changed = {}
    for p in _records(results):
        key = str(p.relative_to(rdir))
        stamp = f"{p.stat().st_size}:{p.stat().st_mtime_ns}"
        if sent["acked"].get(key) != stamp:
            changed[key] = stamp
    extra = [rdir / n for n in ("snakemake.log", "run.json") if (rdir / n).is_file()]
    st["seq"], st["records"] = seq, len(changed)
    carry = _pack_carry(rdir, sent, seq, out / f"carry-{seq:03d}.tar.gz")
    if carry:
        st["carry"] = carry
    _write_json(rdir / "status.json", st)
    tar_path = out / f"records-{seq:03d}.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        for key in sorted(changed):
            tar.add(rdir / key, arcname=key)
        for p in extra + [rdir / "status.json"]:
            tar.add(p, arcname=p.name)
    sent["seq"] = seq
    sent["pending"][str(seq)] = changed
    _write_json(sent_path, sent)
    _write_json(out / "status.json", st)
    return st


def _pack_carry(rdir: Path, sent: dict, seq: int, tar_path: Path) -> dict | None:
    """Pack the resume files that changed since the last packing into `tar_path` (compressed),
    or say why not (too big to travel); None when nothing changed."""
    files = sorted((rdir / "bulk" / CARRY_DIR).glob("*.jsonl"))
    stamps = {f.name: f"{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files}
    if not files or stamps == sent.get("carry"):
        return None
    with tarfile.open(tar_path, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f"{CARRY_DIR}/{f.name}")
    size = tar_path.stat().st_size
    if size > CARRY_MAX_BYTES:
        tar_path.unlink()
        why = f"{size / 2**20:.1f} MiB compressed, over {CARRY_MAX_BYTES >> 20} MiB"
        return {"files": len(files), "bytes": size, "sent": False, "why": why}
    sent["carry_pending"] = {str(seq): stamps}  # acknowledged when this call is landed
    return {"files": len(files), "bytes": size, "sent": True}


# ---------------------------------------------------------------------------------------------
# Here: plan the calls, land what they return


def _path_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size if path.exists() else 0


def tree_bytes(repo: Path) -> int:
    """Bytes of what travels with every call: tracked files, untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo, capture_output=True, check=True,
    ).stdout  # fmt: skip
    return sum(_path_bytes(repo / n) for n in out.decode().split("\0") if n)


def plan(
    bundle_dir: Path,
    run: str,
    configfile: list[str],
    wait_s: int = 540,
    carry_in: Path | None = None,
) -> list[dict]:
    """The calls of one hold: one part each, then install + start (with an earlier hold's
    carried resume files, if given), then polls.

    Refuses a plan whose call would not fit what a call takes in (the working tree travels with
    every call, so records landed since the bundle was cut count too)."""
    manifest = bundle.load_manifest(bundle_dir)
    rel = os.path.relpath(bundle_dir, REPO)
    dev = "python3 src/eagleflow/device.py"
    calls = []
    parts = manifest["parts"]
    for i, part in enumerate(parts):
        cmd = f"{dev} stage {rel}"
        if i == len(parts) - 1:
            overlays = " ".join(configfile)
            cmd += f" && {dev} install --configfile {overlays}"
            cmd += f" && {dev} start --run {run} --configfile {overlays}"
        carry = [f"{rel}/{part['name']}", f"{rel}/{bundle.MANIFEST}"]
        if i == len(parts) - 1 and carry_in is not None:
            carried = os.path.relpath(carry_in, REPO)
            cmd += f" --carry-in {carried}"
            carry.append(carried)
        calls.append({"carry": carry, "command": cmd})
    tree = tree_bytes(REPO)
    for call in calls:
        size = tree + sum(_path_bytes(REPO / c) for c in call["carry"])
        if size > CALL_MAX_BYTES:
            raise DeviceError(
                f"call `{call['command'].split(' && ')[0]}` with {', '.join(call['carry'])} takes "
                f"{size / 2**20:.1f} MiB in (working tree {tree / 2**20:.1f} MiB): expected at "
                f"most {CALL_MAX_BYTES >> 20} MiB; cut smaller parts "
                f"(`make device-bundle PART_MIB={max(1, (CALL_MAX_BYTES - tree) // 2**20 - 4)}`)"
            )
    calls.append(
        {
            "carry": [],
            "command": f"{dev} poll --run {run} --wait {wait_s} --ack SEQ",
            "repeat": True,
        }
    )
    return calls


def _land_carry(tar_path: Path, dest: Path) -> None:
    """Unpack carried resume files into `dest` (git-ignored: data, not records), whole or not."""
    dest.parent.mkdir(parents=True, exist_ok=True)  # the temp folder beside it: one filesystem
    tmp = Path(tempfile.mkdtemp(prefix=".carry-", dir=dest.parent))
    try:
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp, filter="data")
        for f in sorted((tmp / CARRY_DIR).glob("*.jsonl")):
            (dest / CARRY_DIR).mkdir(parents=True, exist_ok=True)
            os.replace(f, dest / CARRY_DIR / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def land(files_at: Path, run: str, repo: Path = REPO, commit: bool = True) -> dict:
    """Unpack a call's records into docs/results/<run>/ and commit them; returns the status."""
    files_at = Path(files_at)
    dest = repo / "docs" / "results" / run
    dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".landing-{run}-", dir=dest.parent))
    status_data: dict = {}
    try:
        for tar_path in sorted(files_at.glob("carry-*.tar.gz")):
            _land_carry(tar_path, repo / ".device" / "carry" / run)
        for tar_path in sorted(files_at.glob("records-*.tar.gz")):
            with tarfile.open(tar_path) as tar:
                tar.extractall(staging, filter="data")
        for j in sorted(files_at.glob("*.json")):
            target = staging / "device" / j.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(j, target)
            if j.name == "status.json":
                status_data = json.loads(j.read_text())
        if not any(staging.rglob("*")):
            raise DeviceError(
                f"{files_at} holds no records-*.tar.gz and no *.json: nothing to land"
            )
        for src in sorted(p for p in staging.rglob("*") if p.is_file()):
            target = dest / src.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if commit:
        rel = os.path.relpath(dest, repo)
        subprocess.run(["git", "-C", str(repo), "add", "--", rel], check=True)
        staged = subprocess.run(["git", "-C", str(repo), "diff", "--cached", "--quiet", "--", rel])
        if staged.returncode:
            if status_data:
                what = f"call {status_data.get('seq', '?')} ({status_data.get('state')})"
            else:  # a stage, install or start call: named by its records
                what = ", ".join(sorted(j.stem for j in files_at.glob("*.json")))
            msg = f"device records: {run}, {what}"
            subprocess.run(
                ["git", "-C", str(repo), "commit", "-q", "-m", msg, "--", rel], check=True
            )
    return status_data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="device", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage", help="(device) copy the carried parts into the stage folder")
    s.add_argument("src", type=Path)
    i = sub.add_parser("install", help="(device) check and install the staged bundle")
    i.add_argument("--configfile", nargs="+", help="overlays whose vLLM commands to check")
    st = sub.add_parser("start", help="(device) start the workflow in its own process session")
    st.add_argument("--run", required=True)
    st.add_argument("--configfile", required=True, nargs="+", help="overlays, in order")
    st.add_argument("--carry-in", type=Path, help="a folder `land` filled: resume files")
    st.add_argument(
        "snakemake_args", nargs="*", help="after --: targets (under the run's results) and options"
    )
    po = sub.add_parser("poll", help="(device) wait, then return new records and the state")
    po.add_argument("--run", required=True)
    po.add_argument("--wait", type=float, default=540)
    po.add_argument("--ack", type=int, default=0, help="seq of the last call landed here")
    pl = sub.add_parser("plan", help="(here) the calls of one hold")
    pl.add_argument("--bundle", type=Path, default=REPO / ".device" / "bundle")
    pl.add_argument("--run", required=True)
    pl.add_argument("--configfile", required=True, nargs="+", help="overlays, in order")
    pl.add_argument("--carry-in", type=Path, help="an earlier hold's .device/carry/<run>")
    la = sub.add_parser("land", help="(here) unpack a call's records into docs/results and commit")
    la.add_argument("files_at", type=Path)
    la.add_argument("--run", required=True)
    la.add_argument("--no-commit", action="store_true")
    args = p.parse_args(argv)
    out = _out() if args.cmd in ("stage", "install", "start") else None
    try:
        if args.cmd == "stage":
            res = stage(args.src)
            # named after the newest part: a warm machine keeps the parts earlier calls carried
            parts = [c for c in res["copied"] if c.startswith(bundle.PART_PREFIX)]
            _write_json(out / f"stage-{parts[-1] if parts else 'none'}.json", res)
        elif args.cmd == "install":
            res = install(configfile=args.configfile)
            _write_json(out / "install.json", res)
        elif args.cmd == "start":
            res = start(
                args.run, args.configfile, extra=args.snakemake_args, carry_in=args.carry_in
            )
            _write_json(out / "start.json", res)
        elif args.cmd == "poll":
            res = poll(args.run, args.wait, args.ack)
        elif args.cmd == "plan":
            res = plan(args.bundle, args.run, args.configfile, carry_in=args.carry_in)
        else:
            res = land(args.files_at, args.run, commit=not args.no_commit)
            if res.get("state") in ("running", "succeeded"):
                res["next"] = f"poll --run {args.run} --ack {res.get('seq')}"
    except (DeviceError, bundle.BundleError) as e:
        print(f"device {args.cmd}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1))
    if args.cmd == "poll" and res.get("state") in ("failed", "lost"):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
