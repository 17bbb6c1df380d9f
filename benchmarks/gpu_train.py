"""Training throughput: eagleflow's `train_draft` (speculators' Trainer, real data loader) against
the bare model step.

    python benchmarks/gpu_train.py --shape llama-3.1-8b [--before OLD_TRAIN_PY] [--work DIR]

Reads the shards gpu_extract.py left in --work (or extracts them first), issues the layer
certificate with `verify_layers` (hf forward hooks on the target) and the vocab map with
`build_vocab_map`, then measures in one run:

- the bare model step: the draft eagleflow builds (`TrainingRun.build`: speculators'
  Eagle3DraftModel, AdamW, schedule, bf16 autocast) stepped on one packed batch already on the
  GPU, forward + backward over the TTT steps + clip + optimizer step, no data loader, no
  per-step synchronisation;
- speculators' Trainer loop on that GPU-resident batch (its per-step timer and metrics, no
  loader): what the Trainer itself costs;
- `train_draft` itself, unchanged, on the shards through speculators' data loader (its
  worker processes read the safetensors shards): the current code, and with --before an
  earlier train.py, as before/after; the steady rate is wall-clock between step callbacks,
  compile and warm-up steps left out;
- `loss_implementation: fused`: refused with a message where it cannot run, or measured.

Writes `train-<shape>.json` under $OUT (or benchmarks/out) and prints a table.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common as common  # noqa: E402
import gpu_extract  # noqa: E402


def prepare(s: dict, manifest: str) -> dict:
    """Certificate and vocab map for the shards: train_draft's inputs."""
    import datasets
    import numpy as np
    import torch

    from eagleflow.extract.certificate import CertificateError, verify_layers
    from eagleflow.train.vocab import build_vocab_map

    work = Path(s["work"])
    cert = work / "layers.certificate.json"
    t = time.perf_counter()
    verify = {"probe_samples": 2, "engine_check": False, "hf_forward": True}
    refused = None
    try:
        verify_layers(
            s["target"], s["dataset"], manifest, verify, s["extract"], "0.5.23", str(cert)
        )
    except CertificateError as e:
        # Reported, then issued without the forward-hook comparison (as for a target too large
        # for an in-process forward), so that training can still be measured.
        refused = str(e)
        common.log("certificate refused:", refused)
        verify = {**verify, "hf_forward": False}
        verify_layers(
            s["target"], s["dataset"], manifest, verify, s["extract"], "0.5.23", str(cert)
        )
    cert_s = time.perf_counter() - t
    common.free_gpu()
    data = datasets.load_from_disk(s["dataset"])
    vocab = common.SHAPES[s["shape"]]["vocab_size"]
    counts = np.zeros(vocab, dtype=np.int64)
    for ids, mask in zip(data["input_ids"], data["loss_mask"], strict=True):
        ids, mask = np.asarray(ids), np.asarray(mask, dtype=bool)
        counts += np.bincount(ids[mask], minlength=vocab)
    freq = {int(t): int(c) for t, c in enumerate(counts) if c}
    torch.save(freq, work / "token_freq.pt")
    size = common.DATA[s["shape"]]["draft_vocab"]
    d2t, t2d = work / f"d2t.{size}.npy", work / f"t2d.{size}.npy"
    build_vocab_map(str(work / "token_freq.pt"), size, str(d2t), str(t2d), s["target"])
    common.log(f"certificate ({cert_s:.0f} s) and vocab map ({size}) ready")
    inputs = {
        "target": s["target"],
        "dataset": s["dataset"],
        "manifest": manifest,
        "certificate": str(cert),
        "d2t": str(d2t),
        "t2d": str(t2d),
    }
    return {"inputs": inputs, "certificate_s": round(cert_s, 1), "certificate_refused": refused}


def train_config(shape: str, num_workers: int) -> dict:
    from eagleflow import config

    data = common.DATA[shape]
    return {
        **config.fill_defaults({})["train"],
        "gpus": 1 if common.cuda() else 0,
        "draft_vocab_size": data["draft_vocab"],
        "total_seq_len": data["seq"],
        "epochs": 1,
        "val_fraction": 0.05 if shape != "tiny" else 0.2,
        "warmup_steps": 0,
        "save_every_steps": 10**6,
        "num_workers": num_workers,
    }


