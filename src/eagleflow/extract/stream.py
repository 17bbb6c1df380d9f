"""Streamed hidden states (`extract.mode` online / hybrid): training gets each sample's states
when it needs them, from a source that runs the target, instead of reading shards of every row.

- online: nothing is stored but the probe rows (`stream_manifest`), which the certificate holds
  against forward hooks as it does offline shards;
- hybrid: the first epoch streams and stores what it received in the offline layout (one shard
  per row, an append-only progress file: an interrupted first epoch resumes with what is stored);
  later epochs read the store.

The source (`extract.backend`) is `hf`: the target in the training process (one unpadded sample
per forward, on the training device), for a target that fits beside the draft; or `vllm`: the
target served by vLLM with its hidden-state capture, reached through speculators' online client
(a server the rule starts and stops; with `extract.gpus` on GPUs of its own). What training
receives is rounded as the store would round it (`as_stored`), so online, hybrid and offline runs
on the same data see the same kind of values. Training's side (the loader's transfer, the probe
checks before step 0 and every `verify.recheck_steps`) is `eagleflow.train.stream`; this module is
what extraction needs, so the extraction rule's rerun hash does not cover it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from eagleflow import layers as lay
from eagleflow.errors import EagleflowError
from eagleflow.extract.compare import probe_rows
from eagleflow.extract.hf import (
    FP8,
    PROGRESS,
    capture_meta,
    dataset_fingerprint,
    extract_hidden_states,
    hf_capture,
    load_hf_target,
    shard_key,
    write_shard,
)
from eagleflow.extract.manifest import write_manifest
from eagleflow.target.prepare import load_target_json
from eagleflow.util import read_jsonl_resumable

log = logging.getLogger(__name__)

MODES = ("offline", "online", "hybrid")


def as_stored(hs, store_dtype: str, read_dtype):
    """The values a reader gets back after storing `hs` as `store_dtype` (fp8: quantized per
    token and dequantized as speculators' FP8Transfer does), in `read_dtype`."""
    import torch

    if store_dtype == FP8:
        from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

        values, scales = quantize_tensor_to_fp8(hs)
        return dequantize_fp8_tensor(values, scales, read_dtype)
    return hs.to(getattr(torch, store_dtype)).to(read_dtype)


class HFSource:
    """The target in this process; `capture(ids)` is one sample's [T, n_aux + 1, H] on the CPU,
    in the dtype the target ran in."""

    name = "hf"

    def __init__(self, target: dict, aux: list[int]):
        self.aux = list(aux)
        self.model = load_hf_target(
            target["path"],
            target.get("run_dtype") or "float32",
            bool(target.get("trust_remote_code")),
        )
        self.device = next(self.model.parameters()).device
        self.forwards = self.tokens = 0
        self.seconds = 0.0

    def capture(self, ids: list[int]):
        import torch

        t0 = time.monotonic()
        x = torch.tensor([ids], device=self.device)
        hs = hf_capture(self.model, x, torch.ones_like(x), self.aux)[0].cpu()
        self.forwards += 1
        self.tokens += len(ids)
        self.seconds += time.monotonic() - t0
        return hs

    def close(self) -> None:
        self.model = None


class VllmSource:
    """The target served by vLLM with its own hidden-state capture (speculative method
    `extract_hidden_states`, a KV connector writing each request's states to a file), reached
    through speculators' online client (`generate_hidden_states`: the prompt's token ids,
    max_tokens 1). `capture(ids)` is one sample's [T, n_aux + 1, H] on the CPU; `close()` stops
    the server. `source_cfg`: serve.vllm options (`vllm`), `host`, `startup_timeout_s` and
    `gpus` (extract.gpus: 0 shares the job's devices, N serves on N GPUs after the first
    `skip_gpus`, tensor parallel)."""

    name = "vllm"

    def __init__(
        self,
        target: dict,
        aux: list[int],
        source_cfg: dict,
        log_path: str | None = None,
        skip_gpus: int = 0,
    ):
        import shutil
        import sys
        import tempfile

        import openai

        from eagleflow import engines
        from eagleflow.extract.vllm_capture import capture_server_command, check_layer_ids

        layers = int(target["num_layers"])
        self.ids = [*aux, layers]  # vLLM's id L: the last layer's output before the norm
        self.engine_ids = check_layer_ids(self.ids, layers)
        self.order = [self.engine_ids.index(i) for i in self.ids]
        self.hidden = int(target["hidden_size"])
        self.storage = tempfile.mkdtemp(prefix="eagleflow-vllm-stream-")
        options = dict(source_cfg.get("vllm") or {})
        env = engines.engine_env("vllm", options)
        gpus = int(source_cfg.get("gpus") or 0)
        cpu = not _cuda_available()
        if gpus and not cpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(_devices(skip_gpus, gpus))
            options["tensor_parallel_size"] = gpus
        host = source_cfg.get("host", "127.0.0.1")
        port = engines.free_port(host)
        dtype = target.get("run_dtype") or "float32"
        cmd = capture_server_command(
            sys.executable, target["path"], self.engine_ids, options, host, port,
            self.storage, dtype, cpu,
        )  # fmt: skip
        self.server = engines.Server(
            cmd,
            host,
            port,
            log_path=log_path,
            env=env,
            startup_timeout_s=float(source_cfg.get("startup_timeout_s", 900)),
        )
        try:
            self.server.__enter__()
        except BaseException:
            shutil.rmtree(self.storage, ignore_errors=True)
            raise
        self.client = openai.OpenAI(base_url=f"{self.server.url}/v1", api_key="EMPTY")
        for name in ("httpx", "httpx2"):  # a log line per request: one per sample streamed
            logging.getLogger(name).setLevel(logging.WARNING)
        self.forwards = self.tokens = 0
        self.seconds = 0.0
        log.info("vLLM capture server for layers %s ready on %s", self.engine_ids, self.server.url)

    def capture(self, ids: list[int]):
        from speculators.data_generation.vllm_client import generate_hidden_states

        from eagleflow.extract.vllm_capture import read_capture

        t0 = time.monotonic()
        ids = [int(i) for i in ids]
        path, _params = generate_hidden_states(
            self.client, "target", {"input_ids": ids}, timeout=600, max_retries=1
        )
        shape = (len(ids), len(self.engine_ids), self.hidden)
        hs = read_capture(path, ids, shape, timeout_s=120)[:, self.order]
        self.forwards += 1
        self.tokens += len(ids)
        self.seconds += time.monotonic() - t0
        return hs

    def close(self) -> None:
        import shutil

        self.server.stop()
        shutil.rmtree(self.storage, ignore_errors=True)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _devices(skip: int, n: int) -> list[str]:
    """GPUs [skip, skip + n) of the job's visible ones (CUDA_VISIBLE_DEVICES when set)."""
    import os

    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if skip + n > len(ids):
        raise EagleflowError(
            f"extract.gpus {n} after the {skip} training GPU(s) needs {skip + n} GPUs; the job "
            f"sees {len(ids)} ({visible or 'all'}); lower extract.gpus or train.gpus"
        )
    return ids[skip : skip + n]


def open_source(
    target: dict,
    aux: list[int],
    backend: str,
    source_cfg: dict | None = None,
    log_path: str | None = None,
    skip_gpus: int = 0,
):
    """The stream source of `extract.backend`: hf (the target here) or vllm (a capture server)."""
    if backend == "hf":
        return HFSource(target, aux)
    if backend == "vllm":
        if source_cfg is None:
            raise EagleflowError("a vllm stream source needs its settings (the rule passes them)")
        return VllmSource(target, aux, source_cfg, log_path, skip_gpus)
    raise EagleflowError(
        f"extract.mode online / hybrid stream from backend hf or vllm, not {backend!r} "
        "(eagleflow config names the fix)"
    )


def store_row(root: Path, row: int, token_ids, hs, dtype: str) -> dict:
    """One streamed row into a stream store: its shard (offline layout), then its record appended
    to the store's progress file (what a resumed run finds); the record."""
    rec = write_shard(root, row, token_ids, hs, dtype, None)
    with open(root / PROGRESS, "a") as progress:
        progress.write(json.dumps(rec) + "\n")
    return rec


def stored_whole(root: Path, rec: dict | None) -> bool:
    """A stream store's row is on disk whole: its shard exists with the bytes its progress record
    names (a shard cut short by a crash is captured again)."""
    if not rec:
        return False
    path = Path(root) / rec["path"]
    return path.is_file() and path.stat().st_size == rec["bytes"]


def stream_key(target: dict, aux: list[int], extract_cfg: dict, fingerprint: str) -> str:
    """The store folder of a streamed extraction (never an offline one: their batches differ)."""
    backend = f"{extract_cfg['backend']}-stream"
    return shard_key(target, aux, extract_cfg["dtype"], fingerprint, backend)


def stream_manifest(
    target_json: str,
    dataset: str,
    extract_cfg: dict,
    shard_dir: str,
    out_manifest: str,
    probe_samples: int,
    sglang_version: str = "0.5.23",
    engine: str = "vllm",
    source_cfg: dict | None = None,
) -> dict:
    """Rule extract_hidden_states in a stream mode: the manifest of what will be captured (ids,
    target, dtype, source, dataset) and the probe rows' shards, captured through the source
    (`source_cfg`: a vllm source's settings, see VllmSource)."""
    import datasets
    import torch

    target = load_target_json(target_json)
    plan = lay.plan_layers(target, extract_cfg["aux_layers"], sglang_version, engine)
    fingerprint = dataset_fingerprint(dataset)
    root = Path(shard_dir) / stream_key(target, plan.aux, extract_cfg, fingerprint)
    root.mkdir(parents=True, exist_ok=True)
    data = datasets.load_from_disk(dataset).with_format(None)
    lengths = data["seq_len"]
    rows = probe_rows(len(lengths), int(probe_samples))
    done = read_jsonl_resumable(root / PROGRESS, "row")
    source = None
    start = time.monotonic()
    try:
        for r in rows:
            if stored_whole(root, done.get(r)):
                continue
            if source is None:
                server_log = str(root / "capture-server.log")
                backend = extract_cfg["backend"]
                source = open_source(target, plan.aux, backend, source_cfg, server_log)
            ids = list(data[r]["input_ids"])
            hs = source.capture(ids)
            done[r] = store_row(root, r, torch.tensor(ids), hs, extract_cfg["dtype"])
    finally:
        if source is not None:
            source.close()
    manifest = write_manifest(
        out_manifest,
        root,
        [done[r] for r in rows],
        producer="extract_hidden_states",
        mode=extract_cfg["mode"],
        **capture_meta(target, plan, extract_cfg, dataset, fingerprint),
        num_samples=len(lengths),
        num_tokens=sum(lengths),
        probe_rows=rows,
        stream={
            "source": extract_cfg["backend"],
            "detail": "each sample captured alone (batch 1, unpadded) when training asks for it",
            "stores_all_rows": extract_cfg["mode"] == "hybrid",
        },
        run={"seconds": round(time.monotonic() - start, 2)},
    )
    log.info(
        "extract (%s): %d rows will be streamed from %s at training time, aux %s + final slot, "
        "%s; %d probe rows captured now under %s",
        extract_cfg["mode"],
        len(lengths),
        extract_cfg["backend"],
        lay.format_ids(plan.aux),
        extract_cfg["dtype"],
        len(rows),
        root,
    )
    return manifest


def extract(
    target_json: str,
    dataset: str,
    extract_cfg: dict,
    shard_dir: str,
    out_manifest: str,
    sglang_version: str = "0.5.23",
    engine: str = "vllm",
    probe_samples: int | None = None,
    source_cfg: dict | None = None,
) -> dict:
    """Rule extract_hidden_states: every row's shards (offline) or the stream manifest."""
    if extract_cfg.get("mode", "offline") == "offline":
        return extract_hidden_states(
            target_json, dataset, extract_cfg, shard_dir, out_manifest, sglang_version, engine
        )
    if probe_samples is None:
        raise EagleflowError("a stream manifest needs verify.probe_samples (the rule passes it)")
    return stream_manifest(
        target_json,
        dataset,
        extract_cfg,
        shard_dir,
        out_manifest,
        probe_samples,
        sglang_version,
        engine,
        source_cfg,
    )
