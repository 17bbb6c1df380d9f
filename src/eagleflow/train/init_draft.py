"""train.init_from: an existing EAGLE-3 draft checked against the target, identified in the
checkpoint key, and its weights loaded strictly into speculators' model."""

from __future__ import annotations

import logging
from pathlib import Path

from eagleflow.doctor import init_draft_findings
from eagleflow.drafts import (
    SPECULATORS,
    draft_files,
    draft_tensors,
    read_draft,
    speculators_tensors,
)
from eagleflow.errors import TrainError
from eagleflow.target.prepare import sha256_file

log = logging.getLogger(__name__)


def refuse_init_draft(
    init_from: str, target: dict, cert: dict | None = None, train_cfg: dict | None = None
) -> None:
    """TrainError naming every difference between the init draft and target / certificate /
    config (doctor's init_draft_findings); nothing when it fits."""

    if not Path(init_from, "config.json").is_file():
        raise TrainError(
            f"train.init_from {init_from} holds no config.json; point it at a speculators or "
            "SGLang-format EAGLE-3 draft folder, or set it to null"
        )
    findings = init_draft_findings(init_from, target, cert, train_cfg)
    if findings:
        raise TrainError(
            f"train.init_from {init_from} does not fit this target"
            + (" and layer certificate" if cert is not None else "")
            + " (nothing was trained):\n"
            + "\n".join(f"  - {f.what}. Fix: {f.fix}" for f in findings)
        )


def init_draft_ident(init_from: str) -> dict:
    """What identifies the init draft in the checkpoint key: its weights' sha256 (and format)."""

    _, fmt, _ = read_draft(init_from)
    files = draft_files(init_from)
    return {"format": fmt, "weights_sha256": [[f.name, sha256_file(f)] for f in files]}


# Tensors a fresh draft takes from the target (speculators' load_verifier_weights), and so does an
# init draft: the embedding (both engines replace a draft's with the target's) and the target's
# head and final norm (training-only, for the loss).
FROM_TARGET = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def load_init_weights(model, init_from: str) -> dict:
    """Set the init draft's tensors in speculators' model: SGLang names renamed back, cast to
    the model's dtypes. Strict: every tensor of the folder lands, and every tensor of the model
    is set, except what a fresh draft takes from the target (FROM_TARGET) and the vocab maps
    (vocab_map wrote the draft's own; they must equal the folder's)."""
    import torch

    _, fmt, _ = read_draft(init_from)
    files = draft_tensors(init_from)
    # the SGLang layout and SafeAILab's original share tensor names (midlayer.*)
    tensors = files if fmt == SPECULATORS else speculators_tensors(files)
    state = model.state_dict()
    maps = ("d2t", "t2d")
    unknown = sorted(n for n in tensors if n not in state and n not in FROM_TARGET)
    shapes = [
        f"{n} {list(t.shape)} (the model's is {list(state[n].shape)})"
        for n, t in sorted(tensors.items())
        if n in state and tuple(t.shape) != tuple(state[n].shape)
    ]
    unset = sorted(n for n in state if n not in FROM_TARGET + maps and n not in tensors)
    maps_differ = [
        n
        for n in maps
        if n in tensors and n in state and not torch.equal(tensors[n].to(state[n].dtype), state[n])
    ]
    problems = []
    if unknown:
        problems.append(f"tensors with no place in the model: {unknown}")
    if shapes:
        problems.append(f"tensors of another shape: {shapes}")
    if unset:
        problems.append(f"model tensors the draft does not set: {unset}")
    if maps_differ:
        problems.append(
            f"{maps_differ} differ from the vocab map training read (rerun vocab_map: with "
            "train.init_from it copies the draft's)"
        )
    if problems:
        raise TrainError(
            f"train.init_from {init_from} ({fmt} format) does not load into speculators' "
            f"Eagle3DraftModel as this config builds it: {'; '.join(problems)}; point "
            "train.init_from at a draft of this architecture, or set it to null"
        )
    load = {
        n: t.to(state[n].dtype) for n, t in tensors.items() if n in state and n not in FROM_TARGET
    }
    missing, unexpected = model.load_state_dict(load, strict=False)
    left = sorted(set(missing) - set(FROM_TARGET) - set(maps) - set(load))
    if left or unexpected:  # cannot happen after the checks above; a speculators change would
        raise TrainError(f"loading {init_from} left {left} unset and {unexpected} unused")
    ignored = sorted(n for n in tensors if n in FROM_TARGET)
    log.info(
        "initialised the draft from %s (%s format): %d tensors loaded; %s from the target%s",
        init_from,
        fmt,
        len(load),
        ", ".join(FROM_TARGET),
        f" (the draft's own {', '.join(ignored)} left out)" if ignored else "",
    )
    return {"loaded": sorted(load), "from_target": list(FROM_TARGET)}
