"""Per-step costs of target and draft on this machine, in process (HF transformers, no server).

What one speculative step costs against one plain decode step: the target's forward over 1
token (a baseline step) and over num_steps + 1 tokens (a verify step), and one draft step, each
after a context of --context tokens, for --batch rows, with the threads torch is given. From
them, the step-cost bound on the speedup at accept length L (L tokens per verify step):
L * decode / (verify + num_steps * draft), and the break-even accept length
(verify + num_steps * draft) / decode. These are transformers' costs, not the serving
engine's (vLLM adds scheduling and its own kernels): they explain a speedup below 1 in orders
of magnitude, not to the percent.

The draft is a speculators export (--draft) or, for timings only, one built with random
weights in the shape a config's train section gives (--random-draft CONFIG: draft layers and
vocabulary; costs depend on the shape, not the weights):

    .venv/bin/snakemake --configfile config/examples/smollm2-quality.yaml --cores 2 \
        results/target/target.json
    .venv/bin/python benchmarks/step_costs.py --target results/target/target.json \
        --random-draft config/examples/smollm2-quality.yaml --accept 2.226 2.472 2.549
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _time(fn, repeats: int) -> float:
    """Median milliseconds of fn over `repeats` calls, after one warm call."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1000


def random_draft(target: dict, config: str, aux: list[int], tmp: Path):
    """A draft of the config's shape (train.draft_layers, train.draft_vocab_size, norm flags)
    with random layers, built the way train_draft builds it; returns (model, aux ids)."""
    import numpy as np

    from eagleflow import config as efconfig
    from eagleflow.serve.acceptance import load_draft
    from eagleflow.train.loop import draft_model

    repo = Path(__file__).resolve().parents[1]
    layers = efconfig.load_layers([repo / "config" / "config.yaml", config])
    train_cfg = efconfig.validate(layers)["train"]
    size = int(train_cfg["draft_vocab_size"])
    # the first `size` target ids as the draft vocabulary: d2t holds offsets (all 0), t2d a mask
    np.save(tmp / "d2t.npy", np.zeros(size, dtype=np.int64))
    np.save(tmp / "t2d.npy", np.arange(int(target["vocab_size"])) < size)
    model = draft_model(target, aux, train_cfg, "sdpa", str(tmp / "d2t.npy"), str(tmp / "t2d.npy"))
    model.save_pretrained(tmp / "draft")
    return load_draft(str(tmp / "draft"))


def measure(model, draft, aux: list[int], batch: int, context: int, steps, repeats: int) -> dict:
    """One row: target decode, target verify at each num_steps + 1, one draft step (ms)."""
    import torch
    from transformers import DynamicCache

    from eagleflow.serve.acceptance import BatchedChain

    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (batch, context), generator=gen)
    valid = torch.ones_like(ids)
    pos = torch.arange(context)[None].expand(batch, -1)
    chain = BatchedChain(model, draft, aux)
    cache = DynamicCache()
    with torch.no_grad():
        _, a = chain.target_step(cache, ids, valid, pos, last_only=True)
        chain.dcache = DynamicCache()
        chain.dvalid = torch.zeros((batch, 0), dtype=torch.long)
        chain.draft_step(ids, chain.project(a.to(chain.dtype)), pos + 1, valid)
    n_t, n_d = cache.get_seq_length(), chain.dcache.get_seq_length()  # kept across the steps
    ones = torch.ones((batch, 1), dtype=torch.long)

    def target_step(q: int):
        x = torch.randint(0, vocab, (batch, q), generator=gen)
        p = context + torch.arange(q)[None].expand(batch, -1)
        with torch.no_grad():
            chain.target_step(cache, x, torch.ones((batch, n_t + q), dtype=torch.long), p)
        cache.crop(-q)

    def draft_step():
        x = torch.randint(0, vocab, (batch, 1), generator=gen)
        h = torch.zeros((batch, 1, int(model.config.hidden_size)), dtype=chain.dtype)
        with torch.no_grad():
            chain.draft_step(x, h, torch.full((batch, 1), context + 1), ones)
        chain.dcache.crop(-1)
        chain.dvalid = chain.dvalid[:, :n_d]

    row = {"batch": batch, "target_decode_ms": round(_time(lambda: target_step(1), repeats), 2)}
    row["draft_step_ms"] = round(_time(draft_step, repeats), 2)
    for k in steps:
        row[f"target_verify_{k + 1}_ms"] = round(_time(lambda k=k: target_step(k + 1), repeats), 2)
    return row


def main() -> None:
    import torch

    from eagleflow.extract.hf import load_hf_target
    from eagleflow.serve.acceptance import load_draft
    from eagleflow.target.prepare import load_target_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="prepare_target's target.json")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--draft", help="a speculators export folder")
    src.add_argument("--random-draft", metavar="CONFIG", help="a config overlay: its draft shape")
    ap.add_argument("--aux", type=int, nargs=3, help="aux layer ids (default: the export's, or "
                    "speculators' default [2, L//2, L-3] for a random draft)")  # fmt: skip
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--steps", type=int, nargs="*", default=[3, 5, 7])
    ap.add_argument("--accept", type=float, nargs="*", default=[],
                    help="accept lengths, one per --steps value: the step-cost bound")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", help="also write the figures here (JSON)")
    args = ap.parse_args()
    if args.accept and len(args.accept) != len(args.steps):
        ap.error(f"--accept has {len(args.accept)} values for {len(args.steps)} --steps values")
    info = load_target_json(args.target)
    model = load_hf_target(info["path"], "float32", False)
    with tempfile.TemporaryDirectory() as tmp:
        if args.draft:
            cfg = json.loads((Path(args.draft) / "config.json").read_text())
            aux = args.aux or cfg["eagle_aux_hidden_state_layer_ids"]
            draft = load_draft(args.draft)
        else:
            n = int(model.config.num_hidden_layers)
            aux = args.aux or [2, n // 2, n - 3]
            draft = random_draft(info, args.random_draft, aux, Path(tmp))
        out = {"threads": torch.get_num_threads(), "context": args.context, "aux": aux,
               "draft": args.draft or f"random, shaped by {args.random_draft}",
               "torch": torch.__version__, "rows": []}  # fmt: skip
        for b in args.batch:
            row = measure(model, draft, aux, b, args.context, args.steps, args.repeats)
            for i, k in enumerate(args.steps):
                step = row[f"target_verify_{k + 1}_ms"] + k * row["draft_step_ms"]
                # the accept length at which a speculative step pays for itself
                row[f"break_even_{k}"] = round(step / row["target_decode_ms"], 3)
                if args.accept:
                    al = args.accept[i]
                    row[f"bound_{k}_at_{al}"] = round(al * row["target_decode_ms"] / step, 3)
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
