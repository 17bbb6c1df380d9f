"""Standalone acceptance: EAGLE-3 chain drafting verified in process, no server.

The target (transformers, KV cache) verifies what a proposer drafts; per verification step the
accept length is the accepted draft tokens plus the target's bonus token, the definition vLLM
(`1 + accepted / drafts`) and SGLang (`completion_tokens / spec_verify_ct`) report. Greedy: the
generated tokens are exactly the target's greedy decode, whatever the proposer does, which the
stage cross-checks against plain decoding. Sampled (temperature > 0): verification follows the
engines' rule (`accept_probability`), and each step counts the *expected* accepted drafts from
the target's probabilities instead of one random draw. This is the reference the served accept
lengths are held against: a served number far below it means the engine feeds the draft
something else.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from eagleflow.errors import EagleflowError
from eagleflow.extract.hf import load_hf_target
from eagleflow.serve.bench import (
    benchmark_prompts,
    standalone_dtype,
    temperature_key,
    temperatures,
)
from eagleflow.target.prepare import load_target_json
from eagleflow.util import atomic_write_json

log = logging.getLogger(__name__)


class Proposer(Protocol):
    """Drafts tokens after the committed sequence; told what the target accepted."""

    def start(self, tokens: list[int], aux) -> None:
        """`tokens` = prompt + the target's first greedy token; `aux` [len(prompt), n*H]."""

    def propose(self, k: int) -> list[int]:
        """k target-vocabulary tokens continuing the committed sequence."""

    def extend(self, tokens: list[int], aux) -> None:
        """Commit `tokens` (accepted drafts + bonus); `aux` rows for the tokens now verified."""


@dataclass
class Stats:
    """Per-position counters over verification steps (position i = the i-th drafted token)."""

    num_steps: int
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    verify_steps: int = 0
    new_tokens: int = 0
    accepted_sq: float = 0.0  # sum over steps of (expected) squared accepted drafts

    def __post_init__(self):
        self.proposed = self.proposed or [0] * self.num_steps
        self.accepted = self.accepted or [0] * self.num_steps

    def add(self, k: int, a: int, emitted: int, expected: list[float] | None = None) -> None:
        """One verification step of k drafts: `a` accepted (greedy), or under sampling the
        per-position acceptance probabilities `expected` (counted instead of the draw)."""
        self.verify_steps += 1
        self.new_tokens += emitted
        for i in range(k):
            self.proposed[i] += 1
            self.accepted[i] += expected[i] if expected is not None else i < a
        # E[A^2] of the step's accepted count A: A^2 = sum over j <= A of (2j - 1), so with
        # P(A >= i + 1) = expected[i] it is sum (2i + 1) expected[i]
        if expected is not None:
            self.accepted_sq += sum((2 * i + 1) * e for i, e in enumerate(expected[:k]))
        else:
            self.accepted_sq += min(a, k) ** 2

    def merge(self, other: Stats) -> None:
        self.verify_steps += other.verify_steps
        self.new_tokens += other.new_tokens
        self.accepted_sq += other.accepted_sq
        for i in range(self.num_steps):
            self.proposed[i] += other.proposed[i]
            self.accepted[i] += other.accepted[i]

    @property
    def accept_length(self) -> float | None:
        """1 + accepted drafts per verification step: vLLM's formula (its counters count a draft
        accepted even where max_tokens then cuts the output short)."""
        return 1 + sum(self.accepted) / self.verify_steps if self.verify_steps else None

    @property
    def tokens_per_step(self) -> float | None:
        """Emitted tokens per verification step (SGLang's completion_tokens / spec_verify_ct);
        below accept_length only where max_tokens or EOS cut a step's tokens."""
        return self.new_tokens / self.verify_steps if self.verify_steps else None

    @property
    def accepted_variance(self) -> float | None:
        """Variance of one step's accepted drafts as an engine draws them (under sampling: the
        draws' spread within a step plus the spread of the expectation across steps)."""
        if not self.verify_steps:
            return None
        mean = sum(self.accepted) / self.verify_steps
        return max(0.0, self.accepted_sq / self.verify_steps - mean * mean)

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "verify_steps": self.verify_steps,
            "new_tokens": self.new_tokens,
            "accept_length": self.accept_length,
            "tokens_per_step": self.tokens_per_step,
            "accepted_variance_per_step": self.accepted_variance,
            "proposed_per_position": self.proposed,
            "accepted_per_position": self.accepted,
            "acceptance_rate_per_position": [
                a / p if p else None for a, p in zip(self.accepted, self.proposed, strict=True)
            ],
        }


