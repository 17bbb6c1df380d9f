"""Rule vocab_map: the draft vocabulary (speculators' `build_vocab_mappings_from_distribution`),
or an init draft's own d2t / t2d (train.init_from)."""

from __future__ import annotations

import io
import logging

from eagleflow.doctor import draft_facts
from eagleflow.drafts import read_draft
from eagleflow.errors import TrainError
from eagleflow.target.prepare import load_target_json
from eagleflow.train.init_draft import refuse_init_draft
from eagleflow.util import atomic_write_bytes

log = logging.getLogger(__name__)


def build_vocab_map(
    token_freq: str,
    draft_vocab_size: int,
    out_d2t: str,
    out_t2d: str,
    target_json: str,
    init_from: str | None = None,
) -> dict:
    """Draft vocabulary (d2t / t2d, .npy as speculators reads them) from masked-token counts,
    or, with `init_from` (train.init_from), the init draft's own (`init_vocab_map`)."""
    import numpy as np
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if init_from:
        return init_vocab_map(
            init_from, draft_vocab_size, out_d2t, out_t2d, target_json, token_freq
        )
    target = load_target_json(target_json)
    vocab = int(target["vocab_size"])
    freq = torch.load(token_freq, weights_only=True)
    if not isinstance(freq, dict) or not freq:
        raise TrainError(
            f"{token_freq} holds no token counts (expected a non-empty {{token_id: count}} dict "
            "written by the tokenize stage); rerun tokenize"
        )
    freq = {int(k): int(v) for k, v in freq.items()}
    outside = [t for t in freq if not 0 <= t < vocab]
    if outside:
        raise TrainError(
            f"{token_freq} counts token id {max(outside)}, outside the target's vocabulary of "
            f"{vocab}: it was tokenized for another target; rerun tokenize for this one"
        )
    distinct = len(freq)
    if draft_vocab_size > distinct:
        raise TrainError(
            f"train.draft_vocab_size {draft_vocab_size} is larger than the {distinct} distinct "
            f"supervised tokens in the training data ({token_freq}); the rest of the draft "
            f"vocabulary would be tokens the draft never sees. Set train.draft_vocab_size to "
            f"at most {distinct}, or train on more data"
        )
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size, vocab)
    for path, array in ((out_d2t, d2t.numpy()), (out_t2d, t2d.numpy())):
        buf = io.BytesIO()
        np.save(buf, array)
        atomic_write_bytes(path, buf.getvalue())
    covered = sum(freq.get(int(i) + int(o), 0) for i, o in enumerate(d2t.tolist()))
    info = {
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": vocab,
        "distinct_supervised_tokens": distinct,
        "supervised_coverage": covered / sum(freq.values()),
    }
    log.info(
        "draft vocab %d of %d target tokens (%d distinct supervised); covers %.1f%% of "
        "supervised tokens",
        draft_vocab_size,
        vocab,
        distinct,
        100 * info["supervised_coverage"],
    )
    return info


def init_vocab_map(
    init_from: str,
    draft_vocab_size: int,
    out_d2t: str,
    out_t2d: str,
    target_json: str,
    token_freq: str | None = None,
) -> dict:
    """The vocab map of the draft training starts from (train.init_from), as vocab_map writes
    it: its own d2t, and t2d (rebuilt from d2t where the draft has none: the SGLang format)."""
    import numpy as np
    import torch

    target = load_target_json(target_json)
    refuse_init_draft(init_from, target)
    config, fmt, tensors = read_draft(init_from)
    size = int(draft_facts(config, fmt, target)["draft_vocab_size"])
    vocab = int(target["vocab_size"])
    if size != draft_vocab_size:
        raise TrainError(
            f"train.draft_vocab_size is {draft_vocab_size}, but the draft in train.init_from "
            f"{init_from} has a vocabulary of {size} tokens, which fine-tuning keeps; set "
            f"train.draft_vocab_size: {size}"
        )
    d2t = tensors["maps"].get("d2t")
    d2t = torch.zeros(size, dtype=torch.long) if d2t is None else d2t.long()  # full vocabulary
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(size) + d2t] = True  # the draft's tokens: target id d + d2t[d]
    have = tensors["maps"].get("t2d")
    if have is not None and not torch.equal(have.bool(), t2d):
        raise TrainError(
            f"the t2d of train.init_from {init_from} marks other tokens than its d2t maps to; "
            "point train.init_from at a draft whose two maps come from one vocab mapping"
        )
    for path, array in ((out_d2t, d2t.numpy()), (out_t2d, t2d.numpy())):
        buf = io.BytesIO()
        np.save(buf, array)
        atomic_write_bytes(path, buf.getvalue())
    info = {
        "draft_vocab_size": size,
        "target_vocab_size": vocab,
        "init_from": str(init_from),
        "format": fmt,
    }
    if token_freq is not None:
        freq = {int(k): int(v) for k, v in torch.load(token_freq, weights_only=True).items()}
        covered = sum(freq.get(int(t), 0) for t in (torch.arange(size) + d2t).tolist())
        info["supervised_coverage"] = covered / max(1, sum(freq.values()))
    log.info(
        "draft vocab %d of %d target tokens from %s (%s format)%s",
        size,
        vocab,
        init_from,
        fmt,
        f"; covers {100 * info['supervised_coverage']:.1f}% of supervised tokens"
        if "supervised_coverage" in info
        else "",
    )
    return info
