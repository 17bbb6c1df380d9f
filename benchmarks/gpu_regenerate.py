"""Regeneration in process (`regenerate.backend: hf`) on a GPU, on the real SmolLM2 target.

Builds the target from its GGUF (`eagleflow.target.prepare.prepare_target`'s own build, bf16),
then runs `eagleflow.data.regenerate.regenerate` unchanged with the hf backend:

1. `--check N`: the first N prompts with the static cache and with the dynamic cache; the share of
   identical answers (both greedy, bf16) and the time of each;
2. `--prompts-limit M`: M prompts with the configured settings; throughput, finish reasons.

Figures go to `$OUT/gpu_regenerate.json` (or `--out`) as each phase ends. Prompts come from
`prepare_prompts` (run where the dataset packages are; e.g. the quality overlay's
`results/data/prompts.jsonl`).

    python3 benchmarks/gpu_regenerate.py --gguf G --prompts P --work /tmp/regen --check 64 \
        --prompts-limit 2000 --batch-size 256 --max-tokens 1024
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def _cfg(args, static: bool) -> dict:
    return {
        "enabled": True,
        "backend": "hf",
        "engine": "vllm",
        "hf_batch_size": args.batch_size,
        "hf_dtype": "bfloat16",
        "hf_static_cache": static,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "max_failed_fraction": 0.05,
    }


def _run(target_json: str, prompts: list[dict], cfg: dict, work: Path, name: str):
    from eagleflow.data.regenerate import regenerate
    from eagleflow.util import read_jsonl

    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{name}.prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out, stats = work / f"{name}.jsonl", work / f"{name}.stats.json"
    t0 = time.monotonic()
    regenerate(target_json, str(path), cfg, {}, str(work / f"{name}.resume"), str(out), str(stats))
    wall = time.monotonic() - t0
    return read_jsonl(out), {**json.loads(stats.read_text()), "wall_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--work", default="/tmp/eagleflow-regen")
    ap.add_argument("--check", type=int, default=64)
    ap.add_argument("--prompts-limit", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    import torch

    from eagleflow.target.prepare import build_from_gguf, prepare_target
    from eagleflow.util import read_jsonl

    work = Path(args.work)
    out = Path(args.out) / "gpu_regenerate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "args": vars(args),
    }

    def save():
        out.write_text(json.dumps(result, indent=1))

    t0 = time.monotonic()
    folder = work / "target"
    if not (folder / "config.json").is_file():
        build_from_gguf(Path(args.gguf), folder, "bfloat16")
    target_json = str(work / "target.json")
    prepare_target({"name": "smollm2-135m-instruct", "path": str(folder), "dtype": "bfloat16"},
                   str(folder), target_json)  # fmt: skip
    result["build_target_s"] = round(time.monotonic() - t0, 1)
    prompts = read_jsonl(args.prompts)
    save()

    if args.check:
        subset = prompts[: args.check]
        static, s_stats = _run(target_json, subset, _cfg(args, True), work, "check-static")
        dynamic, d_stats = _run(target_json, subset, _cfg(args, False), work, "check-dynamic")
        same = sum(a["messages"] == b["messages"] for a, b in zip(static, dynamic, strict=True))
        result["check"] = {
            "prompts": len(subset),
            "identical_answers": same,
            "static": s_stats,
            "dynamic": d_stats,
        }
        save()

    if args.prompts_limit:
        rows, stats = _run(target_json, prompts[: args.prompts_limit], _cfg(args, True), work,
                           "run")  # fmt: skip
        finishes = Counter(f for r in rows for f in r["finish_reasons"])
        result["run"] = {
            **{k: v for k, v in stats.items() if k != "failures"},
            "finish_reasons": dict(finishes),
            "turns": sum(len(r["finish_reasons"]) for r in rows),
            "first_failures": dict(list(stats.get("failures", {}).items())[:3]),
            "sample": [
                {**m, "content": m["content"][:300]} for r in rows[:2] for m in r["messages"][:2]
            ],
        }
        save()
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=1)[:6000])


if __name__ == "__main__":
    main()
