"""A real one-node Slurm cluster on this machine for the Slurm-profile tests (Debian's slurm-wlm).

munged (own key, own socket), slurmctld and slurmd run on ports of their own. Slurm's commands
inside a job read `/etc/slurm/slurm.conf` (the jobstep plugin strips `SLURM_CONF` before its
inner `srun`), so the daemons run in a mount namespace of their own (`unshare --mount`)
with this cluster's config folder bind-mounted over `/etc/slurm`: every job sees it, the host's
`/etc/slurm` is never written. The test process reaches the cluster through `SLURM_CONF`.

The node claims two GPUs whose device files are character devices made here (gres.conf
`File=`), 32 CPUs and 1 TB of memory (`SlurmdParameters=config_overrides`: the profile's
per-rule requests are a real cluster's, not this machine's). No accounting: the plugin's
`squeue` status path is the one tested. `stop()` cancels every job and stops every daemon it
started.

`sbatch` on the clients' PATH is a shim that runs the real one and records each call's exit
status, time and stderr in `log/sbatch.log`: Snakemake's Slurm plugin reports a failed submission
with sbatch's stderr only, which was once empty. `diagnostics()` gives that record and the
controller's log tail for a failing test's message.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.sshd import free_port

NEEDED = ["slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "munged"]

SBATCH_SHIM = """#!/bin/bash
# tests/support/slurm.py: the real sbatch; each call's exit status and stderr recorded
err=$(mktemp)
t0=$EPOCHREALTIME
{real} "$@" 2>"$err"
rc=$?
echo "$(date +%T.%N) rc=$rc start=$t0 end=$EPOCHREALTIME stderr=$(tr '\\n' ' ' <"$err")" \\
  >>{log}/sbatch.log
