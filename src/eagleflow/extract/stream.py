"""Streamed hidden states (`extract.mode` online / hybrid): training gets each sample's states
when it needs them, from a source that runs the target, instead of reading shards of every row.

- online: nothing is stored but the probe rows (`stream_manifest`), which the certificate holds
  against forward hooks as it does offline shards;
- hybrid: the first epoch streams and stores what it received in the offline layout (one shard
  per row, an append-only progress file: an interrupted first epoch resumes with what is stored);
  later epochs read the store.

The source is `hf`: the target in the training process (one unpadded sample per forward, on the
training device), for a target that fits beside the draft. What training receives is rounded as
the store would round it (`as_stored`), so online, hybrid and offline runs on the same data see
the same kind of values. Training's side (the loader's transfer, the probe checks before step 0
and every `verify.recheck_steps`) is `eagleflow.train.stream`; this module is what extraction
needs, so the extraction rule's rerun hash does not cover it.
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


def open_source(target: dict, aux: list[int], backend: str):
    if backend == "hf":
        return HFSource(target, aux)
    raise EagleflowError(
        f"extract.mode online / hybrid stream from backend hf only, not {backend!r} "
        "(eagleflow config names the fix)"
    )


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
) -> dict:
    """Rule extract_hidden_states in a stream mode: the manifest of what will be captured (ids,
    target, dtype, source, dataset) and the probe rows' shards, captured through the source."""
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
    with open(root / PROGRESS, "a") as progress:
        for r in rows:
            rec = done.get(r)
            if rec and (root / rec["path"]).is_file():
                if (root / rec["path"]).stat().st_size == rec["bytes"]:
                    continue
            source = source or open_source(target, plan.aux, extract_cfg["backend"])
            ids = list(data[r]["input_ids"])
            hs = source.capture(ids)
            rec = write_shard(root, r, torch.tensor(ids), hs, extract_cfg["dtype"], None)
            progress.write(json.dumps(rec) + "\n")
            progress.flush()
            done[r] = rec
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
    )
