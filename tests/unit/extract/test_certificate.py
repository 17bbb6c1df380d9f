"""The layer certificate on tiny random targets: it passes on honest shards and refuses the
failures this project exists to catch (shifted layers, a post-norm final slot, config/shard
disagreement, another target)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleflow.extract.certificate import CertificateError, require_certificate, verify_layers
from eagleflow.extract.hf import extract_hidden_states, load_shard, shard_tensors
from eagleflow.extract.manifest import write_manifest
from eagleflow.target.prepare import sha256_file
from tests.support.tiny import target_json, tiny_dataset, tiny_deepseek_v3, tiny_llama

EXTRACT = {"backend": "hf", "aux_layers": ["embed", 1, 3], "batch_tokens": 64, "dtype": "float32"}
EXTRACT_FP8 = dict(EXTRACT, dtype="fp8")
VERIFY = {"probe_samples": 3, "engine_check": False, "hf_forward": True}


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    root = tmp_path_factory.mktemp("cert")
    tiny_llama(root / "target", num_layers=4)
    ds = tiny_dataset(root / "ds")
    man = extract_hidden_states(
        target_json(root / "target"), ds, EXTRACT, str(root / "bulk"), str(root / "manifest.json")
    )
    return root, ds, man


def certify(root, ds, manifest, tmp_path, extract=EXTRACT, version="0.5.23", verify=VERIFY):
    out = tmp_path / "layers.certificate.json"
    cert = verify_layers(
        target_json(root / "target"), ds, str(manifest), verify, extract, version, str(out)
    )
    assert json.loads(out.read_text()) == cert
    return cert


def tampered(extracted, tmp_path, edit):
    """A copy of the shards with `edit(hidden_states, token_ids)` applied, behind a new manifest."""
    root, ds, man = extracted
    folder = tmp_path / "shards"
    shutil.copytree(man["root"], folder)
    shards = []
    for i, s in enumerate(man["shards"]):
        t = load_file(str(folder / s["path"]))
        hs = edit(load_shard(man, i)["hidden_states"].clone(), t["token_ids"])
        # stored as extraction stores it (fp8: quantized again)
        tensors = shard_tensors(t["token_ids"], hs, man["dtype"])
        save_file(tensors, str(folder / s["path"]))
        shards.append(
            dict(
                s, bytes=(folder / s["path"]).stat().st_size, sha256=sha256_file(folder / s["path"])
            )
        )
    meta = {
        k: v for k, v in man.items() if k not in ("shards", "root", "num_shards", "bytes", "host")
    }
    write_manifest(tmp_path / "manifest.json", folder, shards, **meta)
    return tmp_path / "manifest.json"


def test_honest_shards_get_a_certificate(extracted, tmp_path):
    root, ds, _ = extracted
    cert = certify(root, ds, root / "manifest.json", tmp_path)
    assert cert["passed"] and cert["aux_layers"] == [0, 1, 3]
    assert cert["ids_per_engine"]["vllm"] == [0, 1, 3]
    assert cert["ids_per_engine"]["sglang"]["eagle_config_ids"] == [-1, 0, 2]
    checks = {c["name"]: c for c in cert["checks"]}
    assert checks["hf_forward_hooks"]["passed"] and checks["hf_forward_hooks"]["max_rel_err"] < 1e-4
    assert checks["final_slot_is_pre_norm"]["passed"]
    assert checks["token_ids_equal_input_ids"]["passed"]
    # checks that could not run say so instead of claiming a pass
    assert checks["engine_capture"] == {
        "name": "engine_capture",
        "ran": False,
        "passed": None,
        "reason": "verify.engine_check is false",
    }
    assert checks["sglang_rule"]["ran"] is False
    for slot in checks["hf_forward_hooks"]["per_row"][0]["slots"]:
        assert slot["nearest"] == slot["claimed"]


def test_post_norm_final_slot_is_refused(extracted, tmp_path):
    """HF's last hidden_states entry (after the final norm) must not pass as the final slot."""
    root, ds, _ = extracted
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(root / "target"), dtype=torch.float32)
    assert not torch.allclose(model.model.norm.weight, torch.ones(64))

    def post_norm(hs, ids):
        with torch.no_grad():
            out = model.model(ids[None], output_hidden_states=True)
        hs[:, -1] = out.hidden_states[-1][0]
        return hs

    with pytest.raises(CertificateError, match="claimed final.*matches post_norm best"):
        certify(root, ds, tampered(extracted, tmp_path, post_norm), tmp_path)
    assert not (tmp_path / "layers.certificate.json").exists()


@pytest.fixture(scope="module")
def extracted_fp8(extracted, tmp_path_factory):
    root, ds, _ = extracted
    out = tmp_path_factory.mktemp("fp8")
    man = extract_hidden_states(
        target_json(root / "target"), ds, EXTRACT_FP8, str(out / "bulk"), str(out / "m.json")
    )
    return root, ds, man


