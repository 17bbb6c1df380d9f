"""Served vs. standalone on trained SmolLM2 drafts (EAGLE-3 and DFlash), and the WIRING
MISMATCH verdict.

The module trains a real EAGLE-3 draft for the real target with the workflow's own stage
functions (extract_hidden_states -> verify_layers -> vocab_map -> train_draft -> export_draft) on
SmolLM2's own greedy answers to the benchmark prompts. Every row appears twice, so the one
validation row is also a training row and the best checkpoint is the last one: a short run
(24 steps) then accepts some drafts on exactly these prompts. Then:
- check_acceptance (standalone, in-process) and serve_and_benchmark (a real vLLM CPU server
  with the exported draft) run on the same prompts, greedy, same num_steps: their accept
  lengths agree within a few percent, and the verdict is ok (the negative control);
- the SGLang export (which carries vLLM's ids at the top level too) with those ids deliberately
  shifted by one slot (the mission's bug: trained on
  [2, 15, 27], served [embed, 2, 15]) is served; the verdict fires, in the table and its
  Markdown. (A shift of every id by one layer, k-1, barely changes what this briefly trained
  draft accepts: adjacent layers' residual streams are too alike for it to notice.)
"""

from __future__ import annotations

import json
import math
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from eagleflow import config as efconfig
from eagleflow import engines as efserve
from eagleflow.extract.certificate import verify_layers
from eagleflow.extract.hf import extract_hidden_states, load_hf_target
from eagleflow.report import table as report_table
from eagleflow.serve import bench
from eagleflow.serve.acceptance import check_acceptance, greedy_reference
from eagleflow.target.prepare import load_target_json
from eagleflow.train.export import export_draft
from eagleflow.train.loop import train_draft
from eagleflow.train.vocab import build_vocab_map
from tests.conftest import REPO, copy_workflow, snakemake

pytestmark = pytest.mark.slow

NUM_STEPS = 3
BENCH = {
    **efconfig.fill_defaults({})["benchmark"],
    "prompt_sets": ["mtbench"],
    "num_prompts": 6,
    "warmup_requests": 1,
    "repeats": 1,
    "max_tokens": 32,
    "concurrency": [1],
    "request_timeout_s": 300,
}
# the standalone check and the external endpoint: greedy and sampled side by side
SAMPLED = {**BENCH, "temperature": [0.0, 0.7]}
EXTRACT = {"backend": "hf", "aux_layers": "default", "batch_tokens": 4096, "dtype": "float32"}
VERIFY = {"probe_samples": 2, "engine_check": False, "hf_forward": True}
DRAFT_VOCAB = 192
TRAIN = {
    **efconfig.fill_defaults({})["train"],
    "draft_vocab_size": DRAFT_VOCAB,
    "lr": 3e-3,
    "epochs": 24,
    "max_steps": 24,
    "total_seq_len": 1024,
    "val_fraction": 1 / 12 + 1e-6,  # 12 rows: the last one (a copy of row 5) validates
    "warmup_steps": 0,
    "save_every_steps": 1000,
    "num_workers": 0,
    "gpus": 0,
}
SPEC = {"name": "s3", "num_steps": NUM_STEPS, "topk": 1, "num_draft_tokens": None}


