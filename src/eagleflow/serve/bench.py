"""Benchmark client: one engine x one speculative config, accept length from the engine itself.

Prompts are the evaluation sets rendered with the target's chat template and sent as token ids,
so the served runs, the baseline and the standalone check see exactly the same tokens. Warmup
requests are excluded; each (concurrency, repeat) run records per request output tokens, wall
time, time to first token and decode tokens/s, and per run throughput and accept length:
- vLLM: `/metrics` counter deltas, accept length = 1 + accepted / drafts;
- SGLang: per request `meta_info.completion_tokens / spec_verify_ct` (fields can be absent:
  SGLang builds them only for finished requests that ran a speculative step), and
  `/server_info` `internal_states[0].avg_spec_accept_length`, reset with `/flush_cache`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagleflow import engines
from eagleflow.data.prompts import eval_prompts
from eagleflow.data.regenerate_hf import _stop_ids, generate_batch
from eagleflow.errors import EagleflowError
from eagleflow.extract.hf import load_hf_target
from eagleflow.target.prepare import load_target_json
from eagleflow.util import atomic_write_json

log = logging.getLogger(__name__)

VLLM_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
}


def temperatures(bench_cfg: dict) -> list[float]:
    """`benchmark.temperature` as a list (a number or a list of numbers)."""
    t = bench_cfg.get("temperature", 0.0)
    return [float(x) for x in (t if isinstance(t, list) else [t])]


def temperature_key(t: float) -> str:
    """The records' key for a temperature ("0", "0.7")."""
    return f"{float(t):g}"


def _render(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # BatchEncoding in transformers 5
        ids = ids["input_ids"]
    return list(ids)


def _picked(bench_cfg: dict) -> list[tuple[str, dict]]:
    out = []
    for name in bench_cfg["prompt_sets"]:
        rows = eval_prompts(name)
        n = bench_cfg.get("num_prompts") or len(rows)
        # evenly spaced: MT-Bench lists its 8 categories in blocks of 10
        out += [(name, rows[round(i * len(rows) / n)]) for i in range(min(n, len(rows)))]
    return out


def benchmark_prompts(bench_cfg: dict, tokenizer, answers: str | None = None) -> list[dict]:
    """The configured eval sets, spread over categories, as chat-template ids: first turns, and
    with `benchmark.turns: 2` also every second turn, asked after the target's own greedy answer
    to the first (`answers`: the eval_answers stage's file), so every run sees the same tokens."""
    turns = int(bench_cfg.get("turns") or 1)
    known = None
    if turns == 2:
        if not answers:
            raise EagleflowError(
                "benchmark.turns 2 needs the target's answers to the first turns (the "
                "eval_answers stage's output); none was given"
            )
        known = json.loads(Path(answers).read_text())["answers"]
    out = []
    for name, r in _picked(bench_cfg):
        first = [{"role": "user", "content": r["turns"][0]}]
        out.append(
            {"id": r["id"], "set": name, "category": r["category"],
             "input_ids": _render(tokenizer, first)}
        )  # fmt: skip
        if turns == 2 and len(r["turns"]) > 1:
            if r["id"] not in known:
                raise EagleflowError(
                    f"{answers} has no answer for {r['id']}: it was made for other benchmark "
                    "settings; rerun eval_answers"
                )
            second = [
                *first,
                {"role": "assistant", "content": known[r["id"]]},
                {"role": "user", "content": r["turns"][1]},
            ]
            out.append(
                {
                    "id": f"{r['id']}:turn2",
                    "set": name,
                    "category": r["category"],
                    "input_ids": _render(tokenizer, second),
                }
            )
    return out


def standalone_dtype(bench_cfg: dict, target: dict) -> str:
    """The dtype the in-process stages (standalone check, `eval_answers`) run target and draft
    in: `benchmark.standalone_dtype`, else the target's run dtype (`target.dtype`)."""
    return bench_cfg.get("standalone_dtype") or target.get("run_dtype") or "float32"


def eval_answers(target_json: str, bench_cfg: dict, out: str) -> dict:
    """The target's greedy answers to the first turns (up to benchmark.max_tokens), batched with
    the target's own `generate`: the context of every second turn (`benchmark.turns: 2`)."""
    from transformers import AutoTokenizer

    target = load_target_json(target_json)
    remote = bool(target.get("trust_remote_code"))
    tok = AutoTokenizer.from_pretrained(target["path"], trust_remote_code=remote)
    model = load_hf_target(target["path"], standalone_dtype(bench_cfg, target), remote)
    prompts = benchmark_prompts({**bench_cfg, "turns": 1}, tok)
    stop = _stop_ids(model, tok)
    cfg = {"max_tokens": int(bench_cfg["max_tokens"]), "temperature": 0.0}
    batch = int(bench_cfg.get("standalone_batch_size") or 1)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]["input_ids"]))
    answers, finish, start = {}, {}, time.monotonic()
    for c in range(0, len(order), batch):
        rows = [prompts[i] for i in order[c : c + batch]]
        got = generate_batch(model, tok, [r["input_ids"] for r in rows], cfg, stop)
        for r, (new, reason, _n) in zip(rows, got, strict=True):
            answers[r["id"]] = tok.decode(new, skip_special_tokens=True)
            finish[r["id"]] = reason
    body = {
        "target": target.get("name"),
        "max_tokens": cfg["max_tokens"],
        "prompt_sets": bench_cfg["prompt_sets"],
        "decoding": "greedy, the target's generate",
        "dtype": standalone_dtype(bench_cfg, target),
        "answers": answers,
        "finish_reasons": finish,
        "seconds": round(time.monotonic() - start, 1),
    }
    atomic_write_json(out, body)
    log.info("eval_answers: %d first turns answered in %.0f s", len(answers), body["seconds"])
    return body


