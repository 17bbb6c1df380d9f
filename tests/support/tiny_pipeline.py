"""The tiny pipeline: the workflow's real rules on a tiny random target, in seconds on a CPU.

`make_tiny_pipeline(folder, workdir, target_dir)` prepares everything a test needs to run
prepare_target -> prepare_prompts -> regenerate -> tokenize -> extract_hidden_states ->
verify_layers -> vocab_map -> train_draft (and a small local `summarize_tiny` rule after them) in
a workflow copy:

- a 4-layer random Llama at `target_dir` (word-level tokenizer "t0".."t255" plus a chat template,
  so tokenize's loss masks work), given to the workflow as `target.path`;
- a ShareGPT prompt file whose prompts are words of that vocabulary;
- a config overlay (outside the workdir) that sizes every stage for it: 6 samples, 64-token
  sequences, a draft vocabulary of 16, 4 training steps in float32 on the CPU (`train.gpus: 0`,
  which keeps train_draft a non-local rule that asks for no GPU, like export_draft), and the
  engine check of the certificate off (no vLLM);
- STAND-IN, not the real rule: `regenerate` needs a serving engine (a vLLM CPU start costs ~40 s
  per run), so the copy's `workflow/scripts/regenerate.py` is replaced by a stand-in that answers
  every prompt with fixed tokens and records where it ran (cwd, host, CUDA_VISIBLE_DEVICES, the
  remote job id). The rule itself (inputs, outputs, `resources: gpu=1`) is the real one, so it
  runs where GPU rules run. The real regenerate is tested against a real vLLM server elsewhere
  (tests/unit/data/test_regenerate.py).
Every other rule, script and module is the real code. Shared by the remote-profile tests (and
meant for the Slurm and smoke tests).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tiny import tiny_llama

TARGETS = ["summarize_tiny"]  # needs every stage up to train_draft

# user turns rendered as "t3 ... t2", assistant turns as "t4 ... t2" (t2 = end of turn)
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}t4 {{ m['content'] }} t2 "
    "{% else %}t3 {{ m['content'] }} t2 {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}t4 {% endif %}"
)

REGENERATE_STAND_IN = '''"""Test stand-in for rule regenerate: fixed answers; notes where it ran."""

import json
import os
import socket
from pathlib import Path

from eagleflow.stage import stage
from eagleflow.util import atomic_write_json, atomic_write_jsonl, read_jsonl

with stage(snakemake) as sm:
    rows = read_jsonl(sm.input.prompts)
    # answers differ by sample: 22 distinct supervised words, enough for a draft vocab of 16
    # (t30..t51: a word starting with "t1" or "t2" would be split at the bos/eos token)
    convs = [
        {"id": r["id"], "messages": [
            {"role": "user", "content": r["turns"][0]},
            {"role": "assistant", "content": " ".join(f"t{30 + 2 * k + j}" for j in range(12))},
        ]}
        for k, r in enumerate(rows)
    ]
    atomic_write_jsonl(sm.output.conversations, convs)
    atomic_write_json(sm.output.stats, {
        "prompts": len(rows), "stand_in": True, "cwd": os.getcwd(), "host": socket.gethostname(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "remote_job": os.environ.get("EAGLEFLOW_REMOTE_JOB"),
        "hf_hub_offline": os.environ.get("HF_HUB_OFFLINE"),
    })
'''

SUMMARY_RULE = '''
rule summarize_tiny:
    """Test-only local rule after the GPU rules: a config change of it reruns it alone."""
    input:
        manifest=rules.extract_hidden_states.output.manifest,
        certificate=rules.verify_layers.output.certificate,
        train=rules.train_draft.output.summary,
    output:
        summary=res("tiny/summary.json"),
    log:
        logs("summarize_tiny"),
    localrule: True
    params:
        title=config["report"]["title"],
    run:
        import json

        man = json.load(open(input.manifest))
        cert = json.load(open(input.certificate))
        train = json.load(open(input.train))
        with open(output.summary, "w") as f:
            json.dump({"title": params.title, "shards": man["num_shards"],
                       "root": man["root"], "cert_keys": sorted(cert),
                       "train_steps": train["steps"], "train_device": train["device"]}, f)
'''


def make_tiny_pipeline(folder: Path, workdir: Path, target_dir: Path) -> Path:
    """Prepare target, prompts, overlay and the workflow copy's test rules; returns the overlay."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tiny_llama(target_dir, num_layers=4, seed=0)
    tok = AutoTokenizer.from_pretrained(target_dir)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(target_dir)
    (target_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    prompts = folder / "prompts.json"
    records = [
        {
            "conversations": [
                {
                    "from": "human",
                    "value": " ".join(f"t{(7 * i + j) % 200 + 20}" for j in range(6 + i)),
                }
            ]
        }
        for i in range(8)
    ]
    prompts.write_text(json.dumps(records))

    overlay = folder / "tiny.yaml"
    overlay.write_text(
        json.dumps(
            {
                "target": {"name": "tiny", "path": str(target_dir), "dtype": "float32"},
                "data": {
                    "sources": [{"path": str(prompts), "format": "sharegpt"}],
                    "num_samples": 6,
                    "min_prompt_chars": 4,
                    "exclude_eval_sets": [],
                },
                "tokenize": {"max_seq_len": 64, "min_assistant_tokens": 2},
                "extract": {
                    "backend": "hf",
                    "aux_layers": [1, 2, 3],
                    "batch_tokens": 512,
                    "dtype": "float32",
                },
                "verify": {"engine_check": False, "probe_samples": 2},
                "train": {
                    "draft_vocab_size": 16,
                    "epochs": 3,
                    "max_steps": 4,
                    "total_seq_len": 64,
                    "val_fraction": 0.34,
                    "save_every_steps": 2,
                    "warmup_steps": 0,
                    "num_workers": 0,
                    "gpus": 0,
                },
                "report": {"title": "tiny"},
            },
            indent=1,
        )
    )
    (workdir / "workflow" / "scripts" / "regenerate.py").write_text(REGENERATE_STAND_IN)
    (workdir / "workflow" / "rules" / "tiny_test.smk").write_text(SUMMARY_RULE)
    with open(workdir / "Snakefile", "a") as f:
        f.write('\n\ninclude: "workflow/rules/tiny_test.smk"\n')
    return overlay
