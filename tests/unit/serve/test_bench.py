"""Benchmark client against a real vLLM CPU server: the counts add up."""

import pytest

from eagleflow.serve import bench


def test_prometheus_parsing_sums_label_sets():
    text = (
        "# HELP x\n"
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 5.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2.0\n'
        "vllm:spec_decode_num_drafts_total 7\n"
    )
    got = bench.parse_prometheus(text)
    assert got["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == 7.0
    assert got["vllm:spec_decode_num_drafts_total"] == 7.0
    acc = bench.vllm_accept(
        {"vllm:spec_decode_num_drafts_total": 1.0},
        {
            "vllm:spec_decode_num_drafts_total": 5.0,
            "vllm:spec_decode_num_accepted_tokens_total": 6.0,
        },
    )
    assert acc["drafts"] == 4.0 and acc["accept_length"] == 2.5


def test_sglang_meta_fields_present_and_absent():
    assert bench.parse_sglang_meta({"completion_tokens": 30, "spec_verify_ct": 12}) == {
        "spec_verify_ct": 12,
        "accept_length": 2.5,
    }
    assert bench.parse_sglang_meta({"completion_tokens": 30})["accept_length"] is None


@pytest.mark.slow
def test_run_plan_levels_repeats_and_prompt_subsets():
    prompts = [{"id": str(i)} for i in range(160)]
    cfg = {"concurrency": [1, 4], "repeats": 3}
    plan = bench.run_plan(cfg, prompts)
    assert [(c, r, len(p)) for c, r, p in plan] == [(1, 3, 160), (4, 3, 160)]
    cfg["runs"] = [
        {"concurrency": 8, "repeats": 1},
        {"concurrency": 1, "repeats": 2, "num_prompts": 20},
    ]
    plan = bench.run_plan(cfg, prompts)
    assert [(c, r, len(p)) for c, r, p in plan] == [(8, 1, 160), (1, 2, 20)]
    picked = [p["id"] for p in plan[1][2]]
    assert picked == [str(8 * i) for i in range(20)]  # evenly spaced: both turns, all categories


def test_standalone_accept_length_over_the_served_prompts():
    def per(i, steps, acc):
        return {"id": i, "verify_steps": steps, "accepted_per_position": acc}

    rec = {
        "temperature": 0.0,
        "by_num_steps": {
            "3": {
                "accept_length": 1 + (6 + 1 + 9) / (4 + 2 + 4),
                "per_prompt": [
                    per("a", 4, [3, 2, 1]),
                    per("b", 2, [1, 0, 0]),
                    per("c", 4, [4, 3, 2]),
                ],
            }
        },
    }
    assert bench.standalone_accept_length(rec, 3) == rec["by_num_steps"]["3"]["accept_length"]
    assert bench.standalone_accept_length(rec, 3, 0.0, ["a", "b", "c"]) == 2.6
    assert bench.standalone_accept_length(rec, 3, 0.0, ["a", "c"]) == 1 + 15 / 8
    whole = rec["by_num_steps"]["3"]["accept_length"]
    assert bench.standalone_accept_length(rec, 3, 0.0, ["a", "zz"]) == whole  # not a subset


def test_counts_add_up_against_vllm(vllm_server, smollm2_tokenizer):
    cfg = {
        "prompt_sets": ["mtbench"],
        "num_prompts": 3,
        "warmup_requests": 1,
        "repeats": 2,
        "max_tokens": 24,
        "concurrency": [1, 2],
        "temperature": 0.0,
        "request_timeout_s": 300,
    }
    prompts = bench.benchmark_prompts(cfg, smollm2_tokenizer)
    assert len(prompts) == 3 and len({p["id"] for p in prompts}) == 3
    before = bench.parse_prometheus(bench._get(f"{vllm_server.url}/metrics"))
    result = bench.benchmark(vllm_server.url, "vllm", "target", prompts, cfg)
    after = bench.parse_prometheus(bench._get(f"{vllm_server.url}/metrics"))
    runs = result["runs"]
    assert [(r["concurrency"], r["repeat"]) for r in runs] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    measured = sum(r["output_tokens"] for r in runs)
    # the server's own count: warmup request plus every measured request
    served = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    warmup = served - measured
    assert 1 <= warmup <= cfg["max_tokens"]
    for r in runs:
        assert len(r["requests"]) == 3
        assert all(
            0 < q["output_tokens"] <= 24 and q["ttft_s"] <= q["wall_s"] for q in r["requests"]
        )
        assert r["accept_length"] is None  # no draft: vLLM counts no drafts
    # greedy: repeats produce the same token counts
    assert [q["output_tokens"] for q in runs[0]["requests"]] == [
        q["output_tokens"] for q in runs[1]["requests"]
    ]
    summary = bench.summarize_runs(runs)
    assert set(summary) == {"0/1", "0/2"} and summary["0/1"]["throughput_tok_s"] > 0


def test_step_seconds_counts_verify_passes_not_tokens():
    reqs = [
        {"output_tokens": 41, "wall_s": 2.5, "ttft_s": 0.5},
        {"output_tokens": 21, "wall_s": 1.5, "ttft_s": 0.5},
    ]
    plain = {"requests": reqs, "accept_length": None}
    # no speculation: a token per step after the first, (2.0 + 1.0) s over 60 steps
    assert bench.step_seconds(plain, speculative=False) == pytest.approx(3.0 / 60)
    drafted = {"requests": reqs, "spec": {"drafts": 24.0}, "accept_length": 2.5}
    assert bench.step_seconds(drafted, speculative=True) == pytest.approx(3.0 / 24)
    sglang = {"requests": [dict(q, spec_verify_ct=c) for q, c in zip(reqs, (16, 8), strict=True)]}
    assert bench.step_seconds(sglang, speculative=True) == pytest.approx(3.0 / 24)
    # a speculative run whose counters were unreachable has no step count: no figure, rather
    # than a token per step
    blind = {"requests": reqs, "accept_length": None, "accept_source": "none: unreachable"}
    assert bench.step_seconds(blind, speculative=True) is None
    run = dict(plain, concurrency=1, throughput_tok_s=20.0, output_tokens=62)
    assert bench.summarize_runs([run])["0/1"]["step_s"] is None  # not told whether it drafted
    assert bench.summarize_runs([run], False)["0/1"]["step_s"] == pytest.approx(3.0 / 60)
