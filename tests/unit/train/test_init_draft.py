"""train.init_from: fine-tuning from an existing EAGLE-3 draft, on a tiny random target.

The module trains one draft with train_draft (a fresh, random-init run), exports it in both
formats with export_draft, and starts training from each export: the model built from an export
gives the trained draft's logits, and a run started from it begins below the fresh run's first
loss. Drafts that do not fit (shifted ids, another hidden size or target vocabulary, another
config) are refused, naming the differences, before anything trains. The renaming SGLang →
speculators is checked against export's own, both ways.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from eagleflow.drafts import (
    _LAYER_TENSORS,
    SGLANG_DROPPED,
    sglang_names,
    speculators_name,
    speculators_tensors,
)
from eagleflow.errors import TrainError
from eagleflow.target.prepare import load_target_json
from eagleflow.train.export import ExportError, export_draft, sglang_tensors
from eagleflow.train.loop import draft_model
from eagleflow.train.vocab import build_vocab_map
from tests.support.tiny import packed_batch, tiny_llama
from tests.unit.train.test_loop import TRAIN, run, train_losses, training_inputs

AUX = [1, 2, 3]  # SGLang's Llama rule writes [0, 1, 2]; the embedding (id 0) it cannot capture
EXTRACT = {"backend": "hf", "aux_layers": AUX, "batch_tokens": 512, "dtype": "float32"}
DRAFT_VOCAB = 64
FRESH = {**TRAIN, "max_steps": 24, "save_every_steps": 1000}
FORMATS = ("speculators", "sglang")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Target, shards, certificate, vocab map; a fresh trained draft and its two exports."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("init_from")
    inputs, man, info = training_inputs(root, EXTRACT)
    target, cert, freq = inputs["target"], inputs["certificate"], root / "token_freq.pt"
    fresh = root / "fresh"
    summary = run(inputs, fresh, FRESH)
    exports = root / "exports"
    export_draft(
        target,
        str(cert),
        str(fresh / "summary.json"),
        FRESH,
        info["name"],
        str(exports / "speculators"),
        str(exports / "sglang"),
    )
    return {
        "root": root,
        "inputs": inputs,
        "freq": str(freq),
        "manifest": man,
        "fresh": fresh,
        "summary": summary,
        "exports": {fmt: exports / fmt for fmt in FORMATS},
    }


def _vocab_from(built, folder: Path, out: Path, size: int = DRAFT_VOCAB) -> dict:
    """What the vocab_map rule writes with train.init_from: the draft's own d2t / t2d."""
    out.mkdir(parents=True, exist_ok=True)
    d2t, t2d = out / f"d2t.{size}.npy", out / f"t2d.{size}.npy"
    build_vocab_map(
        built["freq"], size, str(d2t), str(t2d), built["inputs"]["target"], init_from=str(folder)
    )
    return {**built["inputs"], "d2t": str(d2t), "t2d": str(t2d)}


def _probe(built) -> dict:
    """The validation rows as one packed batch, as speculators' collate builds it."""
    import datasets

    data = datasets.load_from_disk(built["inputs"]["dataset"]).with_format(None)
    rows = range(12, len(data))  # val_fraction 0.25 of 16: the last four rows
    batch = packed_batch(built["manifest"], {r: data[r]["loss_mask"] for r in rows}, len(AUX))
    batch.pop("verifier_last_hidden_states")
    return batch


def _logits(model, probe) -> torch.Tensor:
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    model.eval()
    with torch.no_grad():
        model(**probe, ttt_steps=TRAIN["ttt_steps"])
    hook.remove()
    return torch.stack(seen)


def _trained_model(built):
    """The fresh run's best checkpoint, loaded by speculators' own from_pretrained."""
    from speculators import Eagle3DraftModel
    from torch.nn.attention.flex_attention import create_mask

    target = load_target_json(built["inputs"]["target"])
    model = Eagle3DraftModel.from_pretrained(
        built["summary"]["best_checkpoint"], verifier=target["path"]
    )
    model.config.transformer_layer_config._attn_implementation = "sdpa"  # as CPU training
    model._attn_impl, model._create_mask_fn = "sdpa", create_mask
    return model.float()


# ---- a matching draft: its vocab map, its weights, its head start


