"""ssh and rsync to the GPU host: the generated ssh config, agent calls, push and pull."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

from eagleflow.errors import RemoteError
from eagleflow.remote.settings import ENV_PREFIX, Settings

AGENT_FILE = Path(__file__).with_name("agent.py")


# ---------------------------------------------------------------------------------------------
# ssh and rsync


def _state_home() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.expanduser("~/.cache")
    return Path(base) / "eagleflow" / "ssh"


def ssh_config_text(s: Settings, control_dir: Path | None) -> str:
    """The ssh config eagleflow uses: its options first (first value wins), then the user's."""
    lines = [
        "# written by eagleflow.remote: host keys checked, no prompts, no forwarding",
        "Host *",
        "  StrictHostKeyChecking yes",
        "  BatchMode yes",
        "  PasswordAuthentication no",
        "  KbdInteractiveAuthentication no",
        "  ForwardAgent no",
        "  ForwardX11 no",
        "  ClearAllForwardings yes",
        "  PermitLocalCommand no",
        "  UpdateHostKeys no",
        f"  ConnectTimeout {int(s.connect_timeout_s)}",
        "  ServerAliveInterval 5",
        "  ServerAliveCountMax 3",
        "  LogLevel ERROR",
    ]
    if s.user:
        lines.append(f"  User {s.user}")
    if s.port:
        lines.append(f"  Port {int(s.port)}")
    if s.identity:
        lines += [f'  IdentityFile "{os.path.expanduser(s.identity)}"', "  IdentitiesOnly yes"]
    if s.known_hosts:
        lines.append(f'  UserKnownHostsFile "{os.path.expanduser(s.known_hosts)}"')
    # A Unix socket path holds at most 107 bytes; ssh binds it with a 17-byte temporary suffix,
    # and %C expands to 40 hex digits. A longer path would make every ssh call fail: no sharing.
    fits = control_dir is not None and len(f"{control_dir}/cm-123456789abc-") + 40 + 17 <= 104
    if s.control_persist_s > 0 and fits:
        # The shared connection is keyed by this config's hash too: a different key or
        # known_hosts file must never ride on a connection that was authenticated otherwise.
        digest = hashlib.sha256(ssh_config_text(s, None).encode()).hexdigest()[:12]
        lines += [
            "  ControlMaster auto",
            f'  ControlPath "{control_dir}/cm-{digest}-%C"',
            f"  ControlPersist {int(s.control_persist_s)}",
        ]
    for opt in s.ssh_options:
        key, _, value = opt.partition("=")
        lines.append(f'  {key} "{value}"')
    user_cfg = os.path.expanduser(s.ssh_config) if s.ssh_config else ""
    if user_cfg and os.path.isfile(user_cfg):
        lines.append(f'  Include "{user_cfg}"')
    return "\n".join(lines) + "\n"