def batch_docs(batch: dict) -> list[int]:
    """Document lengths of one packed batch (its document_ids; -1 is padding)."""
    import torch

    ids = batch["document_ids"].flatten()
    return [int(n) for n in torch.bincount(ids[ids >= 0]).tolist() if n]


def bare_step(inputs: dict, cfg: dict, shape: str, peak: float, steps: int) -> dict:
    """The model step alone, then speculators' Trainer loop on the same GPU-resident batch."""
    import torch

    from eagleflow.train import loop as tm
    from eagleflow.train.settings import check_inputs, resolve_settings

    work = Path(inputs["dataset"]).parent
    run_dir = work / "ckpt-bare"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = {**cfg, "num_workers": 0}  # one batch, read in this process
    checked = check_inputs(inputs, cfg)
    settings = resolve_settings(cfg, common.cuda())
    run = tm.TrainingRun(inputs, cfg, checked, settings, run_dir, None, False)
    run.build()
    run.restore_progress_bar()
    tr = run.trainer
    loader = getattr(tr.train_loader, "loader", tr.train_loader)
    sampler = loader.batch_sampler
    lengths = loader.dataset.approx_lengths
    # FLOPs of every step of epoch 0, in the order the Trainer will run them
    plan = []
    for batch_ids in sampler._generate_batches(0):
        docs, left = [], cfg["total_seq_len"]
        for i in batch_ids:
            n = min(lengths[i] - 1, left)  # shift_batch drops one token a sample
            if n > 0:
                docs.append(n)
            left -= n
            if left <= 0:
                break
        plan.append(common.draft_step_flops(shape, cfg["draft_vocab_size"], cfg["ttt_steps"], docs))
    batch = next(iter(loader))
    device = settings["device"]
    gpu = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
        if not k.startswith("__")
    }
    tokens = int((gpu["document_ids"] != -1).sum())
    flops = common.draft_step_flops(
        shape, cfg["draft_vocab_size"], cfg["ttt_steps"], batch_docs(gpu)
    )
    kwargs = tr.config.train_call_kwargs or {}

    def step():
        with torch.autocast(tr.device_type, dtype=tr.config.hidden_states_dtype):
            _, loss, _ = tr.model(**gpu, **kwargs)
        tr._optimizers_zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.model.parameters(), 1.0)
        tr._optimizers_step()
        tr._schedulers_step()

    t = time.perf_counter()
    for _ in range(3):  # the first compiles
        step()
    common.sync()
    warm = time.perf_counter() - t
    common.gpu_memory(reset=True)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    common.sync()
    seconds = (time.perf_counter() - t) / steps
    out = {
        "tokens_per_step": tokens,
        "compile_and_warmup_s": round(warm, 1),
        "step_s": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds),
        "tflops": common.sig(flops / seconds / 1e12),
        "peak_fraction": round(flops / seconds / 1e12 / peak, 3),
        **common.gpu_memory(reset=True),
    }

    class Repeat:  # the Trainer's view of a loader: len, batch_sampler, iteration
        batch_sampler = sampler

        def __len__(self):
            return steps + 3

        def __iter__(self):
            return (dict(gpu) for _ in range(steps + 3))

    tr.train_loader = Repeat()
    marks = []
    metric_logger = logging.getLogger("speculators.metrics")
    old = metric_logger.propagate
    metric_logger.propagate = False  # a dict a step on the console helps nobody
    try:
        tr.train_epoch(0, step_callback=lambda: marks.append(time.perf_counter()))
    finally:
        metric_logger.propagate = old
    loop = (marks[-1] - marks[2]) / (len(marks) - 3)
    out["trainer_loop"] = {
        "step_s": round(loop, 4),
        "tokens_per_s": round(tokens / loop),
        "tflops": common.sig(flops / loop / 1e12),
        "peak_fraction": round(flops / loop / 1e12 / peak, 3),
    }
    shutil.rmtree(run_dir, ignore_errors=True)
    return out, plan  # the draft and its optimizer go with this frame


