"""The GPU host's side of the remote profile: start, watch, cancel and check jobs there.

This file is shipped to the GPU host as source text on ssh's stdin (`python3 -`), with the request
appended as a Python literal, so the host needs nothing but a Python 3.8+ interpreter before
`remote setup` has run; it must therefore use the standard library only and import nothing from
eagleflow. `eagleflow.remote.client` (the laptop side) builds the requests and reads the one JSON
line this file prints, prefixed with MARK (login scripts may print other lines before it).

State on the host, under `<remote_dir>/.eagleflow/`:
  jobs/<job_id>/request.json  what the laptop asked for (no secrets: paths, args, GPU count,
                              wildcards, and the job's key: same key = same work)
  jobs/<job_id>/job.sh        the Snakemake job command, rewritten for the host
  jobs/<job_id>/job.out       its stdout and stderr (Snakemake's own output on the host); the
                              rule's `log:` files are under the remote dir, as locally
  jobs/<job_id>/state.json    queued | running | success | failed | cancelled, rc, GPUs, times,
                              `collected` once a status call reported its success
  agent.py                    this file, run detached (`agent.py run <jobdir>`) for each job
GPU locks (one directory per GPU index, created atomically) live in `gpu_lock_dir`, shared by
every project on the host.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

MARK = "EAGLEFLOW-AGENT "
JOB_ENV = "EAGLEFLOW_REMOTE_JOB"  # set for every job process: finds them all, even re-sessioned
FINAL = ("success", "failed", "cancelled")
GRACE_S = 10  # SIGTERM -> SIGKILL
LOG_CHUNK = 512 << 10  # bytes of a log sent per call (the rest comes with the next one)


class AgentError(Exception):
    """A request this host cannot satisfy; the message goes back to the laptop."""


# ---------------------------------------------------------------------------------------------
# small helpers


def host_path(path: str) -> str:
    """A host path from the laptop's settings: `~` expanded, relative = under the home folder."""
    return os.path.abspath(os.path.join(os.path.expanduser("~"), os.path.expanduser(path)))


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _read_json(path: str, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _alive(pid) -> bool:
    """True for a live, non-zombie process (zombies linger where no init reaps them)."""
    try:
        pid = int(pid)
        os.kill(pid, 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc (not Linux): trust kill(0)


def job_processes(job_id: str) -> list[int]:
    """Live processes carrying this job's marker in their environment (Linux /proc)."""
    needle = f"{JOB_ENV}={job_id}".encode()
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if needle in env and _alive(name):
            found.append(int(name))
    return found


def _signal_job(job_id: str, pgid, sig) -> None:
    if pgid:
        try:
            os.killpg(int(pgid), sig)
        except (ProcessLookupError, PermissionError, ValueError):
            pass
    for pid in job_processes(job_id):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def read_chunk(path: str, offset: int) -> dict:
    """The bytes of `path` from `offset` (at most LOG_CHUNK, base64) and the file's size; a file
    shorter than `offset` (rewritten) is read from 0."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            offset = 0 if offset > size else int(offset)
            f.seek(offset)
            data = f.read(LOG_CHUNK)
    except OSError:
        return {"offset": 0, "size": 0, "data": ""}
    return {"offset": offset, "size": size, "data": base64.b64encode(data).decode()}


def gpu_indices(spec: str) -> list[str]:
    """GPU indices this host offers: "auto" (nvidia-smi), "none", or a list like "0,1,2"."""
    spec = str(spec).strip()
    if spec in ("", "none"):
        return []
    if spec != "auto":
        out = [s.strip() for s in spec.split(",") if s.strip()]
        bad = [s for s in out if not s.isdigit()]
        if bad:
            raise AgentError(f"gpus setting {spec!r}: {bad[0]!r} is not a GPU index")
        return out
    if shutil.which("nvidia-smi") is None:
        return []
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return [ln.strip() for ln in proc.stdout.splitlines() if ln.strip().isdigit()]


# ---------------------------------------------------------------------------------------------
# GPU locks: a directory per index (mkdir is atomic), owner.json names the job holding it


def _lock_owner_gone(lock: str) -> bool:
    owner = _read_json(os.path.join(lock, "owner.json"))
    if owner is None:  # being created right now, or left by a crash: reclaim only when old
        try:
            return time.time() - os.stat(lock).st_mtime > 60
        except OSError:
            return True
    return owner.get("host") == socket.gethostname() and not _alive(owner.get("pid"))


def try_lock_gpus(lock_dir: str, indices: list[str], need: int, owner: dict) -> list[str] | None:
    """Take `need` free GPUs (lowest indices first) or none at all; stale locks are reclaimed."""
    os.makedirs(lock_dir, exist_ok=True)
    got: list[str] = []
    for idx in indices:
        if len(got) == need:
            break
        lock = os.path.join(lock_dir, f"gpu{idx}")
        for _attempt in range(2):
            try:
                os.mkdir(lock)
            except FileExistsError:
                if _lock_owner_gone(lock):
                    shutil.rmtree(lock, ignore_errors=True)
                    continue
                break
            _write_json(os.path.join(lock, "owner.json"), owner)
            got.append(idx)
            break
    if len(got) < need:
        release_gpus(lock_dir, got, owner["job"])
        return None
    return got


def release_gpus(lock_dir: str, indices: list[str], job_id: str) -> None:
    for idx in indices:
        lock = os.path.join(lock_dir, f"gpu{idx}")
        owner = _read_json(os.path.join(lock, "owner.json"), {})
        if owner.get("job") == job_id:
            shutil.rmtree(lock, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# operations (each returns a JSON-able dict)


def _dirs(req: dict) -> tuple[str, str]:
    root = host_path(req["remote_dir"])
    return root, os.path.join(root, ".eagleflow", "jobs")


def op_ping(req: dict) -> dict:
    root = host_path(req["remote_dir"])
    return {
        "ok": True,
        "host": socket.gethostname(),
        "root": root,
        "python": sys.version.split()[0],
    }


def op_start(req: dict) -> dict:
    """Check what the job needs on this host, then start it detached; returns its pid."""
    root, jobs = _dirs(req)
    missing = [r for r in req.get("require", []) if not os.path.exists(host_path(r["path"]))]
    if missing:
        return {"ok": False, "host": socket.gethostname(), "missing": missing}
    indices = gpu_indices(req["gpus"])
    if req["gpu"] > len(indices):
        raise AgentError(
            f"rule {req['rule']} asks for gpu={req['gpu']} but {socket.gethostname()} offers "
            f"{len(indices)} GPU(s) (gpus setting {req['gpus']!r} -> {indices}); lower the rule's "
            "gpu resource or set EAGLEFLOW_REMOTE_GPUS to the host's GPU indices"
        )
    # checked again here (the laptop asked `find` before pushing): two submissions never race
    attach, conflict = _match(jobs, req.get("key"), req["outputs"])
    if conflict:
        return {"ok": False, "host": socket.gethostname(), "conflict": conflict}
    if attach is not None:
        return {"ok": True, "host": socket.gethostname(), "root": root, "attached": attach}
    jobdir = os.path.join(jobs, req["job_id"])
    os.makedirs(jobdir)
    _write_json(
        os.path.join(jobdir, "request.json"), {k: v for k, v in req.items() if k != "agent"}
    )
    with open(os.path.join(jobdir, "job.sh"), "w") as f:
        f.write(req["job_script"])
    _write_json(os.path.join(jobdir, "state.json"), {"state": "queued", "submitted": time.time()})
    agent = os.path.join(root, ".eagleflow", "agent.py")
    tmp = f"{agent}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(req["agent"])
    os.replace(tmp, agent)
    pid = _spawn(root, jobdir)
    return {
        "ok": True,
        "pid": pid,
        "host": socket.gethostname(),
        "root": root,
    }


def _spawn(root: str, jobdir: str) -> int:
    """Start the detached runner of a job; returns its pid (= its process group id)."""
    agent = os.path.join(root, ".eagleflow", "agent.py")
    pid_file = os.path.join(jobdir, "pid")
    if os.path.exists(pid_file):
        os.unlink(pid_file)
    with open(os.path.join(jobdir, "job.out"), "ab") as out:
        subprocess.Popen(
            [sys.executable, agent, "run", jobdir],
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: cancel kills exactly this job
            close_fds=True,
        )
    deadline = time.time() + 10
    while not os.path.exists(pid_file):
        if time.time() > deadline:
            raise AgentError(f"job {os.path.basename(jobdir)} did not start; see {jobdir}/job.out")
        time.sleep(0.02)
    with open(pid_file) as f:
        return int(f.read())


def op_restart(req: dict) -> dict:
    """Start again jobs that eagleflow's cancel stopped (a later Snakemake run resumes them)."""
    root, jobs = _dirs(req)
    restarted, conflicts = [], {}
    for job_id in req["ids"]:
        jobdir = os.path.join(jobs, job_id)
        st = _read_json(os.path.join(jobdir, "state.json"), {})
        if st.get("state") != "cancelled" or not st.get("by_eagleflow"):
            continue
        r = _read_json(os.path.join(jobdir, "request.json"), {})
        _attach, others = _match(jobs, None, r.get("outputs", []), skip=job_id)
        if others:  # another job writes these outputs now: never two writers
            conflicts[job_id] = others
            continue
        if os.path.exists(os.path.join(jobdir, "cancel")):
            os.unlink(os.path.join(jobdir, "cancel"))
        st = {"state": "queued", "submitted": time.time(), "restarts": st.get("restarts", 0) + 1}
        _write_json(os.path.join(jobdir, "state.json"), st)
        _spawn(root, jobdir)
        restarted.append(job_id)
    return {
        "ok": True,
        "host": socket.gethostname(),
        "restarted": restarted,
        "conflicts": conflicts,
    }


ATTACHABLE = ("queued", "running")


def _job_summary(job_id: str, r: dict, st: dict) -> dict:
    return {
        "id": job_id,
        "rule": r.get("rule"),
        "wildcards": r.get("wildcards", {}),
        "state": st["state"],
        "since": st.get("started") or st.get("submitted"),
        "gpus": st.get("gpus", []),
    }


def _match(jobs: str, key, outputs: list[str], skip: str | None = None):
    """(the job to attach to, live jobs of other work writing any of `outputs`).

    Attach: the newest job with this key that still runs, or that succeeded while nobody
    collected it (its Snakemake was gone) and whose outputs no later job has rewritten. A job
    with another key that is not finished and shares an output is a conflict: never two writers.
    """
    mine = set(outputs)
    attach, conflict, writers = None, [], []
    names = os.listdir(jobs) if os.path.isdir(jobs) else []
    for job_id in names:
        jobdir = os.path.join(jobs, job_id)
        r = _read_json(os.path.join(jobdir, "request.json"))
        if r is None or job_id == skip:
            continue
        st = _state(jobdir)
        overlap = bool(mine & set(r.get("outputs", [])))
        if overlap:
            writers.append(st.get("submitted", 0))
        if key and r.get("key") == key:
            fresh = st["state"] in ATTACHABLE or (
                st["state"] == "success" and not st.get("collected")
            )
            if fresh and (attach is None or st.get("submitted", 0) > attach["submitted"]):
                attach = dict(_job_summary(job_id, r, st), submitted=st.get("submitted", 0))
        elif overlap and st["state"] not in FINAL:
            conflict.append(_job_summary(job_id, r, st))
    if attach is not None and attach["state"] == "success":
        if any(t > attach["submitted"] for t in writers):  # rewritten since: not its outputs
            attach = None
    return attach, conflict


def op_find(req: dict) -> dict:
    """Before a submission pushes anything: a job of the same work to attach to, or conflicts."""
    _root, jobs = _dirs(req)
    attach, conflict = _match(jobs, req["key"], req["outputs"])
    return {"ok": True, "host": socket.gethostname(), "attach": attach, "conflict": conflict}


def _state(jobdir: str) -> dict:
    """A job's state; a runner that died without writing a final state counts as failed."""
    st = _read_json(os.path.join(jobdir, "state.json"))
    if st is None:
        return {"state": "unknown"}
    if st["state"] not in FINAL:
        try:
            with open(os.path.join(jobdir, "pid")) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            pid = None
        if pid is not None and not _alive(pid):
            if os.path.exists(os.path.join(jobdir, "cancel")):
                # cancelled, and the reaper's SIGKILL took the runner before it wrote so (a
                # loaded host: the job outlived the grace period)
                st.update(state="cancelled", rc=None, by_eagleflow=True, killed=True)
            else:
                st.update(state="failed", rc=None, lost=True)
    return st


BENCHMARK_LINE = re.compile(r"^\s+benchmark: (\S.*)$", re.M)


def op_status(req: dict) -> dict:
    root, jobs = _dirs(req)
    out = {}
    for job_id in req["ids"]:
        jobdir = os.path.join(jobs, job_id)
        if not os.path.isdir(jobdir):
            out[job_id] = {"state": "unknown"}
            continue
        st = _state(jobdir)
        r = _read_json(os.path.join(jobdir, "request.json"), {})
        st.update(rule=r.get("rule"), outputs=r.get("outputs", []), logs=r.get("logs", []))
        # live logs: new bytes of the job's own log files only (never a path the laptop names)
        if job_id in req.get("log_offsets", {}):
            offsets = req["log_offsets"][job_id]
            st["log_chunks"] = {
                p: read_chunk(os.path.join(root, p), offsets.get(p, 0))
                for p in st["logs"]
                if not os.path.isabs(p)
            }
        if st["state"] == "success" and not st.get("collected"):
            # reported to a Snakemake that pulls it: a later submission starts afresh
            saved = _read_json(os.path.join(jobdir, "state.json"), {})
            saved["collected"] = time.time()
            _write_json(os.path.join(jobdir, "state.json"), saved)
        if st["state"] in FINAL:
            text = _tail(os.path.join(jobdir, "job.out"), 400)
            bench = BENCHMARK_LINE.findall(text)
            st["benchmark"] = [b.strip() for b in bench[:1]]
            if st["state"] != "success":
                st["tail"] = "\n".join(text.splitlines()[-40:])
        out[job_id] = st
    return {"ok": True, "host": socket.gethostname(), "jobs": out}


def op_log(req: dict) -> dict:
    """New bytes of one job's log: the job by id, or the newest job of a rule; the rule's first
    `log:` file (or job.out when it has none, or when `out` is asked)."""
    root, jobs = _dirs(req)
    job_id = req["job"]
    if not os.path.isfile(os.path.join(jobs, job_id, "request.json")):
        names = os.listdir(jobs) if os.path.isdir(jobs) else []
        mine = [
            (_read_json(os.path.join(jobs, n, "state.json"), {}).get("submitted", 0), n)
            for n in names
            if _read_json(os.path.join(jobs, n, "request.json"), {}).get("rule") == job_id
        ]
        if not mine:
            raise AgentError(
                f"no job with id or rule {job_id!r} under {root}; `eagleflow remote status` "
                "lists the jobs"
            )
        job_id = max(mine)[1]
    jobdir = os.path.join(jobs, job_id)
    r = _read_json(os.path.join(jobdir, "request.json"), {})
    logs = r.get("logs", [])
    path = os.path.join(jobdir, "job.out")
    if logs and not req.get("out"):
        path = os.path.join(root, logs[0])
    return {
        "ok": True,
        "host": socket.gethostname(),
        "job_id": job_id,
        "rule": r.get("rule"),
        "state": _state(jobdir)["state"],
        "path": path,
        **read_chunk(path, req.get("offset", 0)),
    }


def _cancel_one(jobdir: str, job_id: str) -> None:
    st = _read_json(os.path.join(jobdir, "state.json"), {})
    if st.get("state") not in FINAL:
        _write_json(os.path.join(jobdir, "cancel"), {"at": time.time()})
    try:
        with open(os.path.join(jobdir, "pid")) as f:
            pgid = int(f.read())
    except (OSError, ValueError):
        pgid = None
    _signal_job(job_id, pgid, signal.SIGTERM)
    st = _read_json(os.path.join(jobdir, "state.json"), {})
    if st.get("state") not in FINAL and (pgid is None or not _alive(pgid)):
        st.update(state="cancelled", rc=None, finished=time.time(), by_eagleflow=True)
        _write_json(os.path.join(jobdir, "state.json"), st)


def op_cancel(req: dict) -> dict:
    """SIGTERM each job's process group (and marked processes); SIGKILL after a grace period."""
    root, jobs = _dirs(req)
    for job_id in req["ids"]:
        jobdir = os.path.join(jobs, job_id)
        if os.path.isdir(jobdir):
            _cancel_one(jobdir, job_id)
    # Snakemake gives the cancel command 2 s: a detached reaper does the SIGKILL escalation.
    agent = os.path.join(root, ".eagleflow", "agent.py")
    if os.path.exists(agent) and req["ids"]:
        subprocess.Popen(
            [sys.executable, agent, "reap", jobs, *req["ids"]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    return {"ok": True, "host": socket.gethostname()}


def reap(jobs: str, ids: list[str]) -> None:
    """After GRACE_S, SIGKILL whatever of these jobs still runs."""
    deadline = time.time() + GRACE_S
    while time.time() < deadline:
        if not any(job_processes(j) for j in ids):
            return
        time.sleep(0.5)
    for job_id in ids:
        pid = _read_json(os.path.join(jobs, job_id, "pid"))
        _signal_job(job_id, pid, signal.SIGKILL)


def gpu_use() -> dict:
    """What nvidia-smi says about each GPU now (or why there is nothing to say)."""
    if shutil.which("nvidia-smi") is None:
        return {"error": "nvidia-smi not found on this host"}
    fields = "index,name,utilization.gpu,memory.used,memory.total"
    try:
        proc = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"nvidia-smi failed: {e}"}
    if proc.returncode != 0:
        return {"error": f"nvidia-smi exited {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    gpus = []
    for line in proc.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 5:
            index, name, util, used, total = parts
            gpus.append(
                {
                    "index": index,
                    "name": name,
                    "util_pct": util,
                    "mem_used_mib": used,
                    "mem_total_mib": total,
                }
            )
    return {"gpus": gpus}


def _tree_bytes(path: str) -> tuple[int, int]:
    """(bytes, files) under a folder, links not followed."""
    total = files = 0
    for base, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(base, n)).st_size
                files += 1
            except OSError:
                pass
    return total, files


def data_root_usage(root: str) -> dict:
    """Bytes per stage folder of the data root (extract/, checkpoints/, ...) and per entry in
    each, plus the file system's free space."""
    if not os.path.isdir(root):
        return {"path": root, "exists": False}
    stages = []
    for stage in sorted(os.listdir(root)):
        folder = os.path.join(root, stage)
        if not os.path.isdir(folder):
            continue
        entries = []
        for name in sorted(os.listdir(folder)):
            b, n = _tree_bytes(os.path.join(folder, name))
            entries.append({"name": name, "bytes": b, "files": n})
        stages.append(
            {"stage": stage, "bytes": sum(e["bytes"] for e in entries), "entries": entries}
        )
    du = shutil.disk_usage(root)
    return {"path": root, "exists": True, "stages": stages, "free": du.free, "total": du.total}


def op_list(req: dict) -> dict:
    """Recent jobs of this project, the host's GPU locks and GPU use, and the data root's usage
    (for `eagleflow remote status`)."""
    root, jobs = _dirs(req)
    rows = []
    if os.path.isdir(jobs):
        names = sorted(os.listdir(jobs), key=lambda n: os.stat(os.path.join(jobs, n)).st_mtime)
        for job_id in names[-int(req.get("last", 20)) :]:
            jobdir = os.path.join(jobs, job_id)
            r = _read_json(os.path.join(jobdir, "request.json"), {})
            rows.append(
                {
                    "id": job_id,
                    "rule": r.get("rule"),
                    "wildcards": r.get("wildcards", {}),
                    **_state(jobdir),
                }
            )
    lock_dir = host_path(req["gpu_lock_dir"])
    locks = {}
    if os.path.isdir(lock_dir):
        for name in sorted(os.listdir(lock_dir)):
            locks[name] = _read_json(os.path.join(lock_dir, name, "owner.json"), {})
    alive = {j["id"]: job_processes(j["id"]) for j in rows}
    out = {
        "ok": True,
        "host": socket.gethostname(),
        "jobs": rows,
        "locks": locks,
        "procs": alive,
        "now": time.time(),
    }
    if req.get("gpu_use"):
        out["gpu_use"] = gpu_use()
    if req.get("data_root"):
        out["data_root"] = data_root_usage(os.path.join(root, os.path.expanduser(req["data_root"])))
    return out


PROBE = r"""
import importlib.metadata as md, importlib.util, json, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
def probe(name, fn):
    try:
        out[name] = fn()
    except BaseException as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"}
def torch_info():
    import torch
    return {"version": torch.__version__, "cuda": torch.version.cuda,
            "gpus": torch.cuda.device_count()}
def imported(mod):  # a real import: what the issue asks of sglang
    def get():
        m = __import__(mod)
        return {"version": getattr(m, "__version__", None) or md.version(mod)}
    return get
def installed(mod, dist):  # cheap: found on the path, version from its metadata
    def get():
        if importlib.util.find_spec(mod) is None:
            raise ModuleNotFoundError(f"No module named {mod!r}")
        try:
            return {"version": md.version(dist)}
        except md.PackageNotFoundError:
            return {"version": "(source)"}
    return get
probe("torch", torch_info)
probe("sglang", imported("sglang"))
for mod in ("snakemake", "speculators", "eagleflow"):
    probe(mod, installed(mod, mod))
print("EAGLEFLOW-PROBE " + json.dumps(out))
"""


def op_check(req: dict) -> dict:
    """What the job environment on this host offers: python, torch GPUs, sglang, tools, space."""
    root = host_path(req["remote_dir"])
    res: dict = {"ok": True, "host": socket.gethostname(), "root": root}
    os.makedirs(root, exist_ok=True)
    res["writable"] = os.access(root, os.W_OK)
    res["free_gb"] = round(shutil.disk_usage(root).free / 1e9, 1)
    rsync = shutil.which("rsync")
    res["rsync"] = None
    if rsync:
        first = subprocess.run([rsync, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"version (\d+\.\d+\.\d+)", first)
        res["rsync"] = m.group(1) if m else "?"
    res["nvidia_smi"] = gpu_indices("auto")
    res["gpus_setting"] = gpu_indices(req["gpus"])
    env = dict(os.environ, **req.get("env", {}))
    src = os.path.join(root, "src")
    if os.path.isdir(src):
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    script = (
        f"{req['activate']}\n"
        'rc=$?; [ "$rc" = 0 ] || { echo "the activation command exited with $rc" >&2; exit 97; }\n'
        f"exec python -c {shlex.quote(PROBE)}"
    )
    proc = subprocess.run(
        ["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    probe = [ln for ln in proc.stdout.splitlines() if ln.startswith("EAGLEFLOW-PROBE ")]
    if probe:
        res["env"] = json.loads(probe[-1][len("EAGLEFLOW-PROBE ") :])
    else:
        res["env"] = {"error": (proc.stderr or proc.stdout).strip()[-2000:], "rc": proc.returncode}
    return res


def op_setup(req: dict) -> dict:
    """Create the venv (when missing) and install eagleflow with the gpu-host extra into it."""
    root = host_path(req["remote_dir"])
    venv = os.path.join(root, os.path.expanduser(req["venv"]))
    log_path = os.path.join(root, ".eagleflow", "setup.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    steps = []
    python = os.path.join(venv, "bin", "python")
    bundle = req.get("bundle")
    if not os.path.exists(python):
        # offline: the host's own torch/CUDA stay visible; the bundle brings the rest
        steps.append(
            [sys.executable, "-m", "venv", *(["--system-site-packages"] if bundle else []), venv]
        )
    if bundle:
        # No index reachable: install the offline bundle (eagleflow.bundle) into a site folder and
        # put the pushed sources, then that folder, on the venv's path.
        site = os.path.join(root, ".eagleflow", "site")
        steps.append([python, "src/eagleflow/bundle.py", "install", bundle, "--site", site])
        lines = os.path.join(root, "src") + "\n" + site + "\n"
        code = (
            "import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()['purelib'], "
            f"'eagleflow-bundle.pth').write_text({lines!r})"
        )
        steps.append([python, "-c", code])
    else:
        pip = [python, "-m", "pip"]
        steps.append([*pip, "install", "-q", "--upgrade", "pip"])
        steps.append([*pip, "install", "-e", f".[{req['extra']}]"])
    with open(log_path, "a") as log:
        for cmd in steps:
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            rc = subprocess.call(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT)
            if rc != 0:
                return {
                    "ok": False,
                    "host": socket.gethostname(),
                    "failed": shlex.join(cmd),
                    "rc": rc,
                    "log": log_path,
                    "tail": _tail(log_path, 30),
                }
    return {"ok": True, "host": socket.gethostname(), "log": log_path, "venv": venv}


OPS = {
    "ping": op_ping,
    "find": op_find,
    "start": op_start,
    "status": op_status,
    "cancel": op_cancel,
    "restart": op_restart,
    "list": op_list,
    "log": op_log,
    "check": op_check,
    "setup": op_setup,
}


# ---------------------------------------------------------------------------------------------
# the detached runner of one job


class _Cancelled(Exception):
    pass


def run(jobdir: str) -> int:
    """Wait for GPUs, run the job with CUDA_VISIBLE_DEVICES set, record the outcome."""
    # atomic: the starter polls for this file and reads it as soon as it exists
    _write_json(os.path.join(jobdir, "pid"), os.getpid())
    req = _read_json(os.path.join(jobdir, "request.json"))
    state_path = os.path.join(jobdir, "state.json")
    st = _read_json(state_path, {})
    lock_dir = host_path(req["gpu_lock_dir"])
    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    gpus: list[str] = []
    rc = None
    try:
        owner = {"job": req["job_id"], "pid": os.getpid(), "host": socket.gethostname()}
        indices = gpu_indices(req["gpus"])
        waited = 0.0
        while req["gpu"] > 0:
            if stop["sig"]:
                raise _Cancelled
            got = try_lock_gpus(lock_dir, indices, req["gpu"], dict(owner, since=time.time()))
            if got is not None:
                gpus = got
                break
            if waited == 0:
                print(f"eagleflow: waiting for {req['gpu']} free GPU(s) of {indices}", flush=True)
            time.sleep(1)
            waited += 1
        env = dict(os.environ, **req.get("env", {}))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        env[JOB_ENV] = req["job_id"]
        env["PYTHONPATH"] = os.path.join(host_path(req["remote_dir"]), "src") + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        st.update(state="running", gpus=gpus, started=time.time(), host=socket.gethostname())
        _write_json(state_path, st)
        script = (
            f"{req['activate']}\n"
            'rc=$?; if [ "$rc" != 0 ]; then echo "eagleflow: the remote environment\'s '
            'activation command failed (exit $rc); run make remote-setup" >&2; exit 97; fi\n'
            f"exec bash {shlex.quote(os.path.join(jobdir, 'job.sh'))}\n"
        )
        if stop["sig"]:
            raise _Cancelled
        child = subprocess.Popen(["bash", "-c", script], cwd=host_path(req["remote_dir"]), env=env)
        killed_at = None
        while True:
            try:
                rc = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if stop["sig"] and killed_at is None:
                killed_at = time.time()
                _signal_job(req["job_id"], None, signal.SIGTERM)
            if killed_at is not None and time.time() - killed_at > GRACE_S:
                _signal_job(req["job_id"], None, signal.SIGKILL)
        if stop["sig"]:
            raise _Cancelled
        st.update(state="success" if rc == 0 else "failed", rc=rc)
    except _Cancelled:
        by_us = os.path.exists(os.path.join(jobdir, "cancel"))
        st.update(state="cancelled", rc=rc, signal=stop["sig"], by_eagleflow=by_us)
    except BaseException as e:  # the runner itself failed: say so in the job's record
        print(f"eagleflow: remote runner failed: {type(e).__name__}: {e}", flush=True)
        st.update(state="failed", rc=rc)
    finally:
        release_gpus(lock_dir, gpus, req["job_id"])
        st["finished"] = time.time()
        _write_json(state_path, st)
    return 0


def main(req: dict) -> None:
    """Entry point of a request sent on stdin: run one operation, print one JSON line."""
    os.chdir(os.path.expanduser("~"))
    try:
        out = OPS[req["op"]](req)
    except AgentError as e:
        out = {"ok": False, "host": socket.gethostname(), "error": str(e)}
    except Exception as e:
        out = {"ok": False, "host": socket.gethostname(), "error": f"{type(e).__name__}: {e}"}
    print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["run"]:
    sys.exit(run(sys.argv[2]))
elif __name__ == "__main__" and sys.argv[1:2] == ["reap"]:
    reap(sys.argv[2], sys.argv[3:])
