"""Hidden-state stores compared: bytes on disk, extraction time and the certificate's errors.

Runs `extract_hidden_states` and `verify_layers` (the workflow's own functions) once per
`extract.dtype` on a finished workflow's target and tokenized dataset, each into its own shard
folder, and prints one row per dtype: bytes, bytes per token, the ratio to bfloat16, extraction
seconds, the certificate's tolerance and its largest relative error over the probe slots.

    python benchmarks/store_dtypes.py --results results --work /tmp/stores \
        --dtypes bfloat16 fp8 --out docs/results/<name>/store_dtypes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from eagleflow import config as efconfig
from eagleflow.extract.certificate import verify_layers
from eagleflow.extract.hf import extract_hidden_states


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default="results", help="a finished run's results folder")
    ap.add_argument("--work", required=True, help="where the shard folders go (deleted by you)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "fp8"])
    ap.add_argument("--configfile", nargs="*", default=[], help="the run's overlays")
    ap.add_argument("--out", help="JSON record of the rows")
    args = ap.parse_args()

    cfg = efconfig.load_layers(["config/config.yaml", *args.configfile])
    results, work = Path(args.results), Path(args.work)
    target, dataset = str(results / "target" / "target.json"), str(results / "data" / "tokenized")
    verify = dict(cfg["verify"], engine_check=False)  # the stored values are what differ
    rows = []
    for dtype in args.dtypes:
        extract_cfg = dict(cfg["extract"], dtype=dtype)
        folder = work / dtype
        t0 = time.monotonic()
        man = extract_hidden_states(
            target, dataset, extract_cfg, str(folder / "bulk"), str(folder / "manifest.json")
        )
        seconds = time.monotonic() - t0
        cert = verify_layers(
            target,
            dataset,
            str(folder / "manifest.json"),
            verify,
            extract_cfg,
            cfg["serve"]["sglang"]["version"],
            str(folder / "layers.certificate.json"),
        )
        hooks = next(c for c in cert["checks"] if c["name"] == "hf_forward_hooks")
        rows.append(
            {
                "dtype": dtype,
                "bytes": man["bytes"],
                "num_tokens": man["num_tokens"],
                "bytes_per_token": man["bytes_per_token"],
                "extract_seconds": round(seconds, 1),
                "certificate_tolerance_rel": hooks["tolerance_rel"],
                "certificate_max_rel_err": hooks["max_rel_err"],
                "probe_rows": cert["probe_rows"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    bf16 = next((r["bytes"] for r in rows if r["dtype"] == "bfloat16"), None)
    for r in rows:
        r["ratio_to_bfloat16"] = round(r["bytes"] / bf16, 4) if bf16 else None
    print(f"{'dtype':<10} {'bytes':>14} {'B/token':>9} {'÷ bf16':>7} {'extract s':>9} "
          f"{'cert tol':>9} {'cert max err':>12}")  # fmt: skip
    for r in rows:
        ratio = f"{r['ratio_to_bfloat16']:.3f}" if r["ratio_to_bfloat16"] else "-"
        print(
            f"{r['dtype']:<10} {r['bytes']:>14,} {r['bytes_per_token']:>9} {ratio:>7} "
            f"{r['extract_seconds']:>9} {r['certificate_tolerance_rel']:>9.3g} "
            f"{r['certificate_max_rel_err']:>12.3g}"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        record = {
            "host": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "results": str(results.resolve()),
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
