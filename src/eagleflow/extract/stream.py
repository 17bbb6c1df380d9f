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
the same kind of values. `StreamTransfer` is an `hs_connectors` transfer, so speculators' own
dataset and loader drive it.

Before step 0 the trainer streams the certified probe rows again through the same source
(`check_probes`); every `verify.recheck_steps` steps it streams one again. A source whose states
differ from the certified capture (another target, other layers) stops training with the slots,
the certified layer ids and the layer each slot matches best.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from eagleflow import layers as lay
from eagleflow.errors import EagleflowError
from eagleflow.extract.certificate import probe_rows, rel_err
from eagleflow.extract.hf import (
    FP8,
    PROGRESS,
    capture_meta,
    dataset_fingerprint,
    extract_hidden_states,
    hf_capture,
    load_hf_target,
    load_shard,
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


class StreamTransfer:
    """speculators' `HiddenStatesTransfer` over a source: `get_cached(row)` captures the row
    (hybrid: reads it from the store if an earlier epoch stored it, else captures and stores it).
    Used with the loader in the training process (train.num_workers 0): the source holds the
    target."""

    def __init__(self, source, dataset: str, manifest: dict, read_dtype):
        import datasets

        self.source, self.man, self.read_dtype = source, manifest, read_dtype
        self.data = datasets.load_from_disk(dataset).with_format(None)
        self.store = Path(manifest["root"]) if manifest["mode"] == "hybrid" else None
        self.dtype = manifest["dtype"]
        self.done = read_jsonl_resumable(self.store / PROGRESS, "row") if self.store else {}
        self.read = self.captured = 0

    def setup(self) -> None:
        pass

    def delete(self, handle: str) -> None:
        pass

    def get_generated(self, params):  # the server path; this transfer never generates
        raise NotImplementedError

    def stored(self, row: int) -> bool:
        rec = self.done.get(row)
        return bool(rec) and (self.store / rec["path"]).is_file()

    def get_cached(self, file_idx: int) -> dict:
        import torch

        file_idx = int(file_idx)  # the sampler's numpy integers
        if self.store is not None and self.stored(file_idx):
            self.read += 1
            shelf = {"root": str(self.store), "shards": [self.done[file_idx]]}
            got = load_shard(shelf, file_idx, dequantize_dtype=self.read_dtype)
            return {
                "token_ids": got["token_ids"],
                "hidden_states": got["hidden_states"].to(self.read_dtype),
            }
        ids = list(self.data[file_idx]["input_ids"])
        hs = self.source.capture(ids)
        self.captured += 1
        token_ids = torch.tensor(ids, dtype=torch.int64)
        if self.store is not None:
            rec = write_shard(self.store, file_idx, token_ids, hs, self.dtype, None)
            with open(self.store / PROGRESS, "a") as f:
                f.write(json.dumps(rec) + "\n")
            self.done[file_idx] = rec
        return {"token_ids": token_ids, "hidden_states": as_stored(hs, self.dtype, self.read_dtype)}


def match_probe(streamed, certified, aux: list[int], tol: float) -> list[dict]:
    """Per slot of a streamed probe: its error against the certified capture of the same slot,
    and the certified slot it matches best (a source capturing other layers shows up there)."""
    names = [*aux, "final"]
    out = []
    for slot, claimed in enumerate(names):
        got = streamed[:, slot]
        errs = {names[k]: rel_err(got, certified[:, k]) for k in range(len(names))}
        nearest = min(errs, key=errs.get)
        out.append(
            {
                "slot": slot,
                "claimed": claimed,
                "rel_err": errs[claimed],
                "nearest": nearest,
                "ok": errs[claimed] <= tol and nearest == claimed,
            }
        )
    return out


def check_probes(source, manifest: dict, rows: list[int], tol: float, when: str) -> dict:
    """Stream `rows` (probe rows of the manifest) again and hold them against their certified
    capture; raise naming the slots and ids when they differ."""
    import torch

    worst, bad = 0.0, []
    for r in rows:
        cert = load_shard(manifest, r)
        got = source.capture(cert["token_ids"].tolist())
        got = as_stored(got, manifest["dtype"], torch.float32)
        slots = match_probe(got, cert["hidden_states"].float(), manifest["layer_ids"], tol)
        worst = max(worst, *(s["rel_err"] for s in slots))
        bad += [dict(s, row=r) for s in slots if not s["ok"]]
    if bad:
        detail = "; ".join(
            f"row {s['row']} slot {s['slot']} (certified layer {s['claimed']}): relative error "
            f"{s['rel_err']:.3g} > {tol:.3g}, matches certified layer {s['nearest']} best"
            for s in bad[:6]
        )
        raise EagleflowError(
            f"streamed hidden states {when} differ from the certified capture of layers "
            f"{lay.format_ids(manifest['layer_ids'])} + final slot: {detail}. The source is not "
            "the certified target/layers: rerun extract_hidden_states and verify_layers for "
            "what it serves, or fix the source"
        )
    return {"rows": list(rows), "max_rel_err": worst, "tolerance_rel": tol, "when": when}


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
