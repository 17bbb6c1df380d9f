"""Rule train_draft's graceful stop: SIGTERM/SIGINT end training after the step, with a save."""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

# Seconds a run may take after SIGTERM to reach the end of its step and save; then it exits
# without saving (the last periodic checkpoint stays the resume point). speculators uses 120 s.
SHUTDOWN_GRACE_S = 120


class StopOnSignal:
    """SIGTERM/SIGINT ask training to stop at the end of the current step, after a checkpoint.

    Not speculators' graceful_shutdown: that raises wherever the signal lands (possibly inside an
    optimizer step) and saves to `interrupted/`, which its own resume skips. A second signal, or
    no step end within SHUTDOWN_GRACE_S, exits at once (the last checkpoint stays the resume
    point).
    """

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}
        self._timer: threading.Timer | None = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, _frame):
        if self.signum is not None:
            raise SystemExit(128 + signum)
        self.signum = signum
        log.warning(
            "%s: stopping after this step with a checkpoint (send again to stop now)",
            signal.Signals(signum).name,
        )
        self._timer = threading.Timer(SHUTDOWN_GRACE_S, os._exit, args=(128 + signum,))
        self._timer.daemon = True
        self._timer.start()

    def __exit__(self, *exc):
        if self._timer is not None:
            self._timer.cancel()
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
        return False
