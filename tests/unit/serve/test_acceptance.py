"""Standalone acceptance logic on a tiny random target: an oracle proposer is always accepted,
a random one almost never, and the output is the target's greedy decode either way."""

import pytest
import torch

from eagleflow.serve.acceptance import (
    Eagle3Proposer,
    OracleProposer,
    RandomProposer,
    Stats,
    Target,
    generate,
    greedy_reference,
)
from tests.support.tiny import VOCAB, tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("acc") / "target"
    tiny_llama(folder, num_layers=4)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


PROMPT = [1, 17, 99, 3, 42, 250, 7, 8]


def test_oracle_is_always_accepted(model):
    ref = greedy_reference(model, PROMPT, 40, eos=set())
    tokens, stats = generate(Target(model, [0, 1, 3]), OracleProposer(ref), PROMPT, 3, 40, set())
    assert tokens == ref
    # every verification accepts all 3 drafts plus the bonus token, except a shorter last one
    assert stats.accepted == stats.proposed
    assert stats.tokens_per_step == pytest.approx(39 / stats.verify_steps)
    # the engines' count: every draft accepted, even where max_tokens cuts the last step short
    assert stats.accept_length == 1 + sum(stats.accepted) / stats.verify_steps == 4.0


def test_random_proposer_is_almost_never_accepted(model):
    ref = greedy_reference(model, PROMPT, 40, eos=set())
    tokens, stats = generate(Target(model, [0, 1, 3]), RandomProposer(VOCAB), PROMPT, 4, 40, set())
    assert tokens == ref  # verification keeps the output exact whatever the draft proposes
    assert stats.accept_length < 1.2
    assert stats.proposed[0] == stats.verify_steps


def test_eos_stops_generation(model):
    ref = greedy_reference(model, PROMPT, 30, eos=set())
    eos = {ref[5]}
    tokens, _ = generate(Target(model, [0]), OracleProposer(ref), PROMPT, 3, 30, eos)
    assert tokens == ref[: ref.index(ref[5]) + 1]


def test_stats_definition_matches_the_engines():
    s = Stats(3)
    s.add(3, 3, 4)  # all accepted + bonus
    s.add(3, 0, 1)  # none accepted: the bonus token only
    assert s.accept_length == 2.5  # = 1 + accepted / drafts = 1 + 3 / 2 (vLLM's formula)
    assert s.accepted == [1, 1, 1] and s.proposed == [2, 2, 2]
    assert s.tokens_per_step == 2.5
    s.add(3, 2, 1)  # 2 drafts accepted, but max_tokens leaves room for one token
    assert s.accept_length == 1 + 5 / 3  # the engine's counters still count both drafts
    assert s.tokens_per_step == 6 / 3  # what reaches the client


# ---------------------------------------------------------------------------------------------
# Sampling: the engines' verification rule and its expected value


def test_closed_form_on_hand_made_distributions():
    from eagleflow.serve.acceptance import accept_probability, expected_acceptance

    # target probabilities of three greedily drafted tokens
    p = [0.5, 0.3, 0.6]
    acc = [accept_probability(x) for x in p]
    assert acc == p  # vLLM without draft probabilities: p / 1
    assert expected_acceptance(acc) == pytest.approx([0.5, 0.15, 0.09])
    assert sum(expected_acceptance(acc)) == pytest.approx(0.74)
    # greedy is the limit: one-hot target probabilities give the indicator rule
    assert expected_acceptance([1.0, 1.0, 0.0, 1.0]) == [1.0, 1.0, 0.0, 0.0]
    # SGLang's target-only rule: p by default, raised by its thresholds
    assert accept_probability(0.3, "sglang") == pytest.approx(0.3)
    assert accept_probability(0.3, "sglang", threshold_acc=0.5) == pytest.approx(0.6)
    assert accept_probability(0.3, "sglang", threshold_single=0.25) == 1.0
    assert accept_probability(0.0, "sglang", threshold_acc=0.0) == 0.0