@pytest.fixture(scope="module")
def trained(smollm2_target, tmp_path_factory):
    """SmolLM2's greedy answers -> shards -> certificate -> a trained draft -> both exports."""
    import datasets
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("served")
    target_json = str(smollm2_target)
    info = load_target_json(target_json)
    tok = AutoTokenizer.from_pretrained(info["path"])
    prompts = bench.benchmark_prompts(BENCH, tok)
    model = load_hf_target(info["path"], "float32")
    eos = {tok.eos_token_id}
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: dict[int, int] = {}
    for p in prompts:
        answer = greedy_reference(model, p["input_ids"], BENCH["max_tokens"], eos)
        ids = p["input_ids"] + answer
        rows["input_ids"].append(ids)
        rows["loss_mask"].append([0] * len(p["input_ids"]) + [1] * len(answer))
        rows["seq_len"].append(len(ids))
        for t in answer:
            freq[t] = freq.get(t, 0) + 1
    del model
    rows = {k: v * 2 for k, v in rows.items()}
    ds = str(root / "tokenized")
    datasets.Dataset.from_dict(rows).save_to_disk(ds)
    manifest, cert = str(root / "manifest.json"), str(root / "layers.certificate.json")
    extract_hidden_states(target_json, ds, EXTRACT, str(root / "bulk"), manifest)
    verify_layers(target_json, ds, manifest, VERIFY, EXTRACT, "0.5.23", cert)
    torch.save(freq, root / "token_freq.pt")
    vocab = min(DRAFT_VOCAB, len(freq))
    d2t, t2d = str(root / f"d2t.{vocab}.npy"), str(root / f"t2d.{vocab}.npy")
    build_vocab_map(str(root / "token_freq.pt"), vocab, d2t, t2d, target_json)
    cfg = {**TRAIN, "draft_vocab_size": vocab}
    inputs = {
        "target": target_json,
        "dataset": ds,
        "manifest": manifest,
        "certificate": cert,
        "d2t": d2t,
        "t2d": t2d,
    }
    summary = str(root / "summary.json")
    train_draft(inputs, cfg, str(root / "ckpt"), summary, str(root / "metrics.csv"))
    spec_dir, sg_dir = root / "export" / "speculators", root / "export" / "sglang"
    export_draft(target_json, cert, summary, cfg, info["name"], str(spec_dir), str(sg_dir))
    standalone = check_acceptance(
        target_json, str(spec_dir), SAMPLED, [NUM_STEPS], str(root / "standalone.json"), summary
    )
    return {
        "root": root,
        "target_json": target_json,
        "inputs": inputs,
        "train_cfg": cfg,
        "summary": summary,
        "speculators": spec_dir,
        "sglang": sg_dir,
        "standalone": standalone,
    }


def serve(trained, draft: Path, name: str) -> dict:
    """serve_and_benchmark, the rule's function, on a real vLLM CPU server with `draft`."""
    serve_cfg = efconfig.load(REPO / "config" / "config.yaml")["serve"]
    # (vLLM CPU always runs an engine-core and a worker process, spawned: vllm/platforms/cpu.py
    # turns `--distributed-executor-backend uni` into mp, so no flag here makes it start faster)
    out = trained["root"] / "bench" / f"{name}.json"
    log = trained["root"] / f"{name}.server.log"
    return bench.serve_and_benchmark(
        trained["target_json"], str(draft), serve_cfg, BENCH, SPEC, str(out), str(log)
    )


def test_served_accept_length_matches_standalone(trained):
    standalone = trained["standalone"]["by_num_steps"][str(NUM_STEPS)]
    assert trained["standalone"]["greedy_output_checked_on"] == 2
    assert standalone["accept_length"] > 1.05, "the draft learned too little to compare"
    record = serve(trained, trained["speculators"], "correct")
    served = record["runs"][0]
    spec = served["spec"]
    assert spec["draft_tokens"] == spec["drafts"] * NUM_STEPS
    assert spec["accepted"] > 0
    # same prompts, greedy, same num_steps: the engine accepts what the standalone check does
    ratio = served["accept_length"] / standalone["accept_length"]
    assert abs(ratio - 1) < 0.03, (served["accept_length"], standalone["accept_length"])
    # and generates as many tokens (speculative decoding is exact: both equal plain greedy)
    assert served["output_tokens"] == sum(p["new_tokens"] + 1 for p in standalone["per_prompt"])
    rows = report_table.summary_rows([record], trained["standalone"], BENCH)
    assert [r["verdict"] for r in rows] == ["ok"]  # the negative control


