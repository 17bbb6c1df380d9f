"""The quality run's GPU stages on one GPU host that has no Snakemake (the lent H100/H200).

It calls the stage functions the workflow's rules call, in the rules' order and with the rules'
arguments, on the config layered the way `snakemake --configfile config/config.yaml OVERLAY`
layers it, and writes the rules' output paths under `--results` (small files) and `--data-root`
(shards, checkpoints). Each stage is skipped when its output exists (every stage writes its
outputs atomically), so the chain can be started again after a cut and goes on where it
stopped. Stages and their wall times go to `<results>/chain.json` as they end.

Stages: prepare_target, regenerate, tokenize, extract_hidden_states, verify_layers, vocab_map,
train_draft, export_draft, eval_answers, check_acceptance; then the data-size study: the same
recipe (tokenize → … → train_draft → export_draft → check_acceptance at the first num_steps) on
the first N of the regenerated conversations, N from `--study`, the trainings running beside
the main one on the same GPU. `pack` writes what travels back: `results.tar.gz` (small files
only) and the speculators export's weights without `embed_tokens` (the target's own embedding,
frozen in training; `eagleflow.export` puts it back here, checked by sha256), in parts that fit
16 MiB.

    python3 benchmarks/gpu_quality.py --results /tmp/q/results --data-root /tmp/q/bulk \\
        --prompts /tmp/q/prompts.jsonl --study 500 2000 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

log = logging.getLogger("gpu_quality")
OVERLAY = REPO / "config" / "examples" / "smollm2-quality.yaml"
PART_BYTES = 15 * 1024 * 1024


def load_config(overlays: list[str], overrides: list[str]) -> dict:
    """config/config.yaml + overlays + KEY=YAML overrides, validated as the Snakefile does."""
    import yaml

    from eagleflow import config as efconfig
    from eagleflow import serve as efserve

    extra: dict = {}
    for item in overrides:
        key, _, value = item.partition("=")
        node = extra
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    cfg = efconfig.load_layers([REPO / "config" / "config.yaml", *overlays])
    cfg = efconfig.validate(efconfig.deep_merge(cfg, extra))
    efconfig.check(cfg)
    cfg["_spec"] = [vars(s) for s in efserve.spec_configs(cfg)]
    return cfg


class Chain:
    """One results/data_root pair: the rules' paths and the stages that fill them."""

    def __init__(self, cfg: dict, results: Path, bulk: Path, name: str):
        self.cfg, self.results, self.bulk, self.name = cfg, results, bulk, name
        path = results / "stages.json"
        self.times = json.loads(path.read_text()) if path.exists() else {}

    def res(self, *parts) -> str:
        return str(self.results.joinpath(*parts))

    def step(self, stage: str, outputs: list[str], fn) -> None:
        """Run `fn` unless every output exists; its wall time into the record."""
        if all(Path(o).exists() for o in outputs):
            log.info("%s %s: outputs exist, skipped", self.name, stage)
            return
        Path(self.res("logs")).mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(self.res("logs", f"{stage}.log"))
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logging.getLogger().addHandler(handler)
        t0 = time.monotonic()
        log.info("%s %s: start", self.name, stage)
        try:
            fn()
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
        wall = round(time.monotonic() - t0, 1)
        self.times[stage] = wall
        save_record(self.results / "stages.json", self.times)
        log.info("%s %s: %.1f s", self.name, stage, wall)

    # ---- the rules, with the arguments their scripts pass

    @property
    def target(self) -> str:
        return self.res("target", "target.json")

    def prepare_target(self) -> None:
        from eagleflow.targets import prepare_target

        c = self.cfg
        model_dir = str(self.bulk / "target" / c["target"]["name"])
        self.step("prepare_target", [self.target],
                  lambda: prepare_target(c["target"], model_dir, self.target))  # fmt: skip

    def regenerate(self, prompts: str) -> None:
        from eagleflow import serve as efserve
        from eagleflow.data import regenerate

        c = self.cfg
        out = [self.res("data", "regenerated.jsonl"), self.res("data", "regenerated.stats.json")]
        self.step("regenerate", out, lambda: regenerate(
            self.target, prompts, c["regenerate"], efserve.regeneration_settings(c["serve"]),
            str(self.bulk / "regenerate"), *out, self.res("logs", "regenerate.log")))  # fmt: skip

    def data(self, conversations: str, vocab_from: Chain | None = None) -> None:
        """tokenize, extract_hidden_states, verify_layers, vocab_map (or `vocab_from`'s)."""
        from eagleflow.certificate import verify_layers
        from eagleflow.data import tokenize
        from eagleflow.extract import extract_hidden_states
        from eagleflow.train import build_vocab_map

        c = self.cfg
        ds = self.res("data", "tokenized")
        freq = self.res("data", "token_freq.pt")
        self.step("tokenize", [ds, freq, self.res("data", "tokenized.stats.json")],
                  lambda: tokenize(self.target, conversations, c["tokenize"], ds, freq,
                                   self.res("data", "tokenized.stats.json")))  # fmt: skip
        man = self.res("extract", "manifest.json")
        sglang = c["serve"]["sglang"]["version"]
        engine = c["serve"]["engine"]
        shards = str(self.bulk / "extract")
        self.step("extract_hidden_states", [man], lambda: extract_hidden_states(
            self.target, ds, c["extract"], shards, man, sglang, engine))  # fmt: skip
        cert = self.res("layers", "layers.certificate.json")
        self.step("verify_layers", [cert], lambda: verify_layers(
            self.target, ds, man, c["verify"], c["extract"], sglang, cert, engine,
            c["serve"]["sglang"]))  # fmt: skip
        size = c["train"]["draft_vocab_size"]
        d2t, t2d = self.res("train", f"d2t.{size}.npy"), self.res("train", f"t2d.{size}.npy")
        if vocab_from is None:
            self.step("vocab_map", [d2t, t2d], lambda: build_vocab_map(
                freq, size, d2t, t2d, self.target, init_from=c["train"]["init_from"]))  # fmt: skip
        else:  # the study keeps the full run's draft vocabulary: one recipe, one vocabulary
            for mine, theirs in zip((d2t, t2d), vocab_from.vocab(), strict=True):
                Path(mine).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(theirs, mine)

    def vocab(self) -> tuple[str, str]:
        size = self.cfg["train"]["draft_vocab_size"]
        return self.res("train", f"d2t.{size}.npy"), self.res("train", f"t2d.{size}.npy")

    def train_inputs(self) -> dict:
        size = self.cfg["train"]["draft_vocab_size"]
        return {
            "target": self.target,
            "dataset": self.res("data", "tokenized"),
            "manifest": self.res("extract", "manifest.json"),
            "certificate": self.res("layers", "layers.certificate.json"),
            "d2t": self.res("train", f"d2t.{size}.npy"),
            "t2d": self.res("train", f"t2d.{size}.npy"),
            "init_from": [],
        }

    def train(self) -> None:
        from eagleflow.train import train_draft

        c = self.cfg
        out = [self.res("train", "summary.json"), self.res("train", "metrics.csv")]
        self.step("train_draft", out, lambda: train_draft(
            self.train_inputs(), c["train"], str(self.bulk / "checkpoints"), *out,
            trust_remote_code=c["target"]["trust_remote_code"]))  # fmt: skip

    def export(self) -> None:
        from eagleflow.export import export_draft

        c = self.cfg
        out = [self.res("export", "speculators"), self.res("export", "sglang")]
        self.step("export_draft", out, lambda: export_draft(
            self.target, self.res("layers", "layers.certificate.json"),
            self.res("train", "summary.json"), c["train"], c["target"]["name"], *out))  # fmt: skip

    def bench_cfg(self) -> dict:
        return {k: v for k, v in self.cfg["benchmark"].items() if k != "endpoints"}

    def eval_answers(self) -> None:
        from eagleflow.bench import eval_answers

        out = self.res("eval", "answers.json")
        self.step("eval_answers", [out], lambda: eval_answers(self.target, self.bench_cfg(), out))

    def acceptance(self, num_steps: list[int], answers: str | None) -> None:
        from eagleflow.acceptance import check_acceptance

        out = self.res("acceptance", "standalone.json")
        self.step("check_acceptance", [out], lambda: check_acceptance(
            self.target, self.res("export", "speculators"), self.bench_cfg(), num_steps, out,
            train_summary=self.res("train", "summary.json"), answers=answers))  # fmt: skip


