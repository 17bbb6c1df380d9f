"""The standalone DFlash proposer against speculators' own training forward, on a tiny target."""

from __future__ import annotations

import pytest
import torch

from eagleflow.serve.acceptance import Target, generate, greedy_reference
from eagleflow.serve.dflash_check import DFlashProposer
from tests.support.tiny import VOCAB, tiny_llama

AUX = [1, 2, 3]
BLOCK = 4
MASK = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer random target and a random full-vocabulary DFlash draft for it."""
    from speculators.models.dflash import DFlashDraftModel

    from eagleflow.train.dflash_train import layer_config

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("target")
    tiny_llama(folder, num_layers=4)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_training_args(
        layer_config(str(folder), 2, "qwen3", False),
        verifier_name_or_path=str(folder),
        target_layer_ids=AUX,
        draft_attn_impl="sdpa",
        draft_vocab_size=VOCAB,
        block_size=BLOCK,
        mask_token_id=MASK,
        sample_from_anchor=False,
    ).eval()
    return target, draft


def test_a_block_is_drafted_as_speculators_trains_it(tiny, monkeypatch):
    """The proposer's logits for the block anchored at position a equal the training forward's
    for an anchor drawn at a: same context (positions < a), same mask tokens, same positions,
    bidirectional inside the block."""
    import speculators.models.dflash.core as core

    target, draft = tiny
    ids = torch.randint(3, VOCAB, (1, 24))
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[k][0] for k in AUX], dim=-1)
    anchor = 13
    monkeypatch.setattr(
        core, "select_anchors", lambda *a, **k: (torch.tensor([anchor]), torch.tensor([True]))
    )
    with torch.no_grad():
        _, logits, *_ = draft._backbone_forward(
            hidden_states=aux[None],
            input_ids=ids,
            loss_mask=torch.ones_like(ids),
            verifier_last_hidden_states=out.hidden_states[-1],
            document_ids=torch.zeros_like(ids),
            max_anchors=1,
        )
    proposer = DFlashProposer(draft, BLOCK - 1)
    proposer.start(ids[0, : anchor + 1].tolist(), aux[:anchor])
    with torch.no_grad():
        mine = proposer.block_logits()
    assert mine.shape == (BLOCK - 1, VOCAB)
    torch.testing.assert_close(mine, logits[0, 1:], atol=2e-5, rtol=1e-4)
    # drafting fewer than K near max_tokens keeps the K-block (engines send it whole)
    assert proposer.propose(2) == mine.argmax(-1).tolist()[:2]
    # a causal block (what vLLM's speculators adapter serves) would draft other logits
    causal = torch.ones(BLOCK, anchor + BLOCK, dtype=torch.bool).tril(diagonal=anchor)
    x = draft.embed_tokens(torch.tensor([[ids[0, anchor].item()] + [MASK] * (BLOCK - 1)]))
    pos = torch.arange(anchor + BLOCK)[None]
    ctx = draft.hidden_norm(draft.fc(aux[:anchor]))[None]
    with torch.no_grad():
        for layer in draft.layers:
            x = layer(
                hidden_states=x,
                target_hidden=ctx,
                attention_mask=causal[None, None],
                position_ids=pos,
                position_embeddings=draft.rotary_emb(x, pos),
            )
        other = draft.lm_head(draft.norm(x))[0, 1:]
    assert not torch.allclose(other, mine, atol=1e-3)


def test_speculative_greedy_with_block_drafts_is_plain_greedy(tiny):
    target, draft = tiny
    prompt = torch.randint(3, VOCAB, (12,)).tolist()
    ref = greedy_reference(target, prompt, 20, eos=set())
    for k in (1, 3):
        proposer = DFlashProposer(draft, k)
        tokens, stats = generate(Target(target, AUX), proposer, prompt, k, 20, set())
        assert tokens == ref and stats.verify_steps > 0
    with pytest.raises(Exception, match=r"num_steps 4: a DFlash block of 4 proposes 1\.\.3"):
        DFlashProposer(draft, 4)