def standalone_check(trained, bench_cfg: dict, tmp_path) -> dict:
    """check_acceptance, the rule's function, on the trained draft at NUM_STEPS."""
    return check_acceptance(
        trained["target_json"],
        str(trained["speculators"]),
        bench_cfg,
        [NUM_STEPS],
        str(tmp_path / "standalone.json"),
        trained["summary"],
    )


def test_standalone_check_runs_in_benchmark_standalone_dtype(trained, tmp_path, monkeypatch):
    """`benchmark.standalone_dtype: bfloat16` (what vLLM serves in on a GPU): target and draft run
    in bf16, the record says so, and the draft still accepts about what it does in fp32."""
    from eagleflow.serve import acceptance

    seen = {}

    def spy(name, fn):
        def wrapped(*a, **k):
            seen[name] = out = fn(*a, **k)
            return out

        monkeypatch.setattr(acceptance, name, wrapped)

    spy("load_hf_target", acceptance.load_hf_target)
    spy("load_draft", acceptance.load_draft)
    cfg = {**BENCH, "standalone_dtype": "bfloat16", "num_prompts": 2}
    got = standalone_check(trained, cfg, tmp_path)
    assert got["dtype"] == "bfloat16"
    assert {p.dtype for p in seen["load_hf_target"].parameters()} == {torch.bfloat16}
    assert {p.dtype for p in seen["load_draft"].parameters()} == {torch.bfloat16}
    assert trained["standalone"]["dtype"] == "float32"
    fp32 = bench.standalone_accept_length(trained["standalone"], NUM_STEPS, 0.0, got["prompts"])
    bf16 = got["by_num_steps"][str(NUM_STEPS)]["accept_length"]
    assert bf16 > 1 and abs(bf16 - fp32) < 0.5 * (fp32 - 1) + 0.05, (bf16, fp32)  # 2 prompts


def test_standalone_check_counts_each_evaluation_set_on_its_own(trained, tmp_path):
    """Two evaluation sets: each set's counters on their own, adding up to the total (the
    report's per-set table reads them)."""
    cfg = {**BENCH, "prompt_sets": ["mtbench", "humaneval"], "num_prompts": 1, "max_tokens": 16,
           "temperature": 0}  # fmt: skip
    got = standalone_check(trained, cfg, tmp_path)
    total = got["by_num_steps"][str(NUM_STEPS)]
    sets = total["by_prompt_set"]
    assert sorted(sets) == ["humaneval", "mtbench"]
    assert [sets[n]["prompts"] for n in sorted(sets)] == [1, 1]
    assert sum(s["verify_steps"] for s in sets.values()) == total["verify_steps"] > 0
    for pos in range(NUM_STEPS):
        got_pos = sum(s["accepted_per_position"][pos] for s in sets.values())
        assert got_pos == total["accepted_per_position"][pos]
    he = next(p for p in total["per_prompt"] if p["id"].startswith("HumanEval/"))
    assert sets["humaneval"]["verify_steps"] == he["verify_steps"]
    text = report_table.prompt_set_section(got)
    assert "| humaneval | 1 |" in text and "| mtbench | 1 |" in text and "| all | 2 |" in text


