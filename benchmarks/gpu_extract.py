"""Extraction throughput: eagleflow's `extract_hidden_states` (hf backend) against the bare forward.

    python benchmarks/gpu_extract.py --shape llama-3.1-8b [--before OLD_EXTRACT_PY] [--work DIR]

On a random-init target of the shape (bf16 on a GPU, saved as an HF folder in --work) and a
synthetic dataset of realistic lengths (gpu_common.synthetic_dataset), it measures in one run:

- the bf16 matmul peak of this GPU (the ceiling every FLOP fraction below is taken of);
- the disk: sequential writes into the page cache, and with an fsync (what the disk sustains);
- the bare forward: `model.model(ids, output_hidden_states=True)` over the same padded batches
  the extraction makes (eagleflow.extract.hf.token_batches), nothing copied or written, timed on
  a second pass (the first meets each batch shape once, as the extraction runs do); and at one
  fixed shape (batch_tokens // max_len x max_len, no padding) for comparison with earlier runs;
- `extract_hidden_states` itself, unchanged, writing and hashing every shard: the current code,
  and, with --before, an earlier extract.py (e.g. `git show HEAD:src/eagleflow/extract/hf.py`)
  on the same data, as before/after; then every shard's sha256 checked against the manifest.

Rates exclude the model load (timed apart by wrapping `load_hf_target`), so they compare with
the bare forward. Prints a table; writes `extract-<shape>.json` under $OUT (or benchmarks/out).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common as common  # noqa: E402


def setup(shape: str, work: Path, samples: int | None = None) -> dict:
    """Target and dataset for a shape (reused when they exist), and the extract config."""
    data = common.DATA[shape]
    samples = samples or data["samples"]
    work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    target = common.build_target(work / "target", shape)
    built = time.perf_counter() - t
    ds = work / f"ds-{samples}"
    if not (ds / "state.json").is_file():
        common.synthetic_dataset(ds, shape, samples, data["min_len"], data["max_len"])
    lengths = common.dataset_lengths(str(ds))
    cfg = {
        "backend": "hf",
        "aux_layers": [1, 2, 3] if shape == "tiny" else "default",  # 4 layers: defaults collide
        "batch_tokens": data["batch_tokens"],
        "dtype": "bfloat16",
    }
    common.log(
        f"setup: {shape} target ({built:.0f} s), {len(lengths)} samples, {sum(lengths)} tokens"
    )
    return {
        "shape": shape,
        "work": str(work),
        "target": target,
        "dataset": str(ds),
        "lengths": lengths,
        "extract": cfg,
        "target_build_s": round(built, 1),
    }


def bare_forward(s: dict, peak: float) -> dict:
    """The base model's forward over the extraction's batches, and at one fixed shape."""
    import datasets
    import torch

    from eagleflow.extract.hf import decoder_layers, load_hf_target, padded_batch, token_batches

    info = json.loads(Path(s["target"]).read_text())
    model = load_hf_target(info["path"], info["run_dtype"])
    base = decoder_layers(model)[0]
    device = next(model.parameters()).device
    rows = datasets.load_from_disk(s["dataset"])["input_ids"]
    lengths = dict(enumerate(s["lengths"]))
    batches = []
    for batch in token_batches(lengths, s["extract"]["batch_tokens"]):
        ids, mask = padded_batch(rows, batch)
        batches.append((ids.to(device), mask.to(device)))

    def forward(ids, mask):
        with torch.no_grad():
            return base(
                input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False
            )

    for ids, mask in batches:  # warm-up: every batch shape once (kernel choice, mask code)
        forward(ids, mask)
    common.sync()
    common.gpu_memory(reset=True)
    t = time.perf_counter()
    for ids, mask in batches:
        forward(ids, mask)
    common.sync()
    seconds = time.perf_counter() - t
    tokens = sum(s["lengths"])
    flops = common.forward_flops(s["shape"], s["lengths"])
    padded = sum(ids.numel() for ids, _ in batches)
    out = {
        "batches": len(batches),
        "tokens": tokens,
        "padded_tokens": padded,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds),
        "tflops": common.sig(flops / seconds / 1e12),
        "peak_fraction": round(flops / seconds / 1e12 / peak, 3),
        **common.gpu_memory(reset=True),
    }
    # One fixed shape without padding (8 x 2048 was measured earlier on this GPU).
    width = common.DATA[s["shape"]]["max_len"]
    count = max(1, s["extract"]["batch_tokens"] // width)
    ids = torch.randint(0, common.SHAPES[s["shape"]]["vocab_size"], (count, width), device=device)
    forward(ids, None)
    common.sync()
    reps = 5
    t = time.perf_counter()
    for _ in range(reps):
        forward(ids, None)
    common.sync()
    seconds = time.perf_counter() - t
    flops = reps * common.forward_flops(s["shape"], [width] * count)
    out["fixed"] = {
        "batch": f"{count} x {width}",
        "tokens_per_s": round(reps * count * width / seconds),
        "tflops": common.sig(flops / seconds / 1e12),
        "peak_fraction": round(flops / seconds / 1e12 / peak, 3),
        **common.gpu_memory(reset=True),
    }
    return out  # the model goes with this frame; the caller frees the GPU


def extraction(module, s: dict, label: str, peak: float) -> dict:
    """One `module.extract_hidden_states` call into fresh shards, then a full sha256 check."""
    from eagleflow.extract.manifest import load_manifest

    work = Path(s["work"])
    shard_dir, manifest = work / f"shards-{label}", work / f"manifest-{label}.json"
    shutil.rmtree(shard_dir, ignore_errors=True)
    real_load = module.load_hf_target
    spent = {}

    def timed_load(*args, **kwargs):
        t = time.perf_counter()
        model = real_load(*args, **kwargs)
        common.sync()
        spent["load_s"] = time.perf_counter() - t
        return model

    module.load_hf_target = timed_load  # timing only: the same function runs
    common.free_gpu()
    try:
        t = time.perf_counter()
        man = module.extract_hidden_states(
            s["target"], s["dataset"], s["extract"], str(shard_dir), str(manifest)
        )
        total = time.perf_counter() - t
    finally:
        module.load_hf_target = real_load
    memory = common.gpu_memory(reset=True)
    common.free_gpu()
    t = time.perf_counter()
    load_manifest(manifest, verify="sha256")
    verify = time.perf_counter() - t
    seconds = total - spent.get("load_s", 0.0)
    tokens, size = man["num_tokens"], man["bytes"]
    flops = common.forward_flops(s["shape"], s["lengths"])
    return {
        "label": label,
        "tokens": tokens,
        "model_load_s": round(spent.get("load_s", 0.0), 2),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds),
        "tflops": common.sig(flops / seconds / 1e12),
        "peak_fraction": round(flops / seconds / 1e12 / peak, 3),
        "bytes": size,
        "bytes_per_token": round(size / tokens, 1),
        "write_gb_s": round(size / seconds / 1e9, 2),
        "sha256_verify_s": round(verify, 2),
        "sha256_verify_gb_s": round(size / verify / 1e9, 2),
        "manifest": str(manifest),
        "shard_sha256": [x["sha256"] for x in man["shards"]],
        **memory,
    }


def main(argv: list[str] | None = None) -> dict:
    p = common.arguments(__doc__, "extract.py")
    p.add_argument("--disk-gb", type=float, default=None, help="size of the disk-rate write")
    p.add_argument("--keep-before", action="store_true", help="keep the before run's shards")
    args = p.parse_args(argv)

    from eagleflow.extract import hf as extract

    result = {"environment": common.environment(), "shape": args.shape}
    common.log("environment:", json.dumps(result["environment"]))
    peak = common.matmul_peak()
    result["matmul_peak_tflops"] = common.sig(peak)
    common.log(f"bf16 matmul peak {peak:.3g} TFLOP/s")
    s = setup(args.shape, args.work, args.samples)
    result["setup"] = {k: v for k, v in s.items() if k != "lengths"}
    result["setup"]["tokens"] = sum(s["lengths"])
    result["flop_formula"] = common.FORWARD_FLOPS
    os.sync()  # the target's weights are on disk before the disk is measured
    disk_gb = args.disk_gb or (
        8.0 if args.shape == "llama-3.1-8b" else 2.0 if common.cuda() else 0.05
    )
    result["disk"] = common.disk_write_rate(args.work / "disk", disk_gb)
    common.log("disk:", result["disk"])
    result["bare"] = bare_forward(s, peak)
    common.free_gpu()
    common.log("bare forward:", json.dumps(result["bare"]))
    common.save_result(f"extract-{args.shape}", result)
    runs = []
    if args.before:
        before = common.load_module(args.before, "eagleflow_extract_before")
        runs.append(extraction(before, s, "before", peak))
        common.log(
            "before:", json.dumps({k: v for k, v in runs[-1].items() if k != "shard_sha256"})
        )
        if not args.keep_before:
            shutil.rmtree(Path(s["work"]) / "shards-before", ignore_errors=True)
        common.save_result(f"extract-{args.shape}", {**result, "runs": runs})
    runs.append(extraction(extract, s, "after", peak))
    common.log("after:", json.dumps({k: v for k, v in runs[-1].items() if k != "shard_sha256"}))
    if len(runs) == 2:
        same = sum(
            a == b for a, b in zip(runs[0]["shard_sha256"], runs[1]["shard_sha256"], strict=True)
        )
        result["identical_shards"] = f"{same} of {len(runs[1]['shard_sha256'])}"
        result["after_over_before"] = round(runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"], 2)
    result["after_over_bare"] = round(runs[-1]["tokens_per_s"] / result["bare"]["tokens_per_s"], 3)
    bpt = runs[-1]["bytes_per_token"]
    result["disk_needed_gb_s_at_bare_rate"] = round(bpt * result["bare"]["tokens_per_s"] / 1e9, 2)
    for r in runs:
        r.pop("shard_sha256")
    result["runs"] = runs
    common.save_result(f"extract-{args.shape}", result)
    print_table(result)
    return result


def print_table(result: dict) -> None:
    bare, fixed = result["bare"], result["bare"]["fixed"]
    rows = [
        [
            "bare forward (same batches)",
            f"{bare['tokens_per_s']:,}",
            bare["tflops"],
            f"{100 * bare['peak_fraction']:.0f}%",
            bare.get("peak_allocated_gib", "-"),
            "-",
            "-",
        ],
        [
            f"bare forward ({fixed['batch']}, no padding)",
            f"{fixed['tokens_per_s']:,}",
            fixed["tflops"],
            f"{100 * fixed['peak_fraction']:.0f}%",
            fixed.get("peak_allocated_gib", "-"),
            "-",
            "-",
        ],
    ]
    for r in result["runs"]:
        rows.append(
            [
                f"extract_hidden_states ({r['label']})",
                f"{r['tokens_per_s']:,}",
                r["tflops"],
                f"{100 * r['peak_fraction']:.0f}%",
                r.get("peak_allocated_gib", "-"),
                r["bytes_per_token"],
                r["write_gb_s"],
            ]
        )
    print()
    print(f"## extraction, {result['shape']}, {result['environment'].get('gpu') or 'cpu'}")
    print(f"bf16 matmul peak {result['matmul_peak_tflops']} TFLOP/s; {result['flop_formula']}")
    print(
        common.table(
            rows, ["stage", "tok/s", "TFLOP/s", "of peak", "GPU GiB", "bytes/tok", "write GB/s"]
        )
    )
    disk = result["disk"]
    print(
        f"disk: {disk['page_cache_gb_s']} GB/s into the page cache, {disk['fsync_gb_s']} GB/s "
        f"with fsync; the bare forward's rate needs {result['disk_needed_gb_s_at_bare_rate']} GB/s"
    )
    extra = {
        k: result[k]
        for k in ("after_over_before", "after_over_bare", "identical_shards")
        if k in result
    }
    print("ratios:", json.dumps(extra))


if __name__ == "__main__":
    main()