class Tally:
    """One num_steps' counters in the standalone check: in total, per evaluation set (mtbench,
    humaneval: each set's verification steps on their own) and per prompt."""

    def __init__(self, num_steps: int):
        self.total = Stats(num_steps)
        self.by_set: dict[str, Stats] = {}
        self.set_prompts: dict[str, int] = {}
        self.per_prompt: list[dict] = []

    def add(self, prompt: dict, stats: Stats) -> None:
        name = prompt.get("set", "prompts")
        self.total.merge(stats)
        self.by_set.setdefault(name, Stats(stats.num_steps)).merge(stats)
        self.set_prompts[name] = self.set_prompts.get(name, 0) + 1
        self.per_prompt.append({"id": prompt["id"], **stats.as_dict()})

    def as_dict(self) -> dict:
        by_set = {n: {**st.as_dict(), "prompts": self.set_prompts[n]}
                  for n, st in self.by_set.items()}  # fmt: skip
        return {**self.total.as_dict(), "by_prompt_set": by_set, "per_prompt": self.per_prompt}


# ---------------------------------------------------------------------------------------------
# The engines' verification rule under sampling (tests/contract/ ties it to their code)
#
# Both engines draft EAGLE chains greedily at any temperature and verify "target only":
# - vLLM 0.32 (`rejection_sampler.rejection_random_sample_kernel`): with draft_sample_method
#   "greedy" (the default, and the only one allowed with a draft vocabulary) no draft
#   probabilities exist (NO_DRAFT_PROBS, draft_prob = 1), so draft token x is accepted when
#   target_prob(x) / 1 >= u, u uniform: with probability p(x). A rejection samples the
#   recovered token from the target's distribution with x removed.
# - SGLang 0.5.23 (`tree_speculative_sampling_target_only`, topk 1): x is accepted when
#   u < p(x) / threshold_acc or p(x) >= threshold_single (both 1.0 by default: probability
#   p(x)); draft_probs are zeros, and a rejection samples relu(p - q) with q(x) set to p(x),
#   i.e. the target's distribution with x removed.
# p is the target's softmax at the request's temperature (then top-k / top-p, not used here).


def accept_probability(
    p: float, engine: str = "vllm", threshold_single: float = 1.0, threshold_acc: float = 1.0
) -> float:
    """Probability that a greedily drafted token whose target probability is `p` is accepted."""
    if engine == "vllm":
        return min(1.0, p)  # p / draft_prob with draft_prob = 1
    if engine == "sglang":
        if p <= 0:
            return 0.0
        return 1.0 if p >= threshold_single else min(1.0, p / max(threshold_acc, 1e-9))
    raise EagleflowError(f"unknown engine {engine!r}; expected vllm or sglang")


def expected_acceptance(accept_probs: list[float]) -> list[float]:
    """P(draft i is accepted) for a chain: the product of the first i+1 accept probabilities
    (a chain stops at its first rejection); their sum is the expected accepted drafts."""
    out, run = [], 1.0
    for a in accept_probs:
        run *= a
        out.append(run)
    return out


class Target:
    """The target with a KV cache: greedy tokens and the aux hidden states of what it ran."""

    def __init__(self, model, aux: list[int]):
        self.model, self.aux = model, list(aux)
        self.device = next(model.parameters()).device

    def run(self, cache, tokens: list[int], temperature: float = 0.0):
        """Feed `tokens` after the cache; returns (greedy next ids [n], aux rows [n, n_aux*H]),
        and with a temperature > 0 also the next-token probabilities [n, vocab] (float64)."""
        import torch

        ids = torch.tensor([tokens], device=self.device)
        with torch.no_grad():
            out = self.model(
                input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True
            )
        greedy = out.logits[0].argmax(-1).tolist()
        aux = torch.cat([out.hidden_states[k][0] for k in self.aux], dim=-1)
        if temperature > 0:
            probs = torch.softmax(out.logits[0].double() / temperature, dim=-1).cpu()
            return greedy, aux, probs
        return greedy, aux


