"""Rule regenerate: the target answers every turn of every prompt (through an engine server, or
in process with transformers), resumable, keeping its raw text."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from eagleflow import engines
from eagleflow.data.prompts import normalize_tool_calls
from eagleflow.data.regenerate_hf import regenerate_in_process
from eagleflow.errors import EagleflowError
from eagleflow.target.prepare import load_target_json, sha256_file
from eagleflow.util import (
    FROM_DATASET,
    atomic_write_json,
    atomic_write_jsonl,
    fsync_append,
    read_jsonl,
    read_jsonl_resumable,
)

log = logging.getLogger(__name__)


def load_done(path: Path) -> dict[str, dict]:
    """Finished samples of an interrupted run; a torn last line (SIGKILL mid-write) is cut off."""
    return read_jsonl_resumable(path, "id")


def chat_request(model: str, messages: list[dict], cfg: dict, tools: list | None = None) -> dict:
    """The body of one regeneration request: the conversation in OpenAI wire form, plus what
    makes the engine return the target's raw text (engines.raw_output_request)."""

    wire = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != FROM_DATASET}
        if m.get("tool_calls"):  # OpenAI sends arguments as a JSON string
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ]
        wire.append(m)
    body = {
        "model": model,
        "messages": wire,
        "max_tokens": cfg["max_tokens"],
        "temperature": cfg["temperature"],
        **engines.raw_output_request(cfg.get("engine", "vllm"), tools),
    }
    if cfg.get("chat_template_kwargs"):
        body["chat_template_kwargs"] = cfg["chat_template_kwargs"]
    return body


def _chat(session, url: str, body: dict, cfg: dict) -> dict:
    r = session.post(f"{url}/v1/chat/completions", json=body, timeout=cfg["request_timeout_s"])
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def answer_prompt(session, url: str, model: str, prompt: dict, cfg: dict) -> dict:
    """The conversation with every user turn answered by the target, in its raw text (think
    blocks and tool-call markup as emitted); the dataset's tool exchanges are kept as context."""
    messages: list[dict] = []
    if prompt.get("system"):
        messages.append({"role": "system", "content": prompt["system"]})
    tools = prompt.get("tools")
    exchanges = prompt.get("exchanges") or [[] for _ in prompt["turns"]]
    tokens, finish = 0, []
    for turn, exchange in zip(prompt["turns"], exchanges, strict=True):
        messages.append({"role": "user", "content": turn})
        for m in exchange:
            messages.append({**m, FROM_DATASET: True} if m["role"] == "assistant" else m)
        body = _chat(session, url, chat_request(model, messages, cfg, tools), cfg)
        choice = body["choices"][0]
        msg = choice["message"]
        reply = {"role": "assistant", "content": msg.get("content") or ""}
        # The server runs without parsers, so these stay empty; an engine that splits them off
        # regardless (vLLM's harmony models) still loses no text: tokenize renders them back.
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning:
            reply["reasoning_content"] = reasoning
        if msg.get("tool_calls"):
            reply["tool_calls"] = normalize_tool_calls(msg["tool_calls"])
        messages.append(reply)
        tokens += body.get("usage", {}).get("completion_tokens", 0)
        finish.append(choice.get("finish_reason"))
    row = {"id": prompt["id"], "messages": messages}
    if tools:
        row["tools"] = tools
    if cfg.get("chat_template_kwargs"):  # tokenize renders the template as the target saw it
        row["chat_template_kwargs"] = cfg["chat_template_kwargs"]
    return {**row, "completion_tokens": tokens, "finish_reasons": finish}


def regenerate_with_server(
    url: str, model: str, prompts: list[dict], cfg: dict, done_path: Path
) -> dict:
    """Answer every prompt not yet in `done_path` (appending each as it finishes); stats."""
    import concurrent.futures as cf
    import threading

    import requests
    from tqdm import tqdm

    done = load_done(done_path)
    todo = [p for p in prompts if p["id"] not in done]
    log.info(
        "regenerate: %d prompts, %d already done, %d to go", len(prompts), len(done), len(todo)
    )
    local = threading.local()

    def work(prompt: dict) -> dict:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        last = None
        for attempt in range(cfg["max_retries"] + 1):
            try:
                return answer_prompt(local.session, url, model, prompt, cfg)
            except (requests.RequestException, RuntimeError, KeyError, ValueError) as e:
                last = e
                time.sleep(min(2**attempt, 30))
        raise RuntimeError(f"{type(last).__name__}: {last}")

    failures: dict[str, str] = {}
    start, new_tokens = time.monotonic(), 0
    done_path.parent.mkdir(parents=True, exist_ok=True)
    with open(done_path, "a") as f, cf.ThreadPoolExecutor(cfg["concurrency"]) as pool:
        futures = {pool.submit(work, p): p for p in todo}
        bar = tqdm(total=len(todo), desc="regenerate", mininterval=5, file=None)
        for fut in cf.as_completed(futures):
            prompt = futures[fut]
            try:
                row = fut.result()
            except RuntimeError as e:
                failures[prompt["id"]] = str(e)
                log.warning(
                    "sample %s failed after %d attempts: %s",
                    prompt["id"],
                    cfg["max_retries"] + 1,
                    e,
                )
            else:
                fsync_append(f, row)
                done[row["id"]] = row
                new_tokens += row["completion_tokens"]
            bar.update()
        bar.close()
    elapsed = time.monotonic() - start
    return {
        "prompts": len(prompts),
        "done": len(done),
        "failed": len(failures),
        "failures": failures,
        "new_completion_tokens": new_tokens,
        "seconds": elapsed,
        "tokens_per_s": new_tokens / elapsed if elapsed > 0 else None,
    }


