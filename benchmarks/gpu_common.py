"""Shared pieces of the GPU benchmarks (gpu_extract.py, gpu_train.py): targets, data, ceilings.

The benchmarks call eagleflow's own stage functions on a random-init target of a real model's
shape saved as a Hugging Face folder, on synthetic token data of realistic lengths, and count
the floating-point work they claim (formulas in `forward_flops` and `draft_step_flops`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # eagleflow from this checkout, also without `pip -e`

# Decoder shapes (LlamaConfig keys). llama-3.1-8b is meta-llama/Llama-3.1-8B's config.json
# (rope scaling left out: it changes no FLOP and no byte).
SHAPES = {
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
    ),
    "small": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
    ),
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
    ),
}
# Per shape: samples, length range, extraction token budget, draft vocabulary, packed length.
DATA = {
    "tiny": dict(samples=24, min_len=16, max_len=96, batch_tokens=512, draft_vocab=64, seq=256),
    "small": dict(
        samples=256, min_len=128, max_len=2048, batch_tokens=16384, draft_vocab=8000, seq=8192
    ),
    "llama-3.1-8b": dict(
        samples=256, min_len=128, max_len=2048, batch_tokens=16384, draft_vocab=32000, seq=8192
    ),
}


def arguments(doc: str, module: str) -> argparse.ArgumentParser:
    """The options both benchmarks take; `module` is the eagleflow file --before replaces."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "efbench")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--before", type=Path, help=f"an earlier {module} to measure against")
    return p


def out_dir() -> Path:
    """Where results go: $OUT on the device machine, else ./benchmarks/out."""
    path = Path(os.environ.get("OUT") or REPO / "benchmarks" / "out")
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_result(name: str, result: dict) -> None:
    (out_dir() / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")


def sig(x: float) -> float:
    """Three significant digits (TFLOP/s of a GPU and of a CPU smoke run alike)."""
    return float(f"{x:.3g}")


def log(*parts) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def load_module(path: str | Path, name: str):
    """A module from a file (an earlier version of an eagleflow module, for before/after)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def environment() -> dict:
    """GPU, driver and package versions, as the results must state them."""
    import torch

    env = {"python": platform.python_version(), "host": platform.node(), "cpus": os.cpu_count()}
    for name in ("torch", "transformers", "triton", "safetensors", "datasets", "speculators"):
        try:
            from importlib.metadata import version

            env[name] = version(name)
        except Exception:
            env[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sms=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["gpu"] = None
    return env


def matmul_peak(n: int = 8192, iters: int = 20) -> float:
    """Measured bf16 matmul TFLOP/s (n x n x n, random data, three operand sets in rotation,
    median of `iters` CUDA-event timings after warm-up); on a CPU a small fp32 one."""
    import torch

    if not torch.cuda.is_available():
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        return 2 * 512**3 * 10 / (time.perf_counter() - t) / 1e12
    sets = [
        tuple(torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for _ in range(3)
    ]
    for a, b in sets:
        a @ b
    times = []
    for i in range(iters):
        a, b = sets[i % 3]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e12


def disk_write_rate(folder: Path, gigabytes: float) -> dict:
    """Sequential write into `folder`'s file system: GB/s into the page cache, and GB/s
    including an fsync of everything written (what the disk itself sustains)."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "disk-rate.bin"
    chunk = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    count = max(1, int(gigabytes * 1e9 / len(chunk)))
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(count):
            f.write(chunk)
        cached = time.perf_counter() - start
        os.fsync(f.fileno())
    synced = time.perf_counter() - start
    path.unlink()
    size = count * len(chunk)
    usage = shutil.disk_usage(folder)
    return {
        "bytes": size,
        "page_cache_gb_s": round(size / cached / 1e9, 2),
        "fsync_gb_s": round(size / synced / 1e9, 2),
        "disk_free_gb": round(usage.free / 1e9, 1),
    }


def llama_config(shape: str):
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, max_position_embeddings=8192)


