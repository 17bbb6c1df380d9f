"""Regeneration: requests (raw text, tools), the server's flags, resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from eagleflow.data import prompts as data_prompts
from eagleflow.data import regenerate as data_regen
from eagleflow.util import read_jsonl
from tests.unit.data._fixtures import TOOL_CONVERSATION


def test_torn_last_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "done.jsonl"
    path.write_text(json.dumps({"id": "a"}) + "\n" + '{"id": "b", "mess')
    assert list(data_regen.load_done(path)) == ["a"]
    assert path.read_text() == json.dumps({"id": "a"}) + "\n"


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