def loader_rate(inputs: dict, cfg: dict, workers: int) -> dict:
    """What train_draft's data loader alone supplies (no training): batches arriving on the
    device through eagleflow's loader (speculators' workers, pinning, the GPU prefetch)."""
    import torch

    from eagleflow.train import loop as tm
    from eagleflow.train.settings import check_inputs, resolve_settings

    work = Path(inputs["dataset"]).parent
    cfg = {**cfg, "num_workers": workers}
    run_dir = work / f"ckpt-loader-{workers}"
    shutil.rmtree(run_dir, ignore_errors=True)
    checked = check_inputs(inputs, cfg)
    settings = resolve_settings(cfg, common.cuda())
    run = tm.TrainingRun(inputs, cfg, checked, settings, run_dir, None, False)
    run.build()
    run.restore_progress_bar()
    marks, tokens, size = [], [], []
    t = time.perf_counter()
    for batch in run.trainer.train_loader:
        marks.append(time.perf_counter())
        tokens.append(int((batch["document_ids"] != -1).sum()))
        size.append(sum(v.numel() * v.element_size() for v in batch.values() if torch.is_tensor(v)))
    common.sync()
    first = 3 if len(marks) > 6 else 0
    seconds = marks[-1] - marks[first]
    out = {
        "workers": workers,
        "batches": len(marks),
        "first_batch_s": round(marks[0] - t, 1),
        "tokens_per_s": round(sum(tokens[first + 1 :]) / seconds),
        "gb_per_s": round(sum(size[first + 1 :]) / seconds / 1e9, 2),
        "mb_per_batch": round(statistics.mean(size) / 1e6),
    }
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def host_copy_rate() -> dict:
    """One thread's memcpy on this host (GB/s), pageable and into page-locked memory: each copy
    of a batch in the loader's workers and its pinning thread runs at about this rate."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        size = 1 << 30 if common.cuda() else 1 << 26  # 1 GiB; 64 MiB for the CPU smoke run
        src = torch.ones(size, dtype=torch.uint8)
        out = {}
        targets = {"pageable": torch.empty_like(src)}
        if common.cuda():
            targets["pinned"] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        for name, dst in targets.items():
            dst.copy_(src)
            t = time.perf_counter()
            for _ in range(3):
                dst.copy_(src)
            out[f"{name}_gb_s"] = round(3 * src.numel() / (time.perf_counter() - t) / 1e9, 2)
        return out
    finally:
        torch.set_num_threads(threads)


class _Keep(logging.Handler):
    """speculators' per-step metric records (its step timer's profile among them)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        if isinstance(record.msg, dict) and "profile" in record.msg:
            self.records.append(record.msg)


def _reset_compiled() -> None:
    import torch

    common.free_gpu()
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()  # each run compiles afresh, as in its own process


def online_inputs(s: dict, inputs: dict) -> dict:
    """train_draft's inputs for `extract.mode: online` (backend hf: the target in the training
    process) on the same target and data: the stream manifest (its probe rows only) and its
    certificate; the vocab map is the offline run's."""
    from eagleflow.extract.certificate import verify_layers
    from eagleflow.extract.stream import extract

    work = Path(s["work"])
    cfg = {**s["extract"], "mode": "online"}
    manifest, cert = work / "manifest-online.json", work / "layers.online.certificate.json"
    extract(s["target"], s["dataset"], cfg, str(work / "bulk"), str(manifest), probe_samples=2)
    verify = {"probe_samples": 2, "engine_check": False, "hf_forward": True}
    verify_layers(s["target"], s["dataset"], str(manifest), verify, cfg, "0.5.23", str(cert))
    return {**inputs, "manifest": str(manifest), "certificate": str(cert)}