def parse_prometheus(text: str) -> dict[str, float]:
    """Sums of each metric over its label sets (`name{labels} value` lines)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _get(url: str, timeout: float = 30, headers: dict | None = None) -> str:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def _post_stream(url: str, body: dict, timeout: float, headers: dict | None = None):
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    return urllib.request.urlopen(req, timeout=timeout)


def vllm_request(
    base: str, model: str, ids: list[int], cfg: dict, headers: dict | None = None
) -> dict:
    """One streamed /v1/completions request with token-id prompt; per-request timings."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": int(cfg["max_tokens"]),
        "temperature": float(cfg["temperature"]),
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": False,
    }
    start = time.monotonic()
    first = None
    tokens = None
    text = []
    with _post_stream(f"{base}/v1/completions", body, cfg["request_timeout_s"], headers) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                text.append(chunk["choices"][0]["text"])
                if first is None:
                    first = time.monotonic()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.monotonic()
    return {**_timing(start, first, end, tokens), "text_sha256": _text_hash("".join(text))}


def _text_hash(text: str) -> str:
    """A short fingerprint of an answer: greedy answers of a draft and the baseline must match."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sglang_request(base: str, ids: list[int], cfg: dict, headers: dict | None = None) -> dict:
    """One streamed SGLang /generate request; spec counters from the final meta_info."""
    body = {
        "input_ids": ids,
        "sampling_params": {
            "max_new_tokens": int(cfg["max_tokens"]),
            "temperature": float(cfg["temperature"]),
        },
        "stream": True,
    }
    start = time.monotonic()
    first, meta, text = None, {}, ""
    with _post_stream(f"{base}/generate", body, cfg["request_timeout_s"], headers) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            meta = chunk.get("meta_info") or meta
            text = chunk.get("text", text)  # SGLang streams the text so far
            if first is None and meta.get("completion_tokens"):
                first = time.monotonic()
    end = time.monotonic()
    rec = _timing(start, first, end, meta.get("completion_tokens"))
    rec.update(parse_sglang_meta(meta), text_sha256=_text_hash(text))
    return rec


def parse_sglang_meta(meta: dict) -> dict:
    """Speculative counters of one SGLang response; None when SGLang left them out."""
    verify = meta.get("spec_verify_ct")
    tokens = meta.get("completion_tokens")
    return {
        "spec_verify_ct": verify,
        "accept_length": tokens / verify if verify and tokens else None,
    }


def _timing(start: float, first: float | None, end: float, tokens: int | None) -> dict:
    if tokens is None:
        raise EagleflowError("the engine's response carried no completion token count")
    ttft = (first or end) - start
    decode = end - (first or start)
    return {
        "output_tokens": tokens,
        "wall_s": end - start,
        "ttft_s": ttft,
        "decode_tok_s": (tokens - 1) / decode if tokens > 1 and decode > 0 else None,
    }


def run_once(send, prompts: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """All prompts at `concurrency` parallel requests; (per-request records, run wall time)."""
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        recs = list(pool.map(lambda p: {"id": p["id"], **send(p["input_ids"])}, prompts))
    return recs, time.monotonic() - start


def vllm_accept(before: dict, after: dict) -> dict:
    """Counter deltas of one run and the accept length they give (bonus token included)."""
    d = {k: after.get(v, 0.0) - before.get(v, 0.0) for k, v in VLLM_COUNTERS.items()}
    d["accept_length"] = 1 + d["accepted"] / d["drafts"] if d["drafts"] else None
    return d


VLLM_TRAFFIC = {
    "generation_tokens": "vllm:generation_tokens_total",
    "requests": "vllm:request_success_total",
}


def foreign_traffic(before: dict, after: dict, tokens: int, requests: int) -> dict | None:
    """What the server-wide counters moved beyond this client's own requests of one run.

    vLLM's counters are the server's, so on a shared server they count other users' traffic
    too; None when they moved no more than this run explains (2% + 8 tokens of slack for the
    counters' update lag)."""
    gen = after.get(VLLM_TRAFFIC["generation_tokens"], 0.0) - before.get(
        VLLM_TRAFFIC["generation_tokens"], 0.0
    )
    reqs = after.get(VLLM_TRAFFIC["requests"], 0.0) - before.get(VLLM_TRAFFIC["requests"], 0.0)
    extra_tokens, extra_requests = gen - tokens, reqs - requests
    if extra_tokens > 0.02 * tokens + 8 or extra_requests > 0:
        return {"tokens": extra_tokens, "requests": extra_requests}
    return None


def benchmark(
    server_url: str,
    engine: str,
    model: str,
    prompts: list[dict],
    cfg: dict,
    headers: dict | None = None,
    owns_server: bool = True,
) -> dict:
    """Warmup, then every temperature x concurrency level x repeat; the runs with their metrics.

    `owns_server`: the server was started for this benchmark, so server-wide state may be
    reset (SGLang's `/flush_cache` before reading `/server_info`); a server someone else runs
    is only read, never changed."""
    runs = []
    warmed = False
    for temp in temperatures(cfg):
        tcfg = {**cfg, "temperature": temp}
        if engine == "vllm":

            def send(ids, tcfg=tcfg):
                return vllm_request(server_url, model, ids, tcfg, headers)
        else:

            def send(ids, tcfg=tcfg):
                return sglang_request(server_url, ids, tcfg, headers)

        if not warmed:
            for p in prompts[: cfg["warmup_requests"]]:
                send(p["input_ids"])
            warmed = True
        for conc, repeats, subset in run_plan(cfg, prompts):
            for rep in range(repeats):
                before = _engine_counters(server_url, engine, headers, owns_server)
                recs, wall = run_once(send, subset, conc)
                after = _engine_counters(server_url, engine, headers, owns_server)
                runs.append(_run_record(engine, temp, conc, rep, recs, wall, before, after))
    return {"runs": runs}


def spread(items: list, n: int | None) -> list:
    """n items evenly spaced over the list (all where n is None or not smaller)."""
    if not n or n >= len(items):
        return list(items)
    return [items[round(i * len(items) / n)] for i in range(n)]


def run_plan(cfg: dict, prompts: list[dict]) -> list[tuple[int, int, list[dict]]]:
    """(concurrency, repeats, prompts) of each measured level: `benchmark.runs` where set
    (each with its own repeats and prompt count), else every `benchmark.concurrency` level with
    `benchmark.repeats` over all the prompts."""
    runs = cfg.get("runs") or [
        {"concurrency": c, "repeats": cfg["repeats"]} for c in cfg["concurrency"]
    ]
    return [
        (int(r["concurrency"]), int(r["repeats"]), spread(prompts, r.get("num_prompts")))
        for r in runs
    ]


def _run_record(engine, temp, conc, rep, recs, wall, before, after) -> dict:
    tokens = sum(r["output_tokens"] for r in recs)
    run = {
        "temperature": temp,
        "concurrency": conc,
        "repeat": rep,
        "wall_s": wall,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / wall,
        "requests": recs,
    }
    if engine == "vllm":
        if before.get("unreachable") or after.get("unreachable"):
            run["accept_source"] = f"none: {before.get('unreachable') or after['unreachable']}"
            run["accept_length"] = None
        else:
            run["spec"] = vllm_accept(before, after)
            run["accept_length"] = run["spec"]["accept_length"]
            run["accept_source"] = "vllm /metrics counter deltas (server-wide)"
            foreign = foreign_traffic(before, after, tokens, len(recs))
            if foreign:
                run["foreign_traffic"] = foreign
                log.warning(
                    "c=%d repeat %d: the server's counters moved by %d tokens and %d requests "
                    "more than this benchmark sent: other traffic shares the server, so the "
                    "accept length counts it too",
                    conc,
                    rep,
                    foreign["tokens"],
                    foreign["requests"],
                )
    else:
        verify = [r["spec_verify_ct"] for r in recs if r.get("spec_verify_ct")]
        run["accept_length"] = (
            sum(r["output_tokens"] for r in recs if r.get("spec_verify_ct")) / sum(verify)
            if verify
            else None
        )
        run["accept_source"] = (
            "sglang per-request meta_info (completion_tokens / spec_verify_ct)"
            if verify
            else "none: no response carried spec_verify_ct"
        )
        if "avg_spec_accept_length" in after:
            run["server_avg_accept_length"] = after.get("avg_spec_accept_length")
    log.info(
        "temperature %g, c=%d repeat %d: %d tokens in %.1f s, %.1f tok/s, accept length %s",
        temp,
        conc,
        rep,
        tokens,
        wall,
        tokens / wall,
        f"{run['accept_length']:.3f}" if run["accept_length"] else "-",
    )
    return run


def _engine_counters(url: str, engine: str, headers: dict | None, owns_server: bool) -> dict:
    if engine == "vllm":
        try:
            return parse_prometheus(_get(f"{url}/metrics", headers=headers))
        except OSError as e:
            return {"unreachable": f"{url}/metrics unreachable ({e})"}
    if not owns_server:
        return {}  # /server_info's average is server-wide and only /flush_cache resets it
    try:
        _post_stream(f"{url}/flush_cache", {}, 30, headers).close()
        info = json.loads(_get(f"{url}/server_info", headers=headers))
        states = info.get("internal_states") or [{}]
        return {"avg_spec_accept_length": states[0].get("avg_spec_accept_length")}
    except OSError:
        return {}


def step_seconds(run: dict, speculative: bool) -> float | None:
    """Seconds of one engine step as a request sees it: the requests' decode time (wall after
    the first token) over their decode steps. A plain step makes one token per request (steps =
    output tokens - 1); a speculative step is one verify pass with its drafting (vLLM: the
    run's `num_drafts` counter delta; SGLang: the requests' `spec_verify_ct`). None where a
    speculative run's steps are unknown (no counters) or nothing was decoded."""
    reqs = run.get("requests") or []
    decode = sum(max(q["wall_s"] - q["ttft_s"], 0.0) for q in reqs)
    if not speculative:
        steps = sum(max(q["output_tokens"] - 1, 0) for q in reqs)
    elif (run.get("spec") or {}).get("drafts"):
        steps = run["spec"]["drafts"]
    else:
        steps = sum(q.get("spec_verify_ct") or 0 for q in reqs)
    return decode / steps if steps and decode > 0 else None


def summarize_runs(runs: list[dict], speculative: bool | None = None) -> dict:
    """Per (temperature, concurrency): median and min-max throughput and accept length over
    repeats, and the median step time (`step_seconds`; None unless `speculative` says whether
    the runs drafted); keyed "T/C" ("0/1", "0.7/4"), each value naming its temperature and
    concurrency."""
    out = {}
    keys = dict.fromkeys((float(r.get("temperature", 0.0)), r["concurrency"]) for r in runs)
    for temp, conc in sorted(keys):
        rs = [
            r for r in runs if r["concurrency"] == conc and float(r.get("temperature", 0.0)) == temp
        ]
        tput = [r["throughput_tok_s"] for r in rs]
        acc = [r["accept_length"] for r in rs if r["accept_length"] is not None]
        steps = []
        if speculative is not None:
            steps = [t for t in (step_seconds(r, speculative) for r in rs) if t is not None]
        out[f"{temperature_key(temp)}/{conc}"] = {
            "temperature": temp,
            "concurrency": conc,
            "repeats": len(rs),
            "output_tokens": sum(r["output_tokens"] for r in rs),
            "throughput_tok_s": statistics.median(tput),
            "throughput_min_max": [min(tput), max(tput)],
            "accept_length": statistics.median(acc) if acc else None,
            "accept_length_min_max": [min(acc), max(acc)] if acc else None,
            "mean_ttft_s": statistics.mean(q["ttft_s"] for r in rs for q in r["requests"]),
            "step_s": statistics.median(steps) if steps else None,
            # the prompts this level ran (a subset where benchmark.runs names num_prompts)
            "prompt_ids": sorted({q["id"] for r in rs for q in r["requests"] if "id" in q}),
            # the first repeat's answers, fingerprinted (greedy: a draft must not change them)
            "answers": {
                q["id"]: q["text_sha256"] for q in rs[0]["requests"] if q.get("text_sha256")
            },
        }
    return out


def serve_and_benchmark(
    target_json: str,
    draft: str | None,
    serve_cfg: dict,
    bench_cfg: dict,
    spec: dict,
    out: str,
    log_path: str | None = None,
    answers: str | None = None,
) -> dict:
    """Start the engine for one config, benchmark it, stop it; write the records."""
    from transformers import AutoTokenizer

    target = load_target_json(target_json)
    spec_obj = engines.SpecConfig(**spec)
    tok = AutoTokenizer.from_pretrained(
        target["path"], trust_remote_code=bool(target.get("trust_remote_code"))
    )
    prompts = benchmark_prompts(bench_cfg, tok, answers)
    engine = serve_cfg["engine"]
    use_draft = None if spec_obj.is_baseline else draft
    if not spec_obj.is_baseline and not (draft and Path(draft).is_dir()):
        raise EagleflowError(f"speculative config {spec_obj.name} needs a draft; got {draft}")
    started = time.time()
    with engines.target_server(serve_cfg, target["path"], spec_obj, log_path, use_draft) as server:
        result = benchmark(server.url, engine, "target", prompts, bench_cfg)
    body = {
        "engine": engine,
        "config": spec_obj.name,
        "spec": spec,
        "draft": use_draft,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "benchmark": bench_cfg,
        "prompts": [p["id"] for p in prompts],
        "summary": summarize_runs(result["runs"], not spec_obj.is_baseline),
        **result,
    }
    atomic_write_json(out, body)
    return body


# ---------------------------------------------------------------------------------------------
# A server someone else runs


def config_problems(config: dict) -> list[str]:
    """Cross-field rules of `benchmark.endpoints`: unique names apart from the managed configs'
    names, and baselines that name another endpoint."""

    eps = (config.get("benchmark") or {}).get("endpoints") or []
    names = [e.get("name") for e in eps]
    managed = {s.name for s in engines.spec_configs(config)}
    problems = []
    for n in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"benchmark.endpoints: the name {n!r} is used twice; give each its own")
    for e in eps:
        if e.get("name") in managed:
            problems.append(
                f"benchmark.endpoints: {e['name']!r} is also a serve.speculative config name; "
                "rename the endpoint (their rows share the summary)"
            )
        base = e.get("baseline")
        if base is not None and (base not in names or base == e.get("name")):
            problems.append(
                f"benchmark.endpoints[{e.get('name')}].baseline: {base!r} is not another "
                f"endpoint (have: {', '.join(n for n in names if n != e.get('name')) or 'none'}); "
                "name one, or set null for no speedup"
            )
    return problems


