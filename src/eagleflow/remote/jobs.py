"""One remote job's life: submit (stage and start), status (pull back, live logs), logs."""

from __future__ import annotations

import base64
import json
import os
import secrets
import sys
import time
from pathlib import Path

from eagleflow.errors import RemoteError
from eagleflow.remote.jobscript import (
    inside,
    job_key,
    job_script_text,
    parse_jobscript,
    rewrite_args,
)
from eagleflow.remote.settings import LOCAL_STATE, Settings
from eagleflow.remote.transport import AGENT_FILE, Remote
from eagleflow.remote.watch import USER_CANCEL, cancelled_by, register, run_alive, unregister

MAX_REF_JSON = 8 << 20  # input JSON files larger than this are not scanned for bulk references


# ---------------------------------------------------------------------------------------------
# staging


def bulk_refs(workdir: Path, inputs: list[str]) -> list[dict]:
    """Folders the job's inputs point at that must already be on the host: the shard root of a
    manifest, the model folder of a target.json. They never travel (DESIGN.md: bulk stays)."""
    refs = []
    for name in inputs:
        p = Path(name) if os.path.isabs(name) else workdir / name
        if p.suffix != ".json" or not p.is_file() or p.stat().st_size > MAX_REF_JSON:
            continue
        try:
            body = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(body, dict):
            continue
        if "shards" in body and isinstance(body.get("root"), str):
            refs.append(
                {
                    "path": body["root"],
                    "why": f"shards of manifest {name}",
                    "made_on": body.get("host"),
                }
            )
        elif "config_sha256" in body and isinstance(body.get("path"), str):
            refs.append(
                {"path": body["path"], "why": f"target model folder of {name}", "made_on": None}
            )
    return refs


def _missing_message(s: Settings, host: str, rule: str, missing: list[dict]) -> str:
    lines = [f"rule {rule} cannot run on {s.host} ({host}): what it needs is not there."]
    for m in missing:
        where = f" (made on {m['made_on']})" if m.get("made_on") else ""
        lines.append(f"  - {m['why']}: {m['path']} does not exist on {s.host}{where}")
    lines.append(
        "Bulk data stays on the host that made it and is never copied by the profile: run the "
        "producing rule on the GPU host (so its data_root is there), or put the folder at that "
        f"path on {s.host} (e.g. target.path naming a model folder present on both machines)."
    )
    return "\n".join(lines)


def new_job_id(rule: str, jobid) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{rule}-{jobid}-{secrets.token_hex(3)}"


def submit(jobscript: str | Path, settings: Settings, cwd: str | Path | None = None) -> dict:
    """Stage one job to the GPU host and start it there; returns the job id and timings."""
    t0 = time.monotonic()
    js = parse_jobscript(Path(jobscript).read_text(), cwd)
    workdir = js.workdir
    props = js.properties
    inputs = props.get("input")
    outputs = props.get("output")
    if inputs is None or outputs is None:
        raise RemoteError(
            f"rule {js.rule}: more than 100 inputs or outputs; Snakemake then leaves them out of "
            "the jobscript and the remote profile cannot stage them (use a directory() output)"
        )
    args, stage = rewrite_args(js.args, workdir)
    for local, target in stage:
        if target.startswith(str(LOCAL_STATE)):
            dest = workdir / target
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(local.read_bytes())
    push = [src for src in settings.sources if (workdir / src).exists()]
    push += [target for _local, target in stage]
    require = bulk_refs(workdir, inputs)
    for name in inputs:
        rel = inside(name, workdir)
        if rel is None:
            require.append({"path": name, "why": "input outside the workflow folder"})
        else:
            push.append(rel)
    remote = Remote(settings)
    key = job_key(js)
    rel_outputs = [inside(p, workdir) or p for p in outputs]
    # the same work may still run on the host (its Snakemake was killed, the laptop slept):
    # attach to it before pushing anything that could change the files it reads
    found = remote.agent("find", key=key, outputs=rel_outputs)
    if found.get("conflict"):
        raise RemoteError(_conflict_message(settings, found["host"], js.rule, found["conflict"]))
    if found.get("attach"):
        return _attached(workdir, js.rule, found, t0)
    pushed = remote.push(workdir, sorted(set(push)))
    if pushed["rc"] != 0:
        raise RemoteError(
            f"pushing rule {js.rule}'s inputs to {settings.label} failed: {pushed['stderr']}"
        )
    job_id = new_job_id(js.rule, props.get("jobid"))
    logs = [inside(p, workdir) or p for p in props.get("log", [])]
    ans = remote.agent(
        "start",
        job_id=job_id,
        rule=js.rule,
        key=key,
        wildcards=props.get("wildcards", {}),
        gpu=int(props.get("resources", {}).get("gpu", 0) or 0),
        outputs=rel_outputs,
        logs=logs,
        require=require,
        activate=settings.activate_cmd,
        env=settings.env,
        job_script=job_script_text(js, args),
        agent=AGENT_FILE.read_text(),
    )
    if ans.get("missing"):
        raise RemoteError(_missing_message(settings, ans.get("host", "?"), js.rule, ans["missing"]))
    if ans.get("conflict"):
        raise RemoteError(_conflict_message(settings, ans["host"], js.rule, ans["conflict"]))
    if ans.get("attached"):
        return _attached(workdir, js.rule, {"host": ans["host"], "attach": ans["attached"]}, t0)
    if not ans.get("ok"):
        raise RemoteError(f"{settings.label}: cannot start rule {js.rule}: {ans.get('error')}")
    register(workdir, job_id, js.rule)
    return {
        "job_id": job_id,
        "rule": js.rule,
        "host": ans["host"],
        "pushed_bytes": pushed["bytes"],
        "push_s": pushed["seconds"],
        "seconds": time.monotonic() - t0,
        "attached": False,
    }