@pytest.mark.parametrize("fmt", FORMATS)
def test_vocab_map_is_the_drafts_own(built, fmt, tmp_path):
    inputs = _vocab_from(built, built["exports"][fmt], tmp_path)
    for name in ("d2t", "t2d"):  # SGLang's export has no t2d: rebuilt from d2t, identical
        have, want = np.load(inputs[name]), np.load(built["inputs"][name])
        assert have.dtype == want.dtype and np.array_equal(have, want), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_from_export_gives_the_trained_logits(built, fmt, tmp_path):
    inputs = _vocab_from(built, built["exports"][fmt], tmp_path)
    target = load_target_json(inputs["target"])
    cfg = {**FRESH, "init_from": str(built["exports"][fmt])}
    model = draft_model(target, AUX, cfg, "sdpa", inputs["d2t"], inputs["t2d"])
    reference = _trained_model(built)
    if fmt == "sglang":  # the SGLang export is bfloat16: compare with the draft rounded so
        with torch.no_grad():
            for name, t in reference.state_dict().items():
                if t.is_floating_point() and not name.startswith(("embed_tokens", "verifier_")):
                    t.copy_(t.to(torch.bfloat16).float())
    probe = _probe(built)
    got, want = _logits(model, probe), _logits(reference, probe)
    assert got.shape == (TRAIN["ttt_steps"], 1, probe["input_ids"].shape[1], DRAFT_VOCAB)
    assert torch.equal(got, want)
    assert want.abs().max() > 0
    # and a fresh draft, built the same way without init_from, does not
    fresh = draft_model(target, AUX, FRESH, "sdpa", inputs["d2t"], inputs["t2d"])
    assert not torch.allclose(_logits(fresh, probe), want)


def test_training_from_either_export_starts_below_a_fresh_draft(built, tmp_path):
    fresh_first = train_losses(built["fresh"])[1]
    keys = {Path(built["summary"]["run_dir"]).name}
    for fmt in FORMATS:
        inputs = _vocab_from(built, built["exports"][fmt], tmp_path / fmt / "vocab")
        cfg = {**FRESH, "init_from": str(built["exports"][fmt]), "max_steps": 1}
        summary = run(inputs, tmp_path / fmt, cfg)
        first = train_losses(tmp_path / fmt)[1]
        print(f"{fmt}: first loss {first:.4f} from the export, {fresh_first:.4f} fresh")
        assert first < 0.8 * fresh_first, (fmt, first, fresh_first)
        init = summary["init_from"]
        assert init["format"] == fmt and init["path"] == str(built["exports"][fmt].resolve())
        assert [f for f, _ in init["weights_sha256"]] == ["model.safetensors"]
        keys.add(Path(summary["run_dir"]).name)
    assert len(keys) == 3  # another init draft (or none) is another run: never resumed into


# ---- drafts that do not fit: refused before anything trains


