"""Hand-built raw records and report inputs, shared by the report tests and their `run` fixture.

No server and no model: the records below have the exact shape `serve_and_benchmark`,
`check_acceptance`, `train_draft` and `extract_hidden_states` write, with numbers chosen so that
one config is fine (s3) and one is served far below its standalone accept length (s5).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from eagleflow.report import table as report_table
from eagleflow.train.loop import metric_columns

BENCH = {
    "prompt_sets": ["mtbench"],
    "num_prompts": 3,
    "warmup_requests": 1,
    "repeats": 2,
    "max_tokens": 64,
    "concurrency": [1],
    "temperature": 0.0,
    "min_accept_ratio": 0.9,
    "request_timeout_s": 60,
}
REPORT = {"title": "eagleflow test run (synthetic records)", "formats": ["png", "svg"]}
TTT = 3
# config -> (spec, throughput of repeat 0 and 1 at concurrency 1, served accept lengths)
CONFIGS = {
    "baseline": ({"name": "baseline", "num_steps": None, "topk": None}, [100.0, 110.0], None),
    "s3": ({"name": "s3", "num_steps": 3, "topk": 1}, [150.0, 170.0], [2.4, 2.6]),
    "s5": ({"name": "s5", "num_steps": 5, "topk": 1}, [90.0, 95.0], [1.1, 1.2]),
}
STANDALONE = {"3": 2.6, "5": 3.0}  # s5 served 1.15 / 3.0 = 0.38: WIRING MISMATCH?


def _run(conc: int, rep: int, tput: float, accept: float | None) -> dict:
    requests = []
    for i in range(3):
        tokens = 60 + 2 * i
        ttft = 0.05 * (i + 1) + 0.01 * rep
        wall = tokens / tput * conc
        requests.append(
            {
                "id": f"mtbench-{81 + 10 * i}",
                "output_tokens": tokens,
                "wall_s": wall,
                "ttft_s": ttft,
                "decode_tok_s": (tokens - 1) / (wall - ttft),
            }
        )
    tokens = sum(q["output_tokens"] for q in requests)
    wall = tokens / tput
    run = {
        "concurrency": conc,
        "repeat": rep,
        "wall_s": wall,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / wall,
        "requests": requests,
        "accept_length": accept,
    }
    drafts = 50.0 if accept else 0.0
    run["spec"] = {
        "drafts": drafts,
        "draft_tokens": drafts * 3,
        "accepted": (accept - 1) * drafts if accept else 0.0,
        "accept_length": accept,
    }
    return run


def make_records(concurrency=(1,)) -> list[dict]:
    records = []
    for n, (name, (spec, tputs, accepts)) in enumerate(CONFIGS.items()):
        runs = [
            _run(c, rep, tput * c**0.5, accepts[rep] if accepts else None)
            for c in concurrency
            for rep, tput in enumerate(tputs)
        ]
        records.append(
            {
                "engine": "vllm",
                "config": name,
                "spec": spec,
                "draft": None if name == "baseline" else "results/export/speculators",
                "measured_at": f"2026-12-04T10:0{n}:00",
                "benchmark": {**BENCH, "concurrency": list(concurrency)},
                "prompts": ["mtbench-81", "mtbench-91", "mtbench-101"],
                "summary": {"deliberately": "ignored: the report recomputes from runs"},
                "runs": runs,
            }
        )
    return records


def make_acceptance() -> dict:
    by = {}
    for k, al in STANDALONE.items():
        n = int(k)
        rates = [max(0.05, 0.85 - 0.2 * i) for i in range(n)]
        proposed = [200] * n
        by[k] = {
            "num_steps": n,
            "verify_steps": 200,
            "new_tokens": round(al * 200),
            "accept_length": al,
            "proposed_per_position": proposed,
            "accepted_per_position": [round(r * p) for r, p in zip(rates, proposed, strict=True)],
            "acceptance_rate_per_position": rates,
            "per_prompt": [{"id": "mtbench-81", "accept_length": al}],
        }
    return {"draft": "results/export/speculators", "prompts": ["a", "b", "c"], "by_num_steps": by}


def write_metrics(path: Path, val: bool = True, steps: int = 60) -> None:
    rows = []
    for step in range(1, steps + 1):
        row = {"split": "train", "epoch": (step - 1) // 20, "step": step, "lr": 3e-4}
        row.update(tokens=2048, step_ms=400.0 + (step % 5), loss=6.0 - 3.0 * step / steps)
        for i in range(TTT):
            row[f"loss_{i}"] = row["loss"] / TTT
            row[f"full_acc_{i}"] = min(0.9, step / steps * (0.8 - 0.2 * i) + 0.01 * (step % 3))
            row[f"cond_acc_{i}"] = row[f"full_acc_{i}"]
        rows.append(row)
        if val and step % 20 == 0:
            vrow = {"split": "val", "epoch": (step - 1) // 20, "step": step, "loss": row["loss"]}
            vrow.update({f"full_acc_{i}": row[f"full_acc_{i}"] * 0.95 for i in range(TTT)})
            rows.append(vrow)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, metric_columns(TTT), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def make_manifest(tokens_per_s: float | None = 812.5) -> dict:
    return {
        "kind": "hidden_states",
        "host": "testhost",
        "backend": "hf",
        "dtype": "float32",
        "num_samples": 320,
        "num_tokens": 130_000,
        "bytes_per_token": 9216.0,
        "shards": [],
        "run": {
            "host": "testhost",
            "new_tokens": 130_000 if tokens_per_s else 0,
            "seconds": 160.0,
            "tokens_per_s": tokens_per_s,
        },
    }


def build(root: Path, records: list[dict], val=True, acceptance=True, tokens_per_s=812.5) -> dict:
    """Write the inputs the report rules read under `root`; the report's input dicts."""
    paths = {}
    bench_dir = root / "bench" / "vllm"
    bench_dir.mkdir(parents=True)
    for rec in records:
        p = bench_dir / f"{rec['config']}.json"
        p.write_text(json.dumps(rec))
        paths.setdefault("records", []).append(str(p))
    if acceptance:
        paths["acceptance"] = str(root / "standalone.json")
        Path(paths["acceptance"]).write_text(json.dumps(make_acceptance()))
    paths["metrics"] = str(root / "metrics.csv")
    write_metrics(Path(paths["metrics"]), val=val)
    paths["manifest"] = str(root / "manifest.json")
    Path(paths["manifest"]).write_text(json.dumps(make_manifest(tokens_per_s)))
    paths["train"] = str(root / "train_summary.json")
    Path(paths["train"]).write_text(
        json.dumps({"steps": 60, "best_val": {"loss": 3.1, "full_acc_0": 0.74}})
    )
    report_table.summarize(
        {k: paths[k] for k in ("records", "acceptance", "train", "manifest") if k in paths},
        BENCH,
        str(root / "summary.csv"),
        str(root / "summary.md"),
    )
    paths["summary"] = str(root / "summary.csv")
    paths["summary_md"] = str(root / "summary.md")
    return paths