def generate(
    target: Target,
    proposer: Proposer,
    prompt: list[int],
    num_steps: int,
    max_new_tokens: int,
    eos: set[int],
    temperature: float = 0.0,
    rng=None,
    engine: str = "vllm",
) -> tuple[list[int], Stats]:
    """Speculative generation of up to `max_new_tokens`; returns (tokens, stats).

    Greedy at temperature 0. Above it, the first token and every outcome are drawn the way the
    engine's verification draws them (`rng`: a torch.Generator), and the stats count expected
    accepted drafts per position (`expected_acceptance`), not the drawn ones.
    """
    import torch
    from transformers import DynamicCache

    sampled = temperature > 0
    if sampled and rng is None:
        rng = torch.Generator().manual_seed(0)

    def draw(probs) -> int:
        return int(torch.multinomial(probs, 1, generator=rng))

    cache = DynamicCache()
    ran = target.run(cache, prompt, temperature)
    out = [draw(ran[2][-1]) if sampled else ran[0][-1]]
    seq = list(prompt) + out
    proposer.start(seq, ran[1])
    stats = Stats(num_steps)
    while len(out) < max_new_tokens and out[-1] not in eos:
        k = min(num_steps, max_new_tokens - len(out))
        drafts = proposer.propose(k)[:k]
        if len(drafts) != k:
            raise EagleflowError(f"proposer returned {len(drafts)} tokens for k={k}")
        processed = cache.get_seq_length()  # = len(seq) - 1: the last token is not yet run
        ran = target.run(cache, [seq[-1], *drafts], temperature)
        greedy, aux = ran[0], ran[1]
        expected = None
        if sampled:
            probs = ran[2]
            acc = [accept_probability(float(probs[i, d]), engine) for i, d in enumerate(drafts)]
            expected = expected_acceptance(acc)
            u = torch.rand(k, generator=rng, dtype=torch.float64).tolist()
            a = 0
            while a < k and u[a] < acc[a]:
                a += 1
            if a < k:  # rejected: the recovered token, from p without the rejected draft
                rest = probs[a].clone()
                rest[drafts[a]] = 0
                last = draw(rest) if rest.sum() > 0 else int(probs[a].argmax())
            else:
                last = draw(probs[k])
        else:
            a = 0
            while a < k and drafts[a] == greedy[a]:
                a += 1
            last = greedy[a]
        new = [*drafts[:a], last]
        if any(t in eos for t in new):  # stop at the first EOS, as an engine does
            new = new[: next(i for i, t in enumerate(new) if t in eos) + 1]
        new = new[: max_new_tokens - len(out)]  # the bonus token may overshoot max_tokens
        _crop(cache, processed + 1 + a)  # keep seq[-1] and the accepted drafts
        stats.add(k, a, len(new), expected)
        seq += new
        out += new
        proposer.extend(new, aux[: a + 1])
    return out, stats


def _crop(cache, keep: int) -> None:
    """Drop cache entries beyond `keep` (negative crop: the positive form is deprecated)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding with the same KV-cache path (the tokens spec decoding must equal)."""
    from transformers import DynamicCache

    target = Target(model, [0])
    cache = DynamicCache()
    greedy, _ = target.run(cache, prompt)
    out = [greedy[-1]]
    while len(out) < max_new_tokens and out[-1] not in eos:
        greedy, _ = target.run(cache, [out[-1]])
        out.append(greedy[-1])
    return out