def test_step_variance_of_the_accepted_count():
    """The served-vs-sampled tolerance rests on this: the variance of one step's accepted drafts,
    from the expected per-position probabilities (closed form) and from greedy outcomes."""
    from eagleflow.serve.acceptance import expected_acceptance

    s = Stats(2)
    s.add(2, 0, 1, expected_acceptance([0.5, 0.5]))  # P(A=0) .5, P(A=1) .25, P(A=2) .25
    assert s.accepted_variance == pytest.approx(1.25 - 0.75**2)  # E[A^2] - E[A]^2
    g = Stats(3)
    for a in (0, 3, 3, 1):
        g.add(3, a, a + 1)
    mean = 7 / 4
    assert g.accepted_variance == pytest.approx((0 + 9 + 9 + 1) / 4 - mean**2)
    both = Stats(2)
    both.merge(s)
    both.merge(s)
    assert both.accepted_variance == pytest.approx(s.accepted_variance)
    assert both.as_dict()["accepted_variance_per_step"] == pytest.approx(s.accepted_variance)


def test_vllm_rejection_sampler_accepts_by_the_same_rule():
    """vLLM's own CPU rejection kernel (the one vLLM CPU serves with), no draft probabilities:
    with the same uniform draws it accepts exactly where u <= p, and its mean over many draws is
    the closed form."""
    import vllm._custom_ops  # noqa: F401  (loads the CPU extension with the kernel)
    from vllm.utils import cpu_triton_utils

    from eagleflow.serve.acceptance import accept_probability, expected_acceptance

    gen = torch.Generator().manual_seed(0)
    rows, k, vocab = 20000, 3, 8
    table = torch.distributions.Dirichlet(torch.ones(vocab)).sample((k,))
    drafts = torch.tensor([int(table[i].argmax()) if i != 1 else 3 for i in range(k)])
    probs = table.repeat(rows, 1).contiguous()
    u = torch.rand(rows * k, dtype=torch.float64, generator=gen)
    out = torch.full((rows, k + 1), -1, dtype=torch.int32)
    recovered = torch.full((rows * k,), -7, dtype=torch.int64)  # never a draft token
    cpu_triton_utils._rejection_random_sample_kernel_impl(
        out,
        torch.arange(1, rows + 1) * k,
        drafts.repeat(rows).contiguous(),
        None,  # NO_DRAFT_PROBS: what vLLM passes for greedily drafted EAGLE tokens
        probs,
        torch.full((rows, 1), 5, dtype=torch.int64),
        recovered,
        u,
        torch.zeros(rows, dtype=torch.bool),
        k,
        vocab,
        NO_DRAFT_PROBS=True,
    )
    vllm_accepted = (out[:, :k] == drafts[None].int()).int().cumprod(1)
    acc = torch.tensor([accept_probability(float(table[i, d])) for i, d in enumerate(drafts)])
    ours = (u.float().view(rows, k) <= acc[None].float()).int().cumprod(1)
    assert torch.equal(vllm_accepted, ours)
    expected = sum(expected_acceptance(acc.tolist()))
    mean = vllm_accepted.sum(1).double()
    assert abs(mean.mean().item() - expected) < 4 * mean.std().item() / rows**0.5


def test_vllm_gpu_kernel_and_default_draft_sampling_follow_the_rule():
    """The GPU (Triton) kernel vLLM runs on the GPU host has the same acceptance test, and
    EAGLE drafts are greedy by default (no draft probabilities: draft_prob = 1)."""
    import re
    from pathlib import Path

    import vllm.v1.sample.rejection_sampler as rs
    from vllm.config.speculative import SpeculativeConfig

    src = re.sub(r"\s+", " ", Path(rs.__file__).read_text())
    kernel = src[src.index("def rejection_random_sample_kernel(") :]
    kernel = kernel[: kernel.index("def _rejection_random_sample_warmup_inputs")]
    assert "if NO_DRAFT_PROBS: draft_prob = 1" in kernel
    assert "accepted = draft_prob > 0 and target_prob / draft_prob >= uniform_prob" in kernel
    assert "NO_DRAFT_PROBS=draft_probs is None" in src
    assert "target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)" in src
    fields = SpeculativeConfig.__dataclass_fields__
    assert fields["draft_sample_method"].default == "greedy"
    assert fields["rejection_sample_method"].default == "standard"


