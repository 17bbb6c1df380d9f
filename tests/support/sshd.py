"""A private sshd on 127.0.0.1 for the remote-profile tests: own host key, own client key, and a
remote root that only ssh can reach.

sshd runs in a mount namespace of its own (`unshare --mount`) where a tmpfs is mounted over
`remote_root`: every process started through this sshd sees the tmpfs, the test process sees an
empty folder. So a file the tests find under remote_root locally was never made remotely, and
anything remote is visible only through ssh.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SYSTEM_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def _ppid(stat: Path) -> int | None:
    try:
        text = stat.read_text()
        return int(text[text.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TestSshd:
    """Start with `start()`, stop with `stop()`; `env()` gives EAGLEFLOW_REMOTE_* settings."""

    __test__ = False  # not a pytest test class

    def __init__(self, base: Path):
        self.base = base
        self.keys = base / "keys"
        self.remote_root = base / "remote-root"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def _keygen(self, path: Path) -> None:
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
            check=True,
        )

    def start(self) -> TestSshd:
        if os.geteuid() != 0:
            raise RuntimeError("the remote-profile tests need root (sshd, a mount namespace)")
        self.keys.mkdir(parents=True)
        self.remote_root.mkdir()
        self._keygen(self.keys / "host_key")
        self._keygen(self.keys / "client_key")
        self._keygen(self.keys / "stranger_key")  # never authorised: a failed login
        (self.keys / "authorized_keys").write_text((self.keys / "client_key.pub").read_text())
        host_pub = (self.keys / "host_key.pub").read_text().split()
        self.known_hosts = self.keys / "known_hosts"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
        (self.keys / "empty_known_hosts").write_text("")
        cfg = self.base / "sshd_config"
        cfg.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {self.keys / 'host_key'}",
                    f"PidFile {self.base / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.keys / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "MaxStartups 100:30:200",
                    "MaxSessions 100",
                    "PrintMotd no",
                    "LogLevel INFO",
                ]
            )
            + "\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation dir
        # absolute paths everywhere: an sshd started with a relative -f dies on SIGHUP
        inner = (
            f"mount -t tmpfs -o size=1g,mode=755 eagleflow-remote {self.remote_root} && "
            f"exec {SSHD} -D -e -f {cfg}"
        )
        self.cfg = cfg
        self.log = open(self.base / "sshd.log", "ab")
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_up()
        # a process that keeps the mount namespace (and its tmpfs) alive while sshd is down
        self.holder = int(
            self.ssh("setsid sleep infinity </dev/null >/dev/null 2>&1 & echo $!").stdout
        )
        return self

    def _wait_up(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.base / 'sshd.log').read_text()}")
            if self.ssh("true", check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"sshd did not answer: {(self.base / 'sshd.log').read_text()}")

    def cut(self) -> None:
        """The connection lost: sshd stopped and every session it serves killed (the remote
        side's other processes, jobs included, keep running)."""
        listener = self.proc.pid  # unshare and sh exec: the sshd itself
        sessions = [
            int(stat.parent.name)
            for stat in Path("/proc").glob("[0-9]*/stat")
            if _ppid(stat) == listener
        ]
        os.kill(listener, 9)
        for pid in sessions:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)

    def restore(self) -> None:
        """sshd back on the same port, in the same mount namespace (the remote files stay)."""
        self.proc = subprocess.Popen(
            [
                "nsenter",
                f"--mount=/proc/{self.holder}/ns/mnt",
                SSHD,
                "-D",
                "-e",
                "-f",
                str(self.cfg),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_up()

    def ssh_base(self) -> list[str]:
        return [
            "ssh",
            "-F",
            "/dev/null",
            "-p",
            str(self.port),
            "-i",
            str(self.keys / "client_key"),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
            "root@127.0.0.1",
        ]

    def ssh(self, command: str, check: bool = True, timeout: float = 60):
        """Run a shell command on the 'remote' side (inside the sshd's mount namespace)."""
        proc = subprocess.run(
            [*self.ssh_base(), command],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"ssh {command!r} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def env(self, remote_dir: str, **over: str) -> dict[str, str]:
        """EAGLEFLOW_REMOTE_* variables pointing the profile at this sshd."""
        env = {
            "EAGLEFLOW_REMOTE_HOST": "127.0.0.1",
            "EAGLEFLOW_REMOTE_USER": "root",
            "EAGLEFLOW_REMOTE_PORT": str(self.port),
            "EAGLEFLOW_REMOTE_IDENTITY": str(self.keys / "client_key"),
            "EAGLEFLOW_REMOTE_KNOWN_HOSTS": str(self.known_hosts),
            "EAGLEFLOW_REMOTE_SSH_CONFIG": "",
            "EAGLEFLOW_REMOTE_REMOTE_DIR": remote_dir,
            "EAGLEFLOW_REMOTE_GPU_LOCK_DIR": str(self.remote_root / "gpu-locks"),
            "EAGLEFLOW_REMOTE_GPUS": "0,1",
            # the agent needs a plain Python 3 (stdlib only), as on a fresh GPU host
            "EAGLEFLOW_REMOTE_PYTHON": SYSTEM_PYTHON,
        }
        env.update(over)
        return env

    def stop(self) -> None:
        from eagleflow.remote import transport

        # the shared connections (ControlMaster) and ssh configs eagleflow made for this sshd
        for cfg in transport._state_home().glob("config-*"):
            if f"Port {self.port}\n" in cfg.read_text():
                subprocess.run(
                    ["ssh", "-F", str(cfg), "-O", "exit", "127.0.0.1"],
                    capture_output=True,
                    timeout=10,
                )
                cfg.unlink(missing_ok=True)
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=10)
        if getattr(self, "holder", None):
            try:
                os.kill(self.holder, 9)
            except ProcessLookupError:
                pass
        self.log.close()
