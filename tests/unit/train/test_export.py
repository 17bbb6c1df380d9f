"""export_draft on a tiny random target: both formats and their refusals.

The module builds once what the rule reads: a target, greedy continuations written by the target
itself, shards, a real layer certificate (verify_layers), and a draft trained for a few hundred
steps with speculators' own Eagle3DraftModel forward and loss, saved by speculators' own
checkpointer (bf16, exactly the Trainer's layout). Both exports are served by a real vLLM CPU
server in tests/unit/serve/test_served.py (the speculators export against the standalone check,
the SGLang export with shifted ids), on a trained SmolLM2 draft.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from eagleflow.drafts import SGLANG_DROPPED, sglang_names
from eagleflow.extract.certificate import CertificateError, verify_layers
from eagleflow.train.export import ExportError, checkpoint_sha256, export_draft, load_tensors
from tests.support.tiny import packed_batch, target_json, tiny_llama

N_LAYERS = 4
AUX = [1, 2, 3]  # internal ids; SGLang's Llama rule writes [0, 1, 2]
DRAFT_VOCAB = 128
TTT = 3
EXTRACT = {"backend": "hf", "aux_layers": AUX, "batch_tokens": 2048, "dtype": "float32"}
VERIFY = {"probe_samples": 2, "engine_check": False, "hf_forward": True}
TRAIN = {
    "draft_layers": 1,
    "draft_vocab_size": DRAFT_VOCAB,
    "ttt_steps": TTT,
    "norm_before_residual": False,
    "norm_before_fc": True,
    "fc_norm": False,
    "norm_output": True,
}
PROMPT, NEW = 6, 42
STEPS = 80


def greedy_dataset(model_dir: Path, folder: Path, n: int = 24, seed: int = 0) -> tuple[str, list]:
    """Prompts of random tokens continued greedily by the target (its own distribution)."""
    import datasets
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 256, (n, PROMPT), generator=g)
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )
    ids = out.tolist()
    masks = [[0] * PROMPT + [1] * NEW for _ in ids]
    ds = datasets.Dataset.from_dict(
        {"input_ids": ids, "loss_mask": masks, "seq_len": [len(x) for x in ids]}
    )
    ds.save_to_disk(str(folder))
    return str(folder), prompts.tolist()


def train_tiny_draft(
    target_dir: Path, manifest: dict, ds_path: str, run_dir: Path, steps: int, draft_layers: int
):
    """A draft trained with speculators' own model, loss and checkpointer (CPU, float32)."""
    import datasets
    from speculators import Eagle3DraftModel
    from speculators.losses.utils import resolve_loss_config
    from speculators.train.checkpointer import SingleGPUCheckpointer
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    torch.manual_seed(0)
    data = datasets.load_from_disk(ds_path).with_format(None)
    freq: dict[int, int] = {}
    for ids, mask in zip(data["input_ids"], data["loss_mask"], strict=True):
        for t, m in zip(ids, mask, strict=True):
            if m:
                freq[t] = freq.get(t, 0) + 1
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, 256)
    layer_cfg = create_transformer_layer_config(
        str(target_dir), draft_layers, "llama", None, 0, list(range(draft_layers))
    )
    model = Eagle3DraftModel.from_training_args(
        layer_cfg,
        t2d,
        d2t,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=TRAIN["norm_before_residual"],
        norm_before_fc=TRAIN["norm_before_fc"],
        norm_output=TRAIN["norm_output"],
        ttt_steps=TTT,
        verifier_name_or_path=str(target_dir),
        target_layer_ids=AUX,
        draft_attn_impl="sdpa",  # FlexAttention has no CPU backward
    )
    inputs = packed_batch(manifest, dict(enumerate(data["loss_mask"])), len(AUX))
    loss_cfg = resolve_loss_config("kl_div", "eager")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    first = last = None
    metrics = {}
    for _ in range(steps):
        _, loss, metrics = model(**inputs, ttt_steps=TTT, loss_config=loss_cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss.detach())
        last = float(loss.detach())
    model.eval()
    SingleGPUCheckpointer(run_dir).save_checkpoint(model, opt, 0)  # bf16, as the Trainer does
    acc = {
        f"full_acc_{i}": float(metrics[f"full_acc_{i}_sum"] / metrics[f"full_acc_{i}_total"])
        for i in range(TTT)
        if metrics
    }
    return run_dir / "0", {"first_loss": first, "final_loss": last, **acc}, inputs


