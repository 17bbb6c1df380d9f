"""The smoke run: the whole chain on a new target at a tiny size, ending in one pass/fail line.

`eagleflow smoke --configfile USER.yaml` runs Snakemake with the user's config files and
`config/examples/smoke.yaml` layered over them (a few dozen conversations, a short extraction, a
few hundred training steps, a handful of benchmark prompts), into `<results_dir>/smoke` and
`<data_root>/smoke` so a real run's outputs are never touched, up to the `smoke_check` rule.
The sizes in smoke.yaml are ceilings: a smaller value in the user's config stays.

`smoke_check` (this module's `check`) passes when all of these hold:
- certificate: the layer certificate was issued (verify_layers wrote it, status ok);
- doctor: both exports are doctored clean again, now (vLLM for the speculators export; SGLang
  and vLLM for the SGLang export), against the ids the draft was trained on;
- served / standalone: each benchmarked config's accepted drafts per step, served, divided by
  the standalone check's, is at least `benchmark.min_accept_ratio` (the WIRING MISMATCH verdict);
- floor: the standalone accept length is at least `smoke.min_accept_length`, and that floor is
  above what a random draft measures on the same prompts (the standalone check's
  `random_draft` reference), so a draft that learned nothing cannot pass.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

from eagleflow import config as cfg
from eagleflow import engines
from eagleflow.doctor import diagnose
from eagleflow.errors import EagleflowError
from eagleflow.report.table import summary_rows
from eagleflow.target.prepare import load_target_json
from eagleflow.util import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

SMOKE_CONFIG = Path(__file__).resolve().parents[2] / "config" / "examples" / "smoke.yaml"

# smoke.yaml's values of these keys are ceilings: the user's smaller value stays
CEILINGS = (
    ("data", "num_samples"),
    ("regenerate", "max_tokens"),
    ("train", "max_steps"),
    ("benchmark", "num_prompts"),
    ("benchmark", "max_tokens"),
    ("benchmark", "repeats"),
)


def smoke_overlay(user: dict, smoke: dict) -> dict:
    """The overlay a smoke run adds to the user's merged config `user`: smoke.yaml with its
    ceilings applied, and results_dir / data_root moved into a `smoke` subfolder."""
    out = copy.deepcopy(smoke)
    for section, key in CEILINGS:
        mine = (user.get(section) or {}).get(key)
        theirs = (smoke.get(section) or {}).get(key)
        if isinstance(mine, int | float) and isinstance(theirs, int | float) and mine < theirs:
            out.setdefault(section, {})[key] = mine
    out["results_dir"] = str(Path(user["results_dir"]) / "smoke")
    out["data_root"] = str(Path(user["data_root"]) / "smoke")
    return out


def smoke_spec(config: dict) -> str:
    """The speculative config the smoke run benchmarks: smoke.spec, else the first one."""

    names = [s.name for s in engines.spec_configs(config) if not s.is_baseline]
    wanted = (config.get("smoke") or {}).get("spec")
    if wanted is None:
        if not names:
            raise EagleflowError("serve.speculative has no speculative config to smoke-test")
        return names[0]
    if wanted not in names:
        raise EagleflowError(
            f"smoke.spec {wanted!r} is not a serve.speculative config (have: {', '.join(names)})"
        )
    return wanted


def check(
    target_json: str,
    certificate: str,
    exports: dict,
    train_summary: str,
    acceptance: str,
    records: list[str],
    bench_cfg: dict,
    smoke_cfg: dict,
    sglang_version: str,
    out: str,
) -> dict:
    """The smoke verdict from the run's outputs (module doc); writes `out` and returns it."""

    target = load_target_json(target_json)
    trained = json.loads(Path(train_summary).read_text()).get("aux_layers")
    checks = []

    cert = json.loads(Path(certificate).read_text())
    status = cert.get("status", "ok")
    checks.append(
        {
            "check": "certificate",
            "ok": status == "ok",
            "detail": f"{certificate}: status {status}, ids {cert.get('ids_per_engine')}",
        }
    )

    engines = {"speculators": ["vllm"], "sglang": ["sglang", "vllm"]}
    for fmt, folder in exports.items():
        found = []
        for engine in engines[fmt]:
            rep = diagnose(
                target["path"], folder, engine, sglang_version=sglang_version, trained=trained
            )
            found += [f"{engine}: {f.line()}" for f in rep.findings]
        checks.append(
            {
                "check": f"doctor {fmt} export",
                "ok": not found,
                "detail": "; ".join(found) or f"{folder}: clean for {', '.join(engines[fmt])}",
            }
        )

    standalone = json.loads(Path(acceptance).read_text())
    recs = [json.loads(Path(p).read_text()) for p in records]
    min_ratio = float(bench_cfg["min_accept_ratio"])
    rows = summary_rows(recs, standalone, bench_cfg)
    for r in rows:
        ratio = r.get("accepted_ratio")
        ok = r["verdict"] == "ok" and ratio is not None and ratio >= min_ratio
        checks.append(
            {
                "check": f"served / standalone {r['engine']} {r['config']} T={r['temperature']:g}",
                "ok": ok,
                "detail": (
                    f"accept length served {_num(r.get('accept_len_served'))}, standalone "
                    f"{_num(r.get('accept_len_standalone'))}; accepted drafts ratio "
                    f"{_num(ratio)} (needs >= {min_ratio:g}); verdict {r['verdict']}"
                ),
            }
        )
    if not rows:
        checks.append({"check": "served / standalone", "ok": False, "detail": "no records"})

    floor = float(smoke_cfg["min_accept_length"])
    random_ref = (standalone.get("random_draft") or {}).get("accept_length")
    for r in rows:
        alone = r.get("accept_len_standalone")
        checks.append(
            {
                "check": f"standalone floor {r['config']} T={r['temperature']:g}",
                "ok": alone is not None and alone >= floor,
                "detail": f"standalone accept length {_num(alone)} (floor {floor:g})",
            }
        )
    checks.append(
        {
            "check": "floor above a random draft",
            "ok": random_ref is not None and floor > random_ref,
            "detail": (
                f"a random draft measures {_num(random_ref)} on the same prompts; the floor "
                f"{floor:g} must exceed it"
                + ("" if floor > random_ref else " (raise smoke.min_accept_length)")
                if random_ref is not None
                else "no random_draft reference in the standalone check "
                "(benchmark.random_draft_reference must be true; smoke.yaml sets it)"
            ),
        }
    )

    failed = [c for c in checks if not c["ok"]]
    line = (
        f"SMOKE PASS: {len(checks)} checks ({', '.join(c['check'] for c in checks)})"
        if not failed
        else f"SMOKE FAIL: {len(failed)} of {len(checks)} checks failed: "
        + "; ".join(f"{c['check']}: {c['detail']}" for c in failed)
    )
    body = {"passed": not failed, "line": line, "checks": checks, "rows": rows}
    atomic_write_json(out, body)
    (log.info if not failed else log.error)(line)
    return body


