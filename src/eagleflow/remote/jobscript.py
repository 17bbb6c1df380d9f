"""Snakemake's jobscript read and rewritten for the host, and the key of a job's work."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from eagleflow.errors import RemoteError
from eagleflow.remote.settings import LOCAL_STATE

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


def inside(path: str, workdir: Path) -> str | None:
    """`path` relative to the workdir, or None for a path outside it."""
    p = Path(path)
    if not p.is_absolute():
        p = workdir / p
    try:
        rel = Path(os.path.normpath(p)).relative_to(workdir)
    except ValueError:
        return None
    return None if str(rel).startswith("..") else str(rel)


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
        "output": sorted(inside(p, wd) or p for p in props.get("output") or []),
        "input": {inside(p, wd) or p: _content_digest(wd / p) for p in props.get("input") or []},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()