def endpoint_headers(endpoint: dict) -> dict:
    """The request headers of an endpoint: its API key, read from the environment variable the
    config names (only the variable's name is ever in a config, a record or a log)."""
    import os

    var = endpoint.get("api_key_env")
    if not var:
        return {}
    key = os.environ.get(var)
    if not key:
        raise EagleflowError(
            f"endpoint {endpoint.get('name')!r}: the environment variable {var} (its "
            "api_key_env) is not set; export it in the shell that runs the benchmark, or drop "
            "api_key_env for a server without a key"
        )
    return {"Authorization": f"Bearer {key}"}


def served_model(url: str, headers: dict, configured: str | None) -> str:
    """The model name requests carry: the configured one, else the server's only model
    (`GET /v1/models`, read-only)."""
    if configured:
        return configured
    import urllib.error

    try:
        models = [m["id"] for m in json.loads(_get(f"{url}/v1/models", headers=headers))["data"]]
    except (OSError, ValueError, KeyError) as e:
        if isinstance(e, urllib.error.HTTPError) and e.code in (401, 403):
            raise EagleflowError(
                f"{url} refused GET /v1/models with HTTP {e.code}: the server wants an API key "
                "(or another one); name the environment variable that holds it in the "
                "endpoint's `api_key_env` (eagleflow bench --api-key-env VAR)"
            ) from None
        raise EagleflowError(
            f"cannot list the models of {url} ({e}); name the served model in the endpoint's "
            "`model` (eagleflow bench --model NAME)"
        ) from None
    if len(models) != 1:
        raise EagleflowError(
            f"{url} serves {len(models)} models ({', '.join(models) or 'none'}); name one in "
            "the endpoint's `model` (eagleflow bench --model NAME)"
        )
    return models[0]


