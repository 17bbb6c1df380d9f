"""Where every stage writes under `results_dir`: the one table of output paths.

The rules (workflow/rules/*.smk, through common.smk's `res`) and everything that reads results
outside Snakemake (`eagleflow clean`, the layer check of `eagleflow config` and of every
invocation, `eagleflow layers`, the README's results block) take their paths from here, so a
path is written once. Entries are relative to `results_dir`; `{name}` fields are Snakemake
wildcards in the rules and are filled with `path(..., name=...)` elsewhere.
"""

from __future__ import annotations

from pathlib import Path

# prepare_target
TARGET = "target/target.json"
# prepare_prompts, regenerate, tokenize
PROMPTS = "data/prompts.jsonl"
PROMPTS_STATS = "data/prompts.stats.json"
REGENERATED = "data/regenerated.jsonl"
REGENERATED_STATS = "data/regenerated.stats.json"
TOKENIZED = "data/tokenized"
TOKEN_FREQ = "data/token_freq.pt"
TOKENIZED_STATS = "data/tokenized.stats.json"
# extract_hidden_states, verify_layers
MANIFEST = "extract/manifest.json"
CERTIFICATE = "layers/layers.certificate.json"
# vocab_map, train_draft, export_draft, export_dflash
D2T = "train/d2t.{draft_vocab_size}.npy"
T2D = "train/t2d.{draft_vocab_size}.npy"
TRAIN_SUMMARY = "train/summary.json"
TRAIN_METRICS = "train/metrics.csv"
EXPORT_SPECULATORS = "export/speculators"
EXPORT_SGLANG = "export/sglang"
EXPORT_DFLASH = "export/dflash"  # draft.algorithm dflash: the native folder both engines load
# eval_answers, check_acceptance, serve_and_benchmark, benchmark_endpoint, smoke_check
ANSWERS = "eval/answers.json"
ACCEPTANCE = "acceptance/standalone.json"
BENCH = "bench/{engine}/{config}.json"
ENDPOINT = "bench/endpoint/{endpoint}.json"
SMOKE = "smoke.json"
# summarize, plot_results, write_cards
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
SUMMARY_HTML = "summary.html"
PLOTS = "plots"
CARD = "cards/{target}-eagle3.md"
# every rule
LOG = "logs/{name}.log"
STAGE_TIMES = "benchmarks/{name}.tsv"


def path(results_dir: str | Path, entry: str, **fields: object) -> Path:
    """`entry` under `results_dir`, its `{name}` fields filled from `fields`."""
    return Path(results_dir, entry.format(**fields) if fields else entry)
