"""The remote-gpu profile's settings: profiles/remote-gpu/settings.yaml, then
EAGLEFLOW_REMOTE_* overrides, validated before any ssh call.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path

from eagleflow.errors import RemoteError

REPO_ROOT = Path(__file__).resolve().parents[3]
PROFILE_NAME = "remote-gpu"
PROFILE_DIR = REPO_ROOT / "profiles" / PROFILE_NAME
ENV_PREFIX = "EAGLEFLOW_REMOTE_"
LOCAL_STATE = Path(".snakemake") / "remote-gpu"  # under the local workdir


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