def train_run(module, inputs: dict, cfg: dict, label: str, peak: float, plan: list, **kw) -> dict:
    """One `module.train_draft` call; steady rate between step callbacks after warm-up. `kw`
    goes to train_draft (`stream` for a streamed manifest)."""
    import csv

    work = Path(inputs["dataset"]).parent
    ckpt = work / f"ckpt-{label}"
    shutil.rmtree(ckpt, ignore_errors=True)
    marks: dict[int, float] = {}
    keep = _Keep()
    metric_logger = logging.getLogger("speculators.metrics")
    metric_logger.addHandler(keep)
    common.gpu_memory(reset=True)
    t = time.perf_counter()
    try:
        summary = module.train_draft(
            inputs,
            cfg,
            str(ckpt),
            str(work / f"summary-{label}.json"),
            str(work / f"metrics-{label}.csv"),
            on_step=lambda step: marks.__setitem__(step, time.perf_counter()),
            **kw,
        )
    finally:
        metric_logger.removeHandler(keep)
    total = time.perf_counter() - t
    memory = common.gpu_memory(reset=True)
    with open(work / f"metrics-{label}.csv") as f:
        tokens = {
            int(r["step"]): int(r["tokens"]) for r in csv.DictReader(f) if r["split"] == "train"
        }
    steps = sorted(marks)
    skip = 3 if len(steps) > 6 else 1
    first, last = steps[skip - 1], steps[-1]
    window = range(first + 1, last + 1)
    seconds = marks[last] - marks[first]
    n_tokens = sum(tokens[s] for s in window)
    flops = sum(plan[s - 1] for s in window if s - 1 < len(plan))
    prof = [r["profile"] for r in keep.records if r["global_step"] + 1 in window and r["profile"]]
    phases = {
        k: round(statistics.median(p[k] for p in prof), 2)
        for k in ("step_ms", "queue_ms", "h2d_ms", "fwd_ms", "bwd_ms", "opt_ms")
        if prof and k in prof[0]
    }
    out = {
        "label": label,
        "steps": len(steps),
        "steady_steps": len(window),
        "total_s": round(total, 1),
        "step_s": round(seconds / len(window), 4),
        "tokens_per_s": round(n_tokens / seconds),
        "tflops": common.sig(flops / seconds / 1e12),
        "peak_fraction": round(flops / seconds / 1e12 / peak, 3),
        "speculators_step_timer_median_ms": phases,
        "summary_tokens_per_s": summary["tokens_per_s"],
        "best_val_loss": summary["best_val"].get("loss"),
        **memory,
    }
    hs = summary.get("hidden_states") or {}
    if hs.get("forwards"):  # streamed: the target's forwards inside training's wall time
        out["target_forwards"] = hs["forwards"]
        out["target_forward_s"] = hs["forward_seconds"]
        out["target_forward_fraction"] = round(hs["forward_seconds"] / total, 3)
    shutil.rmtree(ckpt, ignore_errors=True)
    _reset_compiled()
    return out


