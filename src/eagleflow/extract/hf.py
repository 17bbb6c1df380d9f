"""Hidden-state extraction: the aux layers plus the pre-norm final slot, one shard per sample.

Shards use speculators' offline layout (`hs_{row}.safetensors`: `token_ids` [T] and `hidden_states`
[T, n_aux + 1, H], aux slots ascending, final slot last) and live under the data root; the Snakemake
output is a manifest (`eagleflow.extract.manifest`). Each shard is written atomically and recorded
in an append-only progress file, so an interrupted run resumes at shard granularity.

Backends: `hf` (in-process transformers forward; `device_map="auto"` on GPUs), `vllm` (vLLM's own
capture, `eagleflow.extract.vllm_capture`) and `sglang` (a running SGLang server,
`eagleflow.extract.sglang_capture`; GPU host only).

Throughput (benchmarks/README.md): on a GPU the forward never waits for the disk. Each batch's
states are cast to the stored dtype on the GPU, copied on a side stream into page-locked host
memory (a few batches in flight), and written by a thread pool straight from that memory, hashed
as they are written: no serialised copy of a shard is ever made.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagleflow import disk
from eagleflow import layers as lay
from eagleflow.errors import EagleflowError
from eagleflow.extract.manifest import write_manifest
from eagleflow.target.prepare import load_target_json
from eagleflow.util import read_jsonl_resumable

log = logging.getLogger(__name__)

PROGRESS = "progress.jsonl"
# Shard writers (threads: hashing and file writes release the GIL) and GPU batches whose host
# copies may wait for them; together they bound the page-locked memory held (~3 batches).
WRITE_THREADS = min(8, os.cpu_count() or 1)
HOST_BATCHES = 3
# safetensors' names for the dtypes a shard can hold
ST_DTYPES = {
    "int64": "I64",
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "float8_e4m3fn": "F8_E4M3",
}
# extract.dtype fp8: e4m3 values and one float32 scale per token, the layout speculators' fp8
# connector writes (hs_connectors.fp8_utils) and its FP8Transfer reads back.
FP8 = "fp8"


def dataset_fingerprint(dataset: str | Path) -> str:
    """The fingerprint `datasets` keeps for a saved dataset (changes when its rows change)."""
    state = Path(dataset) / "state.json"
    if not state.is_file():
        raise EagleflowError(
            f"{dataset} is not a dataset saved by the tokenize stage (no state.json); rerun it"
        )
    return json.loads(state.read_text())["_fingerprint"]


def shard_key(target: dict, aux: list[int], dtype: str, fingerprint: str, backend: str) -> str:
    """Folder name for one extraction: a different target, ids, dtype or dataset never resumes."""
    ident = {
        "config": target["config_sha256"],
        "weights": target.get("weights_sha256"),
        "aux": aux,
        "dtype": dtype,
        "dataset": fingerprint,
        "backend": backend,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def token_batches(lengths: dict[int, int], batch_tokens: int) -> list[list[int]]:
    """Rows grouped longest first so each padded batch holds at most `batch_tokens` tokens."""
    order = sorted(lengths, key=lambda r: (-lengths[r], r))
    batches, cur, cur_max = [], [], 0
    for row in order:
        n = lengths[row]
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(row)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    return batches


def padded_batch(rows, batch: list[int]):
    """Token ids and attention mask [len(batch), longest] of the rows, right-padded with 0."""
    import torch

    width = max(len(rows[r]) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, : len(rows[r])] = torch.tensor(rows[r])
        mask[i, : len(rows[r])] = 1
    return ids, mask


def load_hf_target(model_dir: str, dtype: str, trust_remote_code: bool = False):
    """The target as a transformers model, eval mode; all GPUs via device_map when present."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": getattr(torch, dtype), "trust_remote_code": trust_remote_code}
    if torch.cuda.is_available():
        kwargs["device_map"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise EagleflowError(
            f"target {model_dir} ships its own model code, which transformers runs only when "
            "allowed: set target.trust_remote_code: true (and rerun prepare_target)"
        ) from None
    return model.eval()


def decoder_layers(model):
    """The decoder-layer list and the final norm of a causal LM (Llama and DeepSeek layouts)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return base, base.layers, base.norm


def hf_capture(model, input_ids, attention_mask, aux: list[int]):
    """[B, T, n_aux + 1, H]: `hidden_states[k]` for each aux id, then the last layer pre-norm.

    HF's last `hidden_states` entry is after the final norm; the final slot is taken with a hook
    on the last decoder layer's output instead (what EAGLE-3 training needs).
    """
    import torch

    base, layer_list, _ = decoder_layers(model)
    captured = {}

    def grab(_module, _args, output):
        captured["final"] = output[0] if isinstance(output, tuple) else output

    handle = layer_list[-1].register_forward_hook(grab)
    try:
        with torch.no_grad():
            out = base(
                input_ids=input_ids,
                attention_mask=attention_mask,
                output_hidden_states=True,
                use_cache=False,
            )
    finally:
        handle.remove()
    slots = [out.hidden_states[k] for k in aux] + [captured["final"]]
    device = slots[0].device
    return torch.stack([s.to(device) for s in slots], dim=2)


class HostBatch:
    """One batch's hidden states in host memory, possibly still arriving from the GPU.

    Writers call `wait()` before reading and `release()` when done with their row; the last
    release frees the batch's slot, so at most HOST_BATCHES batches hold page-locked memory.
    """

    def __init__(self, tensor, event, rows: int, on_free=None):
        self.tensor, self._event, self._left, self._on_free = tensor, event, rows, on_free
        self._lock = threading.Lock()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def release(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.tensor = None
            if self._on_free is not None:
                self._on_free()


class _DeviceToHost:
    """Copies GPU batches into page-locked memory on a side stream, HOST_BATCHES at most."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self.slots = threading.BoundedSemaphore(HOST_BATCHES)

    def copy(self, hs, rows: int) -> HostBatch:
        torch = self.torch
        self.slots.acquire()  # blocks while writers are behind: the GPU waits for the disk
        host = torch.empty(hs.shape, dtype=hs.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(hs.device))
        with torch.cuda.stream(self.stream):
            host.copy_(hs, non_blocking=True)
            hs.record_stream(self.stream)  # its memory is not reused before the copy is done
            event = torch.cuda.Event()
            event.record(self.stream)
        return HostBatch(host, event, rows, self.slots.release)


def _hf_backend(target: dict, rows: dict[int, list[int]], cfg: dict, aux: list[int]) -> Iterator:
    import torch

    run_dtype = target.get("run_dtype") or "float32"
    model = load_hf_target(target["path"], run_dtype, bool(target.get("trust_remote_code")))
    device = next(model.parameters()).device
    # fp8 is quantized per row by the shard writers, from the values the target computed
    store = getattr(torch, run_dtype if cfg["dtype"] == FP8 else cfg["dtype"])
    to_host = _DeviceToHost(device) if device.type == "cuda" else None
    lengths = {r: len(ids) for r, ids in rows.items()}
    for batch in token_batches(lengths, cfg["batch_tokens"]):
        ids, mask = padded_batch(rows, batch)
        hs = hf_capture(model, ids.to(device), mask.to(device), aux)
        hs = hs.to(store)  # cast where the data is: half the bytes to copy when storing bf16
        host = to_host.copy(hs, len(batch)) if to_host else HostBatch(hs, None, len(batch))
        del hs
        for i, r in enumerate(batch):
            yield r, host.tensor[i, : lengths[r]], host


def _vllm_backend(target: dict, rows: dict[int, list[int]], cfg: dict, aux: list[int]) -> Iterator:
    from eagleflow.extract.vllm_capture import VllmCapture  # imports torch

    # vLLM's id L is the last layer's output before the final norm: the final slot.
    ids = list(aux) + [int(target["num_layers"])]
    order = sorted(rows)
    dtype = target.get("run_dtype") or "float32"
    remote_code = bool(target.get("trust_remote_code"))
    with VllmCapture(target["path"], ids, dtype=dtype, trust_remote_code=remote_code) as cap:
        step = max(1, cfg["batch_tokens"] // max(1, max(len(rows[r]) for r in order)))
        for i in range(0, len(order), step):
            chunk = order[i : i + step]
            yield from zip(chunk, cap.capture([rows[r] for r in chunk]), strict=True)


def _sglang_backend(
    target: dict, rows: dict[int, list[int]], cfg: dict, aux: list[int]
) -> Iterator:
    raise EagleflowError(
        "extract.backend 'sglang' captures only the aux layers, not the last layer's pre-norm "
        "output that EAGLE-3 trains on as its final slot (SGLang's capture loop stops before it); "
        "use backend 'hf' (device_map across the GPUs) or 'vllm', whose id L is that output"
    )


BACKENDS = {"hf": _hf_backend, "vllm": _vllm_backend, "sglang": _sglang_backend}


def extract_hidden_states(
    target_json: str,
    dataset: str,
    extract_cfg: dict,
    shard_dir: str,
    out_manifest: str,
    sglang_version: str = "0.5.23",
    engine: str = "vllm",
) -> dict:
    """Capture aux-layer hidden states of every dataset row into shards; write the manifest."""
    import datasets
    import torch
    from tqdm import tqdm

    target = load_target_json(target_json)
    plan = lay.plan_layers(target, extract_cfg["aux_layers"], sglang_version, engine)
    backend = extract_cfg["backend"]
    store_dtype = extract_cfg["dtype"]
    fingerprint = dataset_fingerprint(dataset)
    key = shard_key(target, plan.aux, extract_cfg["dtype"], fingerprint, backend)
    root = Path(shard_dir) / key
    root.mkdir(parents=True, exist_ok=True)
    progress_path = root / PROGRESS
    done = read_jsonl_resumable(progress_path, "row")
    data = datasets.load_from_disk(dataset).with_format(None)
    all_ids = data["input_ids"]
    todo = {
        r: list(ids)
        for r, ids in enumerate(all_ids)
        if not (
            r in done
            and (root / done[r]["path"]).is_file()
            and (root / done[r]["path"]).stat().st_size == done[r]["bytes"]
        )
    }
    total_tokens = sum(len(x) for x in all_ids)
    hidden = int(target["hidden_size"])
    need = disk.extraction_bytes(
        (len(v) for v in todo.values()), len(plan.aux) + 1, hidden, extract_cfg["dtype"]
    )
    space = disk.check_free_space(
        root,
        need,
        f"extract_hidden_states ({len(todo)} rows, {len(plan.aux) + 1} slots x {hidden} x "
        f"{extract_cfg['dtype']})",
        store_choices([len(v) for v in todo.values()], len(plan.aux) + 1, hidden),
    )
    log.info(
        "extract: %.2f GB to write, %.2f GB free under %s", need / 1e9, space["free"] / 1e9, root
    )
    log.info(
        "extract: %d rows (%d tokens), %d done before, backend %s, aux %s + final slot, %s -> %s",
        len(all_ids),
        total_tokens,
        len(all_ids) - len(todo),
        backend,
        lay.format_ids(plan.aux),
        extract_cfg["dtype"],
        root,
    )
    start = time.monotonic()
    new_tokens = new_bytes = 0
    bar = tqdm(
        total=sum(len(v) for v in todo.values()),
        unit="tok",
        unit_scale=True,
        mininterval=5,
        desc="extract",
    )
    pending: deque = deque()

    def record(future) -> None:
        nonlocal new_tokens, new_bytes
        rec = future.result()
        progress.write(json.dumps(rec) + "\n")
        progress.flush()
        done[rec["row"]] = rec
        new_tokens += rec["tokens"]
        new_bytes += rec["bytes"]
        bar.update(rec["tokens"])

    with open(progress_path, "a") as progress, ThreadPoolExecutor(WRITE_THREADS) as pool:
        try:
            for item in BACKENDS[backend](target, todo, extract_cfg, plan.aux) if todo else ():
                row, hs, host = item if len(item) == 3 else (*item, None)
                if tuple(hs.shape) != (len(todo[row]), len(plan.aux) + 1, hidden):
                    raise EagleflowError(
                        f"backend {backend} returned hidden states of shape {tuple(hs.shape)} "
                        f"for row {row}; expected {(len(todo[row]), len(plan.aux) + 1, hidden)}"
                    )
                ids = torch.tensor(todo[row], dtype=torch.int64)
                pending.append(pool.submit(write_shard, root, row, ids, hs, store_dtype, host))
                while pending and (pending[0].done() or len(pending) > 4 * WRITE_THREADS):
                    record(pending.popleft())
            while pending:
                record(pending.popleft())
        except BaseException:
            for f in pending:
                f.cancel()
            raise
    bar.close()
    elapsed = time.monotonic() - start
    shards = [done[r] for r in range(len(all_ids))]
    total_bytes = sum(s["bytes"] for s in shards)
    rate = new_tokens / elapsed if elapsed > 0 and new_tokens else None
    manifest = write_manifest(
        out_manifest,
        root,
        shards,
        producer="extract_hidden_states",
        **capture_meta(target, plan, extract_cfg, dataset, fingerprint),
        num_samples=len(shards),
        num_tokens=total_tokens,
        bytes_per_token=round(total_bytes / max(1, total_tokens), 1),
        run={
            "host": socket.gethostname(),
            "new_tokens": new_tokens,
            "seconds": round(elapsed, 2),
            "tokens_per_s": round(rate, 1) if rate else None,
        },
    )
    log.info(
        "extracted %d new tokens in %.1f s (%s tok/s), %.1f MB new; %d shards, %.2f GB, "
        "%.0f bytes/token",
        new_tokens,
        elapsed,
        f"{rate:,.0f}" if rate else "-",
        new_bytes / 1e6,
        len(shards),
        total_bytes / 1e9,
        manifest["bytes_per_token"],
    )
    return manifest


def shard_tensors(ids, hs, dtype: str) -> dict:
    """A shard's tensors: `token_ids` and `hidden_states` in `dtype`; for fp8 the e4m3 values
    and `hidden_states_scales` [T, 1, 1] (one float32 scale per token over all its slots)."""
    import torch

    if dtype != FP8:
        hs = hs.to(device="cpu", dtype=getattr(torch, dtype)).contiguous()  # no-op for hf rows
        return {"token_ids": ids, "hidden_states": hs}
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    values, scales = quantize_tensor_to_fp8(hs.to("cpu"))
    return {"token_ids": ids, "hidden_states": values.contiguous(), SCALES_KEY: scales}


def store_choices(lengths: list[int], slots: int, hidden: int) -> str:
    """The config keys that change what extraction writes, with the bytes of each choice."""
    size = {
        d: disk.human_bytes(disk.extraction_bytes(lengths, slots, hidden, d))
        for d in disk.DTYPE_BYTES
    }
    return (
        f"extract.dtype (float32 {size['float32']}, bfloat16 {size['bfloat16']}, fp8 "
        f"{size['fp8']}); extract.mode online (training streams the hidden states from the "
        "target: only the certificate's probe rows are stored) or hybrid (the same bytes, "
        "written during the first epoch instead); extract.aux_layers, data.num_samples, "
        "tokenize.max_seq_len"
    )


def capture_meta(target: dict, plan, extract_cfg: dict, dataset: str, fingerprint: str) -> dict:
    """What a hidden-states manifest says was (or will be) captured: source, layers, dtype,
    target and dataset."""
    return {
        "backend": extract_cfg["backend"],
        "layer_ids": plan.aux,
        "layer_convention": "hf_hidden_states_index",
        "final_slot": lay.FINAL_SLOT,
        "num_layers": plan.num_layers,
        "hidden_size": int(target["hidden_size"]),
        "dtype": extract_cfg["dtype"],
        "target": {
            "name": target.get("name"),
            "config_sha256": target["config_sha256"],
            "weights_sha256": target.get("weights_sha256"),
        },
        "dataset": {"path": str(Path(dataset).resolve()), "fingerprint": fingerprint},
    }


def write_shard(root: Path, row: int, ids, hs, dtype: str, host: HostBatch | None) -> dict:
    """Write one shard atomically from host memory; returns its progress record."""
    try:
        if host is not None:
            host.wait()
        parts = safetensors_parts(shard_tensors(ids, hs, dtype))
        name = f"hs_{row}.safetensors"
        tmp = root / f".{name}.tmp"
        digest, size = hashlib.sha256(), 0
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
                digest.update(part)
                size += len(part)
        os.replace(tmp, root / name)
    finally:
        if host is not None:
            host.release()
    return {
        "row": row,
        "path": name,
        "bytes": size,
        "sha256": digest.hexdigest(),
        "tokens": len(ids),
    }


def safetensors_parts(tensors: dict) -> list:
    """The bytes `safetensors.torch.save(tensors)` returns, as buffers over the tensors' memory.

    Header, then the data ordered as safetensors orders it (by alignment, then name); writing
    and hashing these avoids the two copies `save` makes. Tensors must be contiguous CPU tensors.
    """
    import torch

    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, offset, data = {}, 0, []
    for key in order:
        t = tensors[key]
        raw = t.reshape(-1).view(torch.uint8).numpy()  # the tensor's bytes, not a copy
        dtype = ST_DTYPES[str(t.dtype).removeprefix("torch.")]
        header[key] = {
            "dtype": dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + raw.nbytes],
        }
        offset += raw.nbytes
        data.append(memoryview(raw))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text, *data]


def load_shard(manifest: dict, row: int, dequantize_dtype=None) -> dict:
    """Row `row`'s tensors (`token_ids`, `hidden_states`) from a manifest's shard folder; fp8
    shards come back dequantized (as speculators' FP8Transfer does) to `dequantize_dtype`
    (default float32)."""
    import torch
    from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor
    from safetensors.torch import load_file

    shards = manifest["shards"]
    entry = shards[row] if row < len(shards) and shards[row].get("row", row) == row else None
    if entry is None:  # a stream manifest lists only its probe rows
        entry = next((s for s in shards if s.get("row") == row), None)
    if entry is None:
        raise EagleflowError(f"no shard of row {row} under {manifest['root']}")
    tensors = load_file(str(Path(manifest["root"]) / entry["path"]))
    if SCALES_KEY in tensors:
        scales = tensors.pop(SCALES_KEY)
        tensors["hidden_states"] = dequantize_fp8_tensor(
            tensors["hidden_states"], scales, dequantize_dtype or torch.float32
        )
    return tensors
