"""The standalone check for DFlash block drafts: one draft forward per verify step.

A DFlash step, as vLLM runs it (`vllm/v1/spec_decode/dflash.py`) and speculators trains it
(`DFlashDraftModel._backbone_forward`): the context is `hidden_norm(fc(aux))` of every token the
target has verified (positions 0 .. n-1); the query block is the embedding of
`[anchor, mask x K]` at positions n .. n+K, where the anchor is the last accepted token (not yet
run by the target) and K the served `num_speculative_tokens`; every query attends to the whole
context and to the whole block (full-attention layers are bidirectional inside a block), and
slot i's argmax through the draft head (mapped by `d2t`) is the draft for position n+i.

The block is always K + 1 long, as an engine sends it: a shorter block would change what the
earlier slots attend to, so near max_tokens the proposer drafts K and returns the first k.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eagleflow.errors import EagleflowError

log = logging.getLogger(__name__)


class DFlashProposer:
    """speculators' `DFlashDraftModel` proposing K tokens per block (acceptance.Proposer)."""

    def __init__(self, draft, num_steps: int):
        most = int(draft.config.block_size) - 1
        if not 1 <= num_steps <= most:
            raise EagleflowError(
                f"num_steps {num_steps}: a DFlash block of {draft.config.block_size} proposes "
                f"1..{most} tokens"
            )
        self.m, self.k = draft, int(num_steps)
        self.device = next(draft.parameters()).device
        self.dtype = next(draft.parameters()).dtype

    def start(self, tokens, aux) -> None:
        self.tokens = list(tokens)
        self.ctx = [self.project(aux)]

    def extend(self, tokens, aux) -> None:
        self.tokens += list(tokens)
        self.ctx.append(self.project(aux))

    def project(self, aux):
        """The draft's context rows: hidden_norm(fc(concatenated aux states))."""
        import torch

        with torch.no_grad():
            return self.m.hidden_norm(self.m.fc(aux.to(self.device, self.dtype)))

    def block_logits(self):
        """Draft logits [K, draft vocab] of the block anchored on the last token."""
        import torch

        m = self.m
        ctx = torch.cat(self.ctx, dim=0)[None]
        n = ctx.shape[1]  # verified positions; the anchor sits at n
        if n != len(self.tokens) - 1:
            raise EagleflowError(
                f"DFlash proposer: {n} context rows for {len(self.tokens)} tokens (expected one "
                "row per token before the anchor)"
            )
        ids = torch.tensor([[self.tokens[-1]] + [m.mask_token_id] * self.k], device=self.device)
        x = m.embed_tokens(ids)
        pos = torch.arange(n + self.k + 1, device=self.device)[None]
        pe = m.rotary_emb(x, pos)
        for layer in m.layers:
            x = layer(
                hidden_states=x,
                target_hidden=ctx,
                attention_mask=None,  # every query sees the context and the whole block
                position_ids=pos,
                position_embeddings=pe,
                use_cache=False,
            )
        return m.lm_head(m.norm(x))[0, 1:]

    def propose(self, k: int) -> list[int]:
        import torch

        with torch.no_grad():
            draft_ids = self.block_logits().argmax(-1).tolist()
        d2t = self.m.d2t
        out = [d + int(d2t[d]) if d2t is not None else d for d in draft_ids]
        return out[:k]


def load_dflash_draft(export_dir: str, train_summary: str):
    """The trained DFlash draft (float32, eval, sdpa) whose weights the export carries: the
    training summary's best checkpoint, refused unless its sha256 is the export's."""
    from speculators import SpeculatorModel

    from eagleflow.train.export import checkpoint_sha256

    summary = json.loads(Path(train_summary).read_text())
    ckpt = Path(summary["best_checkpoint"])
    exported = json.loads(Path(export_dir, "config.json").read_text()).get("eagleflow") or {}
    have = checkpoint_sha256(ckpt)
    if exported.get("checkpoint_sha256") != have:
        raise EagleflowError(
            f"the DFlash export {export_dir} carries checkpoint {exported.get('checkpoint_sha256')}"
            f", the training summary's best checkpoint {ckpt} is {have}: rerun export_dflash"
        )
    draft = SpeculatorModel.from_pretrained(str(ckpt))
    draft.config.transformer_layer_config._attn_implementation = "sdpa"
    return draft.float().eval()
