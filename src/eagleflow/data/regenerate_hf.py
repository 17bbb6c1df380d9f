"""Regeneration in process (`regenerate.backend: hf`): the target's own `generate`, batched.

For hosts with a GPU but no serving engine (the lent H200 of the quality run): the answers are the
target's greedy (or sampled) continuations of the same chat-template rendering an engine would
apply, decoded with the special tokens kept (raw output, as the server path asks for), so the
draft learns the tokens the target emits. Conversations are answered turn by turn, in chunks of
`hf_batch_size` sorted by prompt length (little padding); each finished chunk is appended to the
resume file, like the server path's finished samples.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from eagleflow.errors import EagleflowError
from eagleflow.util import FROM_DATASET, fsync_append, read_jsonl_resumable

log = logging.getLogger("eagleflow.regenerate")

# Prompt widths are padded up to a multiple of this (a power of two >= it with a static cache).
PAD_MULTIPLE = 64


def _messages_for(prompt: dict) -> tuple[list[dict], list[list[dict]]]:
    system = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
    exchanges = prompt.get("exchanges") or [[] for _ in prompt["turns"]]
    return system, exchanges


def render(tokenizer, messages: list[dict], tools, cfg: dict) -> list[int]:
    """Token ids of the conversation plus the generation prompt, as the engine would render it."""
    clean = [{k: v for k, v in m.items() if k != FROM_DATASET} for m in messages]
    text = tokenizer.apply_chat_template(
        clean,
        tools=tools,
        add_generation_prompt=True,
        tokenize=False,
        **(cfg.get("chat_template_kwargs") or {}),
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _stop_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def generate_batch(model, tokenizer, prompts: list[list[int]], cfg: dict, stop: set[int]):
    """Left-padded batch through `generate`; per prompt (new ids up to the stop token, finish
    reason, completion tokens counted as the engines do: the stop token included)."""
    import torch

    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    static = bool(cfg.get("hf_static_cache")) and device.type == "cuda"
    if static:  # each cache shape is a compile: powers of two keep them few
        width = max(PAD_MULTIPLE, 1 << (width - 1).bit_length())
    else:
        width = -(-width // PAD_MULTIPLE) * PAD_MULTIPLE
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kwargs = {
        "max_new_tokens": cfg["max_tokens"],
        "do_sample": cfg["temperature"] > 0,
        "pad_token_id": pad,
        "eos_token_id": sorted(stop),
    }
    if cfg["temperature"] > 0:
        kwargs.update(temperature=cfg["temperature"], top_k=0, top_p=1.0)
    else:  # no sampling knobs from the model's generation_config beside greedy decoding
        kwargs.update(temperature=None, top_k=None, top_p=None)
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs
        ).cpu()
    results = []
    for row in out[:, width:].tolist():
        for n, tok in enumerate(row):
            if tok in stop:
                results.append((row[:n], "stop", n + 1))
                break
        else:
            results.append((row, "length", len(row)))
    return results


def answer_chunk(model, tokenizer, chunk: list[dict], cfg: dict, stop: set[int], limit: int):
    """Every turn of each conversation in `chunk` answered; (rows, failures)."""
    convs, failures = {}, {}
    for p in chunk:
        system, exchanges = _messages_for(p)
        convs[p["id"]] = {"p": p, "messages": list(system), "ex": exchanges, "tok": 0, "fin": []}
    turns = max(len(p["turns"]) for p in chunk)
    for t in range(turns):
        live, rendered = [], []
        for pid, c in convs.items():
            if pid in failures or t >= len(c["p"]["turns"]):
                continue
            c["messages"].append({"role": "user", "content": c["p"]["turns"][t]})
            for m in c["ex"][t]:  # the dataset's tool exchange, as the server path keeps it
                c["messages"].append({**m, FROM_DATASET: True} if m["role"] == "assistant" else m)
            ids = render(tokenizer, c["messages"], c["p"].get("tools"), cfg)
            if len(ids) + cfg["max_tokens"] > limit:
                failures[pid] = (
                    f"turn {t + 1}: {len(ids)} prompt tokens + regenerate.max_tokens "
                    f"{cfg['max_tokens']} exceed the target's {limit}-token context"
                )
                continue
            live.append(pid)
            rendered.append(ids)
        if not live:
            continue
        for pid, (new, finish, n) in zip(
            live, generate_batch(model, tokenizer, rendered, cfg, stop), strict=True
        ):
            c = convs[pid]
            text = tokenizer.decode(new, skip_special_tokens=False)
            c["messages"].append({"role": "assistant", "content": text})
            c["tok"] += n
            c["fin"].append(finish)
    rows = []
    for pid, c in convs.items():
        if pid in failures:
            continue
        row = {"id": pid, "messages": c["messages"]}
        if c["p"].get("tools"):
            row["tools"] = c["p"]["tools"]
        if cfg.get("chat_template_kwargs"):
            row["chat_template_kwargs"] = cfg["chat_template_kwargs"]
        rows.append({**row, "completion_tokens": c["tok"], "finish_reasons": c["fin"]})
    return rows, failures


def regenerate_in_process(model_dir: str, prompts: list[dict], cfg: dict, done_path: Path) -> dict:
    """Answer every prompt not yet in `done_path` with the target's `generate`; stats as the
    server path's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = read_jsonl_resumable(done_path, "id")
    todo = [p for p in prompts if p["id"] not in done]
    log.info("regenerate (hf): %d prompts, %d done, %d to go", len(prompts), len(done), len(todo))
    cuda = torch.cuda.is_available()
    dtype = cfg.get("hf_dtype") or "auto"
    if dtype == "auto":
        dtype = "bfloat16" if cuda else "float32"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.chat_template is None:
        raise EagleflowError(f"target {model_dir} has no chat template; regeneration needs one")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to("cuda" if cuda else "cpu").eval()
    limit = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    stop = _stop_ids(model, tokenizer)
    # sort by first-turn length: a chunk's prompts pad to about the same width
    todo.sort(key=lambda p: (len(p["turns"][0]), p["id"]))
    size = int(cfg.get("hf_batch_size") or 64)
    failures: dict[str, str] = {}
    start, new_tokens = time.monotonic(), 0
    done_path.parent.mkdir(parents=True, exist_ok=True)
    with open(done_path, "a") as f:
        for i in range(0, len(todo), size):
            if cfg["temperature"] > 0:
                torch.manual_seed(i)  # a rerun of the same chunk draws the same answers
            rows, failed = answer_chunk(model, tokenizer, todo[i : i + size], cfg, stop, limit)
            for row in rows:
                fsync_append(f, row)
                done[row["id"]] = row
                new_tokens += row["completion_tokens"]
            for pid, why in failed.items():
                log.warning("sample %s not regenerated: %s", pid, why)
            failures.update(failed)
            log.info(
                "regenerate (hf): %d/%d conversations, %.0f new tok/s",
                min(i + size, len(todo)),
                len(todo),
                new_tokens / max(time.monotonic() - start, 1e-9),
            )
    elapsed = time.monotonic() - start
    return {
        "backend": "hf",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "prompts": len(prompts),
        "done": len(done),
        "failed": len(failures),
        "failures": failures,
        "new_completion_tokens": new_tokens,
        "seconds": elapsed,
        "tokens_per_s": new_tokens / elapsed if elapsed > 0 else None,
    }
