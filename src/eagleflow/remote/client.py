"""The remote-gpu profile's helpers (`python -m eagleflow.remote.client submit|status|cancel|watch`)
and the text of `eagleflow remote status`.

The laptop side lives in settings.py (settings.yaml, EAGLEFLOW_REMOTE_*), transport.py (ssh,
rsync, agent calls), jobscript.py (Snakemake's jobscript, job keys), jobs.py (submit, status,
logs), watch.py (runs, cancel, the watcher) and setup.py (setup, check, install-profile);
the host side in agent.py.

The profile (profiles/remote-gpu) runs every non-local rule through the cluster-generic executor;
its submit / status / cancel helpers are thin shims over `python -m eagleflow.remote.client`:

- submit: read the jobscript Snakemake wrote and compute the job's key (rule, wildcards,
  params, outputs, input contents); a job of the same key still on the host is attached to
  (its id comes back, nothing new starts), one of another key writing the same outputs refuses
  the submission. Else push the workflow sources and the job's inputs
  (rsync: only what is missing or changed), then ask the host's agent (`remote/agent.py`, sent
  on ssh's stdin) to check the bulk data the job needs, take GPU locks, and start the job
  detached with CUDA_VISIBLE_DEVICES set. Prints the job id.
- status: ask the agent (an unreachable host: "running", retried with backoff, failed only
  after status_grace_s, never cancelled); on success pull the declared outputs, logs and
  benchmark back (`rsync -rlt`, mtimes kept) and print "success"; on failure pull the logs and
  print the tail.
  While the job runs, the call brings the new bytes of its log files along (live logs).
- logs: `eagleflow remote logs RULE|JOBID [--follow]`, a job's log read on the host.
- cancel: SIGTERM the job's process group (SIGKILL after a grace period).
- watch: one per Snakemake run, started with its first remote job; when the run ends it cancels
  the remote jobs the run left unfinished (Snakemake's own cancel call can miss some), unless
  Snakemake was killed: then they keep running and a rerun resumes them.

Bulk data (shards, checkpoints, the target's weights) never travels: a job whose input manifest
or target.json points at a folder the host lacks fails at submission, naming host and path.
Every ssh connection checks host keys (StrictHostKeyChecking yes, BatchMode: no password
prompts); every remote command is built from quoted parts, and no key material is ever written.
"""

from __future__ import annotations

import sys
import time

from eagleflow.errors import EagleflowError
from eagleflow.remote.jobs import FINAL_STATES, since, status, submit
from eagleflow.remote.settings import Settings, load_settings
from eagleflow.remote.transport import Remote
from eagleflow.remote.watch import cancel, watch


def list_jobs(
    settings: Settings, last: int = 20, data_root: str | None = None, gpu_use: bool = False
) -> dict:
    """The host's recent jobs and GPU locks; GPU use (nvidia-smi) and the usage of `data_root`
    (relative: under the remote dir) when asked."""
    return Remote(settings).agent(
        "list", last=last, data_root=data_root, gpu_use=gpu_use, timeout=300
    )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _duration(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def status_report(ans: dict, settings: Settings, running_only: bool = False) -> str:
    """`eagleflow remote status`: jobs, GPU locks, GPU use, data root usage, as text."""
    now = ans.get("now") or time.time()
    lines = [f"{settings.label} ({ans['host']}), remote dir {settings.remote_dir}", "jobs:"]
    jobs = [j for j in ans["jobs"] if not running_only or j["state"] not in FINAL_STATES]
    for job in jobs:
        start = job.get("started") or job.get("submitted")
        end = job.get("finished") or now
        wild = ",".join(f"{k}={v}" for k, v in (job.get("wildcards") or {}).items()) or "-"
        lines.append(
            f"  {job['state']:9} {job.get('rule') or '?':24} {wild:16} started {since(start)}"
            f"  elapsed {_duration(end - start) if start else '?':>7}"
            f"  gpus={','.join(job.get('gpus', [])) or '-'}"
            f"  procs={len(ans['procs'].get(job['id'], []))}  {job['id']}"
        )
    if not jobs:
        lines.append("  none" if running_only else "  no jobs yet")
    for name, owner in ans["locks"].items():
        lines.append(f"  lock {name}: held by {owner.get('job')} (pid {owner.get('pid')})")
    use = ans.get("gpu_use")
    if use is not None:
        lines.append("GPUs:")
        if "error" in use:
            lines.append(f"  {use['error']}")
        for g in use.get("gpus", []):
            lines.append(
                f"  {g['index']}: {g['name']}  {g['util_pct']}% busy  "
                f"{g['mem_used_mib']} / {g['mem_total_mib']} MiB"
            )
    dr = ans.get("data_root")
    if dr is not None:
        lines.append(f"data root {dr['path']}:")
        if not dr.get("exists"):
            lines.append("  does not exist yet")
        for st in dr.get("stages", []):
            lines.append(f"  {st['stage'] + '/':14} {_human(st['bytes']):>10}")
            for e in st["entries"]:
                lines.append(f"    {e['name']:40} {_human(e['bytes']):>10}  {e['files']} files")
        if dr.get("exists"):
            lines.append(f"  free {_human(dr['free'])} of {_human(dr['total'])}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the profile's helpers: python -m eagleflow.remote.client submit|status|cancel


def helper_main(argv: list[str] | None = None) -> int:
    """Entry point of the profile's submit / status / cancel shims."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("submit", "status", "cancel", "watch"):
        print(
            "usage: python -m eagleflow.remote.client submit JOBSCRIPT | status ID | cancel ID...",
            file=sys.stderr,
        )
        return 2
    cmd, rest = argv[0], argv[1:]
    try:
        settings = load_settings()
        if cmd == "submit":
            info = submit(rest[0], settings)
            if info["attached"]:
                job = info["attached"]
                print(
                    f"remote-gpu: {info['rule']} -> {info['host']}: attached to {job['id']} "
                    f"({job['state']} since {since(job.get('since'))}, GPUs "
                    f"{','.join(job.get('gpus') or []) or '-'}): the same work, started by an "
                    f"earlier run; nothing new started (in {info['seconds']:.2f} s)",
                    file=sys.stderr,
                )
            else:
                print(
                    f"remote-gpu: {info['rule']} -> {info['host']} as {info['job_id']} (pushed "
                    f"{info['pushed_bytes']} bytes; staged in {info['seconds']:.2f} s)",
                    file=sys.stderr,
                )
            print(info["job_id"])
        elif cmd == "watch":
            return watch(rest[0], settings)
        elif cmd == "status":
            state, msg = status(rest[0], settings)
            if msg:
                print(msg, file=sys.stderr)
            print(state)
        else:
            cancel(rest, settings)
            print(f"remote-gpu: cancelled {' '.join(rest)}", file=sys.stderr)
    except EagleflowError as e:
        # Snakemake shows a failed submit command's stdout in its error message
        print(f"remote-gpu: {e}", file=sys.stdout if cmd == "submit" else sys.stderr)
        if cmd == "status":
            print("failed")
            return 0
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(helper_main())
