"""Probe server for the contract venv: import SGLang once, fork a fresh child per probe.

Importing SGLang costs ~27 s on 2 cores and every probe needs it; the contract tests run five
probes. This process imports it once, then reads one JSON request per line on stdin
({"script", "stdin", "stdout", "stderr"}: paths), forks, and runs the script as __main__ in the
child with those files as its standard streams. Each probe still gets a process of its own (no
state leaks between probes: the fork happens before any of them runs). The parent answers
{"rc": exit code} per request.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

READY = "__eagleflow_probe_server_ready__"
PRELOAD = (
    "torch",
    "sglang",
    "sglang.srt.server_args",
    "sglang.srt.models.llama",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.schedule_batch",
)


def _child(req: dict) -> int:
    for fd, path, flags in (
        (0, req["stdin"], os.O_RDONLY),
        (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        new = os.open(path, flags, 0o644)
        os.dup2(new, fd)
        os.close(new)
    # fresh Python streams over the new descriptors (the parent's buffers are not the probe's)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.argv = [req["script"]]
    sys.path.insert(0, os.path.dirname(req["script"]))
    code = 0
    try:
        runpy.run_path(req["script"], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the probe's failure is reported, not raised here
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> int:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    sys.stderr.flush()
    print(READY, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(_child(req))
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