def fused_loss(inputs: dict, cfg: dict) -> dict:
    """train_draft with the fused loss: refused with a message, or a few measured steps."""
    from eagleflow.errors import TrainError
    from eagleflow.train import loop as tm

    work = Path(inputs["dataset"]).parent
    t = time.perf_counter()
    try:
        summary = tm.train_draft(
            inputs,
            {**cfg, "loss_implementation": "fused", "max_steps": 4},
            str(work / "ckpt-fused"),
            str(work / "summary-fused.json"),
            str(work / "metrics-fused.csv"),
        )
        out = {"ran": True, "steady_tokens_per_s": summary["steady_tokens_per_s"]}
    except TrainError as e:
        out = {"ran": False, "refused": str(e)}
    except Exception as e:  # the crash the check exists to catch, should it get through
        out = {"ran": False, "crashed": f"{type(e).__name__}: {str(e)[:400]}"}
    out["seconds"] = round(time.perf_counter() - t, 1)
    shutil.rmtree(work / "ckpt-fused", ignore_errors=True)
    _reset_compiled()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = common.arguments(__doc__, "train.py")
    p.add_argument("--workers", type=int, default=None, help="data-loader workers (default 4)")
    p.add_argument("--bare-steps", type=int, default=20)
    p.add_argument("--skip-fused", action="store_true")
    p.add_argument(
        "--loader-workers", type=int, nargs="*", default=[], help="loader-only rates for these"
    )
    p.add_argument("--loader-only", action="store_true", help="stop after the loader rates")
    p.add_argument(
        "--online",
        action="store_true",
        help="also train with extract.mode online (the target forward in the training process)",
    )
    args = p.parse_args(argv)

    from eagleflow.extract import hf as extract
    from eagleflow.train import loop as train

    result = {"environment": common.environment(), "shape": args.shape}
    peak = common.matmul_peak()
    result["matmul_peak_tflops"] = common.sig(peak)
    s = gpu_extract.setup(args.shape, args.work, args.samples)
    manifest = Path(s["work"]) / "manifest-after.json"
    if not manifest.is_file():
        gpu_extract.extraction(extract, s, "after", peak)
    prep = prepare(s, str(manifest))
    inputs = prep["inputs"]
    result["certificate_s"] = prep["certificate_s"]
    result["certificate_refused"] = prep["certificate_refused"]
    workers = args.workers if args.workers is not None else (4 if common.cuda() else 0)
    cfg = train_config(args.shape, workers)
    result["train_config"] = {
        k: cfg[k]
        for k in (
            "draft_vocab_size",
            "ttt_steps",
            "total_seq_len",
            "num_workers",
            "loss_implementation",
        )
    }
    result["flop_formula"] = common.DRAFT_FLOPS
    result["host_copy"] = host_copy_rate()
    common.log("host copy:", result["host_copy"])
    result["loader_only"] = []
    for n in args.loader_workers:
        result["loader_only"].append(loader_rate(inputs, cfg, n))
        common.log("loader only:", result["loader_only"][-1])
        common.save_result(f"train-{args.shape}", result)
    if args.loader_only:
        return result
    result["bare"], plan = bare_step(inputs, cfg, args.shape, peak, args.bare_steps)
    _reset_compiled()
    common.log("bare step:", json.dumps(result["bare"]))
    common.save_result(f"train-{args.shape}", result)
    runs = []
    if args.before:
        before = common.load_module(args.before, "eagleflow_train_before")
        runs.append(train_run(before, inputs, cfg, "before", peak, plan))
        common.log("before:", json.dumps(runs[-1]))
        common.save_result(f"train-{args.shape}", {**result, "runs": runs})
    runs.append(train_run(train, inputs, cfg, "after", peak, plan))
    common.log("after:", json.dumps(runs[-1]))
    result["runs"] = runs
    if len(runs) == 2:
        result["after_over_before"] = round(runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"], 3)
    result["after_over_bare"] = round(runs[-1]["tokens_per_s"] / result["bare"]["tokens_per_s"], 3)
    common.save_result(f"train-{args.shape}", result)
    if args.online:
        streamed = online_inputs(s, inputs)
        big = {"recheck_steps": 10**9}  # the probe check before step 0 only
        result["online"] = train_run(train, streamed, cfg, "online", peak, plan, stream=big)
        result["online_over_offline"] = round(
            result["online"]["tokens_per_s"] / runs[-1]["tokens_per_s"], 3
        )
        common.log("online:", json.dumps(result["online"]))
        common.save_result(f"train-{args.shape}", result)
    if not args.skip_fused:
        result["fused_loss"] = fused_loss(inputs, cfg)
        common.log("fused loss:", json.dumps(result["fused_loss"]))
    common.save_result(f"train-{args.shape}", result)
    print_table(result)
    return result


def print_table(result: dict) -> None:
    bare, loop = result["bare"], result["bare"]["trainer_loop"]

    def row(name, r):
        return [
            name,
            f"{r['tokens_per_s']:,}",
            r["step_s"],
            r["tflops"],
            f"{100 * r['peak_fraction']:.0f}%",
            r.get("peak_allocated_gib", "-"),
        ]

    rows = [row("bare model step (batch on GPU)", bare), row("Trainer loop, batch on GPU", loop)]
    rows += [row(f"train_draft ({r['label']}), data loader", r) for r in result["runs"]]
    print()
    print(f"## draft training, {result['shape']}, {result['environment'].get('gpu') or 'cpu'}")
    print(f"config {json.dumps(result['train_config'])}; {bare['tokens_per_step']} tokens a step")
    print(f"bf16 matmul peak {result['matmul_peak_tflops']} TFLOP/s; {result['flop_formula']}")
    print(common.table(rows, ["stage", "tok/s", "step s", "TFLOP/s", "of peak", "GPU GiB"]))
    for r in result["runs"]:
        phases = r["speculators_step_timer_median_ms"]
        print(f"{r['label']}: speculators' step timer, median ms: {phases}")
    print("host copy, one thread:", result["host_copy"])
    for r in result["loader_only"]:
        print("data loader alone:", json.dumps(r))
    extra = {k: result[k] for k in ("after_over_before", "after_over_bare") if k in result}
    print("ratios:", json.dumps(extra))
    if result.get("certificate_refused"):
        print("certificate (hf forward check) refused:", result["certificate_refused"][:600])
    if "fused_loss" in result:
        print("fused loss:", json.dumps(result["fused_loss"]))


if __name__ == "__main__":
    main()