def build_pipeline(root: Path, steps: int = STEPS, draft_layers: int = 1) -> dict:
    """Target, greedy data, shards, certificate, trained checkpoint and train summary."""
    from eagleflow.extract.hf import extract_hidden_states

    torch.set_num_threads(1)  # 2 shared cores; torch threads fight the other processes
    start = time.monotonic()
    target_dir = root / "target"
    info = tiny_llama(target_dir, num_layers=N_LAYERS)
    ds, prompts = greedy_dataset(target_dir, root / "ds")
    man = extract_hidden_states(
        target_json(target_dir), ds, EXTRACT, str(root / "bulk"), str(root / "manifest.json")
    )
    cert = root / "layers.certificate.json"
    verify_layers(
        target_json(target_dir),
        ds,
        str(root / "manifest.json"),
        VERIFY,
        EXTRACT,
        "0.5.23",
        str(cert),
    )
    ckpt, metrics, probe = train_tiny_draft(target_dir, man, ds, root / "run", steps, draft_layers)
    summary = root / "summary.json"
    summary.write_text(
        json.dumps(
            {
                "eagleflow_train_summary": 1,
                "best_checkpoint": str(ckpt),
                "best_checkpoint_sha256": checkpoint_sha256(ckpt),
                "best_epoch": 0,
                "best_step": steps,
                "best_val": metrics,
                "final_val": metrics,
                "steps": steps,
                "epochs": 1,
                "tokens": 24 * (PROMPT + NEW),
                "seconds": round(time.monotonic() - start, 1),
                "device": "cpu",
            }
        )
    )
    return {
        "root": root,
        "target": target_json(target_dir),
        "target_dir": target_dir,
        "info": info,
        "certificate": str(cert),
        "summary": str(summary),
        "checkpoint": ckpt,
        "metrics": metrics,
        "probe": probe,
        "prompts": prompts,
        "manifest": man,
        "dataset": ds,
        "train_cfg": {**TRAIN, "draft_layers": draft_layers},
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_pipeline(tmp_path_factory.mktemp("export"))


def run_export(built, out: Path, **over) -> dict:
    args = {
        "target_json": built["target"],
        "certificate": built["certificate"],
        "summary": built["summary"],
        "train_cfg": built["train_cfg"],
        "target_name": built["info"]["name"],
        "out_speculators": str(out / "speculators"),
        "out_sglang": str(out / "sglang"),
        **over,
    }
    return export_draft(**args)


@pytest.fixture(scope="module")
def exported(built, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports")
    run_export(built, out)
    return out


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_draft_trained(built):
    m = built["metrics"]
    assert m["final_loss"] < 0.2 * m["first_loss"], m
    assert m["full_acc_0"] > 0.4, m


def test_speculators_export_config(built, exported):
    cfg = _config(exported / "speculators")
    cert = json.loads(Path(built["certificate"]).read_text())
    assert cfg["architectures"] == ["Eagle3DraftModel"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == cert["ids_per_engine"]["vllm"] == AUX
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert cfg[flag] is TRAIN[flag], flag  # explicit: vLLM defaults a missing one to true
    prov = cfg["eagleflow"]
    assert prov["trained_aux_layers"] == AUX
    assert prov["target_num_layers"] == N_LAYERS
    assert prov["target_config_sha256"] == built["info"]["config_sha256"]
    assert prov["checkpoint_sha256"] == checkpoint_sha256(built["checkpoint"])
    assert len(prov["certificate_sha256"]) == 64
    files = sorted(p.name for p in (exported / "speculators").iterdir())
    assert files == ["README.md", "config.json", "config.py", "model.safetensors"]
    # the weights are the checkpoint's bytes: its sha256 is the provenance's
    assert checkpoint_sha256(exported / "speculators") == prov["checkpoint_sha256"]


def test_speculators_export_reloads_with_same_logits(built, exported):
    """SpeculatorModel.from_pretrained on the export = the checkpoint, logits on a probe batch."""
    from speculators import SpeculatorModel
    from torch.nn.attention.flex_attention import create_mask

    def logits(folder):
        model = SpeculatorModel.from_pretrained(str(folder))
        # sdpa as in CPU training (the saved default, simple_flex_attention, wants a GPU)
        model.config.transformer_layer_config._attn_implementation = "sdpa"
        model._attn_impl, model._create_mask_fn = "sdpa", create_mask
        model = model.float().eval()
        seen = []
        model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
        p = built["probe"]
        with torch.no_grad():
            model(
                **{k: p[k][:, :200] for k in p if k != "verifier_last_hidden_states"}, ttt_steps=TTT
            )
        return model, torch.stack(seen)

    orig_model, orig = logits(built["checkpoint"])
    exp_model, exp = logits(exported / "speculators")
    assert type(exp_model).__name__ == "Eagle3DraftModel"
    assert exp_model.config.eagle_aux_hidden_state_layer_ids == AUX
    assert orig.shape == (TTT, 1, 200, DRAFT_VOCAB)
    assert torch.equal(orig, exp)
    assert orig.abs().max() > 0


def test_sglang_export_config(built, exported):
    cfg = _config(exported / "sglang")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == 256 and cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert cfg["target_hidden_size"] == 64 and cfg["hidden_size"] == 64
    assert cfg["tie_word_embeddings"] is False
    assert cfg["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2],  # SGLang adds 1 (Llama files)
        "use_aux_hidden_state": True,
        "norm_before_fc": True,
    }
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM reads this one first
    assert (cfg["norm_before_residual"], cfg["fc_norm"], cfg["norm_output"]) == (
        False,
        False,
        True,
    )
    assert cfg["eagleflow"]["trained_aux_layers"] == AUX
    assert cfg["eagleflow"]["target_num_layers"] == N_LAYERS
    assert sorted(p.name for p in (exported / "sglang").iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]


def test_sglang_tensors_equal_checkpoint_under_renaming(built, exported):
    from safetensors import safe_open

    ckpt = load_tensors(built["checkpoint"])
    with safe_open(str(exported / "sglang" / "model.safetensors"), "pt") as f:
        out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    expected = {}
    for name, t in ckpt.items():
        for new in sglang_names(name, 1):
            expected[new] = t
    assert set(out) == set(expected)
    assert "midlayer.self_attn.q_proj.weight" in out and "layers.0.hidden_norm.weight" not in out
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "input_norm.weight"} <= set(out)
    assert {"t2d", "embed_tokens.weight"} & set(out) == set()
    for name, t in out.items():
        want = expected[name]
        if want.is_floating_point():
            assert t.dtype == torch.bfloat16, name
        assert torch.equal(t, want.to(t.dtype)), name
    assert set(ckpt) - {n for n in ckpt if sglang_names(n, 1)} <= set(SGLANG_DROPPED)


def test_sglang_names_of_a_two_layer_draft():
    assert sglang_names("layers.0.self_attn.q_proj.weight", 2) == [
        "layers.0.self_attn.q_proj.weight"
    ]
    # later layers: vLLM and speculators normalise with input_layernorm, SGLang with hidden_norm
    assert sglang_names("layers.1.input_layernorm.weight", 2) == [
        "layers.1.input_layernorm.weight",
        "layers.1.hidden_norm.weight",
    ]
    assert sglang_names("layers.0.hidden_norm.weight", 1) == ["midlayer.hidden_norm.weight"]
    assert sglang_names("t2d", 1) == [] and sglang_names("embed_tokens.weight", 1) == []


def test_model_cards(built, exported):
    for fmt in ("speculators", "sglang"):
        card = (exported / fmt / "README.md").read_text()
        assert built["info"]["name"] in card
        assert "| 0 | 1 | input of layer 1 (output of 0) | 1 | 0 |" in card
        assert "vllm.entrypoints.openai.api_server" in card and "sglang.launch_server" in card
        assert '"method": "eagle3"' in card
        assert "--speculative-algorithm EAGLE3" in card
        assert "--max-model-len 512" in card  # the tiny target's context
        assert "final_loss" in card
        assert "accept_length" not in card  # measured numbers belong to the report's cards
    spec_card = (exported / "speculators" / "README.md").read_text()
    assert str((exported / "speculators").resolve()) in spec_card
    assert f"--speculative-draft-model-path {(exported / 'sglang').resolve()}" in spec_card


def test_no_partial_exports_left(exported):
    assert sorted(p.name for p in exported.iterdir()) == ["sglang", "speculators"]


# ---- refusals: nothing is written


def _assert_refused(built, tmp_path, match, exc=ExportError, **over):
    out = tmp_path / "out"
    with pytest.raises(exc, match=match):
        run_export(built, out, **over)
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


def _edited_checkpoint(built, tmp_path, edit) -> str:
    folder = tmp_path / "ckpt"
    shutil.copytree(built["checkpoint"], folder)
    cfg = _config(folder)
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    summary = json.loads(Path(built["summary"]).read_text())
    summary["best_checkpoint"] = str(folder)
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    return str(path)


def test_refuses_norm_before_residual(built, tmp_path):
    summary = _edited_checkpoint(built, tmp_path, lambda c: c.update(norm_before_residual=True))
    _assert_refused(
        built,
        tmp_path,
        r"norm_before_residual is true, but SGLang's llama_eagle3 has no such option",
        summary=summary,
        train_cfg={**TRAIN, "norm_before_residual": True},
    )


def test_refuses_checkpoint_that_disagrees_with_train_config(built, tmp_path):
    _assert_refused(
        built,
        tmp_path,
        r"trained with norm_output=True, but train.norm_output is False",
        train_cfg={**TRAIN, "norm_output": False},
    )


def test_refuses_without_certificate(built, tmp_path):
    _assert_refused(
        built,
        tmp_path,
        r"no layer certificate at .*run verify_layers",
        exc=CertificateError,
        certificate=str(tmp_path / "none.json"),
    )


def test_refuses_certificate_for_other_ids(built, tmp_path):
    cert = json.loads(Path(built["certificate"]).read_text())
    cert["aux_layers"], cert["aux_layers_text"] = [0, 1, 3], "[embed, 1, 3]"
    path = tmp_path / "other.certificate.json"
    path.write_text(json.dumps(cert))
    _assert_refused(
        built,
        tmp_path,
        r"proves layers \[embed, 1, 3\], not \[1, 2, 3\]",
        exc=CertificateError,
        certificate=str(path),
    )


def test_refuses_certificate_without_sglang_ids(built, tmp_path):
    cert = json.loads(Path(built["certificate"]).read_text())
    cert["ids_per_engine"]["sglang"].update(eagle_config_ids=None, problems=["ids differ"])
    path = tmp_path / "nosglang.certificate.json"
    path.write_text(json.dumps(cert))
    _assert_refused(
        built, tmp_path, r"no SGLang ids for these layers: ids differ", certificate=str(path)
    )


def test_refuses_altered_checkpoint(built, tmp_path):
    summary = json.loads(Path(built["summary"]).read_text())
    summary["best_checkpoint_sha256"] = "0" * 64
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    _assert_refused(built, tmp_path, r"changed since training", summary=str(path))


def test_doctor_findings_fail_the_export(built, tmp_path, monkeypatch):
    """A finding of doctor (here: a draft config that claims another target) refuses it all."""
    from eagleflow.train import export as ex

    real = ex.sglang_config

    def shifted(*a, **k):
        cfg = real(*a, **k)
        cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]  # SGLang's ids where vLLM reads
        return cfg

    monkeypatch.setattr(ex, "sglang_config", shifted)
    _assert_refused(
        built, tmp_path, r"(?s)doctor refused the exports.*sglang export: vllm: MISMATCH layer ids"
    )


def test_refuses_extra_tensors_sglang_would_drop(built, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(built["checkpoint"], folder)
    t = load_file(str(folder / "model.safetensors"))
    t["layers.0.self_attn.q_norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    summary = json.loads(Path(built["summary"]).read_text())
    summary.update(best_checkpoint=str(folder), best_checkpoint_sha256=checkpoint_sha256(folder))
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    _assert_refused(
        built,
        tmp_path,
        r"would silently drop \['midlayer.self_attn.q_norm.weight'\]",
        summary=str(path),
    )