def _edited(built, tmp_path, fmt, edit) -> Path:
    folder = tmp_path / f"edited-{fmt}"
    shutil.copytree(built["exports"][fmt], folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _assert_training_refused(built, tmp_path, folder, match, **over):
    cfg = {**FRESH, "init_from": str(folder), **over}
    with pytest.raises(TrainError, match=match) as e:
        run(built["inputs"], tmp_path / "out", cfg)
    assert not (tmp_path / "out" / "ckpt").exists()  # not even a run folder
    assert not (tmp_path / "out" / "summary.json").exists()
    return str(e.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_shifted_layer_ids_are_refused(built, tmp_path, fmt):
    def shift(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
        cfg["eagleflow"]["trained_aux_layers"] = [0, 1, 2]

    folder = _edited(built, tmp_path, fmt, shift)
    msg = _assert_training_refused(
        built,
        tmp_path,
        folder,
        r"layer ids: the draft was trained on hidden states of \[embed, 1, 2\] .*the layer "
        r"certificate proves \[1, 2, 3\] for these shards\. Fix: set extract.aux_layers to "
        r"\[embed, 1, 2\]",
    )
    assert f"train.init_from {folder} does not fit this target and layer certificate" in msg


def test_draft_for_another_hidden_size_is_refused(built, tmp_path):
    """A real (random) speculators draft for a target of hidden size 128."""
    from speculators import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    tiny_llama(tmp_path / "wide", num_layers=4, hidden=128)
    layer_cfg = create_transformer_layer_config(
        str(tmp_path / "wide"), 1, "llama", "silu", None, [0]
    )
    d2t, t2d = (torch.from_numpy(np.load(built["inputs"][k])) for k in ("d2t", "t2d"))
    draft = Eagle3DraftModel.from_training_args(
        layer_cfg,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=str(tmp_path / "wide"),
        target_layer_ids=AUX,
        draft_attn_impl="sdpa",
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=False,
        norm_before_fc=True,
        norm_output=True,
        ttt_steps=3,
    )
    draft.save_pretrained(tmp_path / "wide-draft")
    _assert_training_refused(
        built,
        tmp_path,
        tmp_path / "wide-draft",
        r"hidden size: the draft has 128 \(config.json transformer_layer_config hidden_size\), "
        r"the target has 64\. Fix: point train.init_from at a draft made for this target",
    )
    with pytest.raises(TrainError, match="hidden size: the draft has 128"):  # vocab_map, too
        _vocab_from(built, tmp_path / "wide-draft", tmp_path / "vocab")


def test_draft_for_another_target_vocabulary_is_refused(built, tmp_path):
    folder = _edited(built, tmp_path, "sglang", lambda c: c.update(vocab_size=512))
    match = (
        r"target vocabulary: the draft was made for 512 tokens \(config.json vocab_size\), the "
        r"target has 256\. Fix: point train.init_from at a draft made for this target"
    )
    with pytest.raises(TrainError, match=match):
        _vocab_from(built, folder, tmp_path / "vocab")
    assert not list((tmp_path / "vocab").iterdir())
    _assert_training_refused(built, tmp_path, folder, match)


def test_draft_vocab_size_and_flags_must_be_the_drafts(built, tmp_path):
    folder = built["exports"]["speculators"]
    with pytest.raises(
        TrainError,
        match=r"train.draft_vocab_size is 32, but the draft in train.init_from .* has a "
        r"vocabulary of 64 tokens, which fine-tuning keeps; set train.draft_vocab_size: 64",
    ):
        _vocab_from(built, folder, tmp_path / "vocab", size=32)
    msg = _assert_training_refused(
        built,
        tmp_path,
        folder,
        r"train.norm_output: the draft has true, the config says false\. Fix: set "
        r"train.norm_output: true",
        norm_output=False,
        draft_layers=2,
    )
    assert "train.draft_layers: the draft has 1, the config says 2" in msg


def test_tensors_that_do_not_land_are_named(built, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "extra"
    shutil.copytree(built["exports"]["sglang"], folder)
    t = load_file(str(folder / "model.safetensors"))
    t["midlayer.self_attn.q_norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    del t["norm.weight"]
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    inputs = _vocab_from(built, folder, tmp_path / "vocab")
    target = load_target_json(inputs["target"])
    with pytest.raises(
        TrainError,
        match=r"tensors with no place in the model: \['layers.0.self_attn.q_norm.weight'\]; "
        r"model tensors the draft does not set: \['norm.weight'\]",
    ):
        cfg = {**FRESH, "init_from": str(folder)}
        draft_model(target, AUX, cfg, "sdpa", inputs["d2t"], inputs["t2d"])


# ---- the renaming SGLang -> speculators is the inverse of the export's


def _speculators_names(num_layers: int) -> list[str]:
    """The tensors of a speculators Eagle3 llama checkpoint with `num_layers` layers."""
    names = ["fc.weight", "norm.weight", "lm_head.weight", "input_norm.weight", "d2t", "t2d"]
    names += ["embed_tokens.weight"]
    for i in range(num_layers):
        names += [f"layers.{i}.{t}" for t in _LAYER_TENSORS if i == 0 or t != "hidden_norm.weight"]
    return names


@pytest.mark.parametrize("num_layers", [1, 2])
def test_renaming_round_trip_from_speculators_names(num_layers):
    kept = [n for n in _speculators_names(num_layers) if n not in SGLANG_DROPPED]
    for name in kept:
        back = [speculators_name(s) for s in sglang_names(name, num_layers)]
        assert back[0] == name and all(b is None for b in back[1:]), (name, back)
    # the tensors themselves: export's renaming, then ours, gives the checkpoint back
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(4, generator=g) for n in _speculators_names(num_layers)}
    tensors["d2t"] = torch.arange(4)
    ckpt = {
        "transformer_layer_config": {"num_hidden_layers": num_layers, "vocab_size": 8},
        "eagle_aux_hidden_state_layer_ids": AUX,
        "draft_vocab_size": 4,
        "norm_before_fc": True,
    }
    back = speculators_tensors(sglang_tensors(tensors, ckpt))
    assert sorted(back) == sorted(kept)
    for n in kept:
        assert torch.equal(back[n], tensors[n].to(back[n].dtype)), n


@pytest.mark.parametrize("prefix", ["midlayer", "layers.0"])
def test_renaming_round_trip_from_sglang_names(prefix):
    """SGLang loads a one-layer draft's layer as `midlayer.*` or `layers.0.*`: both come back
    as speculators' `layers.0.*`, which the export writes as `midlayer.*`."""
    for t in _LAYER_TENSORS:
        name = speculators_name(f"{prefix}.{t}")
        assert name == f"layers.0.{t}"
        assert sglang_names(name, 1) == [f"midlayer.{t}"]
    for name in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "input_norm.weight"):
        assert speculators_name(name) == name and sglang_names(name, 1) == [name]
    assert speculators_name("aux_norm_mid.weight") == "fc_norm.1.weight"  # SGLang's legacy alias
    # a later layer's two input norms are one speculators tensor
    assert speculators_name("layers.1.hidden_norm.weight") is None
    assert speculators_name("layers.0.hidden_norm.weight") == "layers.0.hidden_norm.weight"


def test_renaming_refuses_what_has_no_single_speculators_tensor():
    one = torch.ones(4)
    with pytest.raises(ExportError, match=r"two tensors become layers.0.mlp.up_proj.weight"):
        speculators_tensors(
            {"midlayer.mlp.up_proj.weight": one, "layers.0.mlp.up_proj.weight": one}
        )
    with pytest.raises(
        ExportError,
        match=r"layers.1.hidden_norm.weight and layers.1.input_layernorm.weight differ",
    ):
        speculators_tensors(
            {"layers.1.input_layernorm.weight": one, "layers.1.hidden_norm.weight": 2 * one}
        )
    # only SGLang's copy: it is the layer's input norm
    got = speculators_tensors({"layers.1.hidden_norm.weight": one})
    assert list(got) == ["layers.1.input_layernorm.weight"]
