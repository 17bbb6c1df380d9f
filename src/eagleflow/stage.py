"""What every workflow script shares: logging into the rule's log, and clean user errors.

A script does `with stage(snakemake) as sm: module.function(...)`. A user error (EagleflowError)
ends the job with its message in the log and on stderr, and no traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator

from eagleflow.errors import EagleflowError

log = logging.getLogger("eagleflow")


def _where() -> str:
    """The scheduler's id for this job and the GPUs it was given, where there are any."""
    env = os.environ
    parts = []
    if env.get("SLURM_JOB_ID"):
        parts.append(f"slurm job {env['SLURM_JOB_ID']}")
    if env.get("EAGLEFLOW_REMOTE_JOB"):
        parts.append(f"remote job {env['EAGLEFLOW_REMOTE_JOB']}")
    if "CUDA_VISIBLE_DEVICES" in env:
        parts.append(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}")
    return f" [{', '.join(parts)}]" if parts else ""


@contextlib.contextmanager
def stage(smk, name: str | None = None) -> Iterator[object]:
    """Send logging (and stderr) to the rule's log file; turn EagleflowError into exit status 1."""
    name = name or getattr(smk, "rule", "stage")
    log_path = smk.log[0] if len(smk.log) else None
    stream = open(log_path, "a", buffering=1) if log_path else sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    old_stderr = sys.stderr
    sys.stderr = stream
    start = time.monotonic()
    # one line per run of the job: a log with two of them shows that the job ran twice
    log.info("%s started on %s (pid %d)%s", name, socket.gethostname(), os.getpid(), _where())
    # SIGTERM (Snakemake cancelling a job) unwinds like an exception, so managed servers are
    # stopped and partial outputs cleaned by the `finally` blocks on the way out.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield smk
    except EagleflowError as e:
        log.error("%s failed: %s", name, e)
        sys.stderr = old_stderr
        print(f"eagleflow: {name}: {e}", file=sys.stderr)
        sys.exit(1)
    else:
        log.info("%s done in %.1f s", name, time.monotonic() - start)
    finally:
        sys.stderr = old_stderr
        if stream is not sys.stderr and stream is not old_stderr:
            stream.close()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)