cat "$err" >&2
rm -f "$err"
exit $rc
"""


def available() -> str | None:
    """None when a cluster can start here, else why not."""
    if os.geteuid() != 0:
        return "the Slurm tests need root (daemons, a mount namespace)"
    missing = [b for b in NEEDED if not (shutil.which(b) or Path("/usr/sbin", b).exists())]
    if missing:
        return f"missing {missing}: tests/support/system-deps.sh installs slurm-wlm and munge"
    if not Path("/etc/slurm").is_dir():
        return "/etc/slurm does not exist (slurm-wlm creates it): nothing to bind-mount over"
    return None


class TestSlurm:
    """`start()`, then `env()` for Slurm's client commands; `stop()` at the end."""

    __test__ = False

    def __init__(self, base: Path, gpus: int = 2):
        self.base = base
        self.gpus = gpus
        self.etc = base / "etc"
        self.conf = self.etc / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        self.pids: dict[str, Path] = {}
        # munged runs as the munge user, which cannot enter pytest's 0700 folders
        self.munge = Path(tempfile.mkdtemp(prefix="eagleflow-munge-"))

    def env(self) -> dict[str, str]:
        path = f"{self.base / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": path}

    def diagnostics(self, lines: int = 40) -> str:
        """The sbatch shim's record and the tails of the daemons' logs."""
        out = []
        for name in ("sbatch.log", "slurmctld.log", "slurmd.log"):
            path = self.base / "log" / name
            text = path.read_text(errors="replace").splitlines() if path.is_file() else []
            out.append(f"== {path} (last {lines} lines)\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def cmd(self, *args: str, check: bool = True, timeout: float = 30) -> str:
        r = subprocess.run(
            list(args), env=self.env(), capture_output=True, text=True, timeout=timeout
        )
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def _write_config(self) -> None:
        b = self.base
        for d in ("etc", "state", "spool", "log", "run", "dev", "bin"):
            (b / d).mkdir(parents=True, exist_ok=True)
        shim = b / "bin" / "sbatch"
        shim.write_text(
            SBATCH_SHIM.format(real=shutil.which("sbatch") or "/usr/bin/sbatch", log=b / "log")
        )
        shim.chmod(0o755)
        m = self.munge
        os.chmod(m, 0o755)
        for d in ("munge", "mkey"):
            (m / d).mkdir(exist_ok=True)
        for i in range(self.gpus):
            dev = b / "dev" / f"gpu{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # a /dev/null twin
        key = m / "mkey" / "key"
        key.write_bytes(os.urandom(128))
        shutil.chown(m / "mkey", "munge", "munge")
        shutil.chown(key, "munge", "munge")
        shutil.chown(m / "munge", "munge", "munge")
        os.chmod(m / "mkey", 0o700)
        os.chmod(key, 0o600)
        os.chmod(m / "munge", 0o755)
        ctld, slurmd = free_port(), free_port()
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=eagleflow-test",
                    f"SlurmctldHost={self.host}",
                    f"SlurmctldPort={ctld}",
                    f"SlurmdPort={slurmd}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={m / 'munge' / 'sock'}",
                    f"StateSaveLocation={b / 'state'}",
                    f"SlurmdSpoolDir={b / 'spool'}",
                    f"SlurmctldPidFile={b / 'run' / 'slurmctld.pid'}",
                    f"SlurmdPidFile={b / 'run' / 'slurmd.pid'}",
                    f"SlurmctldLogFile={b / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={b / 'log' / 'slurmd.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core_Memory",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "ReturnToService=2",
                    "SlurmdParameters=config_overrides",
                    "MinJobAge=600",
                    "KillWait=30",
                    "GresTypes=gpu",
                    f"NodeName={self.host} CPUs=32 RealMemory=1000000 Gres=gpu:{self.gpus} "
                    "State=UNKNOWN",
                    f"PartitionName=main Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        (self.etc / "gres.conf").write_text(
            f"Name=gpu File={b / 'dev'}/gpu[0-{self.gpus - 1}]\n"
            if self.gpus > 1
            else f"Name=gpu File={b / 'dev'}/gpu0\n"
        )
        plugstack = Path("/etc/slurm/plugstack.conf")
        if plugstack.is_file():
            shutil.copy(plugstack, self.etc / "plugstack.conf")

    def start(self) -> TestSlurm:
        why = available()
        if why:
            raise RuntimeError(why)
        self._write_config()
        b, m = self.base, self.munge
        munged = shutil.which("munged") or "/usr/sbin/munged"
        subprocess.run(
            ["runuser", "-u", "munge", "--", munged, f"--socket={m / 'munge' / 'sock'}",
             f"--key-file={m / 'mkey' / 'key'}", f"--pid-file={m / 'munge' / 'pid'}",
             f"--log-file={m / 'munge' / 'log'}", f"--seed-file={m / 'munge' / 'seed'}"],
            check=True, timeout=30,
        )  # fmt: skip
        self.pids["munged"] = m / "munge" / "pid"
        script = (
            f"mount --bind {self.etc} /etc/slurm && /usr/sbin/slurmctld -f /etc/slurm/slurm.conf"
            " && /usr/sbin/slurmd -f /etc/slurm/slurm.conf"
        )
        subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            check=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "SLURM_CONF"},
        )  # fmt: skip
        self.pids["slurmctld"] = b / "run" / "slurmctld.pid"
        self.pids["slurmd"] = b / "run" / "slurmd.pid"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = self.cmd("sinfo", "--noheader", "-o", "%T", check=False).strip()
            if out == "idle":
                return self
            time.sleep(0.2)
        raise RuntimeError(f"the test node did not come up idle: {out!r}; logs in {b / 'log'}")

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (Slurm's own record of the job)."""
        out = self.cmd("scontrol", "-o", "show", "job", str(job_id))
        fields = {}
        for item in out.split():
            if "=" in item:
                k, v = item.split("=", 1)
                fields[k] = v
        return fields

    def jobs(self) -> list[dict[str, str]]:
        out = self.cmd("squeue", "--states=all", "--noheader", "-o", "%i")
        return [self.job(j) for j in out.split()]

    def stop(self) -> None:
        self.cmd("scancel", "--full", "--user", "root", check=False)
        for name in ("slurmd", "slurmctld", "munged"):
            path = self.pids.get(name)
            try:
                pid = int(path.read_text().split()[0]) if path else None
            except (OSError, ValueError, IndexError):
                pid = None
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.munge, ignore_errors=True)
