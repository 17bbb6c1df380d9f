"""Standalone acceptance logic on a tiny random target: an oracle proposer is always accepted,
a random one almost never, and the output is the target's greedy decode either way."""

import pytest
import torch

from eagleflow.acceptance import (
    OracleProposer,
    RandomProposer,
    Stats,
    Target,
    generate,
    greedy_reference,
)
from tests.tiny import VOCAB, tiny_llama


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
