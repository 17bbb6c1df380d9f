"""Draft training on a tiny random target: vocab map, contracts, loss, resume = uninterrupted.

The target, its shards and its layer certificate are built once per module (no download); each
training run takes a few seconds on one core.
"""

from __future__ import annotations

import csv
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from eagleflow import config as efconfig
from eagleflow import disk
from eagleflow.errors import TrainError, TrainingInterrupted
from eagleflow.extract.certificate import CertificateError, verify_layers
from eagleflow.extract.stream import extract
from eagleflow.target.prepare import sha256_file
from eagleflow.train.checkpoints import recover_swaps
from eagleflow.train.loop import compiled, metric_columns, train_draft
from eagleflow.train.settings import resolve_settings
from eagleflow.train.vocab import build_vocab_map
from tests.support.tiny import target_json, tiny_dataset, tiny_llama

EXTRACT = {"backend": "hf", "aux_layers": ["embed", 1, 3], "batch_tokens": 512, "dtype": "float32"}
VERIFY = {"probe_samples": 3, "engine_check": False, "hf_forward": True}
LENGTHS = (40, 33, 57, 21, 48, 30, 60, 25, 44, 38, 52, 29, 47, 35, 26, 55)
DRAFT_VOCAB = 64
TRAIN = {
    **efconfig.fill_defaults({})["train"],
    "draft_vocab_size": DRAFT_VOCAB,
    "lr": 3e-3,
    "epochs": 5,
    "total_seq_len": 128,
    "val_fraction": 0.25,
    "save_every_steps": 4,
    "warmup_steps": 0,
    "num_workers": 0,
    "gpus": 0,
}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    # 2 shared cores: more threads only contend (OMP_NUM_THREADS=1 trains fastest).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def training_inputs(root: Path, extract_cfg: dict = EXTRACT) -> tuple[dict, dict, dict]:
    """Builds a tiny target, dataset, shards (or a stream manifest) + manifest, certificate, token
    counts and vocab map under `root`: (train_draft's inputs, the manifest, the target's info)."""
    info = tiny_llama(root / "target", num_layers=4)
    ds = tiny_dataset(root / "ds", lengths=LENGTHS)
    target = target_json(root / "target")
    manifest = root / "manifest.json"
    man = extract(target, ds, extract_cfg, str(root / "bulk"), str(manifest), probe_samples=3)
    cert = root / "layers.certificate.json"
    verify_layers(target, ds, str(manifest), VERIFY, extract_cfg, "0.5.23", str(cert))
    freq = root / "token_freq.pt"
    torch.save(_token_freq(ds), freq)
    d2t, t2d = root / f"d2t.{DRAFT_VOCAB}.npy", root / f"t2d.{DRAFT_VOCAB}.npy"
    build_vocab_map(str(freq), DRAFT_VOCAB, str(d2t), str(t2d), target)
    inputs = {
        "target": target,
        "dataset": ds,
        "manifest": str(manifest),
        "certificate": str(cert),
        "d2t": str(d2t),
        "t2d": str(t2d),
    }
    return inputs, man, info


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Target, dataset, shards + manifest, certificate, token counts, vocab map."""
    root = tmp_path_factory.mktemp("train")
    return root, training_inputs(root)[0]


def _token_freq(ds: str) -> dict:
    import datasets

    data = datasets.load_from_disk(ds)
    freq: dict = {}
    for ids, mask in zip(data["input_ids"], data["loss_mask"], strict=True):
        for t, m in zip(ids, mask, strict=True):
            if m:
                freq[t] = freq.get(t, 0) + 1
    return freq


def run(inputs, out, cfg=TRAIN, **kw) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    return train_draft(
        inputs, cfg, str(out / "ckpt"), str(out / "summary.json"), str(out / "metrics.csv"), **kw
    )


def train_losses(out) -> dict[int, float]:
    with open(out / "metrics.csv") as f:
        return {
            int(r["step"]): float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"
        }


@pytest.fixture(scope="module")
def baseline(pipeline, tmp_path_factory):
    """One uninterrupted run: the reference for the loss and resume tests."""
    _, inputs = pipeline
    out = tmp_path_factory.mktemp("baseline")
    return out, run(inputs, out)


# ---- vocab_map


def test_vocab_map_sizes_and_refusal(tmp_path):
    target = tmp_path / "t.target.json"
    target.write_text(json.dumps({"vocab_size": 100}))
    freq = tmp_path / "token_freq.pt"
    torch.save({5: 10, 7: 3, 9: 1, 42: 8, 99: 2}, freq)
    d2t, t2d = tmp_path / "d2t.4.npy", tmp_path / "t2d.4.npy"
    info = build_vocab_map(str(freq), 4, str(d2t), str(t2d), str(target))
    d, t = np.load(d2t), np.load(t2d)
    assert d.shape == (4,) and t.shape == (100,) and t.sum() == 4
    # the 4 most frequent supervised tokens, as speculators' offsets (target = i + d2t[i])
    assert sorted(int(i + o) for i, o in enumerate(d)) == [5, 7, 42, 99]
    assert info["distinct_supervised_tokens"] == 5 and info["supervised_coverage"] == 23 / 24

    with pytest.raises(
        TrainError, match=r"draft_vocab_size 6 .* 5 distinct supervised .*at most 5"
    ):
        build_vocab_map(
            str(freq), 6, str(tmp_path / "d2t.6.npy"), str(tmp_path / "t2d.6.npy"), str(target)
        )
    assert not (tmp_path / "d2t.6.npy").exists()

    torch.save({5: 1, 120: 1}, freq)
    with pytest.raises(TrainError, match="token id 120, outside the target's vocabulary of 100"):
        build_vocab_map(str(freq), 2, str(d2t), str(t2d), str(target))


# ---- refusals before any training


def _edited_cert(pipeline, tmp_path, edit) -> dict:
    _, inputs = pipeline
    cert = json.loads(open(inputs["certificate"]).read())
    edit(cert)
    path = tmp_path / "cert.json"
    path.write_text(json.dumps(cert))
    return {**inputs, "certificate": str(path)}


def test_training_without_certificate_refuses(pipeline, tmp_path):
    _, inputs = pipeline
    missing = {**inputs, "certificate": str(tmp_path / "none.json")}
    with pytest.raises(CertificateError, match="no layer certificate at .*run verify_layers"):
        run(missing, tmp_path)
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "ckpt").exists()


def test_training_refuses_when_its_checkpoints_do_not_fit(pipeline, tmp_path, monkeypatch):
    _, inputs = pipeline
    monkeypatch.setattr(disk, "free_bytes", lambda path: (300_000, Path(path)))  # < 1 checkpoint
    with pytest.raises(disk.DiskSpaceError, match=r"train_draft \(2 \+ 1 checkpoints of .* MB"):
        run(inputs, tmp_path)
    assert not (tmp_path / "summary.json").exists()
    assert not [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file() and p.suffix != ".txt"]


def test_certificate_for_other_ids_refuses(pipeline, tmp_path):
    def other_ids(c):
        c["aux_layers"], c["aux_layers_text"] = [0, 1, 2], "[embed, 1, 2]"

    with pytest.raises(
        CertificateError, match=r"proves layers \[embed, 1, 2\], not \[embed, 1, 3\]"
    ):
        run(_edited_cert(pipeline, tmp_path, other_ids), tmp_path)


def test_certificate_for_another_target_refuses(pipeline, tmp_path):
    root, inputs = pipeline
    tiny_llama(tmp_path / "other", num_layers=4, seed=1)
    other = {**inputs, "target": target_json(tmp_path / "other")}
    with pytest.raises(CertificateError, match="is for a target with weights_sha256"):
        run(other, tmp_path)


def test_certificate_for_another_extraction_refuses(pipeline, tmp_path):
    def other_manifest(c):
        c["manifest"]["sha256"] = "0" * 64

    with pytest.raises(TrainError, match="issued for another extraction"):
        run(_edited_cert(pipeline, tmp_path, other_manifest), tmp_path)


def test_settings_refuse_what_cannot_run():
    with pytest.raises(TrainError, match=r"train.gpus 2 but 0 CUDA device\(s\) are visible"):
        resolve_settings({**TRAIN, "gpus": 2}, cuda_available=True, device_count=0)
    with pytest.raises(TrainError, match="no CUDA device is visible"):
        resolve_settings({**TRAIN, "gpus": 1}, cuda_available=False)
    with pytest.raises(TrainError, match="no CPU backward"):
        resolve_settings({**TRAIN, "attn_implementation": "simple_flex_attention"}, False)
    with pytest.raises(TrainError, match="fused needs Triton"):
        resolve_settings({**TRAIN, "loss_implementation": "fused"}, False)
    cpu = resolve_settings(TRAIN, cuda_available=True)  # gpus 0: the CPU even beside a GPU
    assert (cpu["attn_implementation"], cpu["hidden_states_dtype"]) == ("sdpa", "float32")
    gpu = resolve_settings({**TRAIN, "gpus": 1}, cuda_available=True)
    assert (gpu["attn_implementation"], gpu["hidden_states_dtype"]) == (
        "simple_flex_attention",
        "bfloat16",
    )
    assert gpu["loss_implementation"] == "eager"


def test_compile_false_runs_compiled_functions_eagerly():
    """train.compile: false, as speculators' compiled draft sees it: a torch.compile'd function
    called inside runs eagerly (no graph reaches the backend); true leaves compiling on."""
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend)
    def on(x):
        return x * 2 + 1

    @torch.compile(backend=backend)
    def off(x):
        return x * 3 + 1

    with compiled(True):
        assert on(torch.ones(3)).tolist() == [3.0] * 3
    assert len(graphs) == 1
    with compiled(False):
        assert off(torch.ones(3)).tolist() == [4.0] * 3
    assert len(graphs) == 1, "compiled although train.compile is false"
    assert torch._dynamo.config.disable is False  # restored for whatever runs next


def test_kill_inside_a_checkpoint_swap_keeps_the_previous_checkpoint(tmp_path):
    """Killed between a swap's two renames: the old checkpoint comes back, the new half goes."""
    (tmp_path / ".partial-old-3").mkdir()
    (tmp_path / ".partial-old-3" / "model.safetensors").write_text("old")
    (tmp_path / ".partial-3").mkdir()  # the new one, maybe incomplete
    (tmp_path / ".partial-old-2").mkdir()
    (tmp_path / "2").mkdir()  # swap of 2 had finished: its leftover is dropped
    recover_swaps(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3"]
    assert (tmp_path / "3" / "model.safetensors").read_text() == "old"


# ---- training


@pytest.mark.slow
def test_training_loss_falls_and_summary(pipeline, baseline):
    _, inputs = pipeline
    out, summary = baseline
    losses = train_losses(out)
    steps = summary["steps"]
    assert sorted(losses) == list(range(1, steps + 1)) and steps >= 12
    first, last = (
        np.mean([losses[s] for s in (1, 2, 3)]),
        np.mean([losses[s] for s in range(steps - 2, steps + 1)]),
    )
    assert last < 0.9 * first, (first, last)

    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == metric_columns(3)
    vals = [r for r in rows if r["split"] == "val"]
    assert len(vals) == TRAIN["epochs"] and float(vals[-1]["loss"]) < float(vals[0]["loss"])

    assert summary["aux_layers"] == [0, 1, 3] and summary["device"].startswith("cpu")
    hs = summary["hidden_states"]
    assert hs["source"] == "shards" and hs["dtype"] == "float32" and hs["batches_hashed"] == steps
    assert len(hs["batches_sha256"]) == 64
    assert summary["tokens"] > 0 and summary["steps_per_s"] > 0 and summary["tokens_per_s"] > 0
    assert summary["best_val"]["loss"] == min(float(v["loss"]) for v in vals)
    assert summary["final_val"]["loss"] == pytest.approx(float(vals[-1]["loss"]))
    best = summary["best_checkpoint"]
    assert os.path.isabs(best) and str(out / "ckpt") in best  # the data root, not an output
    assert summary["best_checkpoint_sha256"] == sha256_file(os.path.join(best, "model.safetensors"))

    # The disk check's estimate, against what the run wrote (a resumable epoch, and the best)
    est = summary["disk_estimate"]
    epoch = max((p for p in Path(summary["run_dir"]).iterdir() if p.name.isdigit()), key=str)
    for what, folder in (("checkpoint", epoch), ("best", Path(best))):
        written = disk.folder_bytes(folder)
        print(f"disk estimate, {what}: {est[what]} bytes, written {written}")
        assert abs(est[what] - written) / written < 0.10, (what, est[what], written)

    # The checkpoint as speculators saves it, for the certificate's ids and flags both engines run.
    config = json.loads(open(os.path.join(best, "config.json")).read())
    assert config["architectures"] == ["Eagle3DraftModel"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    assert config["norm_before_residual"] is False and config["draft_vocab_size"] == DRAFT_VOCAB
    from speculators import Eagle3DraftModel

    model = Eagle3DraftModel.from_pretrained(
        best, verifier=json.load(open(inputs["target"]))["path"]
    )
    assert model.fc.weight.shape == (64, 3 * 64)

    # Provenance with every checkpoint.
    run_dir = out / "ckpt" / os.path.basename(summary["run_dir"])
    for folder in [run_dir / "best", *[p for p in run_dir.iterdir() if p.name.isdigit()]]:
        prov = json.loads((folder / "eagleflow_provenance.json").read_text())
        assert prov["aux_layers"] == [0, 1, 3] and prov["versions"]["speculators"] == "0.9.0"
        assert prov["train_config"]["lr"] == TRAIN["lr"] and "git" in prov and prov["argv"]
    assert len([p for p in run_dir.iterdir() if p.name.isdigit()]) <= TRAIN["keep_checkpoints"]

    # A rerun with the same settings finds the finished run and trains nothing more.
    again = run(inputs, out)
    assert again["steps"] == steps and again["resumed_from_step"] == steps
    assert train_losses(out) == losses


@pytest.mark.slow
def test_fp8_shards_train_through_speculators_fp8_reader(baseline, tmp_path):
    """extract.dtype fp8: the loader dequantizes (hs_connectors' FP8Transfer); the first step's
    loss (same seed, same init, no update yet) is the float32 run's within the rounding."""
    inputs, man, _ = training_inputs(tmp_path / "p", dict(EXTRACT, dtype="fp8"))
    assert man["dtype"] == "fp8"
    summary = run(inputs, tmp_path / "out", dict(TRAIN, max_steps=2))
    assert summary["hidden_states"]["source"] == "shards"
    assert summary["hidden_states"]["dtype"] == "fp8"
    first = train_losses(tmp_path / "out")[1]
    ref = train_losses(baseline[0])[1]
    assert first != ref and abs(first - ref) / ref < 0.02, (first, ref)


def _assert_same_losses(resumed: dict, reference: dict) -> None:
    assert sorted(resumed) == sorted(reference)
    worst = max(abs(resumed[s] - reference[s]) / abs(reference[s]) for s in reference)
    assert worst <= 1e-5, f"resumed losses differ from the uninterrupted run by {worst:.2e}"


@pytest.mark.slow
def test_sigterm_then_resume_matches_uninterrupted(pipeline, baseline, tmp_path):
    _, inputs = pipeline
    ref_out, ref = baseline

    def sigterm_at_6(step):
        if step == 6:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingInterrupted, match="SIGTERM at step 6: checkpoint saved"):
        run(inputs, tmp_path, on_step=sigterm_at_6)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler given back
    assert not (tmp_path / "summary.json").exists()
    summary = run(inputs, tmp_path)
    assert summary["resumed_from_step"] == 6 and summary["steps"] == ref["steps"]
    _assert_same_losses(train_losses(tmp_path), train_losses(ref_out))
    assert summary["best_val"]["loss"] == pytest.approx(ref["best_val"]["loss"], rel=1e-5)


@pytest.mark.slow
def test_crash_then_resume_from_last_checkpoint_matches(pipeline, baseline, tmp_path):
    """A crash (no chance to save) at step 7 resumes from the step-4 checkpoint, redoing 5-7."""
    _, inputs = pipeline
    ref_out, ref = baseline

    def crash_at_7(step):
        if step == 7:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        run(inputs, tmp_path, on_step=crash_at_7)
    summary = run(inputs, tmp_path)
    assert summary["resumed_from_step"] == 4  # the resume granularity: the last checkpoint
    _assert_same_losses(train_losses(tmp_path), train_losses(ref_out))
    assert summary["best_checkpoint_sha256"] == ref["best_checkpoint_sha256"] or (
        summary["best_val"]["loss"] == pytest.approx(ref["best_val"]["loss"], rel=1e-5)
    )


# ---- eagleflow clean on a real layout


def test_clean_lists_exactly_what_nothing_current_references(pipeline, baseline, tmp_path):
    import shutil

    from eagleflow import clean
    from eagleflow.extract.manifest import load_manifest

    root, inputs = pipeline
    out, summary = baseline
    # the layer ids were changed once: shards of the old ids, and a run trained on them
    old = tmp_path / "old-ids.json"
    old_ids = {**EXTRACT, "aux_layers": [1, 2]}
    stale_shards = extract(
        inputs["target"], inputs["dataset"], old_ids, str(root / "bulk"), str(old)
    )["root"]
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(out / "ckpt", ckpt)
    run_dir = ckpt / Path(summary["run_dir"]).name
    cur = {**summary, "run_dir": str(run_dir)}
    (tmp_path / "summary.json").write_text(json.dumps(cur))
    resume = ckpt / "resume-point"  # another config on the current shards: may resume
    shutil.copytree(run_dir, resume)
    stale_run = ckpt / "old-ids-run"
    shutil.copytree(run_dir, stale_run)
    for prov in stale_run.rglob(clean.PROVENANCE):
        p = json.loads(prov.read_text())
        prov.write_text(json.dumps({**p, "certificate_sha256": "0" * 64}))
    (ckpt / "just-started").mkdir()
    epochs = sorted((p for p in run_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert len(epochs) >= 2, "the baseline run must leave two resumable checkpoints"

    def plan(active_s=0.0):
        return clean.plan_folders(
            root / "bulk",
            ckpt,
            Path(inputs["manifest"]),
            Path(inputs["certificate"]),
            tmp_path / "summary.json",
            1,
            active_s,
        )

    # just written: a job may be running there, so nothing is a candidate yet
    assert plan(active_s=900)["remove"] == []
    p = plan()
    want = {str(Path(stale_shards)), str(stale_run), *map(str, epochs[:-1])}
    assert {r["path"] for r in p["remove"]} == want, clean.report(p)
    assert all(r["bytes"] > 0 for r in p["remove"])
    clean.apply(p)
    assert not Path(stale_shards).exists() and not stale_run.exists()
    load_manifest(inputs["manifest"], verify="size")  # the current shards are all there
    assert (run_dir / "best" / "model.safetensors").is_file() and epochs[-1].is_dir()
    assert resume.is_dir() and (ckpt / "just-started").is_dir()
    assert plan()["remove"] == []  # a second pass finds nothing


def test_clean_command_deletes_only_with_yes(tmp_path, capsys):
    from eagleflow import cli

    stale = tmp_path / "bulk" / "extract" / "0123456789abcdef"
    stale.mkdir(parents=True)
    (stale / "hs_0.safetensors").write_bytes(b"x" * 1000)
    for p in (stale / "hs_0.safetensors", stale):
        os.utime(p, (1e9, 1e9))  # long ago: no job is writing there
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(f"results_dir: {tmp_path / 'results'}\ndata_root: {tmp_path / 'bulk'}\n")
    base = str(efconfig.REPO_ROOT / "config" / "config.yaml")
    args = ["clean", "--configfile", base, "--configfile", str(overlay)]
    assert cli.main(args) == 0
    listed = capsys.readouterr().out
    assert f"remove    1.00 kB  {stale}" in listed and "rerun with --yes" in listed
    assert stale.is_dir()
    assert cli.main([*args, "--yes"]) == 0
    assert "freed 1.00 kB" in capsys.readouterr().out and not stale.exists()


def test_train_script_survives_being_imported_by_a_spawned_loader_worker():
    """train.num_workers > 0: torch's DataLoader spawns workers that import the Snakemake script
    again as __mp_main__, with no `snakemake` object; the script must do nothing then (on the lent
    H100 every worker died of a NameError, 2026-12-07)."""
    import runpy

    from tests.conftest import REPO

    script = REPO / "workflow" / "scripts" / "train_draft.py"
    runpy.run_path(str(script), run_name="__mp_main__")  # no NameError: nothing ran
    with pytest.raises(NameError, match="snakemake"):
        runpy.run_path(str(script), run_name="__main__")  # the real run needs Snakemake's object
