"""regenerate.backend: hf — in-process batched generation, against the target's own unbatched
greedy decoding (tiny random Llama, CPU)."""

from __future__ import annotations

import json
import re

import pytest

from eagleflow.data.regenerate import regenerate
from eagleflow.util import read_jsonl
from tests.support.tiny import target_json, tiny_llama
from tests.support.tiny_pipeline import CHAT_TEMPLATE

CFG = {
    "enabled": True,
    "backend": "hf",
    "engine": "vllm",
    "hf_batch_size": 3,
    "hf_dtype": "auto",
    "hf_static_cache": True,
    "max_tokens": 8,
    "temperature": 0.0,
    "max_failed_fraction": 0.0,
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("hf-regen") / "tiny"
    tiny_llama(folder, num_layers=2, seed=3)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def _prompts(path, n=7):
    rows = [
        {
            "id": f"p{i}",
            "turns": [" ".join(f"t{(11 * i + j) % 200 + 20}" for j in range(3 + 2 * i))],
        }
        for i in range(n)
    ]
    rows[min(2, n - 1)]["turns"].append("t40 t41 t42")  # a second user turn, after the first
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _greedy_alone(model, tok, messages, max_tokens):
    """The target's own greedy continuation of one conversation, no batch, no padding."""
    import torch

    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=2,
                         pad_token_id=2, temperature=None, top_p=None, top_k=None)  # fmt: skip
    new = out[0, ids.shape[1] :].tolist()
    return new[: new.index(2)] if 2 in new else new


def _run(target, tmp_path, prompts_path, cfg=CFG):
    out, stats = tmp_path / "regenerated.jsonl", tmp_path / "stats.json"
    regenerate(target_json(target), str(prompts_path), cfg, {}, str(tmp_path / "work"),
               str(out), str(stats))  # fmt: skip
    return read_jsonl(out), json.loads(stats.read_text())


def test_batched_answers_are_the_targets_own_greedy_tokens_turn_by_turn(target, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = _prompts(tmp_path / "prompts.jsonl")
    rows, stats = _run(target, tmp_path, tmp_path / "prompts.jsonl")
    assert stats["backend"] == "hf" and stats["done"] == len(prompts) and stats["failed"] == 0
    assert [r["id"] for r in rows] == [p["id"] for p in prompts]  # the prompts' order, not length
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target)
    tokens = 0
    for row, prompt in zip(rows, prompts, strict=True):
        msgs = row["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * len(prompt["turns"])
        assert [m["content"] for m in msgs[::2]] == prompt["turns"]
        for k in range(1, len(msgs), 2):  # each answer continues the conversation before it
            want = _greedy_alone(model, tok, msgs[:k], CFG["max_tokens"])
            assert want and msgs[k]["content"] == tok.decode(want, skip_special_tokens=False), (
                row["id"], k, want)  # fmt: skip
        assert len(row["finish_reasons"]) == len(prompt["turns"])
        tokens += row["completion_tokens"]
    assert stats["new_completion_tokens"] == tokens > 0


def test_a_rerun_answers_only_what_the_resume_file_lacks(target, tmp_path):
    _prompts(tmp_path / "prompts.jsonl")
    first, _ = _run(target, tmp_path, tmp_path / "prompts.jsonl")
    (resume,) = (tmp_path / "work").glob("*.jsonl")
    kept = resume.read_text().splitlines()[:4]  # as if killed after the first chunk and a bit
    resume.write_text("\n".join(kept) + "\n")
    again, stats = _run(target, tmp_path, tmp_path / "prompts.jsonl")
    assert again == first
    redone = {r["id"] for r in first} - {json.loads(k)["id"] for k in kept}
    assert stats["new_completion_tokens"] == sum(
        r["completion_tokens"] for r in first if r["id"] in redone
    )


def test_a_conversation_longer_than_the_context_is_named_and_fails_the_stage(target, tmp_path):
    from eagleflow.errors import EagleflowError

    rows = _prompts(tmp_path / "prompts.jsonl", n=2)
    rows[1]["turns"] = [" ".join(["t50"] * 600)]  # the tiny target's context is 512
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(EagleflowError, match="1 of 2 samples failed") as e:
        _run(target, tmp_path, tmp_path / "prompts.jsonl")
    assert re.search(r"turn 1: 60\d prompt tokens \+ regenerate.max_tokens 8 exceed the target's "
                     r"512-token context", str(e.value)), e.value  # fmt: skip
    assert not (tmp_path / "regenerated.jsonl").exists()  # nothing a later run takes for done
