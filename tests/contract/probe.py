"""Run one of the SGLang probe scripts in the contract venv: JSON request in, JSON answer out.

The probes run in children forked from one probe server (zygote.py) that imported SGLang once
for the whole test session, so each probe costs its own work, not SGLang's ~27 s import.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
_servers: dict[str, tuple[subprocess.Popen, Path]] = {}


def _readline(proc: subprocess.Popen, deadline: float, what: str, log: Path) -> str:
    """One line of the server's stdout before the deadline (kills the server past it)."""
    buf = b""
    fd = proc.stdout.fileno()
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
        if not ready:
            _stop(proc)
            raise AssertionError(f"{what}: no answer in time; server log:\n{_tail(log)}")
        chunk = os.read(fd, 1)
        if not chunk:
            raise AssertionError(f"{what}: the probe server died; its log:\n{_tail(log)}")
        buf += chunk
    return buf.decode(errors="replace").rstrip("\n")


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for key, (p, _log) in list(_servers.items()):
        if p is proc:
            del _servers[key]


def _server(python: Path, timeout: int) -> subprocess.Popen:
    key = str(python)
    if key in _servers and _servers[key][0].poll() is None:
        return _servers[key][0]
    log = Path(tempfile.mkdtemp(prefix="probe-server-")) / "server.log"
    proc = subprocess.Popen(
        [str(python), str(HERE / "zygote.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),  # noqa: SIM115 - the child holds it
        start_new_session=True,  # its probes are killed with it
    )
    _servers[key] = (proc, log)
    deadline = time.monotonic() + timeout
    while (
        _readline(proc, deadline, "starting the probe server", log)
        != "__eagleflow_probe_server_ready__"
    ):
        pass  # SGLang may print on stdout while it imports
    return proc


@atexit.register
def _shutdown() -> None:
    for proc, _log in list(_servers.values()):
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            _stop(proc)
    _servers.clear()


def run_probe(sglang_python: Path, probe: str | Path, request: dict, timeout: int = 600):
    """The probe's answer: the last stdout line, parsed (SGLang may print before it)."""
    script = HERE / Path(probe).name
    proc = _server(sglang_python, timeout)
    log = _servers[str(sglang_python)][1]
    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        paths = {k: str(Path(tmp) / k) for k in ("stdin", "stdout", "stderr")}
        Path(paths["stdin"]).write_text(json.dumps(request))
        proc.stdin.write((json.dumps({"script": str(script), **paths}) + "\n").encode())
        proc.stdin.flush()
        answer = json.loads(_readline(proc, time.monotonic() + timeout, script.name, log))
        out = Path(paths["stdout"]).read_text()
        err = Path(paths["stderr"]).read_text()
    assert answer["rc"] == 0, f"{script.name} exited with {answer['rc']}:\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])