def benchmark_endpoint(
    tokenizer_path: str,
    endpoint: dict,
    bench_cfg: dict,
    out: str,
    baseline_of: list[str] | None = None,
    trust_remote_code: bool = False,
    answers: str | None = None,
) -> dict:
    """Benchmark a running server with the managed runs' client and prompts; write the record.

    Nothing is started and nothing that changes the server's state is called. Accept length
    comes from SGLang's per-request fields, or vLLM's server-wide counters (the record says
    which, and warns when other traffic moved them); unknown where neither is reachable.
    """
    from transformers import AutoTokenizer

    name, engine = endpoint["name"], endpoint["engine"]
    url = endpoint["url"].rstrip("/")
    if engine not in ("vllm", "sglang"):
        raise EagleflowError(f"endpoint {name!r}: engine {engine!r}; expected vllm or sglang")
    headers = endpoint_headers(endpoint)
    tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    prompts = benchmark_prompts(bench_cfg, tok, answers)
    model = served_model(url, headers, endpoint.get("model")) if engine == "vllm" else None
    started = time.time()
    try:
        result = benchmark(url, engine, model, prompts, bench_cfg, headers, owns_server=False)
    except OSError as e:
        raise EagleflowError(f"endpoint {name!r} at {url}: {e}") from None
    num_steps = endpoint.get("num_steps")
    body = {
        "engine": engine,
        "config": name,
        "endpoint": True,
        "url": url,
        "model": model,
        "api_key_env": endpoint.get("api_key_env"),  # the variable's name, never its value
        "baseline_endpoint": endpoint.get("baseline"),
        "is_baseline": bool(baseline_of),
        "spec": {"name": name, "num_steps": num_steps} if num_steps else {},
        "draft": None,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "benchmark": bench_cfg,
        "prompts": [p["id"] for p in prompts],
        "accept_sources": sorted({r.get("accept_source", "") for r in result["runs"]}),
        "summary": summarize_runs(result["runs"], not baseline_of),
        **result,
    }
    atomic_write_json(out, body)
    return body