def _num(x) -> str:
    return "unknown" if x is None else f"{x:.3f}"


def run(
    configfiles: list[str],
    cores: int,
    profile: str | None = None,
    extra: list[str] | None = None,
    dry_run: bool = False,
) -> int:
    """`eagleflow smoke`: Snakemake up to smoke_check with the smoke overlay; prints the line.
    Returns 0 on PASS, 1 on FAIL (a failed stage, or a failed check)."""
    import shlex
    import subprocess
    import sys

    import yaml

    embedded = Path("config") / "config.yaml"
    if not Path("Snakefile").is_file() or not embedded.is_file():
        raise EagleflowError(
            f"eagleflow smoke runs in the repository (Snakefile, {embedded}); cwd is {Path.cwd()}"
        )
    merged = cfg.load_layers([str(embedded), *configfiles])
    smoke = cfg.read_yaml(SMOKE_CONFIG)
    overlay = smoke_overlay(merged, smoke)
    full = cfg.validate(cfg.deep_merge(merged, overlay))  # bad input fails before any job
    smoke_spec(full)
    results = Path(overlay["results_dir"])
    target = results / "smoke.json"
    results.mkdir(parents=True, exist_ok=True)
    overlay_path = str(results / "smoke-overlay.yaml")  # what the run layered, kept to read
    atomic_write_text(overlay_path, yaml.safe_dump(overlay, sort_keys=False))
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        str(target),
        "--cores",
        str(cores),
        *(["--profile", profile] if profile else []),
        *(["-n"] if dry_run else []),
        *(extra or []),
        "--configfile",
        *configfiles,
        overlay_path,
    ]
    print("eagleflow smoke: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.run(cmd)
    if dry_run:
        return proc.returncode
    if proc.returncode != 0:
        print(
            f"SMOKE FAIL: snakemake exited with status {proc.returncode} before the checks "
            f"(the failed rule's log is named above; results under {results})"
        )
        return 1
    body = json.loads(target.read_text())
    print(body["line"])
    return 0 if body["passed"] else 1
