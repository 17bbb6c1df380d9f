"""Rule tokenize: conversations rendered with the target's chat template, the tokens the target
wrote supervised (loss masks)."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from pathlib import Path

from eagleflow.data.prompts import BadTools, normalize_tool_calls
from eagleflow.errors import EagleflowError
from eagleflow.target.prepare import load_target_json
from eagleflow.util import (
    FROM_DATASET,
    atomic_write_json,
    read_jsonl,
)

log = logging.getLogger(__name__)


def check_conversation(messages: list[dict]) -> None:
    """Raise BadTools for a malformed tool call or tool result in a conversation to tokenize."""
    calls: list[dict] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadTools("a message is not an object with a role")
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = normalize_tool_calls(m["tool_calls"])
        elif m["role"] == "tool":
            if not calls:
                raise BadTools("a tool result has no tool call before it")
            if not isinstance(m.get("content"), str):
                raise BadTools("a tool result's content is not text")
            ids = {c["id"] for c in calls if "id" in c}
            if m.get("tool_call_id") is not None and ids and m["tool_call_id"] not in ids:
                raise BadTools(f"tool_call_id {m['tool_call_id']!r} matches no tool call before it")


def _prepare_messages(messages: list[dict], template: str) -> list[dict]:
    """Messages for the chat template; reasoning goes into a think block where the template
    has no reasoning_content of its own, so the draft learns the tokens the target emitted.
    Tool-call arguments become objects, as vLLM hands them to the template."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != FROM_DATASET}
        reasoning = m.pop("reasoning_content", None)
        if reasoning:
            if "reasoning_content" in template:
                m["reasoning_content"] = reasoning
            else:
                m["content"] = f"<think>\n{reasoning}\n</think>\n\n{m.get('content') or ''}"
        if m.get("tool_calls"):
            m["tool_calls"] = normalize_tool_calls(m["tool_calls"])
            if m.get("content") is None:  # OpenAI's null content beside tool calls
                m["content"] = ""
        out.append(m)
    return out


def assistant_spans(
    tokenizer, messages: list[dict], tools: list | None = None, template_kwargs: dict | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans the target generated.

    A span runs from the end of the generation prompt (`<|im_start|>assistant\\n`) through the
    end-of-turn token; the whitespace the template adds after it is scaffolding. Reasoning and
    tool calls are part of the span; tool results, and assistant tool calls kept from the
    dataset (`from_dataset`), are not; nor is what the generation prompt already holds (an
    opening `<think>` that a thinking template writes there). Templates that re-render history
    (dropping old reasoning) make earlier turns unstable; then only the last assistant turn is
    supervised. `template_kwargs` are the variables the target's requests set (e.g.
    enable_thinking).
    """
    template = tokenizer.chat_template or ""
    msgs = _prepare_messages(messages, template)
    generated = [m["role"] == "assistant" and not m.get(FROM_DATASET) for m in messages]

    def render(ms, gen):
        return tokenizer.apply_chat_template(
            ms, tools=tools, tokenize=False, add_generation_prompt=gen, **(template_kwargs or {})
        )

    full = render(msgs, False)
    spans = []
    for j, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prefix = render(msgs[:j], True)
        upto = render(msgs[: j + 1], False)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            spans = []  # history is re-rendered: keep the last turn only (below)
            continue
        if generated[j]:
            spans.append((len(prefix), len(prefix) + len(upto[len(prefix) :].rstrip())))
    if not spans and msgs and generated[-1]:
        prefix = render(msgs[:-1], True)
        if full.startswith(prefix):
            spans = [(len(prefix), len(prefix) + len(full[len(prefix) :].rstrip()))]
    return full, spans


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    max_seq_len: int,
    tools: list | None = None,
    template_kwargs: dict | None = None,
) -> tuple[list, list]:
    """input_ids and loss_mask (1 exactly on tokens the target generated), truncated."""
    text, spans = assistant_spans(tokenizer, messages, tools, template_kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, mask = enc["input_ids"], []
    for start, _end in enc["offset_mapping"]:
        mask.append(int(any(a <= start < b for a, b in spans)))
    return ids[:max_seq_len], mask[:max_seq_len]


def tokenize(
    target_json: str,
    conversations: str,
    tok_cfg: dict,
    out_dir: str,
    out_freq: str,
    out_stats: str,
) -> None:
    """Render with the chat template, mask assistant tokens, write the speculators dataset."""
    import shutil

    import datasets
    import torch
    from transformers import AutoTokenizer

    start = time.monotonic()
    target = load_target_json(target_json)
    tokenizer = AutoTokenizer.from_pretrained(
        target["path"], trust_remote_code=bool(target.get("trust_remote_code"))
    )
    if not tokenizer.is_fast:
        raise EagleflowError(f"{target['path']}: tokenize needs a fast tokenizer (offsets)")
    rows = read_jsonl(conversations)
    cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: Counter = Counter()
    dropped, truncated = 0, 0
    for row in rows:
        try:
            check_conversation(row["messages"])
        except BadTools as e:
            raise EagleflowError(
                f"{conversations}: conversation {row.get('id')!r}: {e}; fix the tool messages "
                "(OpenAI tool_calls with a function name and JSON-object arguments, each tool "
                "result after the call it answers)"
            ) from None
        ids, mask = tokenize_conversation(
            tokenizer,
            row["messages"],
            tok_cfg["max_seq_len"],
            row.get("tools"),
            row.get("chat_template_kwargs"),
        )
        if sum(mask) < tok_cfg["min_assistant_tokens"]:
            dropped += 1
            continue
        truncated += len(ids) == tok_cfg["max_seq_len"]
        cols["input_ids"].append(ids)
        cols["loss_mask"].append(mask)
        cols["seq_len"].append(len(ids))
        freq.update(t for t, m in zip(ids, mask, strict=True) if m)
    if not cols["input_ids"]:
        raise EagleflowError(
            f"{conversations}: no conversation has {tok_cfg['min_assistant_tokens']} or more "
            "supervised tokens (tokenize.min_assistant_tokens); check the regenerated responses"
        )
    tmp = Path(out_dir).with_name(Path(out_dir).name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    datasets.Dataset.from_dict(cols).save_to_disk(str(tmp))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    Path(out_freq).parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(freq), out_freq)  # speculators' token-frequency format: {token_id: count}
    total = sum(cols["seq_len"])
    supervised = sum(sum(m) for m in cols["loss_mask"])
    stats = {
        "samples": len(cols["seq_len"]),
        "dropped_too_few_supervised": dropped,
        "truncated": truncated,
        "tokens": total,
        "supervised_tokens": supervised,
        "distinct_supervised_tokens": len(freq),
    }
    atomic_write_json(out_stats, stats)
    log.info(
        "tokenized %d samples (%d dropped, %d truncated): %d tokens, %d supervised, in %.1f s",
        stats["samples"],
        dropped,
        truncated,
        total,
        supervised,
        time.monotonic() - start,
    )