class SelfProposer:
    """Drafts the target's own greedy continuation of the committed sequence (full recompute:
    a tiny model), so acceptance under sampling is its target probability, well away from 0."""

    def __init__(self, model):
        self.model = model

    def start(self, tokens, aux) -> None:
        self.seq = list(tokens)

    def propose(self, k: int) -> list[int]:
        seq, out = list(self.seq), []
        with torch.no_grad():
            for _ in range(k):
                nxt = int(self.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
                out.append(nxt)
                seq.append(nxt)
        return out

    def extend(self, tokens, aux) -> None:
        self.seq += list(tokens)


def test_sampled_expected_accept_length_matches_the_draws(model):
    """Under sampling, generate() counts expected accepted drafts; over many seeded runs the
    drawn outcomes (tokens per verify step) average to the same figure."""
    from eagleflow.serve.acceptance import Stats

    expected, drawn = Stats(3), Stats(3)
    for seed in range(12):
        rng = torch.Generator().manual_seed(seed)
        _, st = generate(Target(model, [0]), SelfProposer(model), PROMPT, 3, 25, set(), 0.05, rng)
        expected.merge(st)
        drawn.verify_steps += st.verify_steps
        drawn.new_tokens += st.new_tokens
    # the proposer is the target's argmax: accepted with p(argmax), neither 0 nor 1
    rates = [a / p for a, p in zip(expected.accepted, expected.proposed, strict=True)]
    assert all(0.05 < r < 0.999 for r in rates), rates
    # drawn: 1 + accepted per step, except where max_tokens cut a step (rare at k=3, 25 tokens)
    assert drawn.tokens_per_step == pytest.approx(expected.accept_length, rel=0.1)


def test_sampled_generation_is_seeded_and_greedy_is_unchanged(model):
    runs = [
        generate(
            Target(model, [0]),
            SelfProposer(model),
            PROMPT,
            3,
            12,
            set(),
            0.7,
            torch.Generator().manual_seed(3),
        )
        for _ in range(2)
    ]
    assert runs[0][0] == runs[1][0] and runs[0][1].accepted == runs[1][1].accepted
    ref = greedy_reference(model, PROMPT, 12, eos=set())
    assert generate(Target(model, [0]), SelfProposer(model), PROMPT, 3, 12, set())[0] == ref


# ---- the batched check (benchmark.standalone_batch_size > 1) against the sequential one


def _small_vocab_draft(tmp_path, info, tokens):
    """A random speculators draft whose vocabulary is `tokens` (target ids the target emits
    often): it proposes one of them by its context, so some drafts are accepted, most not."""
    import numpy as np

    from eagleflow import config as efconfig
    from eagleflow.train.loop import draft_model

    t2d = np.zeros(VOCAB, dtype=bool)
    t2d[tokens] = True
    d2t = np.array([t - i for i, t in enumerate(sorted(tokens))], dtype=np.int64)
    np.save(tmp_path / "d2t.npy", d2t)
    np.save(tmp_path / "t2d.npy", t2d)
    cfg = {**efconfig.fill_defaults({})["train"], "draft_vocab_size": len(tokens)}
    torch.manual_seed(0)
    draft = draft_model(
        info, [1, 2, 3], cfg, "sdpa", str(tmp_path / "d2t.npy"), str(tmp_path / "t2d.npy")
    )
    return draft.float().eval()


class _Recording(Eagle3Proposer):
    def __init__(self, draft):
        super().__init__(draft)
        self.trace = []

    def propose(self, k):
        drafts = super().propose(k)
        self.trace.append(drafts)
        return drafts


@pytest.mark.parametrize("num_steps", [1, 3])
def test_batched_check_equals_the_sequential_one(model, tmp_path, num_steps):
    """Same drafts offered at every step, the same tokens and the same per-position counters,
    prompt by prompt, with ragged prompt lengths, accepted and rejected drafts, EOS and
    max_tokens cuts."""
    from collections import Counter

    from eagleflow.serve.acceptance import BatchedChain
    from tests.support.tiny import _save

    info = _save(model, tmp_path / "target")
    prompts = [PROMPT, PROMPT[:3], [5, 9, 200, 31, 77, 12, 64, 1, 90, 33, 4], [8], PROMPT[::-1]]
    greedy = [greedy_reference(model, p, 40, set()) for p in prompts]
    common = [t for t, _ in Counter(t for g in greedy for t in g).most_common(9)]
    draft = _small_vocab_draft(tmp_path, info, common[:8])
    eos = {common[8]}  # a frequent token: some rows stop early, others at max_tokens
    want, offered = [], []
    for p in prompts:
        proposer = _Recording(draft)
        want.append(generate(Target(model, [1, 2, 3]), proposer, p, num_steps, 40, eos))
        offered.append(proposer.trace)
    got = []
    for chunk in (prompts[:3], prompts[3:]):  # two batches: padding differs between them
        chain = BatchedChain(model, draft, [1, 2, 3])
        chain.trace = [[] for _ in chunk]
        got += [
            (*r, t) for r, t in zip(chain.run(chunk, num_steps, 40, eos), chain.trace, strict=True)
        ]
    for (wt, ws), trace, (gt, gs, gtrace), p in zip(want, offered, got, prompts, strict=True):
        assert gtrace == trace
        assert gt == wt == greedy_reference(model, p, 40, eos)
        assert gs.as_dict() == ws.as_dict()
    accepted = sum(sum(s.accepted) for _, s in want)
    rejected = sum(sum(s.proposed) - sum(s.accepted) for _, s in want)
    assert accepted > 5 and rejected > 5
    assert len({d for t in offered for step in t for d in step}) > 3  # context-dependent drafts
    assert any(t[-1] in eos for t, _ in want) and any(len(t) == 40 for t, _ in want)


def test_check_acceptance_batched_path_sorts_and_restores_prompt_order(model, tmp_path):
    """batched_greedy runs prompts in length order and hands the results back in prompt order."""
    from eagleflow.serve.acceptance import batched_greedy
    from tests.support.tiny import _save

    info = _save(model, tmp_path / "target")
    draft = _small_vocab_draft(tmp_path, info, list(range(8)))
    rows = [{"id": str(i), "input_ids": p} for i, p in enumerate([PROMPT, [8], PROMPT[:3]])]
    got = batched_greedy(model, draft, [1, 2, 3], rows, 2, 12, set(), batch=2)
    for r, (tokens, _) in zip(rows, got, strict=True):
        assert tokens == greedy_reference(model, r["input_ids"], 12, set())


def test_batched_chain_keeps_no_autograd_history(model, tmp_path):
    """The draft's steps run without a graph (with one, a long batch filled an 80 GB GPU)."""
    from eagleflow.serve.acceptance import BatchedChain
    from tests.support.tiny import _save

    info = _save(model, tmp_path / "target")
    draft = _small_vocab_draft(tmp_path, info, list(range(8)))
    assert any(p.requires_grad for p in draft.parameters())  # as loaded: trainable weights
    chain = BatchedChain(model, draft, [1, 2, 3])
    chain.run([PROMPT, PROMPT[:3]], 3, 12, set())
    cache = chain.dcache
    kept = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert kept and not any(t.requires_grad or t.grad_fn is not None for t in kept)