def test_fp8_shards_get_a_certificate_within_the_stated_rounding(extracted_fp8, tmp_path):
    root, ds, man = extracted_fp8
    manifest = Path(man["root"]).parents[1] / "m.json"  # <out>/bulk/<key>: written beside
    cert = certify(root, ds, manifest, tmp_path, EXTRACT_FP8)
    hooks = {c["name"]: c for c in cert["checks"]}["hf_forward_hooks"]
    assert hooks["tolerance_rel"] == 2.0**-4 + 1e-4  # e4m3's half step + float32 arithmetic
    assert 1e-3 < hooks["max_rel_err"] <= 2.0**-4, hooks["max_rel_err"]  # quantized, in bound
    assert cert["manifest"]["dtype"] == "fp8"


@pytest.mark.parametrize("store", ["float32", "fp8"])
def test_shifted_layers_are_refused(extracted, extracted_fp8, tmp_path, store):
    """Shards labelled [embed, 1, 3] holding layers [1, 2, 3]'s inputs: found and named."""
    root, ds, _ = extracted
    if store == "fp8":
        extracted = extracted_fp8
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(root / "target"), dtype=torch.float32)

    def shift(hs, ids):
        with torch.no_grad():
            out = model.model(ids[None], output_hidden_states=True)
        for slot, k in enumerate([1, 2, 3]):
            hs[:, slot] = out.hidden_states[k][0]
        return hs

    cfg = EXTRACT_FP8 if store == "fp8" else EXTRACT
    with pytest.raises(CertificateError) as e:
        certify(root, ds, tampered(extracted, tmp_path, shift), tmp_path, cfg)
    assert "slot 0 (claimed 0)" in str(e.value) and "matches 1 best" in str(e.value)


def test_config_and_shards_disagree(extracted, tmp_path):
    """The mission's failure at its root: shards of [embed, 1, 3], config says [1, 2, 3]."""
    root, ds, _ = extracted
    with pytest.raises(CertificateError) as e:
        certify(root, ds, root / "manifest.json", tmp_path, dict(EXTRACT, aux_layers=[1, 2, 3]))
    msg = str(e.value)
    assert "shards hold layers [embed, 1, 3]" in msg and "resolves to [1, 2, 3]" in msg


def test_token_ids_must_equal_the_dataset(extracted, tmp_path):
    root, _, _ = extracted
    other = tiny_dataset(tmp_path / "other", seed=1)
    with pytest.raises(CertificateError, match="token_ids_equal_input_ids"):
        certify(root, other, root / "manifest.json", tmp_path)


def test_require_certificate(extracted, tmp_path):
    root, ds, _ = extracted
    certify(root, ds, root / "manifest.json", tmp_path)
    target = json.loads(open(target_json(root / "target")).read())
    path = tmp_path / "layers.certificate.json"
    assert require_certificate(path, target, [0, 1, 3])["passed"]
    with pytest.raises(
        CertificateError, match="proves layers \\[embed, 1, 3\\], not \\[1, 2, 3\\]"
    ):
        require_certificate(path, target, [1, 2, 3])
    with pytest.raises(CertificateError, match="is for a target with config_sha256"):
        require_certificate(path, dict(target, config_sha256="0" * 64), [0, 1, 3])
    with pytest.raises(CertificateError, match="no layer certificate"):
        require_certificate(tmp_path / "missing.json", target)


def test_deepseek_v3_certificate(tmp_path):
    tiny_deepseek_v3(tmp_path / "target", num_layers=8)
    ds = tiny_dataset(tmp_path / "ds", lengths=(9, 14))
    cfg = dict(EXTRACT, aux_layers="default")
    extract_hidden_states(
        target_json(tmp_path / "target"), ds, cfg, str(tmp_path / "bulk"), str(tmp_path / "m.json")
    )
    cert = certify(tmp_path, ds, tmp_path / "m.json", tmp_path, cfg)
    assert cert["target"]["family"] == "deepseek" and cert["aux_layers"] == [2, 4, 5]
    assert cert["ids_per_engine"]["sglang"]["eagle_config_ids"] == [1, 3, 4]


BF16 = {"backend": "hf", "aux_layers": ["embed", 3, 6], "batch_tokens": 128, "dtype": "bfloat16"}
BF16_LENGTHS = (40, 23, 31, 9, 17, 36)  # batch_tokens 128: [40, 36, 31] and [23, 17, 9], padded
VERIFY_ALL = dict(VERIFY, probe_samples=len(BF16_LENGTHS))