def build_target(folder: Path, shape: str) -> str:
    """A random-init LlamaForCausalLM of `shape` saved as an HF folder; returns its target.json.

    Made on the GPU in the run dtype (bf16 there, fp32 on a CPU) and saved in 4 GB shards, as
    a real checkpoint would be. An existing folder of the same shape is reused.
    """
    import torch
    from transformers import LlamaForCausalLM

    from eagleflow.target.prepare import describe_target

    target_json = folder.parent / f"{folder.name}.target.json"
    if target_json.is_file() and json.loads(target_json.read_text()).get("shape") == shape:
        return str(target_json)
    shutil.rmtree(folder, ignore_errors=True)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(llama_config(shape)).eval()
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)  # a post-norm value never passes for pre-norm
    model.save_pretrained(folder, max_shard_size="4GB")
    del model
    info = describe_target(folder)
    info.update(name=f"random-{shape}", run_dtype=str(dtype).removeprefix("torch."), shape=shape)
    target_json.write_text(json.dumps(info))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return str(target_json)


def synthetic_dataset(folder: Path, shape: str, samples: int, min_len: int, max_len: int) -> str:
    """A tokenized dataset in the tokenize stage's layout (input_ids, loss_mask, seq_len).

    Lengths are log-normal around half of `max_len` (sigma 0.5), clipped to [min_len, max_len]:
    chat conversations of a prompt and a long answer. Tokens are uniform over the vocabulary;
    the first 30% of each sample (the prompt) is outside the loss mask.
    """
    import datasets
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(max_len / 2), 0.5, samples), min_len, max_len)
    lengths = [int(n) for n in lengths]
    vocab = SHAPES[shape]["vocab_size"]
    ids = [rng.integers(0, vocab, n).tolist() for n in lengths]
    masks = [[0] * (3 * n // 10) + [1] * (n - 3 * n // 10) for n in lengths]
    shutil.rmtree(folder, ignore_errors=True)
    datasets.Dataset.from_dict(
        {"input_ids": ids, "loss_mask": masks, "seq_len": lengths}
    ).save_to_disk(str(folder))
    return str(folder)


def dataset_lengths(dataset: str) -> list[int]:
    import datasets

    return list(datasets.load_from_disk(dataset)["seq_len"])


def body_params(cfg: dict) -> int:
    """Matmul parameters of the decoder layers (no embedding, no LM head)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return layers * (h * q + 2 * h * kv + q * h + 3 * h * inter)


FORWARD_FLOPS = (
    "target forward FLOPs = sum over samples of (2 * P * n + 2 * L * d * n^2): P = matmul "
    "parameters of the decoder layers (no embedding, no LM head: extraction runs the base "
    "model), n = the sample's real tokens (padding not counted), L = layers, d = heads * "
    "head_dim (causal attention: QK^T and PV over n^2/2 pairs, 2 FLOPs a multiply-add each)"
)


def forward_flops(shape: str, lengths: list[int]) -> float:
    cfg = SHAPES[shape]
    p = body_params(cfg)
    d = cfg["num_attention_heads"] * cfg["head_dim"]
    layers = cfg["num_hidden_layers"]
    return float(sum(2 * p * n + 2 * layers * d * n * n for n in lengths))


DRAFT_FLOPS = (
    "draft training FLOPs per packed step = sum over documents of n * (4 * Pfc + 6 * T * "
    "(Players + Phead) + 2 * Pvhead) + 3 * T * 4 * d * (n^2 / 2 + n * (T - 1) / 2): Pfc = the "
    "fc layer (3H x H, forward + weight gradient only: its input needs no gradient), Players = "
    "the draft decoder layer's matmuls (q, k, v read 2H), Phead = draft LM head (H x draft "
    "vocab), all run forward + backward (6 = 2 forward + 4 backward) on each of T TTT steps; "
    "Pvhead = the verifier head on the draft vocabulary, forward once; attention over the "
    "causal context plus the previous TTT steps' diagonal, forward + backward (3x forward)"
)


def draft_step_flops(shape: str, draft_vocab: int, ttt: int, doc_lengths: list[int]) -> float:
    cfg = SHAPES[shape]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    p_fc = 3 * h * h
    p_layer = 2 * h * q + 2 * (2 * h) * kv + q * h + 3 * h * inter
    p_head = h * draft_vocab
    total = 0.0
    for n in doc_lengths:
        total += n * (4 * p_fc + 6 * ttt * (p_layer + p_head) + 2 * p_head)
        total += 3 * ttt * 4 * q * (n * n / 2 + n * (ttt - 1) / 2)
    return total


def gpu_memory(reset: bool = False) -> dict:
    """Peak GPU memory since the last reset (GiB), then reset it when asked."""
    import torch

    if not torch.cuda.is_available():
        return {}
    peak = {
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
    }
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def free_gpu() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def table(rows: list[list], header: list[str]) -> str:
    """A Markdown table (the README's figures come from these)."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
