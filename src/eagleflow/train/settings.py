"""Rule train_draft's contracts and settings: input checks, host settings, checkpoint key.

No torch needed at import: refusals come before the heavy imports.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from eagleflow.errors import TrainError
from eagleflow.extract.certificate import require_certificate
from eagleflow.extract.manifest import load_manifest
from eagleflow.target.prepare import load_target_json, sha256_file
from eagleflow.train.init_draft import init_draft_ident, refuse_init_draft

log = logging.getLogger(__name__)

TRAIN_FORMAT = 1  # bump when the checkpoint layout or key changes: old runs then never resume
# Keys that change neither the arithmetic nor the data order: editing them keeps resuming.
RESUME_NEUTRAL = {"save_every_steps", "keep_checkpoints", "tensorboard", "num_workers", "compile"}


def check_inputs(inputs: dict, train_cfg: dict) -> dict:
    """Manifest, certificate, dataset and vocab files agree; returns what training needs."""
    import datasets

    target = load_target_json(inputs["target"])
    man = load_manifest(inputs["manifest"], verify="size")
    cert = require_certificate(inputs["certificate"], target, aux=man.get("layer_ids"))
    want = cert.get("manifest", {}).get("sha256")
    have = sha256_file(inputs["manifest"])
    if want != have:
        raise TrainError(
            f"layer certificate {inputs['certificate']} was issued for another extraction "
            f"(manifest sha256 {str(want)[:12]}, this manifest {have[:12]}); rerun verify_layers "
            "for these shards"
        )
    aux = list(cert["aux_layers"])
    data = datasets.load_from_disk(inputs["dataset"]).with_format(None)
    lengths = list(data["seq_len"])
    n = len(lengths)
    shards = man["shards"]
    mode = man.get("mode", "offline")
    if mode != "offline":  # streamed: the manifest describes the rows, training captures them
        have = man.get("dataset", {}).get("fingerprint")
        if man.get("num_samples") != n or have != _fingerprint(inputs["dataset"]):
            raise TrainError(
                f"stream manifest {inputs['manifest']} describes {man.get('num_samples')} rows "
                f"of dataset {have}, not the {n}-row dataset {inputs['dataset']}; rerun "
                "extract_hidden_states for this dataset"
            )
    elif len(shards) != n or any(s["path"] != f"hs_{i}.safetensors" for i, s in enumerate(shards)):
        raise TrainError(
            f"manifest {inputs['manifest']} lists {len(shards)} shards, not one "
            f"hs_<row>.safetensors per row of the {n}-row dataset {inputs['dataset']}; rerun "
            "extract_hidden_states for this dataset"
        )
    seq = int(train_cfg["total_seq_len"])
    if max(lengths) > seq:
        log.warning(
            "train.total_seq_len %d is shorter than %d samples (the longest has %d tokens): "
            "speculators truncates them to %d tokens; raise total_seq_len to keep their ends",
            seq,
            sum(x > seq for x in lengths),
            max(lengths),
            seq,
        )
    frac = float(train_cfg["val_fraction"])
    split = int(n * (1.0 - frac))  # speculators' split: the first rows train, the rest validate
    if not 0 < split < n:
        raise TrainError(
            f"train.val_fraction {frac} of {n} samples leaves "
            f"{'no validation' if split >= n else 'no training'} sample; use a val_fraction "
            f"between {1 / n:.3g} and {1 - 1 / n:.3g}, or more samples"
        )
    init = None
    if train_cfg.get("init_from"):
        refuse_init_draft(train_cfg["init_from"], target, cert, train_cfg)
        init = {
            "path": str(Path(train_cfg["init_from"]).resolve()),
            **init_draft_ident(train_cfg["init_from"]),
        }
    return {
        "target": target,
        "manifest": man,
        "certificate": cert,
        "aux": aux,
        "num_samples": n,
        "num_train": split,
        "dataset_fingerprint": _fingerprint(inputs["dataset"]),
        "vocab": _check_vocab(inputs, train_cfg, target),
        "init_from": init,
    }


def _fingerprint(dataset: str) -> str:
    state = Path(dataset) / "state.json"
    return json.loads(state.read_text())["_fingerprint"] if state.is_file() else "unknown"


def _check_vocab(inputs: dict, train_cfg: dict, target: dict) -> dict:
    import numpy as np

    d2t, t2d = np.load(inputs["d2t"]), np.load(inputs["t2d"])
    size, vocab = int(train_cfg["draft_vocab_size"]), int(target["vocab_size"])
    if d2t.shape != (size,) or t2d.shape != (vocab,) or int(t2d.sum()) != size:
        raise TrainError(
            f"vocab mapping {inputs['d2t']} / {inputs['t2d']} has d2t {d2t.shape}, t2d "
            f"{t2d.shape} with {int(t2d.sum())} draft tokens; expected d2t ({size},) and t2d "
            f"({vocab},) for train.draft_vocab_size {size} and this target; rerun vocab_map"
        )
    return {"d2t_sha256": sha256_file(inputs["d2t"]), "t2d_sha256": sha256_file(inputs["t2d"])}


def resolve_settings(
    train_cfg: dict, cuda_available: bool, device_count: int | None = None
) -> dict:
    """Device, attention, loss, dtypes and process count for this host; refuses combinations
    that cannot run. `device_count`: visible CUDA devices (None: ask torch)."""
    gpus = int(train_cfg["gpus"])
    procs = train_cfg.get("processes")
    if gpus > 1:
        if procs not in (None, gpus):
            raise TrainError(
                f"train.processes {procs} with train.gpus {gpus}: training runs one process per "
                f"GPU; set train.processes: null (or {gpus})"
            )
        if device_count is None:
            import torch

            device_count = torch.cuda.device_count() if cuda_available else 0
        if device_count < gpus:
            raise TrainError(
                f"train.gpus {gpus} but {device_count} CUDA device(s) are visible here "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); ask for at "
                "most that many, or run train_draft where the GPUs are (the remote profile "
                "gives the job train.gpus GPUs)"
            )
        procs = gpus
    elif gpus == 1 and procs not in (None, 1):
        raise TrainError(
            f"train.processes {procs} with train.gpus 1: one process per GPU; set train.gpus "
            f"{procs} to train on {procs} GPUs, or train.processes: null"
        )
    procs = int(procs or 1)
    if gpus == 1 and not cuda_available:
        raise TrainError(
            "train.gpus is 1 but no CUDA device is visible here; set train.gpus: 0 to train on "
            "the CPU, or run train_draft on the GPU host (the remote profile does)"
        )
    if train_cfg["norm_before_fc"] and train_cfg["fc_norm"]:
        raise TrainError(
            "train.norm_before_fc and train.fc_norm are both true; they are alternatives "
            "(one norm over the concatenated aux states, or one per state): set one to false"
        )
    cpu = gpus == 0
    attn = train_cfg["attn_implementation"]
    if attn == "auto":
        attn = "sdpa" if cpu else "simple_flex_attention"
    if cpu and attn == "simple_flex_attention":
        raise TrainError(
            "train.attn_implementation simple_flex_attention has no CPU backward pass; use "
            "sdpa (or auto) for CPU training"
        )
    loss = train_cfg["loss_implementation"]
    if cpu and loss == "fused":
        raise TrainError(
            "train.loss_implementation fused needs Triton (a GPU); use eager on the CPU"
        )
    hs = train_cfg["hidden_states_dtype"]
    if hs == "auto":
        hs = "float32" if cpu else "bfloat16"
    return {
        "cpu": cpu,
        "processes": procs,
        "device": "cpu" if cpu else "cuda:0",
        "attn_implementation": attn,
        "loss_implementation": loss,
        "hidden_states_dtype": hs,
        "checkpoint_dtype": train_cfg["checkpoint_dtype"],
    }


def check_fused_loss(loss_fn: str) -> None:
    """Run speculators' fused loss once as training runs it (compiled, bf16, backward).

    On torch 2.11 it fails inside TorchDynamo; that shows up here, in a second,
    as a TrainError naming the fix, instead of as a traceback after the draft is built.
    """
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.metrics import compute_metrics

    config = resolve_loss_config(loss_fn, "fused")

    def step(logits, targets, mask, prev_correct):
        loss, _ = compute_metrics(logits, targets, mask, prev_correct, 1, 1.0, config)
        return loss

    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 64, 256)
    logits = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
    logits.requires_grad_(True)
    targets = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
    mask = torch.ones(shape[:2], device="cuda", dtype=torch.bool)
    try:
        torch.compile(step)(logits, targets, mask, mask.clone()).backward()
        torch.cuda.synchronize()
    except Exception as e:  # whatever Dynamo, Inductor or Triton raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise TrainError(
            f"train.loss_implementation fused does not run on this host (torch "
            f"{torch.__version__}): speculators' fused loss failed when compiled "
            f"({type(e).__name__}: {first}); set train.loss_implementation: eager"
        ) from None


def checkpoint_key(checked: dict, train_cfg: dict, settings: dict) -> str:
    """Run folder name: another target, ids, data, vocab map or setting never resumes this one."""
    man = checked["manifest"]
    ident = {
        "format": TRAIN_FORMAT,
        "target": [checked["target"]["config_sha256"], checked["target"].get("weights_sha256")],
        "aux": checked["aux"],
        "shards": hashlib.sha256(
            json.dumps([[s["path"], s["sha256"]] for s in man["shards"]]).encode()
        ).hexdigest(),
        "dataset": checked["dataset_fingerprint"],
        "vocab": checked["vocab"],
        # init_from by its weights (below), not its path: another draft is another run
        "train": {
            k: v
            for k, v in sorted(train_cfg.items())
            if k not in RESUME_NEUTRAL and k not in ("init_from", "processes")
        },
        "settings": {k: v for k, v in settings.items() if k != "processes"},
    }
    if settings.get("processes", 1) > 1:  # absent for one process: existing keys stay theirs
        ident["processes"] = settings["processes"]
    if man.get("mode", "offline") != "offline":  # absent offline: existing keys stay theirs
        ident["mode"] = man["mode"]
    if checked.get("init_from"):  # absent otherwise, so the keys of existing runs stay theirs
        ident["init_from"] = {k: v for k, v in checked["init_from"].items() if k != "path"}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