class Remote:
    """ssh / rsync / agent calls to one GPU host."""

    def __init__(self, settings: Settings):
        self.s = settings
        home = _state_home()
        text = ssh_config_text(settings, home)
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        self.config = home / f"config-{digest}"
        if not self.config.is_file() or self.config.read_text() != text:
            home.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = home / f".config-{digest}.{os.getpid()}"
            tmp.write_text(text)
            tmp.chmod(0o600)
            os.replace(tmp, self.config)

    # -- ssh
    def ssh_argv(self, command: str) -> list[str]:
        return ["ssh", "-F", str(self.config), "-T", self.s.host, "--", command]

    def ssh(self, command: str, stdin: str | None = None, timeout: float | None = 120):
        """Run one remote shell command; ssh failures become a RemoteError with the reason."""
        try:
            proc = subprocess.run(
                self.ssh_argv(command),
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=None if stdin is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise RemoteError(
                f"{self.s.label}: no answer within {timeout:.0f} s; is the host up and reachable?"
            ) from None
        except FileNotFoundError:
            raise RemoteError(
                "ssh is not installed here (Debian: apt-get install openssh-client)"
            ) from None
        if proc.returncode == 255:
            raise RemoteError(diagnose_ssh(proc.stderr, self.s))
        return proc

    def agent(self, op: str, timeout: float | None = 120, **request) -> dict:
        """Run one agent operation on the host and return its JSON answer."""
        req = {
            "op": op,
            "remote_dir": self.s.remote_dir,
            "gpus": self.s.gpus,
            "gpu_lock_dir": self.s.gpu_lock_dir,
            **request,
        }
        literal = repr(req)
        # the request travels as a Python literal: only plain data, never code
        if ast.literal_eval(literal) != req:
            raise RemoteError(f"internal: request for {op} is not plain data")
        script = AGENT_FILE.read_text() + f"\nmain({literal})\n"
        proc = self.ssh(f"{shlex.quote(self.s.python)} -", stdin=script, timeout=timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("EAGLEFLOW-AGENT ")]
        if not lines:
            err = (proc.stderr or proc.stdout).strip()[-1500:]
            hint = ""
            if proc.returncode == 127 or "not found" in err:
                hint = f"; is {self.s.python!r} a Python 3 on the host (setting python)?"
            raise RemoteError(
                f"{self.s.label}: the remote agent failed (exit {proc.returncode}){hint}\n{err}"
            )
        ans = json.loads(lines[-1][len("EAGLEFLOW-AGENT ") :])
        if op != "start" and not ans.get("ok") and "error" in ans:  # submit words its own
            raise RemoteError(f"{self.s.label} ({ans.get('host')}): {op} failed: {ans['error']}")
        return ans

    # -- rsync
    def rsync_e(self) -> str:
        # rsync splits -e itself; it honours double quotes (and the path has none: validated).
        return f'ssh -F "{self.config}"'

    def remote_spec(self, path: str = "") -> str:
        """host:path for rsync, the remote dir relative to the remote home unless absolute."""
        base = remote_rel(self.s.remote_dir)
        full = f"{base.rstrip('/')}/{path}" if path else base.rstrip("/") + "/"
        return f"{self.s.host}:{full}"

    def _rsync_argv(self, *extra: str) -> list[str]:
        """rsync -rlt (mtimes kept, never -a) over eagleflow's ssh; the names on stdin."""
        # file names travel in rsync's protocol, never through the remote shell: a remote dir
        # with spaces or `;` stays one path on every rsync version (3.2.4+ also escapes)
        protect = "-s"  # --protect-args (called --secluded-args since 3.2.7)
        return ["rsync", "-rlt", protect, "--stats", "--files-from=-", "-e", self.rsync_e(), *extra]

    def push(self, local_root: Path, rel_paths: list[str], timeout: float = 600) -> dict:
        """Copy these paths (relative to local_root) into the remote dir; only changed files."""
        argv = self._rsync_argv(
            "--delete",
            "--mkpath",
            "--exclude=__pycache__",
            "--exclude=*.pyc",
            "--exclude=*.egg-info",  # made on the host by `pip install -e`: keep it there
            "./",
            self.remote_spec(),
        )
        return self._rsync(argv, rel_paths, local_root, timeout)

    def pull(self, local_root: Path, rel_paths: list[str], timeout: float = 600) -> dict:
        """Copy these remote paths (relative to the remote dir) into local_root (-rlt, no -a)."""
        argv = self._rsync_argv(self.remote_spec(), "./")
        return self._rsync(argv, rel_paths, local_root, timeout)

    def _rsync(self, argv: list[str], rel_paths: list[str], cwd: Path, timeout: float) -> dict:
        start = time.monotonic()
        listing = "".join(f"{p}\n" for p in rel_paths)
        try:
            proc = subprocess.run(
                argv, input=listing, capture_output=True, text=True, cwd=cwd, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise RemoteError(f"{self.s.label}: rsync did not finish in {timeout:.0f} s") from None
        except FileNotFoundError:
            raise RemoteError(
                "rsync is not installed here (Debian: apt-get install rsync)"
            ) from None
        if proc.returncode == 255 or "connection unexpectedly closed" in proc.stderr:
            raise RemoteError(diagnose_ssh(proc.stderr, self.s))
        sent = re.search(r"Total transferred file size: ([\d,]+)", proc.stdout)
        return {
            "rc": proc.returncode,
            "stderr": proc.stderr.strip(),
            "bytes": int(sent.group(1).replace(",", "")) if sent else 0,
            "seconds": time.monotonic() - start,
        }

    def close(self) -> None:
        """End the shared ssh connection (ControlMaster), if one is open."""
        subprocess.run(
            ["ssh", "-F", str(self.config), "-O", "exit", self.s.host],
            capture_output=True,
            timeout=10,
        )


def remote_rel(path: str) -> str:
    """The remote dir as rsync and a login shell read it: `~/x` -> `x` (relative to home)."""
    if path == "~":
        return "."
    if path.startswith("~/"):
        path = path[2:]
    return path if path.startswith("/") else "./" + path if path.startswith("-") else path


def diagnose_ssh(stderr: str, s: Settings) -> str:
    """One sentence saying why ssh failed and what to change (from ssh's own message)."""
    err = stderr.strip()
    last = "; ".join(ln.strip() for ln in err.splitlines() if ln.strip())[-400:] or "no message"
    hosts = s.known_hosts or "~/.ssh/known_hosts"
    if re.search(
        r"host key verification failed|identification has changed|no \S+ host key", err, re.I
    ):
        return (
            f"{s.label}: the host key is unknown or changed ({last}). eagleflow checks host keys; "
            f"verify the host's fingerprint, then add it to {hosts} (ssh-keyscan -p PORT HOST >> "
            f"{hosts}) or set {ENV_PREFIX}KNOWN_HOSTS"
        )
    if re.search(r"permission denied|too many authentication failures", err, re.I):
        key = s.identity or "your default ssh key"
        return (
            f"{s.label}: login failed ({last}). Check user ({ENV_PREFIX}USER) and that {key} is "
            f"authorised on the host (ssh-copy-id); set {ENV_PREFIX}IDENTITY to use another key"
        )
    if re.search(
        r"connection refused|timed out|no route|could not resolve|network is unreachable|"
        r"name or service not known|connection closed|connection reset",
        err,
        re.I,
    ):
        return (
            f"{s.label}: cannot reach the GPU host ({last}). Check {ENV_PREFIX}HOST / "
            f"{ENV_PREFIX}PORT and that sshd runs there"
        )
    if not err:  # a shared connection that died under the call says nothing
        return f"{s.label}: the connection dropped (ssh exited 255 with no message)"
    return f"{s.label}: ssh failed ({last})"
