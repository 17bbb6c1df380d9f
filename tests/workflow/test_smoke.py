"""The smoke run (`eagleflow smoke`): its overlay, and the whole chain on the tiny pipeline.

The end-to-end test runs the real CLI on the tests' tiny pipeline (tests/support/tiny_pipeline.py):
the workflow's real rules from prepare_target to smoke_check, serving with a real vLLM CPU server.
One stand-in, as in the remote tests: `regenerate`, which here answers every prompt with the tiny
target's own greedy continuation (HF, the tokens a greedy engine would return), so the draft learns
the target's distribution. Half the prompts are English: every English word is the tokenizer's
unknown token, like the MT-Bench prompts the benchmark sends, so the draft sees those contexts. Then
the speculators export with its layer ids shifted one slot (the serving tests' broken export) must
fail the check loudly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagleflow import config as efconfig
from eagleflow import smoke
from eagleflow.data.prompts import eval_prompts
from eagleflow.errors import EagleflowError
from eagleflow.serve import bench
from tests.conftest import REPO, copy_workflow
from tests.support.tiny_pipeline import CHAT_TEMPLATE, make_tiny_pipeline

BENCH = {"prompt_sets": ["mtbench"], "num_prompts": 4, "max_tokens": 32}
SMOKE_YAML = yaml.safe_load((REPO / "config" / "examples" / "smoke.yaml").read_text())

GREEDY_REGENERATE = '''"""Test stand-in for rule regenerate: the tiny target's greedy answers."""

from transformers import AutoTokenizer

from eagleflow.serve.acceptance import greedy_reference
from eagleflow.extract.hf import load_hf_target
from eagleflow.stage import stage
from eagleflow.target.prepare import load_target_json
from eagleflow.util import atomic_write_json, atomic_write_jsonl, read_jsonl