def _attached(workdir: Path, rule: str, found: dict, t0: float) -> dict:
    """Submission answered by a job of the same work already on the host: its id, no new job
    (it keeps its GPUs; this run's status calls pull its outputs, Ctrl-C cancels it)."""
    job = found["attach"]
    register(workdir, job["id"], rule)
    return {
        "job_id": job["id"],
        "rule": rule,
        "host": found["host"],
        "attached": job,
        "seconds": time.monotonic() - t0,
    }


def since(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "?"


def _conflict_message(s: Settings, host: str, rule: str, jobs: list[dict]) -> str:
    lines = [
        f"rule {rule}: not started on {host}: a job that writes the same outputs still runs there "
        "for other work (its script, params or inputs differ from this run's), and two jobs "
        "never write the same files:"
    ]
    for j in jobs:
        gpus = ",".join(j.get("gpus") or []) or "-"
        lines.append(
            f"  - {j['id']} (rule {j['rule']}, {j['state']} since {since(j.get('since'))}, "
            f"GPUs {gpus})"
        )
    ids = " ".join(j["id"] for j in jobs)
    lines.append(
        f"Wait for it to finish (`eagleflow remote logs {jobs[0]['id']} --follow`), or cancel it "
        f"and rerun: eagleflow remote cancel {ids}"
    )
    return "\n".join(lines)


def _grace_file(workdir: Path) -> Path:
    return workdir / LOCAL_STATE / "unreachable.json"


def _read_grace(path: Path) -> dict | None:
    try:
        rec = json.loads(path.read_text())
        return rec if {"since", "fails", "next"} <= set(rec) else None
    except (OSError, ValueError):
        return None


def _write_json_file(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def status(job_id: str, settings: Settings, workdir: str | Path | None = None) -> tuple[str, str]:
    """(running | success | failed, a message for stderr); pulls outputs back on success."""
    workdir = Path(workdir or os.getcwd())
    remote = Remote(settings)
    grace = _grace_file(workdir)
    lost = _read_grace(grace)
    now = time.time()
    if lost and now < lost["next"] and now - lost["since"] < settings.status_grace_s:
        return "running", ""  # backing off: the host did not answer a moment ago
    mirror = _mirror_due(workdir, job_id, settings)
    extra = {"log_offsets": {job_id: mirror["offsets"]}} if mirror is not None else {}
    try:
        ans = remote.agent("status", ids=[job_id], timeout=settings.connect_timeout_s + 30, **extra)
    except RemoteError as e:
        # a dropped connection must not fail a GPU job that keeps running on the host: retry
        # with backoff (shared by all of this run's jobs: one host), fail after the grace period
        lost = lost or {"since": now, "fails": 0}
        lost["fails"] += 1
        delay = min(2 ** lost["fails"], 30)
        lost["next"] = now + delay
        grace.parent.mkdir(parents=True, exist_ok=True)
        _write_json_file(grace, lost)
        waited = now - lost["since"]
        if waited < settings.status_grace_s:
            return "running", (
                f"remote-gpu: status of {job_id} unknown for now (check {lost['fails']} failed, "
                f"next try in {delay} s; it counts as failed after {settings.status_grace_s} s "
                f"without contact): {e}"
            )
        unregister(workdir, job_id)  # a lost connection is no cancel: the job may keep running
        return "failed", (
            f"remote-gpu: lost contact with {settings.label} for {waited:.0f} s (setting "
            f"status_grace_s = {settings.status_grace_s}) while job {job_id} was running: {e}\n"
            "The job was not cancelled and may still run there: once the host answers, "
            f"`eagleflow remote status` shows it; rerunning the same work attaches to it (or "
            f"`eagleflow remote cancel {job_id}` stops it)."
        )
    grace.unlink(missing_ok=True)
    st = ans["jobs"].get(job_id, {"state": "unknown"})
    state = st["state"]
    rule = st.get("rule") or "?"
    if state in ("queued", "running"):
        register(workdir, job_id, rule)  # also the jobs this run resumed
        if mirror is not None:
            _mirror_write(workdir, job_id, mirror, st.get("log_chunks", {}))
        return "running", ""
    if state == "cancelled" and st.get("by_eagleflow"):
        # Snakemake resumes a job it once submitted (its external id is on record). If a run
        # that has ended since cancelled it (Ctrl-C), this run wants it done: start it again.
        # A live cancelling run is this one, shutting down (or a concurrent one): no restart.
        by = cancelled_by(workdir, job_id)
        if by != USER_CANCEL and (by is None or not run_alive(by)):
            ans = remote.agent("restart", ids=[job_id])
            if job_id in ans.get("conflicts", {}):
                unregister(workdir, job_id)
                return "failed", "remote-gpu: " + _conflict_message(
                    settings, ans["host"], rule, ans["conflicts"][job_id]
                ).replace("not started", "not restarted", 1)
            register(workdir, job_id, rule)
            return (
                "running",
                f"remote-gpu: {rule}: restarted {job_id} (cancelled by an earlier run)",
            )
    unregister(workdir, job_id)  # finished: nothing to cancel any more
    _mirror_file(workdir, job_id).unlink(missing_ok=True)  # the final pull brings the whole log
    if state == "success":
        files = st.get("outputs", []) + st.get("logs", []) + st.get("benchmark", [])
        pulled = remote.pull(workdir, [f for f in files if not os.path.isabs(f)])
        if pulled["rc"] != 0:
            return "failed", (
                f"remote-gpu: job {job_id} succeeded on {ans['host']} but pulling its outputs "
                f"failed: {pulled['stderr']}"
            )
        return "success", (
            f"remote-gpu: {rule} done on {ans['host']}; pulled "
            f"{pulled['bytes']} bytes in {pulled['seconds']:.2f} s"
        )
    if state == "unknown":
        return "failed", (
            f"remote-gpu: job {job_id} is unknown on {settings.label} under {settings.remote_dir}"
            " (settings changed since it was submitted?)"
        )
    remote.pull(workdir, [f for f in st.get("logs", []) if not os.path.isabs(f)])
    why = "it was cancelled" if state == "cancelled" else f"exit status {st.get('rc')}"
    if st.get("lost"):
        why = "its runner died (host rebooted or process killed)"
    tail = st.get("tail", "")
    return "failed", (
        f"remote-gpu: {rule} failed on {ans['host']} ({why}); last lines of "
        f"{settings.remote_dir}/.eagleflow/jobs/{job_id}/job.out:\n{tail}"
    )


# live logs: while a job runs, the new bytes of its `log:` files ride on a status call (at most
# once per log_mirror_s) and are written at their offset into the local log files, so `tail -F`
# works here; writing at the offset makes a repeated or concurrent write harmless.


def _mirror_file(workdir: Path, job_id: str) -> Path:
    return workdir / LOCAL_STATE / "logs" / f"{job_id}.json"


def _mirror_due(workdir: Path, job_id: str, settings: Settings) -> dict | None:
    """The job's mirror record ({"at", "offsets"}) when a mirror is due now, else None."""
    if settings.log_mirror_s <= 0:
        return None
    try:
        rec = json.loads(_mirror_file(workdir, job_id).read_text())
    except (OSError, ValueError):
        return {"at": 0, "offsets": {}}
    return rec if time.time() - rec.get("at", 0) >= settings.log_mirror_s else None


def write_at(path: Path, offset: int, data: bytes) -> None:
    """Write `data` at `offset` of a local file (made with its folder; cut there at offset 0)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if offset == 0:
            os.ftruncate(fd, 0)  # a stale log of an earlier run
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _mirror_write(workdir: Path, job_id: str, rec: dict, chunks: dict) -> None:
    behind = False
    for rel, chunk in chunks.items():
        local = inside(rel, workdir)
        data = base64.b64decode(chunk["data"])
        if local is None or (not data and chunk["offset"] == rec["offsets"].get(rel, 0)):
            continue
        write_at(workdir / local, chunk["offset"], data)
        rec["offsets"][rel] = chunk["offset"] + len(data)
        behind = behind or rec["offsets"][rel] < chunk["size"]
    rec["at"] = 0 if behind else time.time()  # more waiting: fetch it with the next call
    path = _mirror_file(workdir, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))


def logs(
    settings: Settings, job: str, follow: bool = False, out_file: bool = False, out=None
) -> dict:
    """Print the remote log of a job (id, or the newest job of a rule); with `follow`, keep
    printing new bytes until the job ends. Returns the last answer (job id, state, path)."""
    out = out or sys.stdout.buffer
    remote = Remote(settings)
    offset = 0
    while True:
        ans = remote.agent("log", job=job, offset=offset, out=out_file, timeout=60)
        if offset == 0:
            print(
                f"== {ans['job_id']} ({ans['rule']}, {ans['state']}) on {ans['host']}: "
                f"{ans['path']}",
                file=sys.stderr,
                flush=True,
            )
        data = base64.b64decode(ans["data"])
        out.write(data)
        out.flush()
        offset = ans["offset"] + len(data)
        job = ans["job_id"]  # a rule's newest job stays the one followed
        if offset < ans["size"]:
            continue
        if not follow or ans["state"] in FINAL_STATES:
            return ans
        time.sleep(1)


FINAL_STATES = ("success", "failed", "cancelled")