@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory):
    """An 8-layer tiny Llama run in bfloat16, and a dataset of rows of different lengths."""
    root = tmp_path_factory.mktemp("bf16")
    tiny_llama(root / "target", num_layers=8)
    path = target_json(root / "target")
    info = json.loads(open(path).read())
    open(path, "w").write(json.dumps(dict(info, run_dtype="bfloat16")))
    return root, tiny_dataset(root / "ds", lengths=BF16_LENGTHS)


def batch1_errors(root, ds, manifest) -> float:
    """The worst slot error of the old reference: each row alone, unpadded."""
    import datasets

    from eagleflow.extract.certificate import compare_slots, hook_capture
    from eagleflow.extract.hf import load_hf_target, load_shard
    from eagleflow.extract.manifest import load_manifest

    model = load_hf_target(str(root / "target"), "bfloat16")
    data = datasets.load_from_disk(ds)
    man = load_manifest(manifest)
    worst = 0.0
    for r in range(len(data)):
        ref = hook_capture(model, torch.tensor([data[r]["input_ids"]]), man["layer_ids"])
        slots = compare_slots(load_shard(man, r)["hidden_states"], ref, man["layer_ids"], 1.0)
        worst = max(worst, *(s["rel_err"] for s in slots))
    return worst


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_bf16_reference_uses_the_extraction_batch(bf16_target, tmp_path, stored):
    """bf16 kernels differ with batch shape: the reference reruns each row's padded batch.

    Against a batch-1 unpadded forward the same honest shards are off by ~1e-2 of a value (on an
    H200 at 8B, past the bf16 tolerance); in their own batch they match exactly, so float32
    shards of a bf16 run (tolerance 1e-4), refused by the batch-1 reference, now pass too.
    """
    root, ds = bf16_target
    cfg = dict(BF16, dtype=stored)
    manifest = tmp_path / "m.json"
    extract_hidden_states(target_json(root / "target"), ds, cfg, str(tmp_path / "b"), str(manifest))
    cert = certify(root, ds, manifest, tmp_path, cfg, verify=VERIFY_ALL)
    check = {c["name"]: c for c in cert["checks"]}["hf_forward_hooks"]
    assert check["passed"] and check["reference"]["mode"] == "extraction_batch"
    shapes = {x["row"]: x["batch_shape"] for x in check["per_row"]}
    assert shapes == {0: [3, 40], 5: [3, 40], 2: [3, 40], 1: [3, 23], 4: [3, 23], 3: [3, 23]}
    assert check["max_rel_err"] == 0.0  # the extraction's own arithmetic, stored losslessly
    assert batch1_errors(root, ds, manifest) > 1e-3  # what the batch-1 reference sees

    # Shards whose batches cannot be rebuilt (engine backends) keep the batch-1 reference.
    body = json.loads(manifest.read_text())
    (tmp_path / "engine.json").write_text(json.dumps(dict(body, backend="vllm")))
    if stored == "float32":
        with pytest.raises(CertificateError, match="hf_forward_hooks: row .* rel err"):
            certify(root, ds, tmp_path / "engine.json", tmp_path, cfg, verify=VERIFY_ALL)
        return
    cert = certify(root, ds, tmp_path / "engine.json", tmp_path, cfg, verify=VERIFY_ALL)
    check = {c["name"]: c for c in cert["checks"]}["hf_forward_hooks"]
    assert check["reference"]["mode"] == "batch1_unpadded"
    assert "'vllm'" in check["reference"]["detail"]
    assert {tuple(x["batch_shape"]) for x in check["per_row"]} == {(1, n) for n in BF16_LENGTHS}
    assert check["max_rel_err"] > 1e-3


def test_sglang_capture_server_is_the_serving_command_plus_capture_flags():
    """The certificate's SGLang check starts SGLang as serving does (tp_size, extra_args such as
    --trust-remote-code for Kimi-K2.5), plus the aux-capture flags."""
    from eagleflow.extract.certificate import sglang_capture_command
    from eagleflow.extract.sglang_capture import LAYER_IDS_FLAG, SGLANG_AUX_CAPTURE_FLAGS

    opts = {"tp_size": 8, "extra_args": ["--trust-remote-code"]}
    cmd = sglang_capture_command("python", "/models/k", opts, 30000, [2, 30, 58])
    assert cmd[:5] == ["python", "-m", "sglang.launch_server", "--model-path", "/models/k"]
    assert "--trust-remote-code" in cmd and cmd[cmd.index("--tp-size") + 1] == "8"
    assert "--speculative-draft-model-path" not in cmd  # the target alone, no draft
    assert all(f in cmd for f in SGLANG_AUX_CAPTURE_FLAGS)
    assert cmd[cmd.index(LAYER_IDS_FLAG) + 1 :][:3] == ["2", "30", "58"]