class OracleProposer:
    """Proposes the target's own greedy continuation: acceptance must be total."""

    def __init__(self, continuation: list[int]):
        self.cont = continuation
        self.pos = 0

    def start(self, tokens, aux) -> None:
        self.pos = 1  # the first greedy token is already committed

    def propose(self, k: int) -> list[int]:
        return (self.cont[self.pos : self.pos + k] + [0] * k)[:k]

    def extend(self, tokens, aux) -> None:
        self.pos += len(tokens)


class RandomProposer:
    """Uniformly random tokens: acceptance near zero (a control)."""

    def __init__(self, vocab: int, seed: int = 0):
        import random

        self.vocab, self.rng = vocab, random.Random(seed)

    def start(self, tokens, aux) -> None:
        pass

    def propose(self, k: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(k)]

    def extend(self, tokens, aux) -> None:
        pass


class Eagle3Proposer:
    """A speculators `Eagle3DraftModel` drafting a chain, with its own KV cache.

    Pair j of the draft's input is (embedding of token j+1, fc(aux hidden of token j)) at
    position j+1, as speculators trains it (`shift_batch`); drafted steps feed the draft's own
    output hidden state, and are cropped from the cache once the target has verified them.
    """

    def __init__(self, draft):
        self.m = draft
        self.device = next(draft.parameters()).device
        self.dtype = next(draft.parameters()).dtype

    def start(self, tokens, aux) -> None:
        from transformers import DynamicCache

        self.tokens = list(tokens)
        self.aux = [aux.to(self.device, self.dtype)]
        self.cache = DynamicCache()
        self.done = 0  # pairs in the cache

    def extend(self, tokens, aux) -> None:
        self.tokens += list(tokens)
        self.aux.append(aux.to(self.device, self.dtype))

    def project(self, aux):
        """fc over the aux slots, with the draft's optional norms first (as in its forward)."""
        import torch

        m = self.m
        if m.input_norm is not None:
            aux = m.input_norm(aux)
        if m.fc_norm is not None:
            chunks = aux.chunk(len(m.fc_norm), dim=-1)
            aux = torch.cat([n(c) for n, c in zip(m.fc_norm, chunks, strict=True)], dim=-1)
        return m.fc(aux)

    def _step(self, token_ids, hidden, start_pos: int):
        """Run pairs at positions start_pos+1.. through the draft; (draft hidden, target ids)."""
        import torch

        m = self.m
        q = len(token_ids)
        past = self.cache.get_seq_length()
        ids = torch.tensor([token_ids], device=self.device)
        x = torch.cat([m.embed_tokens(ids), hidden[None]], dim=-1)
        pos = torch.arange(start_pos + 1, start_pos + 1 + q, device=self.device)[None]
        pe = m.rotary_emb(x, pos)
        mask = (
            torch.arange(past + q, device=self.device)[None, :]
            <= (past + torch.arange(q, device=self.device))[:, None]
        )[None, None]
        for layer in m.layers:
            x = layer(
                x,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=self.cache,
                use_cache=True,
                cache_position=torch.arange(past, past + q, device=self.device),
                position_embeddings=pe,
            )
        if m.config.norm_output:
            x = m.norm(x)
            logits = m.lm_head(x)
        else:
            logits = m.lm_head(m.norm(x))
        draft_id = int(logits[0, -1].argmax())
        target_id = draft_id + int(m.d2t[draft_id]) if m.d2t is not None else draft_id
        return x[0, -1:], target_id

    def propose(self, k: int) -> list[int]:
        import torch

        with torch.no_grad():
            aux = torch.cat(self.aux, dim=0)
            n = aux.shape[0]  # pairs available: one per verified token
            new = range(self.done, n)
            hidden = self.project(aux[self.done : n])
            h, tok = self._step([self.tokens[j + 1] for j in new], hidden, self.done)
            self.done = n
            drafts = [tok]
            for i in range(1, k):
                h, tok = self._step([tok], h, n - 1 + i)
                drafts.append(tok)
            _crop(self.cache, n)
        return drafts


