"""The quality run's served half, here: the rules after the GPU stages, through their functions.

After `gpu_quality.py` (GPU host) and `--unpack` (here), the results folder holds the export,
the acceptance record and the answers, but not the bulk files the earlier rules made on the GPU
host (regenerated data, shards), so Snakemake would plan those rules again. This calls what
`serve_and_benchmark`, `summarize`, `plot_results` and `write_cards` call, with the rules'
arguments and paths (the baseline first, then each speculative config, one server at a time):

    .venv/bin/python benchmarks/quality_served.py --results /tmp/q/results --data-root /tmp/q/bulk
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_quality import load_config, run_parser  # noqa: E402

log = logging.getLogger("quality_served")


def main() -> None:
    ap = run_parser(__doc__)
    ap.add_argument("--only", nargs="*", help="these configs (default: all, baseline first)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.set + [f"results_dir={args.results}",
                                               f"data_root={args.data_root}"])  # fmt: skip
    from eagleflow.bench import serve_and_benchmark
    from eagleflow.report import plot_results, summarize, write_cards

    res = Path(args.results)
    engine = cfg["serve"]["engine"]
    bench = {
        k: v for k, v in cfg["benchmark"].items() if k not in ("endpoints", "standalone_batch_size")
    }  # fmt: skip  (bench_settings())
    answers = str(res / "eval" / "answers.json") if int(bench.get("turns") or 1) == 2 else None
    draft = str(res / "export" / ("sglang" if engine == "sglang" else "speculators"))
    times = {}
    records = []
    for spec in cfg["_spec"]:
        out = res / "bench" / engine / f"{spec['name']}.json"
        records.append(str(out))
        if out.exists() or (args.only and spec["name"] not in args.only):
            continue
        (res / "logs").mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        log.info("serve_and_benchmark %s/%s: start", engine, spec["name"])
        serve_and_benchmark(
            str(res / "target" / "target.json"),
            None if spec["name"] == "baseline" else draft,
            cfg["serve"], bench, spec, str(out),
            str(res / "logs" / f"serve_and_benchmark.{engine}.{spec['name']}.log"),
            answers=answers,
        )  # fmt: skip
        times[f"serve_and_benchmark.{spec['name']}"] = round(time.monotonic() - t0, 1)
        log.info(
            "serve_and_benchmark %s/%s: %.0f s",
            engine,
            spec["name"],
            times[f"serve_and_benchmark.{spec['name']}"],
        )
        path = res / "stages.served.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, **times}, indent=1))
    if not all(Path(r).exists() for r in records):
        return
    inputs = {
        "records": records,
        "acceptance": str(res / "acceptance" / "standalone.json"),
        "train": str(res / "train" / "summary.json"),
        "manifest": str(res / "extract" / "manifest.json"),
    }
    summarize(inputs, bench, str(res / "summary.csv"), str(res / "summary.md"))
    plot_inputs = {
        "summary": str(res / "summary.csv"),
        "acceptance": inputs["acceptance"],
        "metrics": str(res / "train" / "metrics.csv"),
        "manifest": inputs["manifest"],
        "train": inputs["train"],
    }
    plot_results(plot_inputs, cfg["report"], str(res / "plots"), bench,
                 out_table=str(res / "summary.html"))  # fmt: skip
    write_cards({"summary": str(res / "summary.csv"),
                 "speculators": str(res / "export" / "speculators"),
                 "certificate": str(res / "layers" / "layers.certificate.json")},
                cfg["report"], str(res / "cards" / f"{cfg['target']['name']}-eagle3.md"),
                bench)  # fmt: skip
    print((res / "summary.md").read_text())


if __name__ == "__main__":
    main()
