"""What training a DFlash block draft changes in `eagleflow.train.loop` (draft.algorithm dflash).

The same data (shards of `[T, n_aux + 1, H]`, the certificate's ids), loaders, Trainer,
checkpoints and summary as EAGLE-3; speculators' `DFlashDraftModel` instead of its Eagle3 one,
no `shift_batch` (a block is anchored on an accepted token and predicts the ones after it), its
own loss arguments and its own metrics: `full_acc`, `position_{i}_acc` for block positions 1 ..
block_size - 1 (accuracy at each position, the earlier ones not required), and `eal`, the mean
accepted run of a block plus the target's bonus token.
"""

from __future__ import annotations

from eagleflow.dflash import ALGORITHM


def is_dflash(train_cfg: dict) -> bool:
    """The train rule's config is a DFlash one (it then carries `algorithm` and `dflash`)."""
    return train_cfg.get("algorithm") == ALGORITHM


def positions(train_cfg: dict) -> list[int]:
    """The block positions the draft predicts (the anchor, position 0, is the given token)."""
    return list(range(1, int(train_cfg["dflash"]["block_size"])))


def resolve_mask_token_id(target: dict, train_cfg: dict, trust_remote_code: bool) -> int:
    """`draft.dflash.mask_token_id`, or speculators' choice for the target's tokenizer (its mask
    token, an unused embedding row, then pad, eos, unk)."""
    from speculators.train.utils import resolve_mask_token_id as speculators_choice

    return int(
        speculators_choice(
            target["path"],
            int(target["vocab_size"]),
            train_cfg["dflash"]["mask_token_id"],
            trust_remote_code=trust_remote_code,
        )
    )


def layer_config(verifier: str, num_layers: int, draft_arch: str, trust_remote_code: bool):
    """speculators' draft layer config (EAGLE-3: llama, DFlash: qwen3) with full attention on
    every layer (speculators' CLI default is a 2048-token sliding window)."""
    from speculators.train.cli import create_transformer_layer_config

    return create_transformer_layer_config(
        verifier_name_or_path=verifier,
        num_layers=num_layers,
        draft_arch=draft_arch,
        hidden_act="silu",
        sliding_window=None,
        full_attention_indices=list(range(num_layers)),
        trust_remote_code=trust_remote_code,
    )


def draft_model(
    target: dict,
    aux: list[int],
    train_cfg: dict,
    attn_implementation: str,
    d2t_path: str,
    t2d_path: str,
    mask_token_id: int,
    trust_remote_code: bool = False,
):
    """speculators' DFlashDraftModel: Qwen3-style layers, full attention on every one (the
    z-lab layout, and what vLLM's CPU runner can serve: mixed sliding/full layers need its V2
    runner), bidirectional inside a block, its embedding and head from the target."""
    import numpy as np
    import torch
    from speculators.models.dflash import DFlashDraftModel

    d = train_cfg["dflash"]
    layer_cfg = layer_config(target["path"], int(d["layers"]), "qwen3", trust_remote_code)
    return DFlashDraftModel.from_training_args(
        layer_cfg,
        t2d=torch.from_numpy(np.load(t2d_path)),
        d2t=torch.from_numpy(np.load(d2t_path)),
        verifier_name_or_path=target["path"],
        trust_remote_code=trust_remote_code,
        target_layer_ids=aux,  # eagleflow ids are speculators' aux ids (no offset)
        draft_attn_impl=attn_implementation,
        draft_vocab_size=int(train_cfg["draft_vocab_size"]),
        block_size=int(d["block_size"]),
        mask_token_id=mask_token_id,
        sample_from_anchor=False,  # the anchor is the accepted token (vLLM 0.26 has no other)
        sliding_window_non_causal=False,
    )


def trainer_kwargs(train_cfg: dict, loss_implementation: str) -> tuple[dict, dict]:
    """speculators' DFlash train / validation call kwargs for `draft.dflash`."""
    from speculators.models.dflash import DFlashDraftModel

    d = train_cfg["dflash"]
    return DFlashDraftModel.get_trainer_kwargs(
        loss_fn=d["loss_fn"],
        loss_implementation=loss_implementation,
        dflash_decay_gamma=float(d["decay_gamma"]),
        max_anchors=int(d["max_anchors"]),
        per_position_loss_weight=d["per_position_loss_weight"],
        dpace_alpha=float(d["dpace_alpha"]),
    )


def metric_columns(train_cfg: dict) -> list[str]:
    """Columns of a DFlash run's metrics CSV."""
    per = [f"position_{i}_acc" for i in positions(train_cfg)]
    return ["split", "epoch", "step", "lr", "tokens", "step_ms", "loss", "full_acc", "eal", *per]


def accuracies(row: dict, train_cfg: dict) -> list[float]:
    """Per-position accuracies of a metrics row (what the log line and summary print)."""
    return [row.get(f"position_{i}_acc", 0.0) for i in positions(train_cfg)]


def draft_record(train_cfg: dict, mask_token_id: int) -> dict:
    """The summary's `draft` entry: what export and the standalone check need to know."""
    d = train_cfg["dflash"]
    return {
        "algorithm": ALGORITHM,
        "layers": int(d["layers"]),
        "draft_vocab_size": int(train_cfg["draft_vocab_size"]),
        "block_size": int(d["block_size"]),
        "mask_token_id": mask_token_id,
        "max_anchors": int(d["max_anchors"]),
        "loss_fn": d["loss_fn"],
        "per_position_loss_weight": d["per_position_loss_weight"],
    }