def test_shifted_ids_export_gets_wiring_mismatch(trained, tmp_path):
    # The SGLang export, whose top-level ids (vLLM's; eagle_config holds SGLang's) are shifted:
    # so this serve also shows that vLLM runs the SGLang-format folder as its EAGLE-3 draft (the
    # folder carries both engines' ids; tests/contract loads it through SGLang's own code).
    shifted = tmp_path / "shifted"
    shutil.copytree(trained["sglang"], shifted)
    cfg = json.loads((shifted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    good = cfg["eagle_aux_hidden_state_layer_ids"]
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, *good[:-1]]  # one slot off: [embed, 2, 15]
    (shifted / "config.json").write_text(json.dumps(cfg))
    record = serve(trained, shifted, "shifted")
    log = (trained["root"] / "shifted.server.log").read_text()
    assert "eagle3" in log.lower()
    served = record["runs"][0]
    spec = served["spec"]
    assert spec["drafts"] > 0 and spec["draft_tokens"] == NUM_STEPS * spec["drafts"], spec
    assert spec["accepted"] > 0, spec  # the tensors work: some drafts still land
    standalone = trained["standalone"]["by_num_steps"][str(NUM_STEPS)]
    # exact, whatever the draft: as many tokens as plain greedy
    assert served["output_tokens"] == sum(p["new_tokens"] + 1 for p in standalone["per_prompt"])
    rows = report_table.summary_rows([record], trained["standalone"], BENCH)
    assert [r["verdict"] for r in rows] == [bench.MISMATCH], rows
    assert rows[0]["accepted_ratio"] < BENCH["min_accept_ratio"]
    assert rows[0]["accepted_ratio"] < rows[0]["accept_ratio"] < 1
    md = tmp_path / "summary.md"
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    inputs = {"records": [str(path)], "acceptance": str(trained["root"] / "standalone.json")}
    report_table.summarize(inputs, BENCH, str(tmp_path / "summary.csv"), str(md))
    text = md.read_text()
    assert bench.MISMATCH in text and "eagleflow doctor" in text
    assert "s3" in text.split(bench.MISMATCH, 2)[-1]  # the note names the config


def test_a_dflash_draft_is_served_as_checked_and_a_shifted_export_is_caught(trained):
    """DFlash end to end on the same data: a block draft trained by the loop, exported in the
    native format, checked standalone (one forward per block) and served by vLLM CPU with method
    dflash: served = standalone accept length. Its export with the ids one slot off ([embed, 2,
    15] for [2, 15, 27], vLLM's top-level key) is served too, and the verdict fires."""
    from eagleflow.train.dflash_export import export_dflash

    root = trained["root"] / "dflash"
    root.mkdir()
    cfg = {
        **trained["train_cfg"],
        "algorithm": "dflash",
        "dflash": {
            **efconfig.fill_defaults({})["draft"]["dflash"],
            "block_size": NUM_STEPS + 1,
            "layers": 1,
            "max_anchors": 64,
        },
        "epochs": 60,
        "max_steps": 60,
    }
    summary = str(root / "summary.json")
    train_draft(trained["inputs"], cfg, str(root / "ckpt"), summary, str(root / "metrics.csv"))
    export = root / "export"
    info = load_target_json(trained["target_json"])
    export_dflash(trained["target_json"], trained["inputs"]["certificate"], summary, cfg,
                  info["name"], str(export))  # fmt: skip
    standalone = check_acceptance(
        trained["target_json"], str(export), BENCH, [NUM_STEPS], str(root / "standalone.json"),
        summary, algorithm="dflash",
    )  # fmt: skip
    assert standalone["draft_algorithm"] == "dflash"
    assert standalone["greedy_output_checked_on"] == 2  # block drafting is exact
    alone = standalone["by_num_steps"][str(NUM_STEPS)]
    assert alone["accept_length"] > 1.05, "the block draft learned too little to compare"

    record = serve(trained, export, "dflash")
    log = (trained["root"] / "dflash.server.log").read_text()
    assert '"method": "dflash"' in log and "DFlashDraftModel" in log
    served = record["runs"][0]
    assert served["spec"]["draft_tokens"] == served["spec"]["drafts"] * NUM_STEPS
    assert served["accept_length"] == pytest.approx(alone["accept_length"], rel=0.03)
    assert served["output_tokens"] == sum(p["new_tokens"] + 1 for p in alone["per_prompt"])
    rows = report_table.summary_rows([record], standalone, BENCH)
    assert [r["verdict"] for r in rows] == ["ok"]

    shifted = root / "shifted"
    shutil.copytree(export, shifted)
    native = json.loads((shifted / "config.json").read_text())
    good = native["eagle_aux_hidden_state_layer_ids"]
    native["eagle_aux_hidden_state_layer_ids"] = [0, *good[:-1]]  # vLLM reads this key first
    (shifted / "config.json").write_text(json.dumps(native))
    record = serve(trained, shifted, "dflash-shifted")
    served = record["runs"][0]
    assert served["output_tokens"] == sum(p["new_tokens"] + 1 for p in alone["per_prompt"])
    rows = report_table.summary_rows([record], standalone, BENCH)
    assert [r["verdict"] for r in rows] == [bench.MISMATCH], rows
    assert rows[0]["accepted_ratio"] < BENCH["min_accept_ratio"]


def _spec_totals(runs: list[dict]) -> tuple[int, float]:
    """(verify steps, accepted drafts) over served runs, from the engine's counter deltas."""
    return sum(r["spec"]["drafts"] for r in runs), sum(r["spec"]["accepted"] for r in runs)


def eagleflow_bench(work: Path, url: str, tokenizer: str, *args: str):
    """`eagleflow bench` against a vLLM server at `url`, run in `work`."""
    return subprocess.run(
        [sys.executable, "-m", "eagleflow.cli", "bench", "--url", url, "--engine", "vllm"]
        + ["--tokenizer", tokenizer, *args],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_external_server_keeps_its_key_secret_and_sampled_acceptance_matches(
    trained, tmp_path_factory, monkeypatch
):
    """A vLLM server the test starts itself, with --api-key: the workflow's benchmark_endpoint
    rule (through Snakemake) and `eagleflow bench` measure it, greedy and at temperature 0.7;
    the key appears nowhere eagleflow writes; served and standalone accept lengths agree
    (greedy within 3%; sampled within the tolerance below)."""
    sentinel = "ef-sentinel-" + secrets.token_hex(12)
    var = "EAGLEFLOW_TEST_ENDPOINT_KEY"
    monkeypatch.setenv(var, sentinel)
    outside = tmp_path_factory.mktemp("external-server")  # the user's server: its own log
    work = copy_workflow(tmp_path_factory.mktemp("endpoint-wf"))
    info = load_target_json(trained["target_json"])
    serve_cfg = efconfig.load(REPO / "config" / "config.yaml")["serve"]
    host = serve_cfg["host"]
    port = efserve.free_port(host)
    cmd = efserve.vllm_command(
        sys.executable,
        info["path"],
        efserve.SpecConfig(**SPEC),
        serve_cfg["vllm"],
        host,
        port,
        str(trained["speculators"]),
        "external",
    ) + ["--api-key", sentinel]
    env = efserve.engine_env("vllm", serve_cfg["vllm"])
    server = efserve.Server(cmd, host, port, str(outside / "server.log"), env, api_key=sentinel)
    url = f"http://{host}:{port}"
    overlay = work / "endpoint.yaml"
    overlay.write_text(
        yaml.safe_dump(
            {
                "target": {"name": info["name"], "path": info["path"]},
                "benchmark": {
                    **{k: v for k, v in SAMPLED.items() if k != "endpoints"},
                    "endpoints": [
                        {
                            "name": "ext",
                            "url": url,
                            "engine": "vllm",
                            "api_key_env": var,
                            "num_steps": NUM_STEPS,
                        }
                    ],
                },
            }
        )
    )
    cli_out = work / "results" / "cli.json"
    with server:
        # no key: vLLM refuses, and the message says what to set
        refused = eagleflow_bench(
            work, url, info["path"], "--num-prompts", "1", "--out", str(work / "x.json")
        )
        assert refused.returncode == 2 and "HTTP 401" in refused.stderr, refused.stderr
        assert "--api-key-env" in refused.stderr
        assert not (work / "x.json").exists()
        snakemake(
            work, "results/bench/endpoint/ext.json", "--cores", "1", "--configfile", str(overlay)
        )
        proc = eagleflow_bench(
            work,
            url,
            info["path"],
            "--api-key-env",
            var,
            "--prompts",
            "mtbench",
            "--num-prompts",
            str(BENCH["num_prompts"]),
            "--max-tokens",
            str(BENCH["max_tokens"]),
            "--warmup",
            "1",
            "--repeats",
            "2",
            "--temperature",
            "0.7",
            "--name",
            "cli",
            "--out",
            str(cli_out),
        )
        assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    rule_rec = json.loads((work / "results" / "bench" / "endpoint" / "ext.json").read_text())
    cli_rec = json.loads(cli_out.read_text())

    # The key: in no file eagleflow or Snakemake wrote (records, logs, .snakemake/ metadata,
    # the scripts Snakemake generated), nor in the CLI's output
    leaked = [
        str(f) for f in work.rglob("*") if f.is_file() and sentinel.encode() in f.read_bytes()
    ]
    assert not leaked, leaked
    assert sentinel not in proc.stdout + proc.stderr
    assert (work / ".snakemake").is_dir() and any((work / "results" / "logs").rglob("*.log"))
    assert rule_rec["api_key_env"] == var and cli_rec["api_key_env"] == var

    # Measured: what the managed runs record, from the server's counters; no speedup without a
    # named baseline; nothing but this client moved the counters
    for rec in (rule_rec, cli_rec):
        assert rec["endpoint"] and rec["model"] == "external"
        assert rec["accept_sources"] == ["vllm /metrics counter deltas (server-wide)"]
        for run in rec["runs"]:
            assert run["output_tokens"] > 0 and run["spec"]["drafts"] > 0
            assert not run.get("foreign_traffic"), run["foreign_traffic"]
    assert {r["temperature"] for r in rule_rec["runs"]} == {0.0, 0.7}
    standalone = json.loads((trained["root"] / "standalone.json").read_text())
    rows = report_table.summary_rows([rule_rec], standalone, SAMPLED)
    assert [r["temperature"] for r in rows] == [0.0, 0.7]
    assert all(r["speedup"] is None for r in rows)

    # Greedy: the endpoint path measures what the managed path does (exact decoding)
    greedy = standalone["by_temperature"]["0"]["by_num_steps"][str(NUM_STEPS)]
    served0 = [r for r in rule_rec["runs"] if r["temperature"] == 0.0]
    assert served0[0]["accept_length"] == pytest.approx(greedy["accept_length"], rel=0.03)
    assert rows[0]["verdict"] == "ok"

    # Sampled (0.7): served draws, standalone counts expected accepted drafts by the engines'
    # rule. Both estimate the mean accepted drafts per step m; the tolerance is 4 standard errors
    # of the difference, sqrt(v (1/N_served + 1/N_standalone)), v = the per-step variance the
    # standalone check measures (draw spread + spread across steps; it over-covers the
    # standalone's expected counts), N = verify steps; steps are treated as independent.
    key = bench.temperature_key(0.7)
    sampled = standalone["by_temperature"][key]["by_num_steps"][str(NUM_STEPS)]
    runs07 = [r for rec in (rule_rec, cli_rec) for r in rec["runs"] if r["temperature"] == 0.7]
    assert len(runs07) == 3
    n_served, accepted = _spec_totals(runs07)
    m_served = accepted / n_served
    m_alone, n_alone = sampled["accept_length"] - 1, sampled["verify_steps"]
    v = sampled["accepted_variance_per_step"]
    tol = 4 * math.sqrt(v * (1 / n_served + 1 / n_alone))
    print(
        f"accepted drafts per step at 0.7: served {m_served:.3f} over {n_served} steps, "
        f"standalone {m_alone:.3f} over {n_alone} steps, variance {v:.3f}, tolerance {tol:.3f};"
        f" greedy: served {served0[0]['accept_length']:.3f}, standalone "
        f"{greedy['accept_length']:.3f}"
    )
    assert abs(m_served - m_alone) < tol, (m_served, m_alone, tol)
    assert tol < 0.5 * max(m_alone, 1e-9) + 0.1, "too few steps for the comparison to mean much"