def save_record(path: Path, record: dict) -> None:
    from eagleflow.util import atomic_write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(str(path), record)


def study_chain(cfg, args, n: int) -> Chain:
    return Chain(cfg, Path(args.results) / "study" / f"n{n}", Path(args.data_root) / "study" /
                 f"n{n}", f"n{n}")  # fmt: skip


def prefix_conversations(main: Chain, sub: Chain, n: int) -> str:
    """The first n regenerated conversations (prompt order: prepare_prompts' seeded sample)."""
    from eagleflow.util import atomic_write_jsonl, read_jsonl

    path = Path(sub.res("data", "regenerated.jsonl"))
    if not path.exists():
        rows = read_jsonl(main.res("data", "regenerated.jsonl"))
        if len(rows) < n:
            raise SystemExit(f"--study {n}: only {len(rows)} conversations were regenerated")
        atomic_write_jsonl(str(path), rows[:n])
    return str(path)


def share_target(main: Chain, sub: Chain) -> None:
    """The study reuses the main run's target folder and target.json (same build)."""
    Path(sub.target).parent.mkdir(parents=True, exist_ok=True)
    if not Path(sub.target).exists():
        Path(sub.target).write_text(Path(main.target).read_text())


def pack(main: Chain, out: Path) -> dict:
    """results.tar.gz (small files) and the draft without embed_tokens, in parts."""
    import hashlib

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from eagleflow.targets import sha256_file

    out.mkdir(parents=True, exist_ok=True)
    skip = ("data/regenerated.jsonl", "data/tokenized", "export/speculators/model",
            "export/sglang/model", "data/token_freq.pt")  # fmt: skip
    results = Path(main.results)
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        for p in sorted(results.rglob("*")):
            rel = p.relative_to(results).as_posix()
            if p.is_file() and not any(s in rel for s in skip) and p.stat().st_size < 8 << 20:
                tar.add(p, arcname=rel)
    folder = Path(main.res("export", "speculators"))
    weights = sorted(folder.glob("*.safetensors"))
    if len(weights) != 1:
        raise SystemExit(f"{folder}: expected one weights file, found {len(weights)}")
    tensors = load_file(weights[0])
    with safe_open(weights[0], "pt") as f:
        metadata = f.metadata()
    embed = tensors.pop("embed_tokens.weight")
    digest = hashlib.sha256(embed.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    parts, cur, size = [], {}, 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > PART_BYTES:
            parts.append(cur)
            cur, size = {}, 0
        if nbytes > PART_BYTES:  # one tensor over a part: split along its first dimension
            rows = max(1, PART_BYTES // (nbytes // t.shape[0]))
            for i in range(0, t.shape[0], rows):
                parts.append({f"{name}@{i}": t[i : i + rows].clone()})
            continue
        cur[name] = t
        size += nbytes
    if cur:
        parts.append(cur)
    for i, part in enumerate(parts):
        save_file(part, str(out / f"draft.part{i}.safetensors"))
    info = {
        "parts": len(parts),
        "embed_tokens": {"shape": list(embed.shape), "dtype": str(embed.dtype), "sha256": digest},
        "files": sorted(p.name for p in folder.iterdir()),
        "weights": {
            "name": weights[0].name,
            "sha256": sha256_file(weights[0]),
            "metadata": metadata,
        },  # fmt: skip
    }
    (out / "draft.json").write_text(json.dumps(info, indent=1))
    return info


def unpack(parts_dir: Path, target_json: str, folder: Path) -> None:
    """Here: the draft's weights from the parts plus the target's own embedding, into the
    speculators export `folder` (its small files come from results.tar.gz); byte-identical to
    the export made on the GPU host, or refused."""
    import hashlib

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from eagleflow.targets import load_target_json, sha256_file

    info = json.loads((parts_dir / "draft.json").read_text())
    target = load_target_json(target_json)
    model = AutoModelForCausalLM.from_pretrained(target["path"], dtype=torch.float32)
    embed = model.get_input_embeddings().weight.detach().contiguous()
    digest = hashlib.sha256(embed.view(torch.uint8).numpy().tobytes()).hexdigest()
    if digest != info["embed_tokens"]["sha256"]:
        want = info["embed_tokens"]["sha256"][:12]
        raise SystemExit(
            f"the target's embedding here ({digest[:12]}) is not the draft's ({want}): the "
            "target was built differently; rebuild it from the same GGUF"
        )
    tensors: dict = {"embed_tokens.weight": embed}
    pieces: dict = {}
    for i in range(info["parts"]):
        for name, t in load_file(parts_dir / f"draft.part{i}.safetensors").items():
            if "@" in name:
                base, _, start = name.partition("@")
                pieces.setdefault(base, []).append((int(start), t))
            else:
                tensors[name] = t
    for name, chunks in pieces.items():
        tensors[name] = torch.cat([t for _, t in sorted(chunks, key=lambda c: c[0])])
    out = folder / info["weights"]["name"]
    save_file(tensors, str(out), metadata=info["weights"]["metadata"])
    if sha256_file(out) != info["weights"]["sha256"]:
        out.unlink()
        raise SystemExit(f"{out} does not match the GPU host's export (sha256); removed")
    print(f"{out}: {len(tensors)} tensors, sha256 equal to the GPU host's export")


def run_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every quality-run script takes: the config layers and the two roots."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--config", nargs="*", default=[str(OVERLAY)])
    ap.add_argument("--set", nargs="*", default=[], help="KEY=YAML overrides (dotted keys)")
    ap.add_argument("--results", required=True)
    ap.add_argument("--data-root", required=True)
    return ap


def main() -> None:
    ap = run_parser(__doc__)
    ap.add_argument("--prompts", required=True, help="prepare_prompts' output (made where the "
                    "dataset packages are)")  # fmt: skip
    ap.add_argument("--study", nargs="*", type=int, default=[])
    ap.add_argument("--stages", default="all", help="all, or one of: main-data, train-one")
    ap.add_argument("--which", default="main", help="train-one: main or nN")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--parts", help="checks: the folder of a packed draft's parts to unpack "
                    "into the export first")  # fmt: skip
    ap.add_argument("--unpack", help="here: the folder of the parts (then --results is the "
                    "unpacked results folder)")  # fmt: skip
    ap.add_argument("--target-json", help="--unpack: this host's target.json (prepare_target)")
    args = ap.parse_args()
    if args.unpack:
        res = Path(args.results)
        unpack(Path(args.unpack), args.target_json or str(res / "target" / "target.json"),
               res / "export" / "speculators")  # fmt: skip
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.set)
    results, bulk = Path(args.results), Path(args.data_root)
    results.mkdir(parents=True, exist_ok=True)
    rec_path = results / "chain.json"
    record = json.loads(rec_path.read_text()) if rec_path.exists() else {}
    main_chain = Chain(cfg, results, bulk, "main")
    studies = {n: study_chain(cfg, args, n) for n in args.study}

    if args.stages == "checks":  # eval_answers and the standalone check, in their own process
        main_chain.prepare_target()
        if args.parts:  # a draft brought back earlier, carried again: this host's embedding in
            unpack(
                Path(args.parts), main_chain.target, Path(main_chain.res("export", "speculators"))
            )
        answers = None
        if int(cfg["benchmark"].get("turns") or 1) == 2:
            main_chain.eval_answers()
            answers = main_chain.res("eval", "answers.json")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if answers:  # the served benchmarks elsewhere ask the same second turns (first: grab)
            shutil.copy(answers, out / "answers.json")
        steps = sorted({s["num_steps"] for s in cfg["_spec"] if s.get("num_steps")})
        main_chain.acceptance(steps, answers)
        for sub in studies.values():
            sub.export()
            sub.acceptance(steps[:1], answers)
        # one file for the checks' records (a device call returns at most 8 files): the
        # answers, and each chain's acceptance record and stage times
        tmp = out / "checks.tar.gz.partial"
        with tarfile.open(tmp, "w:gz") as tar:
            if answers:
                tar.add(answers, arcname="answers.json")
            for chain in (main_chain, *studies.values()):
                tag = "" if chain is main_chain else f".{chain.name}"
                tar.add(chain.res("acceptance", "standalone.json"), f"standalone{tag}.json")
                tar.add(chain.results / "stages.json", f"stages{tag}.json")
        tmp.rename(out / "checks.tar.gz")
        (out / "answers.json").unlink(missing_ok=True)  # now in checks.tar.gz
        return

    if args.stages == "train-one":  # one training, in its own process (see below)
        chain = main_chain if args.which == "main" else studies[int(args.which[1:])]
        chain.train()
        return

    import torch

    record["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    record["torch"] = torch.__version__
    record["config"] = args.config + args.set
    save_record(rec_path, record)
    main_chain.prepare_target()
    main_chain.regenerate(args.prompts)
    main_chain.data(main_chain.res("data", "regenerated.jsonl"))
    for n, sub in studies.items():
        share_target(main_chain, sub)
        sub.data(prefix_conversations(main_chain, sub, n), vocab_from=main_chain)
    # The trainings run side by side on the GPU (a small draft leaves most of it idle); each is
    # its own process, as the rule's job would be.
    t0 = time.monotonic()
    procs = {}
    for which in ["main", *(f"n{n}" for n in studies)]:
        cmd = [sys.executable, __file__, "--stages", "train-one", "--which", which,
               "--results", args.results, "--data-root", args.data_root,
               "--prompts", args.prompts, "--config", *args.config,
               "--study", *map(str, args.study)]  # fmt: skip
        cmd += ["--set", *args.set] if args.set else []
        procs[which] = subprocess.Popen(cmd)
    failed = [w for w, p in procs.items() if p.wait() != 0]
    record["trainings_side_by_side_s"] = round(time.monotonic() - t0, 1)
    for chain in (main_chain, *studies.values()):  # the trainings wrote their own times
        path = chain.results / "stages.json"
        chain.times = json.loads(path.read_text()) if path.exists() else {}
    save_record(rec_path, record)
    if failed:
        raise SystemExit(f"training failed: {failed}")
    main_chain.export()
    pack(main_chain, Path(args.out))  # the draft is ready to travel (gpu_quality.sh grab) if
    # the session's device time ends in the checks. They run in a process of their own: the
    # earlier stages' CUDA memory (regeneration's static cache, compiled graphs) is not all
    # given back inside one process, and a batch of 80 long second turns then ran out of it.
    cmd = [sys.executable, __file__, "--stages", "checks", "--results", args.results,
           "--data-root", args.data_root, "--prompts", args.prompts, "--config", *args.config,
           "--study", *map(str, args.study), "--out", args.out]  # fmt: skip
    cmd += ["--set", *args.set] if args.set else []
    if subprocess.call(cmd) != 0:
        raise SystemExit("the checks failed")
    for chain in (main_chain, *studies.values()):  # the checks wrote their own times
        chain.times = json.loads((chain.results / "stages.json").read_text())
    t0 = time.monotonic()
    record["stages"] = {c.name: c.times for c in (main_chain, *studies.values())}
    save_record(rec_path, record)
    info = pack(main_chain, Path(args.out))
    record["pack_s"] = round(time.monotonic() - t0, 1)
    save_record(rec_path, record)
    (Path(args.out) / "chain.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({"record": record, "draft": info}, indent=1))


if __name__ == "__main__":
    main()
