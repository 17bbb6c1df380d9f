"""Which Snakemake run a helper serves, cancelling remote jobs, and the watcher that cancels
what a run leaves unfinished.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eagleflow.errors import EagleflowError
from eagleflow.remote.settings import LOCAL_STATE, Settings
from eagleflow.remote.transport import Remote

USER_CANCEL = "user"  # `eagleflow remote cancel`: a later run never restarts such a job


def cancel(
    job_ids: list[str],
    settings: Settings,
    workdir: str | Path | None = None,
    run: str | None = None,
) -> None:
    """Kill these jobs' process groups on the host; remember which run cancelled them."""
    workdir = Path(workdir or os.getcwd())
    run = run or current_run()
    folder = workdir / LOCAL_STATE / "cancelled"
    folder.mkdir(parents=True, exist_ok=True)
    for job_id in job_ids:
        (folder / job_id).write_text(run or "")
        unregister(workdir, job_id)
    if job_ids:
        Remote(settings).agent("cancel", ids=list(job_ids), timeout=30)


def cancelled_by(workdir: Path, job_id: str) -> str | None:
    try:
        return (workdir / LOCAL_STATE / "cancelled" / job_id).read_text() or None
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# which Snakemake run a helper serves, and the watcher that cancels what a run leaves behind
#
# Snakemake's cancel call (Ctrl-C) can miss jobs: the executor empties its list of active jobs
# while a status round runs. So every run gets a watcher (a detached process, started with its
# first remote job): when the run's Snakemake process ends, the watcher cancels the run's
# unfinished remote jobs, unless Snakemake was killed (SIGKILL; its lock files are still there):
# then they keep running and a rerun resumes them. (The cluster-generic sidecar cannot do this:
# Snakemake 9.27 never stops it when there is nothing to be done, and the run hangs.)

SHELLS = {"sh", "dash", "bash", "zsh", "ksh"}
CALLER_VAR = "EAGLEFLOW_REMOTE_CALLER"  # cancel.sh passes Snakemake's pid (it runs detached)


HAVE_PROC = os.path.isdir("/proc/self")


def _proc(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, start time, command name) of a live process, or None."""
    if HAVE_PROC:
        try:
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
            name = text[text.index("(") + 1 : text.rindex(")")]
            rest = text[text.rindex(")") + 2 :].split()
            return (int(rest[1]), rest[19], name) if rest[0] != "Z" else None
        except (OSError, ValueError, IndexError):
            return None
    # no /proc (macOS): ask ps
    out = subprocess.run(
        ["ps", "-o", "ppid=,lstart=,comm=", "-p", str(pid)], capture_output=True, text=True
    ).stdout.split()
    if len(out) < 3 or not out[0].isdigit():
        return None
    return int(out[0]), "_".join(out[1:-1]), os.path.basename(out[-1])


def current_run() -> str | None:
    """The Snakemake process this helper serves, as "<pid>-<start time>": the first ancestor
    that is not a shell (Snakemake starts submit and status through `sh -c`)."""
    try:
        pid = int(os.environ.get(CALLER_VAR) or os.getppid())
    except ValueError:
        return None
    for _ in range(6):
        info = _proc(pid) if pid > 1 else None  # reparented to init: its Snakemake is gone
        if info is None:
            return None
        ppid, start, name = info
        if name not in SHELLS:
            return f"{pid}-{start}"
        pid = ppid
    return None


def run_alive(run: str) -> bool:
    pid, _, start = run.partition("-")
    info = _proc(int(pid)) if pid.isdigit() else None
    return info is not None and info[1] == start


def _runs_dir(workdir: Path) -> Path:
    return workdir / LOCAL_STATE / "active"


def register(workdir: Path, job_id: str, rule: str) -> None:
    """Note a remote job as this run's, and make sure the run has a watcher."""
    run = current_run()
    if run is None:  # no way to tell the run: Snakemake's own cancel call is all there is
        return
    folder = _runs_dir(workdir) / run
    if (folder / job_id).exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / job_id).write_text(rule)
    _ensure_watcher(workdir, run)


def unregister(workdir: Path, job_id: str) -> None:
    for f in _runs_dir(workdir).glob(f"*/{job_id}"):
        f.unlink(missing_ok=True)


def _ensure_watcher(workdir: Path, run: str) -> None:
    lock = _runs_dir(workdir) / run / ".watcher"
    for _attempt in range(2):
        try:
            lock.mkdir()  # atomic: one watcher per run, even for concurrent submissions
        except FileExistsError:
            try:
                pid = int((lock / "pid").read_text())
            except (OSError, ValueError):
                return  # another helper is starting it right now
            if _proc(pid) is not None:
                return
            shutil.rmtree(lock, ignore_errors=True)  # it died: start another
            continue
        log = open(workdir / LOCAL_STATE / "watch.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagleflow.remote.client", "watch", run],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # out of the terminal's process group: Ctrl-C spares it
            close_fds=True,
        )
        log.close()
        (lock / "pid").write_text(str(proc.pid))
        return


def _snakemake_locked(workdir: Path) -> bool:
    """Snakemake's lock files are left behind only by a killed Snakemake (or a running one)."""
    locks = workdir / ".snakemake" / "locks"
    return locks.is_dir() and any(locks.iterdir())


def watch(run: str, settings: Settings, workdir: str | Path | None = None) -> int:
    """Wait for the run's Snakemake to end, then cancel the remote jobs it left unfinished."""
    workdir = Path(workdir or os.getcwd())
    while run_alive(run) and not run.startswith("1-"):
        time.sleep(0.5)
    folder = _runs_dir(workdir) / run
    ids = sorted(p.name for p in folder.glob("[!.]*")) if folder.is_dir() else []
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    if ids and _snakemake_locked(workdir):
        print(
            f"{stamp} run {run} was killed: {len(ids)} remote job(s) keep running, a rerun "
            f"resumes them: {' '.join(ids)}",
            flush=True,
        )
    elif ids:
        try:
            cancel(ids, settings, workdir, run=run)
            print(f"{stamp} run {run} ended: cancelled {' '.join(ids)}", flush=True)
        except EagleflowError as e:
            print(f"{stamp} run {run} ended; cancelling {' '.join(ids)} failed: {e}", flush=True)
            return 1
    shutil.rmtree(folder, ignore_errors=True)
    return 0