with stage(snakemake) as sm:
    path = load_target_json(sm.input.target)["path"]
    tok = AutoTokenizer.from_pretrained(path)
    model = load_hf_target(path, "float32")
    eos = {tok.eos_token_id}
    convs = []
    for r in read_jsonl(sm.input.prompts):
        msgs = [{"role": "user", "content": r["turns"][0]}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        answer = greedy_reference(model, ids, sm.params.regenerate["max_tokens"], eos)
        text = " ".join(tok.convert_ids_to_tokens([t for t in answer if t not in eos]))
        convs.append({"id": r["id"], "messages": msgs + [{"role": "assistant", "content": text}]})
    atomic_write_jsonl(sm.output.conversations, convs)
    atomic_write_json(sm.output.stats, {"prompts": len(convs), "stand_in": "hf greedy"})
'''


def round_trip_tokenizer(target_dir: Path) -> None:
    """The tiny target's tokenizer with bos/eos named "<s>"/"</s>": the tiny pipeline's "t1"/"t2"
    are matched inside words ("t251" reads back as "t2" "51"), and this test's regenerate writes
    the target's answers as text that tokenize must read back as the same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.support.tiny import VOCAB

    vocab = {f"t{i}": i for i in range(VOCAB) if i not in (1, 2)} | {"<s>": 1, "</s>": 2}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="t0", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = CHAT_TEMPLATE.replace(" t2 ", " </s> ")
    tok.save_pretrained(target_dir)
    (target_dir / "chat_template.jinja").write_text(tok.chat_template)


def test_overlay_caps_the_sizes_and_keeps_smaller_values():
    user = efconfig.load(REPO / "config" / "config.yaml")
    user["train"]["max_steps"] = 20  # smaller than smoke.yaml's: stays
    user["data"]["num_samples"] = 100_000  # larger: capped
    over = smoke.smoke_overlay(user, SMOKE_YAML)
    assert over["train"]["max_steps"] == 20
    assert over["data"]["num_samples"] == SMOKE_YAML["data"]["num_samples"]
    assert over["benchmark"]["random_draft_reference"] is True
    assert over["results_dir"] == str(Path(user["results_dir"]) / "smoke")
    assert over["data_root"] == str(Path(user["data_root"]) / "smoke")
    merged = efconfig.validate(efconfig.deep_merge(user, over))
    assert smoke.smoke_spec(merged) == merged["serve"]["speculative"][0]["name"]
    merged["smoke"]["spec"] = "s9"
    with pytest.raises(EagleflowError, match=r"smoke.spec 's9'.*have: s3, s5"):
        smoke.smoke_spec(merged)


@pytest.mark.slow
def test_smoke_run_passes_on_the_tiny_pipeline_and_fails_on_a_shifted_export(tmp_path):
    (tmp_path / "wf").mkdir()
    work = copy_workflow(tmp_path / "wf")
    tiny = make_tiny_pipeline(tmp_path / "tiny", work, tmp_path / "tiny" / "target")
    (work / "workflow" / "scripts" / "regenerate.py").write_text(GREEDY_REGENERATE)
    from transformers import AutoTokenizer

    round_trip_tokenizer(tmp_path / "tiny" / "target")
    # Training prompts like the benchmark's: MT-Bench questions the benchmark does not send (to
    # the tiny target all English words are its unknown token, as in the benchmark), and a few
    # in its own words for a varied draft vocabulary
    picked = {
        p["id"]
        for p in bench.benchmark_prompts(
            BENCH, AutoTokenizer.from_pretrained(tmp_path / "tiny" / "target")
        )
    }
    english = [r["turns"][0] for r in eval_prompts("mtbench") if r["id"] not in picked][::3]
    words = [" ".join(f"t{(7 * i + j) % 200 + 30}" for j in range(4 + i % 5)) for i in range(12)]
    records = [{"conversations": [{"from": "human", "value": v}]} for v in english[:20] + words]
    (tmp_path / "tiny" / "prompts.json").write_text(json.dumps(records))
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        yaml.safe_dump(
            {
                "data": {"num_samples": 32},
                "regenerate": {"max_tokens": 40},
                "serve": {
                    "speculative": [{"name": "s3", "num_steps": 3, "topk": 1}],
                    "vllm": {"max_model_len": 256, "kv_cache_gib": 1},
                },
                "tokenize": {"max_seq_len": 256},
                "train": {"max_steps": 150, "lr": 3e-3, "total_seq_len": 256},
                "benchmark": {k: BENCH[k] for k in ("num_prompts", "max_tokens")},
            }
        )
    )
    env = dict(os.environ, PYTHONPATH=str(work / "src"))
    cli = [sys.executable, "-m", "eagleflow.cli", "smoke", "--configfile", str(tiny), str(mine)]
    proc = subprocess.run(
        [*cli, "--cores", "2"], cwd=work, env=env, capture_output=True, text=True, timeout=900
    )
    out = proc.stdout + proc.stderr
    verdict_path = work / "results" / "smoke" / "smoke.json"
    assert proc.returncode == 0, out[-6000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SMOKE ")]
    assert lines and lines[-1].startswith("SMOKE PASS"), out[-6000:]
    body = json.loads(verdict_path.read_text())
    print(body["line"])
    for c in body["checks"]:
        print(f"  {c['check']}: {c['detail']}")
    names = [c["check"] for c in body["checks"]]
    assert body["passed"] and all(c["ok"] for c in body["checks"])
    assert names[0] == "certificate" and "doctor speculators export" in names
    assert "doctor sglang export" in names and "floor above a random draft" in names
    assert any(n.startswith("served / standalone vllm s3") for n in names)
    # it ran the sizes asked for, into results/smoke: the user's own results are untouched
    train = json.loads((work / "results" / "smoke" / "train" / "summary.json").read_text())
    assert train["steps"] == 150
    assert not (work / "results" / "train").exists()
    standalone = json.loads(
        (work / "results" / "smoke" / "acceptance" / "standalone.json").read_text()
    )
    assert (
        standalone["random_draft"]["accept_length"] < 1.2 < body["rows"][0]["accept_len_standalone"]
    )

    # The serving tests' broken export: the speculators ids shifted by one slot
    exports = work / "results" / "smoke" / "export"
    shifted = tmp_path / "shifted"
    shutil.copytree(exports / "speculators", shifted)
    cfg = json.loads((shifted / "config.json").read_text())
    ids = cfg["eagle_aux_hidden_state_layer_ids"]
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, *ids[:-1]]
    (shifted / "config.json").write_text(json.dumps(cfg))
    res = work / "results" / "smoke"
    bad = smoke.check(
        str(res / "target" / "target.json"),
        str(res / "layers" / "layers.certificate.json"),
        {"speculators": str(shifted), "sglang": str(exports / "sglang")},
        str(res / "train" / "summary.json"),
        str(res / "acceptance" / "standalone.json"),
        [str(p) for p in (res / "bench" / "vllm").glob("s3.json")],
        efconfig.load(REPO / "config" / "config.yaml")["benchmark"],
        {"min_accept_length": 1.2},
        "0.5.23",
        str(tmp_path / "bad.json"),
    )
    print(bad["line"])
    assert not bad["passed"] and bad["line"].startswith("SMOKE FAIL: 1 of")
    assert "doctor speculators export" in bad["line"] and str(ids) in bad["line"], bad["line"]