# ---------------------------------------------------------------------------------------------
# served vs. standalone

MISMATCH = "WIRING MISMATCH?"
MISMATCH_CAUSES = (
    "aux layer ids the engine feeds differ from the trained ones (`eagleflow layers`)",
    "norm flags the engine's draft model ignores (norm_before_residual on SGLang)",
    "vocabulary mapping (d2t/t2d) not loaded or of another size",
    "prompts rendered with another chat template than the training data",
)


def standalone_accept_length(
    acceptance: dict,
    num_steps: int | None,
    temperature: float = 0.0,
    prompt_ids: list[str] | None = None,
) -> float | None:
    """The standalone check's accept length for `num_steps` drafted tokens at `temperature`
    (None: not run for that pair); over `prompt_ids` alone where they are a strict subset of
    the check's prompts (their summed counters: the prompts a served level ran)."""
    if num_steps is None:
        return None
    by_t = acceptance.get("by_temperature")
    if by_t is not None:
        acceptance = by_t.get(temperature_key(temperature)) or {}
    elif float(acceptance.get("temperature") or 0.0) != float(temperature):
        return None  # a record from before by_temperature: one temperature only
    got = acceptance.get("by_num_steps", {}).get(str(num_steps))
    if not got:
        return None
    per = {p["id"]: p for p in got.get("per_prompt") or []}
    if not prompt_ids or not set(prompt_ids) < set(per):  # not a strict subset: the whole
        return got.get("accept_length")
    steps = sum(per[i]["verify_steps"] for i in prompt_ids)
    accepted = sum(sum(per[i]["accepted_per_position"]) for i in prompt_ids)
    return 1 + accepted / steps if steps else None