def regeneration_server(serve_cfg: dict, model: str, engine: str, log_path: str | None):
    """The target's server for regeneration (not started yet): serve's flags WITHOUT
    engines.reasoning_parser / engines.tool_call_parser, which would return the thinking and the
    tool calls parsed apart instead of the tokens the target emitted."""

    spec = engines.SpecConfig(engines.BASELINE)
    return engines.target_server(serve_cfg, model, spec, log_path, engine=engine, parsers=False)


def resume_path(work_dir: str | Path, prompts: str, target: dict, regen_cfg: dict) -> Path:
    """The resume file of a regeneration: named by the prompts, the target's weights and
    config and the answer settings, so a file carried to another machine is found there."""

    hf = regen_cfg.get("backend", "server") == "hf"
    key = hashlib.sha256(
        json.dumps(
            [
                sha256_file(prompts),
                target["weights_sha256"],
                target["config_sha256"],
                {
                    k: regen_cfg.get(k)
                    for k in ("max_tokens", "temperature", "chat_template_kwargs")
                },
                "raw-output",  # answers kept as emitted (no parsers, special tokens kept)
            ]
            # in-process answers differ from an engine's in the last bits: their own file
            + ([{"backend": "hf", "dtype": regen_cfg.get("hf_dtype")}] if hf else [])
        ).encode()
    ).hexdigest()[:16]
    return Path(work_dir) / f"{key}.jsonl"


def regenerate(
    target_json: str,
    prompts: str,
    regen_cfg: dict,
    serve_cfg: dict,
    work_dir: str,
    out: str,
    out_stats: str,
    log_path: str | None = None,
) -> None:
    """Answer every prompt with the target through its engine; resumable across interruptions."""

    target = load_target_json(target_json)
    rows = read_jsonl(prompts)
    if not regen_cfg["enabled"]:
        raise EagleflowError(
            "regenerate.enabled: false is not supported yet: the prompt files keep only user "
            "turns; set regenerate.enabled: true"
        )
    hf = regen_cfg.get("backend", "server") == "hf"
    done_path = resume_path(work_dir, prompts, target, regen_cfg)
    already = load_done(done_path)
    if all(p["id"] in already for p in rows):
        # every answer is in the resume file (an earlier run, or one carried in from another
        # machine: the key names prompts, target and settings): no engine to start
        log.info(
            "regenerate: all %d prompts already answered in %s; no engine started",
            len(rows),
            done_path,
        )
        stats = {
            "prompts": len(rows),
            "done": len(rows),
            "failed": 0,
            "failures": {},
            "new_completion_tokens": 0,
            "seconds": 0.0,
            "tokens_per_s": None,
            "from_resume_file": True,
        }
    elif hf:
        stats = regenerate_in_process(target["path"], rows, regen_cfg, done_path)
    else:
        with regeneration_server(serve_cfg, target["path"], regen_cfg["engine"], log_path) as srv:
            stats = regenerate_with_server(srv.url, "target", rows, regen_cfg, done_path)
    stats["resume_file"] = str(done_path)
    failed_frac = stats["failed"] / max(1, stats["prompts"])
    if failed_frac > regen_cfg["max_failed_fraction"]:
        raise EagleflowError(
            f"{stats['failed']} of {stats['prompts']} samples failed (more than "
            f"regenerate.max_failed_fraction={regen_cfg['max_failed_fraction']}); first: "
            f"{next(iter(stats['failures'].items()))}. Finished samples are kept in {done_path}; "
            "rerun to retry only the failed ones"
        )
    done = load_done(done_path)
    ordered = [done[p["id"]] for p in rows if p["id"] in done]
    atomic_write_jsonl(out, ordered)
    atomic_write_json(out_stats, stats)
    log.info(
        "regenerated %d conversations (%d failed), %d new tokens in %.0f s, %.1f tok/s",
        len(ordered),
        stats["failed"],
        stats["new_completion_tokens"],
        stats["seconds"],
        stats["tokens_per_s"] or 0,
    )