# ---------------------------------------------------------------------------------------------
# Batched greedy chain drafting (a GPU check over many prompts at once)
#
# The same steps as `generate` + `Eagle3Proposer`, for B prompts at once. The rows' accepted
# counts differ, so instead of cropping each row's KV cache, a rejected slot stays in the cache
# and is masked out (a validity mask per row, over cache slots), and each row carries its own
# position ids. Rows that finished keep running in the batch, their results ignored.


class BatchedChain:
    """Greedy EAGLE-3 chain drafting for a batch of prompts: target and draft with KV caches
    that keep rejected slots as masked holes."""

    def __init__(self, model, draft, aux: list[int]):
        self.model, self.m, self.aux_ids = model, draft, list(aux)
        self.device = next(model.parameters()).device
        self.dtype = next(draft.parameters()).dtype
        self.trace: list[list[list[int]]] | None = None  # set to [[] per prompt] to record

    def target_step(self, cache, ids, mask, pos, last_only: bool = False):
        """Run ids [B, q] at positions pos [B, q] after the cache; `mask` [B, past + q] marks
        the real slots. (greedy [B, q] or [B, 1] with last_only, aux [B, q, n*H])."""
        import torch

        with torch.no_grad():
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
                logits_to_keep=1 if last_only else 0,
            )
        aux = torch.cat([out.hidden_states[k] for k in self.aux_ids], dim=-1)
        return out.logits.argmax(-1), aux

    def draft_step(self, tokens, hidden, pos, new_valid):
        """Draft pairs (tokens [B, q], hidden [B, q, H]) at positions pos [B, q]; new_valid
        [B, q] marks the real pairs. Returns (output hidden [B, q, H], target ids [B, q])."""
        import torch

        m = self.m
        past = self.dcache.get_seq_length()
        q = tokens.shape[1]
        x = torch.cat([m.embed_tokens(tokens), hidden], dim=-1)
        pe = m.rotary_emb(x, pos)
        keys = torch.cat([self.dvalid, new_valid], dim=1).bool()  # [B, past + q]
        slot = torch.arange(past + q, device=self.device)
        causal = slot[None, :] <= (past + torch.arange(q, device=self.device))[:, None]
        mask = keys[:, None, :] & causal[None]
        mask |= slot[None, None, :] == (past + torch.arange(q, device=self.device))[None, :, None]
        for layer in m.layers:  # a masked query still sees itself: no all-false row, no NaN
            x = layer(
                x,
                attention_mask=mask[:, None],
                position_ids=pos,
                past_key_values=self.dcache,
                use_cache=True,
                cache_position=torch.arange(past, past + q, device=self.device),
                position_embeddings=pe,
            )
        self.dvalid = keys.long()
        logits = m.lm_head(m.norm(x))
        if m.config.norm_output:  # the normed state is what the next step reads
            x = m.norm(x)
        ids = logits.argmax(-1)
        if m.d2t is not None:
            ids = ids + m.d2t.to(ids.device)[ids]
        return x, ids

    def project(self, aux):
        return Eagle3Proposer.project(self, aux)

    def run(self, prompts: list[list[int]], num_steps: int, max_new: int, eos: set[int]):
        """Greedy speculative generation of every prompt; [(tokens, Stats)] in prompt order."""
        import torch

        # without it the draft's steps build an autograd graph that keeps every step's
        # activations and draft cache alive: a batch of 16 long MT-Bench turns then filled an
        # 80 GB GPU at num_steps 5
        with torch.no_grad():
            return self._run(prompts, num_steps, max_new, eos)

    def _run(self, prompts: list[list[int]], num_steps: int, max_new: int, eos: set[int]):
        import torch
        from transformers import DynamicCache

        dev, B, k = self.device, len(prompts), int(num_steps)
        width = max(len(p) for p in prompts)
        ids = torch.zeros((B, width), dtype=torch.long)
        valid = torch.zeros((B, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left-padded
            ids[i, width - len(p) :] = torch.tensor(p)
            valid[i, width - len(p) :] = 1
        ids, valid = ids.to(dev), valid.to(dev)
        pos = (valid.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        greedy, aux = self.target_step(cache, ids, valid, pos, last_only=True)
        lens = valid.sum(1)  # real tokens in the target cache per row
        outs = [[int(greedy[i, -1])] for i in range(B)]
        stats = [Stats(k) for _ in range(B)]
        done = [o[-1] in eos or max_new <= 1 for o in outs]
        # the draft's first pairs: (token j+1, aux j) for every prompt token j, left-padded
        # like the prompt; the last pair's token is the first generated token
        nxt = torch.cat([ids[:, 1:], greedy[:, -1:]], dim=1)
        self.dcache = DynamicCache()
        self.dvalid = torch.zeros((B, 0), dtype=torch.long, device=dev)
        h, tok = self.draft_step(nxt, self.project(aux.to(self.dtype)), pos + 1, valid)
        last_tok = greedy[:, -1]
        while not all(done):
            drafts = [tok[:, -1]]
            h_last = h[:, -1:]
            dpos = lens[:, None] + 1  # position of the next pair: the last token's + 1
            for i in range(1, k):
                h_last, t = self.draft_step(
                    drafts[-1][:, None],
                    h_last,
                    dpos + i - 1,
                    torch.ones((B, 1), dtype=torch.long, device=dev),
                )
                drafts.append(t[:, -1])
            if k > 1:  # the chain's own steps leave the draft cache (the target judges them)
                self.dcache.crop(-(k - 1))
                self.dvalid = self.dvalid[:, : -(k - 1)]
            drafts = torch.stack(drafts, dim=1)  # [B, k]
            if self.trace is not None:  # what each live row was offered (tests compare it)
                for i, row in enumerate(drafts.tolist()):
                    if not done[i]:
                        self.trace[i].append(row[: min(k, max_new - len(outs[i]))])
            inp = torch.cat([last_tok[:, None], drafts], dim=1)
            tpos = lens[:, None] + torch.arange(k + 1, device=dev)[None]
            greedy, aux = self.target_step(
                cache, inp, torch.cat([valid, torch.ones_like(inp)], 1), tpos
            )
            g, d = greedy.tolist(), drafts.tolist()
            acc = []
            for i in range(B):
                if done[i]:
                    acc.append(0)
                    continue
                ki = min(k, max_new - len(outs[i]))
                a = 0
                while a < ki and d[i][a] == g[i][a]:
                    a += 1
                new = [*d[i][:a], g[i][a]]
                if any(t in eos for t in new):
                    new = new[: next(j for j, t in enumerate(new) if t in eos) + 1]
                new = new[: max_new - len(outs[i])]
                stats[i].add(ki, a, len(new))
                outs[i] += new
                done[i] = outs[i][-1] in eos or len(outs[i]) >= max_new
                acc.append(a)
            acc_t = torch.tensor(acc, device=dev)
            slot = torch.arange(k + 1, device=dev)[None]
            valid = torch.cat([valid, (slot <= acc_t[:, None]).long()], dim=1)
            lens = lens + acc_t + 1
            bonus = greedy.gather(1, acc_t[:, None])[:, 0]
            # the draft's new pairs: (drafts[:a] + bonus, aux of last_tok and drafts[:a])
            pair_tok = torch.cat([drafts, bonus[:, None]], dim=1)
            pair_tok = torch.where(slot < acc_t[:, None], pair_tok, bonus[:, None])
            pair_valid = (slot <= acc_t[:, None]).long()
            h, tok_all = self.draft_step(
                pair_tok, self.project(aux.to(self.dtype)), tpos + 1, pair_valid
            )
            # each row drafts from its last real pair
            h = h.gather(1, acc_t[:, None, None].expand(-1, 1, h.shape[-1]))
            tok = tok_all.gather(1, acc_t[:, None])
            last_tok = bonus
        return [(o, s) for o, s in zip(outs, stats, strict=True)]


def load_draft(path: str):
    """A speculators-format draft folder as an eval-mode float32 model with sdpa attention.

    The saved config names the training attention (simple_flex_attention on a GPU), which
    transformers refuses to build through sdpa at load time; the layers read the attention
    implementation from the config at call time, so it is switched after loading (FlexAttention
    has no CPU path, and the proposer passes an explicit boolean mask).
    """
    from speculators import SpeculatorModel

    draft = SpeculatorModel.from_pretrained(path)
    draft.config.transformer_layer_config._attn_implementation = "sdpa"
    draft._attn_impl = "sdpa"
    return draft.float().eval()


def check_acceptance(
    target_json: str,
    draft: str,
    bench_cfg: dict,
    num_steps: list,
    out: str,
    train_summary: str | None = None,
    answers: str | None = None,
    algorithm: str = "eagle3",
) -> dict:
    """Standalone acceptance on the benchmark prompts, per num_steps and position: an EAGLE-3
    chain (`Eagle3Proposer`), or with `algorithm` dflash one block per step
    (`eagleflow.serve.dflash_check`; the draft is the native export, one prompt at a time).

    The target's aux states are taken at the ids the draft was trained on (the training
    summary's), not at the ids the export's config declares: the standalone figure is what the
    draft can do, so an export or engine that wires other layers shows up as a served accept
    length below it (the consistency verdict), instead of dragging the reference down with it.
    """
    import json

    target_info = load_target_json(target_json)
    config = json.loads(open(f"{draft}/config.json").read())
    declared = config.get("eagle_aux_hidden_state_layer_ids")
    trained = json.loads(open(train_summary).read())["aux_layers"] if train_summary else None
    if not trained:
        trained = (config.get("eagleflow") or {}).get("trained_aux_layers") or declared
    aux = list(trained or [])
    if not aux:
        raise EagleflowError(
            f"{draft}/config.json has no eagle_aux_hidden_state_layer_ids and no training "
            "summary was given, so the layers the draft was trained on are unknown; pass the "
            "train_draft summary"
        )
    if declared is not None and list(declared) != aux:
        log.warning(
            "the export %s declares aux ids %s, the draft was trained on %s: an engine reading "
            "the export feeds other layers (expect a WIRING MISMATCH? verdict)",
            draft,
            declared,
            aux,
        )
    import torch
    from transformers import AutoTokenizer

    remote_code = bool(target_info.get("trust_remote_code"))
    tok = AutoTokenizer.from_pretrained(target_info["path"], trust_remote_code=remote_code)
    prompts = benchmark_prompts(bench_cfg, tok, answers)
    dtype = standalone_dtype(bench_cfg, target_info)
    model = load_hf_target(target_info["path"], dtype, remote_code)
    target = Target(model, aux)
    batch = int(bench_cfg.get("standalone_batch_size") or 1)
    if algorithm == "dflash":
        from eagleflow.serve.dflash_check import DFlashProposer, load_dflash_draft

        block = load_dflash_draft(draft, train_summary).to(target.device, getattr(torch, dtype))
        proposers = {int(k): DFlashProposer(block, int(k)) for k in num_steps}
        batch = 1  # block drafting is checked prompt by prompt
    else:
        eagle = Eagle3Proposer(load_draft(draft).to(target.device, getattr(torch, dtype)))
        proposers = {int(k): eagle for k in num_steps}
    eos = {t for t in [tok.eos_token_id, *(_gen_eos(model))] if t is not None}
    max_new = int(bench_cfg["max_tokens"])

    by_temp, start = {}, time.monotonic()
    checked = mismatch = 0
    for temp in temperatures(bench_cfg):
        results = {}
        for k in num_steps:
            tally = Tally(k)
            if temp == 0 and batch > 1:  # greedy, many prompts at once (module doc)
                for p, (tokens, stats) in zip(
                    prompts,
                    batched_greedy(model, eagle.m, aux, prompts, k, max_new, eos, batch),
                    strict=True,
                ):
                    if checked < 2:
                        checked += 1
                        mismatch += _greedy_mismatch(model, p, tokens, max_new, eos)
                    tally.add(p, stats)
            for i, p in enumerate(prompts if temp > 0 or batch <= 1 else []):
                ids = p["input_ids"]
                # one seeded stream per (prompt, num_steps): reruns give the same figures
                rng = torch.Generator().manual_seed(1000 * int(k) + i) if temp > 0 else None
                tokens, stats = generate(target, proposers[int(k)], ids, k, max_new, eos, temp, rng)
                if temp == 0 and checked < 2:  # spec decoding must not change the output
                    ref = greedy_reference(model, ids, max_new, eos)
                    if ref != tokens:
                        raise EagleflowError(
                            f"speculative greedy output differs from plain greedy on {p['id']}: "
                            "the verification logic is broken"
                        )
                    checked += 1
                tally.add(p, stats)
            results[str(k)] = tally.as_dict()
            log.info(
                "standalone temperature %g, num_steps=%d: accept length %.3f over %d verify "
                "steps, per position %s",
                temp,
                k,
                tally.total.accept_length or 0.0,
                tally.total.verify_steps,
                [
                    None if r is None else round(r, 3)
                    for r in results[str(k)]["acceptance_rate_per_position"]
                ],
            )
        by_temp[temperature_key(temp)] = {"temperature": temp, "by_num_steps": results}
    first = next(iter(by_temp.values()))
    random_draft = None
    if bench_cfg.get("random_draft_reference"):
        # the control a smoke floor must beat: uniform random drafts, greedy, same prompts
        k = int(num_steps[0])
        ref = Stats(k)
        rand = RandomProposer(int(target_info["vocab_size"]), seed=0)
        for p in prompts:
            ref.merge(generate(target, rand, p["input_ids"], k, max_new, eos)[1])
        random_draft = {"proposer": "uniform random tokens", **ref.as_dict()}
        log.info("standalone random draft: accept length %.3f", ref.accept_length or 0.0)
    body = {
        "draft": str(draft),
        "draft_algorithm": algorithm,
        "aux_layers": aux,
        "export_aux_layers": declared,
        "prompts": [p["id"] for p in prompts],
        "max_tokens": max_new,
        "temperature": first["temperature"],
        "temperatures": [v["temperature"] for v in by_temp.values()],
        # sampled: expected accepted drafts under the engines' target-only rule (module doc)
        "verification": "greedy, and above temperature 0: accept a draft with its target "
        "probability (vLLM and SGLang's target-only rule), expected values",
        "greedy_output_checked_on": checked,
        "standalone_batch_size": batch,
        "dtype": dtype,
        # batched: rows are padded, so a near-tie of logits may round the other way (a warning)
        "greedy_output_mismatches": mismatch,
        "by_num_steps": first["by_num_steps"],  # the first temperature's (the positions plot)
        "by_temperature": by_temp,
        "random_draft": random_draft,
        "seconds": round(time.monotonic() - start, 1),
    }
    atomic_write_json(out, body)
    return body


def batched_greedy(model, draft, aux, prompts, num_steps, max_new, eos, batch):
    """`BatchedChain` over the prompts in chunks of `batch` sorted by length (little padding);
    [(tokens, Stats)] in the prompts' order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]["input_ids"]))
    chain = BatchedChain(model, draft, aux)
    out: list = [None] * len(prompts)
    for c in range(0, len(order), batch):
        rows = order[c : c + batch]
        ran = chain.run([prompts[i]["input_ids"] for i in rows], num_steps, max_new, eos)
        for i, r in zip(rows, ran, strict=True):
            out[i] = r
    return out


def _greedy_mismatch(model, prompt: dict, tokens: list[int], max_new: int, eos) -> int:
    """1 (with a warning) where the batched output differs from plain greedy decoding."""
    ref = greedy_reference(model, prompt["input_ids"], max_new, eos)
    if ref == tokens:
        return 0
    at = next(
        (i for i, (a, b) in enumerate(zip(ref, tokens, strict=False)) if a != b),
        min(len(ref), len(tokens)),
    )
    log.warning(
        "batched speculative greedy output differs from plain greedy on %s from token %d of %d "
        "(padding rounds a near-tie differently, or the verification is broken: rerun with "
        "benchmark.standalone_batch_size 1, which refuses a difference)",
        prompt["id"],
        at,
        len(ref),
    )
    return 1


def _gen_eos(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    return eos if isinstance(eos, list) else [eos]