def consistency_verdict(
    served: float | None, standalone: float | None, min_ratio: float, draft: str | None = None
) -> dict:
    """Served accept length against the standalone one for the same num_steps.

    Both count the bonus token. `accept_ratio` is served / standalone accept length;
    `accepted_ratio` is the same for the accepted drafts alone (accept length - 1), which the
    verdict uses: the bonus token is free, so with a draft that accepts 0.2 tokens per step a
    wiring error that halves its acceptance moves the accept length only from 1.2 to 1.1.
    Below `min_ratio` the engine is not running the draft the way it was trained: the verdict is
    WIRING MISMATCH? with the usual causes and the doctor command that checks them.
    """
    if served is None or standalone is None:
        missing = "served" if served is None else "standalone"
        return {
            "accept_ratio": None,
            "accepted_ratio": None,
            "verdict": f"no {missing} accept length",
            "causes": [],
        }
    ratio = served / standalone
    if standalone - 1 < 1e-3:
        return {
            "accept_ratio": ratio,
            "accepted_ratio": None,
            "verdict": "draft accepts nothing standalone",
            "causes": ["the draft itself accepts no token: train longer or on more data"],
        }
    accepted = (served - 1) / (standalone - 1)
    if accepted >= min_ratio:
        return {"accept_ratio": ratio, "accepted_ratio": accepted, "verdict": "ok", "causes": []}
    doctor = f"eagleflow doctor --target <target> --draft {draft or '<draft>'} --engine <engine>"
    return {
        "accept_ratio": ratio,
        "accepted_ratio": accepted,
        "verdict": MISMATCH,
        "causes": [*MISMATCH_CAUSES, f"check with: {doctor}"],
    }
