"""EAGLE-3 s3 served with the same benchmark, same machine and session, for the side by side."""
import sys
from eagleflow import config as efconfig
from eagleflow.serve import bench
cfg = efconfig.load_layers(["config/config.yaml", "/tmp/dfcfg/e2e.yaml"])
cfg = efconfig.validate(cfg)
spec = {"name": "s3", "num_steps": 3, "topk": 1, "num_draft_tokens": None}
bench_cfg = {k: v for k, v in cfg["benchmark"].items() if k not in ("endpoints", "standalone_batch_size", "standalone_dtype")}
rec = bench.serve_and_benchmark("results/target/target.json", "results/export/speculators", cfg["serve"],
    bench_cfg, spec, sys.argv[1], sys.argv[2])
print(rec["summary"])
