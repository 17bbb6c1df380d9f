"""GPU-host operations for `snakemake --profile remote-gpu`: settings, staging, jobs, set-up.

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

import ast
import base64
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from eagleflow.errors import EagleflowError, RemoteError

REPO_ROOT = Path(__file__).resolve().parents[3]
PROFILE_NAME = "remote-gpu"
PROFILE_DIR = REPO_ROOT / "profiles" / PROFILE_NAME
ENV_PREFIX = "EAGLEFLOW_REMOTE_"
AGENT_FILE = Path(__file__).with_name("agent.py")
LOCAL_STATE = Path(".snakemake") / "remote-gpu"  # under the local workdir
MAX_REF_JSON = 8 << 20  # input JSON files larger than this are not scanned for bulk references


# ---------------------------------------------------------------------------------------------
# settings


@dataclass
class Settings:
    """One GPU host; every field can be overridden by EAGLEFLOW_REMOTE_<FIELD> (upper case)."""

    host: str = ""
    user: str | None = None
    port: int | None = None
    identity: str | None = None
    known_hosts: str | None = None
    ssh_config: str = "~/.ssh/config"
    ssh_options: list[str] = field(default_factory=list)
    connect_timeout_s: int = 5
    control_persist_s: int = 60
    remote_dir: str = "eagleflow"
    python: str = "python3"
    venv: str = ".venv"
    activate: str | None = None
    gpus: str = "auto"
    gpu_lock_dir: str = "~/.cache/eagleflow/gpu-locks"
    env: dict[str, str] = field(default_factory=dict)
    sources: list[str] = field(
        default_factory=lambda: ["Snakefile", "workflow", "config", "src", "pyproject.toml"]
    )
    status_grace_s: int = 120
    log_mirror_s: int = 5  # a running job's log is mirrored at most this often; 0: off
    # where the values came from, for messages ("settings.yaml" or the env var's name)
    origin: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def activate_cmd(self) -> str:
        """Shell code run before each job (and the check); default: source the venv."""
        if self.activate:
            return self.activate
        return f". {shlex.quote(self.venv.rstrip('/') + '/bin/activate')}"

    @property
    def label(self) -> str:
        """user@host:port as a user would write it, for messages."""
        who = f"{self.user}@" if self.user else ""
        return f"{who}{self.host}" + (f":{self.port}" if self.port else "")


_INT_FIELDS = {"port", "connect_timeout_s", "control_persist_s", "status_grace_s", "log_mirror_s"}
_LIST_FIELDS = {"ssh_options", "sources"}
# ssh_config values are written into a generated ssh config file: a newline or a quote in one
# would let a setting inject ssh options (ProxyCommand, ...), so they are refused.
_SSH_VALUE = re.compile(r'^[^\s"\\\x00-\x1f\x7f]+$')
_SSH_PATH = re.compile(r'^[^"\\\x00-\x1f\x7f]+$')
_REFUSED_OPTIONS = {
    "stricthostkeychecking": "host keys are always checked (StrictHostKeyChecking yes)",
    "userknownhostsfile": "set known_hosts (EAGLEFLOW_REMOTE_KNOWN_HOSTS) instead",
    "globalknownhostsfile": "set known_hosts (EAGLEFLOW_REMOTE_KNOWN_HOSTS) instead",
    "batchmode": "eagleflow never prompts (BatchMode yes); use a key",
    "permitlocalcommand": "local commands are disabled",
    "localcommand": "local commands are disabled",
    "forwardagent": "agent forwarding to a shared GPU host is disabled",
}


def settings_path(environ: dict | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get(f"{ENV_PREFIX}SETTINGS") or PROFILE_DIR / "settings.yaml")


def load_settings(path: str | Path | None = None, environ: dict | None = None) -> Settings:
    """The settings file (profiles/remote-gpu/settings.yaml), then EAGLEFLOW_REMOTE_* overrides."""
    import yaml

    env = os.environ if environ is None else environ
    path = Path(path) if path else settings_path(env)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise RemoteError(f"remote settings {path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise RemoteError(f"remote settings {path} is not valid YAML: {e}") from None
    names = {f.name for f in fields(Settings)} - {"origin"}
    unknown = sorted(set(data) - names)
    if unknown:
        raise RemoteError(
            f"remote settings {path}: unknown key {unknown[0]!r}; known: {', '.join(sorted(names))}"
        )
    origin = {k: str(path) for k in data}
    for name in names:
        var = ENV_PREFIX + name.upper()
        if var in env:
            data[name] = _from_env(name, env[var])
            origin[name] = var
    for name in names:
        if name in data and data[name] is not None:
            data[name] = _coerce(name, data[name], origin.get(name, str(path)))
    s = Settings(**{k: v for k, v in data.items() if v is not None or k in ("user", "port")})
    s.origin = origin
    validate_settings(s)
    return s


def _from_env(name: str, value: str):
    if name in _LIST_FIELDS:
        return [v.strip() for v in value.split(",") if v.strip()]
    if name == "env":
        pairs = [p for p in value.split(",") if p.strip()]
        return dict(p.split("=", 1) if "=" in p else (p, "") for p in pairs)
    if value == "" and name in ("user", "port", "identity", "known_hosts", "activate"):
        return None
    return value


def _coerce(name: str, value, where: str):
    try:
        if name in _INT_FIELDS:
            return int(value)
        if name in _LIST_FIELDS:
            if not isinstance(value, list):
                raise ValueError("expected a list")
            return [str(v) for v in value]
        if name == "env":
            if not isinstance(value, dict):
                raise ValueError("expected a mapping NAME: value")
            return {str(k): str(v) for k, v in value.items()}
        return str(value)
    except (TypeError, ValueError) as e:
        raise RemoteError(f"remote setting {name} ({where}): {value!r} is invalid: {e}") from None


def validate_settings(s: Settings) -> None:
    """Refuse values that would break or inject into the ssh config and remote commands."""

    def bad(name: str, why: str):
        where = s.origin.get(name, "settings")
        return RemoteError(f"remote setting {name} ({where}): {why}")

    if not s.host:
        raise bad("host", f"no GPU host is set; set host in {settings_path()} or {ENV_PREFIX}HOST")
    for name in ("host", "user"):
        value = getattr(s, name)
        if value is not None and (not _SSH_VALUE.match(value) or value.startswith("-")):
            raise bad(name, f"{value!r} is not a host or user name")
    if s.port is not None and not 0 < s.port < 65536:
        raise bad("port", f"{s.port} is not a TCP port")
    for name in ("identity", "known_hosts", "ssh_config"):
        value = getattr(s, name)
        if value and not _SSH_PATH.match(value):
            raise bad(name, f"{value!r}: paths with quotes, backslashes or newlines are refused")
    for opt in s.ssh_options:
        key, sep, value = opt.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z]+", key) or not _SSH_PATH.match(value):
            raise bad("ssh_options", f"{opt!r} is not Key=Value")
        why = _REFUSED_OPTIONS.get(key.lower())
        if why:
            raise bad("ssh_options", f"{opt!r} refused: {why}")
    for name in ("remote_dir", "venv", "gpu_lock_dir"):
        value = getattr(s, name)
        if not value or "\x00" in value or "\n" in value:
            raise bad(name, f"{value!r} is not a path")
    for key in s.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise bad("env", f"{key!r} is not an environment variable name")
    for src in s.sources:
        if src.startswith(("/", "..")) or "\n" in src:
            raise bad("sources", f"{src!r}: sources are paths inside the workflow folder")


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


# ---------------------------------------------------------------------------------------------
# Snakemake jobscripts


@dataclass
class JobScript:
    properties: dict
    workdir: Path
    args: list[str]  # Snakemake's job arguments (after `python -m snakemake`)

    @property
    def rule(self) -> str:
        return self.properties.get("rule") or "group"


def parse_jobscript(text: str, cwd: str | Path | None = None) -> JobScript:
    """The properties line and the `python -m snakemake ...` arguments of a jobscript."""
    props = None
    exec_line = None
    for line in text.splitlines():
        if line.startswith("# properties = "):
            props = json.loads(line[len("# properties = ") :])
        elif " -m snakemake " in line:
            exec_line = line
    if props is None or exec_line is None:
        raise RemoteError(
            "unexpected jobscript (no properties line or no `python -m snakemake` command); "
            "the remote profile needs Snakemake's default jobscript"
        )
    if props.get("type") != "single":
        raise RemoteError("group jobs are not supported by the remote profile (remove `group:`)")
    tokens = shlex.split(exec_line)
    workdir = Path(cwd or os.getcwd())
    if tokens[:1] == ["cd"] and tokens[2:3] == ["&&"]:
        workdir = Path(tokens[1])
        tokens = tokens[3:]
    try:
        start = tokens.index("snakemake", tokens.index("-m")) + 1
        end = next(i for i in range(start, len(tokens)) if tokens[i] in ("&&", "||", ";"))
    except (ValueError, StopIteration):
        raise RemoteError(f"unexpected jobscript command: {exec_line[:200]}") from None
    return JobScript(props, workdir, tokens[start:end])


def _values(args: list[str], i: int) -> int:
    """Index after the values of the option at args[i] (values run until the next --option)."""
    j = i + 1
    while j < len(args) and not args[j].startswith("--"):
        j += 1
    return j


def rewrite_args(args: list[str], workdir: Path) -> tuple[list[str], list[tuple[Path, str]]]:
    """Job arguments for the remote dir: local absolute paths made relative, the local tmpdir
    wait dropped, config files outside the workdir staged. Returns (args, files to push)."""
    wd = str(workdir).rstrip("/")
    stage: list[tuple[Path, str]] = []

    def rel(token: str) -> str:
        if token == wd:
            return "."
        if token.startswith(wd + "/"):
            return token[len(wd) + 1 :]
        return token

    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--wait-for-files-file":
            # Snakemake lists more than 20 files in a local file; the host gets them inline
            try:
                listed = Path(args[i + 1]).read_text().split("\n")
            except (IndexError, OSError) as e:
                raise RemoteError(f"cannot read the jobscript's wait-for-files file: {e}") from None
            args = [*args[:i], "--wait-for-files", *[f for f in listed if f], *args[i + 2 :]]
            continue
        if a == "--cores" and i + 1 < len(args):
            # the laptop's --cores (the profile's `cores: all`) says nothing about the host: the
            # host's Snakemake takes all of its own, and caps each rule's threads at them
            out += ["--cores", "all"]
            i += 2
            continue
        if a in ("--wait-for-files", "--configfiles", "--configfile"):
            j = _values(args, i)
            vals = []
            for v in args[i + 1 : j]:
                p = Path(v) if os.path.isabs(v) else workdir / v
                p = Path(os.path.normpath(p))
                if a == "--wait-for-files":
                    if not (p.name.startswith("tmp.") and p.parent.name == ".snakemake"):
                        vals.append(rel(str(p)))
                    continue
                try:
                    inside = p.relative_to(workdir)
                    vals.append(str(inside))
                    stage.append((p, str(inside)))
                except ValueError:
                    digest = hashlib.sha256(str(p).encode()).hexdigest()[:12]
                    target = str(LOCAL_STATE / "configfiles" / digest / p.name)
                    vals.append(target)
                    stage.append((p, target))
            if vals:
                out += [a, *vals]
            i = j
            continue
        out.append(rel(a))
        i += 1
    return out, stage


# What the host's copy of the properties line keeps: params (config sections, anything a rule
# passes) stay on the laptop, so no value a user did not mean to send is written on the host.
REMOTE_PROPERTIES = ("type", "rule", "jobid", "input", "output", "log", "wildcards", "threads")


def job_script_text(js: JobScript, args: list[str]) -> str:
    """The script the host runs (in the remote dir, after the activation command)."""
    cmd = shlex.join(["python", "-m", "snakemake", *args])
    props = {k: js.properties[k] for k in REMOTE_PROPERTIES if k in js.properties}
    props["resources"] = {"gpu": js.properties.get("resources", {}).get("gpu", 0)}
    return (
        "#!/bin/bash\n"
        f"# properties = {json.dumps(props)}\n"
        "# written by eagleflow.remote: Snakemake's job command, paths relative to the remote dir\n"
        f"{cmd}\n"
    )


# ---------------------------------------------------------------------------------------------
# staging


def _inside(path: str, workdir: Path) -> str | None:
    """`path` relative to the workdir, or None for a path outside it."""
    p = Path(path)
    if not p.is_absolute():
        p = workdir / p
    try:
        rel = Path(os.path.normpath(p)).relative_to(workdir)
    except ValueError:
        return None
    return None if str(rel).startswith("..") else str(rel)


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
        rel = _inside(name, workdir)
        if rel is None:
            require.append({"path": name, "why": "input outside the workflow folder"})
        else:
            push.append(rel)
    remote = Remote(settings)
    key = job_key(js)
    rel_outputs = [_inside(p, workdir) or p for p in outputs]
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
    logs = [_inside(p, workdir) or p for p in props.get("log", [])]
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


def _since(t) -> str:
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
            f"  - {j['id']} (rule {j['rule']}, {j['state']} since {_since(j.get('since'))}, "
            f"GPUs {gpus})"
        )
    ids = " ".join(j["id"] for j in jobs)
    lines.append(
        f"Wait for it to finish (`eagleflow remote logs {jobs[0]['id']} --follow`), or cancel it "
        f"and rerun: eagleflow remote cancel {ids}"
    )
    return "\n".join(lines)


# What makes two submissions the same work. eagleflow's rules carry the sha256 of their script
# and of the modules it imports in `params.code` (eagleflow.codehash), so an edited script is
# other work; Snakemake's jobscript holds no shell command, so for a rule without such a param
# the key is its rule, wildcards, params, outputs and inputs only.
KEY_HASH_LIMIT = 64 << 20  # input files larger than this enter the key by size and mtime


def _content_digest(path: Path) -> str:
    if path.is_dir():
        h = hashlib.sha256()
        for p in sorted(path.rglob("*")):
            if p.is_file():
                h.update(f"{p.relative_to(path)}\0{_content_digest(p)}\n".encode())
        return "dir:" + h.hexdigest()
    try:
        st = path.stat()
    except OSError:
        return "missing"
    if st.st_size > KEY_HASH_LIMIT:
        return f"size:{st.st_size}:mtime_ns:{st.st_mtime_ns}"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def job_key(js: JobScript) -> str:
    """sha256 of the job's rule, wildcards, params, outputs and each input's content."""
    props, wd = js.properties, js.workdir
    doc = {
        "rule": js.rule,
        "wildcards": props.get("wildcards") or {},
        "params": props.get("params") or {},
        "output": sorted(_inside(p, wd) or p for p in props.get("output") or []),
        "input": {_inside(p, wd) or p: _content_digest(wd / p) for p in props.get("input") or []},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


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
        _unregister(workdir, job_id)  # a lost connection is no cancel: the job may keep running
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
        by = _cancelled_by(workdir, job_id)
        if by != USER_CANCEL and (by is None or not run_alive(by)):
            ans = remote.agent("restart", ids=[job_id])
            if job_id in ans.get("conflicts", {}):
                _unregister(workdir, job_id)
                return "failed", "remote-gpu: " + _conflict_message(
                    settings, ans["host"], rule, ans["conflicts"][job_id]
                ).replace("not started", "not restarted", 1)
            register(workdir, job_id, rule)
            return (
                "running",
                f"remote-gpu: {rule}: restarted {job_id} (cancelled by an earlier run)",
            )
    _unregister(workdir, job_id)  # finished: nothing to cancel any more
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
        local = _inside(rel, workdir)
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
        _unregister(workdir, job_id)
    if job_ids:
        Remote(settings).agent("cancel", ids=list(job_ids), timeout=30)


def _cancelled_by(workdir: Path, job_id: str) -> str | None:
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


def _unregister(workdir: Path, job_id: str) -> None:
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


# ---------------------------------------------------------------------------------------------
# set-up, checks and the profile


@dataclass
class CheckItem:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        head = f"{'OK' if self.ok else 'MISSING':8}{self.name}: {self.detail}"
        return head + (f"\n        fix: {self.fix}" if self.fix and not self.ok else "")


def check(settings: Settings, min_gpus: int = 1) -> list[CheckItem]:
    """What the GPU host offers the profile, item by item, with the fix for each gap."""
    remote = Remote(settings)
    items = []
    t0 = time.monotonic()
    try:
        ping = remote.agent("ping", timeout=settings.connect_timeout_s + 30)
        took = time.monotonic() - t0
        ans = remote.agent("check", activate=settings.activate_cmd, env=settings.env, timeout=None)
    except RemoteError as e:
        return [CheckItem("ssh", False, str(e), "fix the connection settings above")]
    items.append(
        CheckItem(
            "ssh",
            True,
            f"{settings.label} is {ping['host']}, agent Python {ping['python']} ({took:.1f} s)",
        )
    )
    items.append(
        CheckItem(
            "remote dir",
            ans.get("writable", False),
            f"{ans['root']} ({ans.get('free_gb')} GB free)",
            f"make {settings.remote_dir} writable or set {ENV_PREFIX}REMOTE_DIR",
        )
    )
    for where, version in (("here", local_rsync_version()), ("on the host", ans.get("rsync"))):
        items.append(
            CheckItem(
                f"rsync {where}",
                _version_at_least(version, (3, 2, 3)),
                f"version {version}" if version else "not installed",
                f"install rsync >= 3.2.3 {where} (Debian: apt-get install rsync; macOS: brew "
                "install rsync); the profile uses --mkpath",
            )
        )
    env = ans.get("env", {})
    setup_fix = "make remote-setup (creates the venv with the gpu-host extra)"
    if "error" in env:
        items.append(
            CheckItem(
                "environment",
                False,
                f"the activation command `{settings.activate_cmd}` failed: {env['error']}",
                setup_fix + f", or set {ENV_PREFIX}ACTIVATE",
            )
        )
        return items
    py = env.get("python", "?")
    py_ok = tuple(int(x) for x in py.split(".")[:2]) >= (3, 11)
    items.append(
        CheckItem(
            "python", py_ok, f"{py} ({env.get('executable')})", "the venv needs Python >= 3.11"
        )
    )
    torch = env.get("torch", {})
    if "error" in torch:
        items.append(CheckItem("torch", False, f"not importable ({torch['error']})", setup_fix))
    else:
        n = torch.get("gpus", 0)
        items.append(
            CheckItem(
                "torch GPUs",
                n >= min_gpus,
                f"torch {torch.get('version')} (CUDA {torch.get('cuda')}) sees {n} GPU(s)"
                + (f", needs >= {min_gpus}" if n < min_gpus else ""),
                "install a CUDA build of torch in the venv and check nvidia-smi on the host",
            )
        )
    gpus = ans.get("gpus_setting", [])
    items.append(
        CheckItem(
            "gpu assignment",
            len(gpus) >= min_gpus,
            f"gpus setting {settings.gpus!r} -> indices {gpus} "
            f"(nvidia-smi: {ans.get('nvidia_smi')})",
            f"set {ENV_PREFIX}GPUS to the host's GPU indices (e.g. 0,1,2,3) or install the driver",
        )
    )
    for mod, why in (
        ("sglang", "the production engine"),
        ("snakemake", "runs each job"),
        ("eagleflow", "the workflow's code"),
        ("speculators", "training"),
    ):
        info = env.get(mod, {})
        ok = "error" not in info
        detail = f"{info.get('version')}" if ok else f"not importable ({info.get('error')})"
        fix = setup_fix
        if mod == "eagleflow" and not ok:
            fix = "the sources are pushed by the first job or by make remote-setup"
        items.append(CheckItem(mod, ok, f"{detail} ({why})", fix))
    return items


def local_rsync_version() -> str | None:
    try:
        out = subprocess.run(["rsync", "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    m = re.search(r"version (\d+\.\d+\.\d+)", out)
    return m.group(1) if m else "?"


def _version_at_least(version: str | None, wanted: tuple[int, ...]) -> bool:
    try:
        return tuple(int(x) for x in (version or "").split(".")[:3]) >= wanted
    except ValueError:
        return False


def setup(
    settings: Settings, dry_run: bool = False, out=sys.stdout, bundle: str | None = None
) -> int:
    """Push the sources, create the remote venv with the gpu-host extra, then check it.

    With `bundle` (a folder `make device-bundle` wrote, inside the checkout) the host needs no
    package index: the parts travel with the sources, are checked against their manifest there
    and installed into `.eagleflow/site`, which a venv with the host's own packages (its CUDA
    torch) puts on its path after the pushed sources."""
    remote = Remote(settings)
    venv = settings.venv
    rel_bundle = None
    if bundle:
        path = Path(bundle).resolve()
        if not (path / "manifest.json").is_file():
            raise RemoteError(f"--bundle {bundle}: no manifest.json there; run make device-bundle")
        try:
            rel_bundle = str(path.relative_to(REPO_ROOT))
        except ValueError:
            raise RemoteError(
                f"--bundle {bundle} is outside the checkout {REPO_ROOT}; build it inside "
                "(make device-bundle writes .device/bundle)"
            ) from None
    install = (
        f"{venv}/bin/python src/eagleflow/bundle.py install {rel_bundle} --site .eagleflow/site"
        " (+ a .pth: src, then that site)"
        if rel_bundle
        else f"{venv}/bin/python -m pip install -e '.[gpu-host]'"
    )
    plan = [
        f"rsync the sources {settings.sources} to {settings.label}:{settings.remote_dir}",
        f"{settings.python} -m venv {'--system-site-packages ' if rel_bundle else ''}{venv}"
        f"   (in {settings.remote_dir}, if missing)",
        *([f"rsync the bundle {rel_bundle} (parts and manifest)"] if rel_bundle else []),
        install,
        "eagleflow remote check",
    ]
    if dry_run:
        print("remote setup would run:", file=out)
        for step in plan:
            print(f"  {step}", file=out)
        return 0
    if settings.activate and settings.activate != Settings().activate_cmd:
        print(f"note: activation is `{settings.activate}`; the venv is created at {venv}", file=out)
    print(f"== pushing sources to {settings.label}:{settings.remote_dir}", file=out)
    paths = [s for s in settings.sources if (REPO_ROOT / s).exists()] + (
        [rel_bundle] if rel_bundle else []
    )
    pushed = remote.push(REPO_ROOT, paths)
    if pushed["rc"] != 0:
        raise RemoteError(f"pushing the sources failed: {pushed['stderr']}")
    what = f"the offline bundle {rel_bundle}" if rel_bundle else "eagleflow[gpu-host]"
    print(f"== installing {what} into {venv} (log: .eagleflow/setup.log)", file=out)
    ans = remote.agent("setup", venv=venv, extra="gpu-host", bundle=rel_bundle, timeout=None)
    if not ans.get("ok"):
        print(f"FAILED: {ans.get('failed') or ans.get('error')} (exit {ans.get('rc')})", file=out)
        print(ans.get("tail", ""), file=out)
        return 1
    items = check(settings)
    for item in items:
        print(item.line(), file=out)
    return 0 if all(i.ok for i in items) else 1


def user_profile_dir() -> Path:
    """Where `snakemake --profile remote-gpu` finds the profile (Snakemake's user config dir)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "snakemake" / PROFILE_NAME


def install_profile(force: bool = False) -> Path:
    """Link profiles/remote-gpu into the user's Snakemake config dir (Snakemake does not look in
    ./profiles for --profile)."""
    link = user_profile_dir()
    if not (PROFILE_DIR / "config.yaml").is_file():
        raise RemoteError(f"{PROFILE_DIR} holds no profile (config.yaml); is this a checkout?")
    if link.is_symlink() and Path(os.readlink(link)) == PROFILE_DIR:
        return link
    if link.exists() or link.is_symlink():
        if not force:
            raise RemoteError(
                f"{link} exists and is not a link to {PROFILE_DIR}; move it away or pass --force"
            )
        if link.is_symlink() or link.is_file():
            link.unlink()
        else:
            raise RemoteError(f"{link} is a folder; move it away first")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(PROFILE_DIR, target_is_directory=True)
    return link


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
            f"  {job['state']:9} {job.get('rule') or '?':24} {wild:16} started {_since(start)}"
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
                    f"({job['state']} since {_since(job.get('since'))}, GPUs "
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
