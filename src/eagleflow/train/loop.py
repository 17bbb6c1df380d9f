"""Rule train_draft: draft training on speculators 0.9.0, with its own Trainer, resumable.

(The vocab map is `eagleflow.train.vocab`'s, the init draft `eagleflow.train.init_draft`'s; the
contracts and settings are `eagleflow.train.settings`, the run folder's file names and swaps
`eagleflow.train.checkpoints`, provenance `.provenance`, the signal stop `.shutdown`.)
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
import io
import json
import logging
import os
import platform
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from eagleflow import dflash, disk
from eagleflow import layers as lay
from eagleflow.errors import EagleflowError, TrainError, TrainingInterrupted
from eagleflow.extract.compare import tolerance
from eagleflow.extract.stream import open_source
from eagleflow.target.prepare import sha256_file
from eagleflow.train import dflash_train
from eagleflow.train import dist as train_dist
from eagleflow.train.checkpoints import BEST, HISTORY, PROVENANCE, STATE, recover_swaps, swap_in
from eagleflow.train.init_draft import load_init_weights
from eagleflow.train.provenance import device_name, git_state, now, resolved, versions
from eagleflow.train.settings import (
    check_fused_loss,
    check_inputs,
    checkpoint_key,
    resolve_settings,
)
from eagleflow.train.shutdown import StopOnSignal
from eagleflow.train.stream import StreamTransfer, check_probes
from eagleflow.util import (
    atomic_write_json,
    atomic_write_text,
    read_jsonl_resumable,
)

log = logging.getLogger(__name__)


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


class _Hashed:
    """The training loader, its batches' hidden states hashed in order (sha256, on a thread of its
    own: hashlib releases the GIL, so the step does not wait for it)."""

    def __init__(self, loader):
        import hashlib
        from concurrent.futures import ThreadPoolExecutor

        self.loader, self.batches = loader, 0
        self._digest = hashlib.sha256()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hs-hash")
        self._last = None

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        for batch in self.loader:
            views = [_bytes_of(batch[k]) for k in sorted(batch) if "hidden_states" in k]
            self._last = self._pool.submit(self._update, views)
            self.batches += 1
            yield batch

    def _update(self, views) -> None:
        for v in views:
            self._digest.update(v)

    def hexdigest(self) -> str:
        if self._last is not None:
            self._last.result()
        return self._digest.hexdigest()


def _bytes_of(t):
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def train_draft(
    inputs: dict,
    train_cfg: dict,
    checkpoint_dir: str,
    out_summary: str,
    out_metrics: str,
    trust_remote_code: bool = False,
    on_step: Callable[[int], None] | None = None,
    stream: dict | None = None,
) -> dict:
    """Train the EAGLE-3 draft with speculators (resumable); write the summary and metrics CSV.

    `inputs`: target (target.json), dataset, manifest, certificate, d2t, t2d. `on_step(step)` is
    called after every optimizer step (tests interrupt training through it). `stream`: settings
    of a streamed manifest (extract.mode online / hybrid): `recheck_steps`.
    """
    checked = check_inputs(inputs, train_cfg)
    if dflash_train.is_dflash(train_cfg):
        problems = dflash.dflash_problems(checked["aux"], int(checked["target"]["num_layers"]))
        if problems:
            raise TrainError("; ".join(problems))
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
            "stream": stream,
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
        recover_swaps(run_dir)
    train_dist.barrier()
    run = TrainingRun(inputs, train_cfg, checked, settings, run_dir, on_step, trust_remote_code)
    run.stream_cfg = stream or {}
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

    verifier = target["path"]
    # A llama draft (what vLLM's and SGLang's Eagle3 model files load), full attention on
    # every layer: speculators' CLI default of a 2048-token sliding window is a setting the
    # engines' EAGLE-3 drafts do not all apply.
    layer_cfg = dflash_train.layer_config(
        verifier, int(train_cfg["draft_layers"]), "llama", trust_remote_code
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
        self.stop = StopOnSignal()
        self.rank0 = train_dist.rank() == 0
        self.mode = checked["manifest"].get("mode", "offline")
        self.stream_cfg: dict = {}
        self.source = None  # the stream source (extract.mode online / hybrid)
        self.stream_checks: list[dict] = []
        self.dflash = dflash_train.is_dflash(train_cfg)
        self.mask_token_id: int | None = None  # DFlash: resolved in build

    # ---- building speculators' objects

    def build(self):
        """speculators' draft, loaders and Trainer for this run (the benchmark times them bare)."""
        import speculators.train.trainer as trainer_mod
        import torch
        from hs_connectors import FileTransfer, FP8Transfer
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
        args = (target, self.checked["aux"], cfg, st["attn_implementation"])
        args += (self.inputs["d2t"], self.inputs["t2d"])
        if self.dflash:
            self.mask_token_id = dflash_train.resolve_mask_token_id(
                target, cfg, self.trust_remote_code
            )
            model = dflash_train.draft_model(*args, self.mask_token_id, self.trust_remote_code)
        else:
            model = draft_model(*args, self.trust_remote_code)
        self.space = self._check_space(model)
        hs_dtype = getattr(torch, st["hidden_states_dtype"])
        workers = int(cfg["num_workers"])
        man = self.checked["manifest"]
        root = Path(man["root"])
        if self.mode == "offline":
            # The shards stay where extraction wrote them (the manifest's root); fp8 shards are
            # dequantized by speculators' own reader.
            fp8 = man.get("dtype") == "fp8"
            transfer = FP8Transfer(root, dequantize_dtype=hs_dtype) if fp8 else FileTransfer(root)
        else:
            self.source = open_source(
                target,
                self.checked["aux"],
                man["backend"],
                self.stream_cfg.get("source"),
                log_path=str(self.run_dir / "capture-server.log"),
                skip_gpus=int(cfg["gpus"]),  # a capture server's GPUs come after training's
            )
            transfer = self.stream = StreamTransfer(
                self.source, self.inputs["dataset"], man, hs_dtype
            )
            if workers:
                log.info(
                    "extract.mode %s: the loader runs in the training process (the stream "
                    "source holds the target), train.num_workers %d not used",
                    self.mode,
                    workers,
                )
            workers = 0
        train_loader, val_loader = create_train_val_loaders(
            data_path=self.inputs["dataset"],
            total_seq_len=int(cfg["total_seq_len"]),
            hidden_states_dtype=hs_dtype,
            transfer=transfer,
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
            preprocess=None if self.dflash else shift_batch,  # a block keeps its positions
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
        if self.dflash:
            train_kwargs, val_kwargs = dflash_train.trainer_kwargs(cfg, st["loss_implementation"])
        else:
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
        self.trainer.train_loader = self.hashed = _Hashed(train_loader)
        if not st["cpu"]:
            # The Trainer copies each batch to the GPU and then waits for it (its step timer
            # synchronises): copy the next batch during the current step instead.
            self.trainer.train_loader = _PrefetchToGpu(self.hashed, st["device"])
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
                self._check_stream("before step 0")
                start = time.monotonic()
                first_step = self.trainer.global_step
                self._loop(resumed)
                seconds = time.monotonic() - start
                self._save(validated=True)
            summary = (
                self._outputs(out_summary, out_metrics, seconds, first_step) if self.rank0 else {}
            )
        finally:
            if self.source is not None:
                self.source.close()  # a vllm source's server stops with the run
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
        every = int(self.stream_cfg.get("recheck_steps") or 0)
        if self.source is not None and every and step % every == 0:
            rows = self.checked["manifest"]["probe_rows"]
            self._check_stream(f"at step {step}", [rows[(step // every) % len(rows)]])
        self._check_signal(validated=False)
        if step % int(self.cfg["save_every_steps"]) == 0 and step < self.total_steps:
            self._save(validated=False)

    def _check_stream(self, when: str, rows: list[int] | None = None) -> None:
        """Streamed modes: probe rows streamed again against their certified capture."""
        if self.source is None:
            return
        man = self.checked["manifest"]
        tol = tolerance(man["dtype"], self.checked["target"].get("run_dtype"))
        try:
            got = check_probes(self.source, man, rows or man["probe_rows"], tol, when)
        except EagleflowError as e:
            raise TrainError(str(e)) from None
        self.stream_checks.append(got)
        log.info(
            "stream check %s: probe rows %s match their certified capture (max rel err %.3g, "
            "tolerance %.3g)",
            when,
            got["rows"],
            got["max_rel_err"],
            tol,
        )

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
            "epoch %d (step %d): val loss %.4g, %s %s",
            epoch,
            row["step"],
            val.get("loss", float("nan")),
            "acc by block position" if self.dflash else "full acc",
            " ".join(f"{a:.3f}" for a in self._accuracies(val)),
        )

    def _ttt(self) -> int:
        return int(self.cfg["ttt_steps"])

    def _columns(self) -> list[str]:
        if self.dflash:
            return dflash_train.metric_columns(self.cfg)
        return metric_columns(self._ttt())

    def _accuracies(self, row: dict) -> list[float]:
        """Per-position validation accuracies: TTT steps (EAGLE-3), block positions (DFlash)."""
        if self.dflash:
            return dflash_train.accuracies(row, self.cfg)
        return [row.get(f"full_acc_{i}", 0) for i in range(self._ttt())]

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
        swap_in(tmp, final)
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
        swap_in(tmp, self.run_dir / BEST)

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
        lines += [f"# eagleflow git: {git['sha']} (dirty: {git['dirty']})", f"# time: {now()}"]
        return "\n".join([*lines, " ".join(prov["argv"])]) + "\n"

    def _provenance(self) -> dict:
        if not hasattr(self, "_prov"):
            c = self.checked
            git, self._git_patch = git_state()
            self._prov = {
                "argv": list(sys.argv),
                "cwd": os.getcwd(),
                "host": socket.gethostname(),
                "python": platform.python_version(),
                "train_config": self.cfg,
                "settings": self.settings,
                "inputs": {k: resolved(v) for k, v in self.inputs.items()},
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
                "versions": versions(),
            }
        step = self.trainer.global_step if hasattr(self, "trainer") else None
        return {**self._prov, "epoch": self.epoch, "global_step": step, "time": now()}

    # ---- outputs

    def _hidden_states_record(self) -> dict:
        """Where training's hidden states came from, and a hash of what it received."""
        man = self.checked["manifest"]
        rec = {"source": "shards", "dtype": man.get("dtype")}
        if self.mode != "offline":
            rec = {
                "source": f"stream ({man['backend']})",
                "dtype": man.get("dtype"),
                "mode": self.mode,
                "forwards": self.source.forwards,
                "forward_seconds": round(self.source.seconds, 2),
                "stored_rows_read": self.stream.read,
                "checks": self.stream_checks,
            }
        # sha256 over the training batches' hidden states as the trainer received them, in order
        # (from resumed_from_step): two runs that saw the same states have the same digest.
        rec["batches_sha256"] = self.hashed.hexdigest()
        rec["batches_hashed"] = self.hashed.batches
        return rec

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
        metric_keys = self._columns()[6:]  # loss and the per-position columns
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
            "hidden_states": self._hidden_states_record(),
            "draft": (
                dflash_train.draft_record(self.cfg, self.mask_token_id)
                if self.dflash
                else {
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
                }
            ),
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
            "device": device_name(self.settings),
            "disk_estimate": {k: self.space[k] for k in ("checkpoint", "best", "free", "path")},
            "train_config": self.cfg,
        }
        _write_metrics_csv(out_metrics, self.history, self._columns())
        atomic_write_json(out_summary, summary)
        log.info(
            "trained %d steps (%d new, %s tokens) in %.1f s: %s steps/s, %s tok/s on %s; "
            "best val loss %.4g (epoch %d), %s %s; %s",
            steps,
            new_steps,
            f"{new_tokens:,}",
            seconds,
            summary["steps_per_s"],
            f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "-",
            summary["device"],
            best["loss"],
            best_info["epoch"],
            f"eal {best.get('eal', 0):.3f}, acc by block position" if self.dflash else "full acc",
            "/".join(f"{a:.3f}" for a in self._accuracies(best)),
            best_dir,
        )
        return summary


def metric_columns(ttt_steps: int) -> list[str]:
    """Columns of the metrics CSV (one row per optimizer step, one per validation epoch)."""
    per = [f"{m}_{i}" for m in ("loss", "full_acc", "cond_acc") for i in range(ttt_steps)]
    return ["split", "epoch", "step", "lr", "tokens", "step_ms", "loss", *per]


def _write_metrics_csv(path: str, rows: list[dict], columns: list[str]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, columns, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in r.items()})
    atomic_write_text(path, buf.getvalue())


class _Capture(logging.Handler):
    """Keeps speculators' per-step metric record for the step callback that follows it."""

    def __init__(self, run: TrainingRun):
        super().__init__()
        self.run = run

    def emit(self, record):
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.run.pending = record.msg
