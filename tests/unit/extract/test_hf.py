"""Hidden-state extraction (hf backend) on tiny random targets: layout, final slot, resume."""

import json
import os
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagleflow.extract import hf as extract
from eagleflow.extract.hf import extract_hidden_states, safetensors_parts, token_batches
from eagleflow.extract.manifest import ManifestError, load_manifest
from tests.support.tiny import target_json, tiny_dataset, tiny_deepseek_v3, tiny_llama

CFG = {"backend": "hf", "aux_layers": ["embed", 1, 3], "batch_tokens": 40, "dtype": "float32"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    tiny_llama(root / "target", num_layers=4)
    return root


def run(root, tmp_path, cfg=CFG, name="m.json"):
    ds = root / "ds"
    if not ds.exists():
        tiny_dataset(ds)
    return extract_hidden_states(
        target_json(root / "target"), str(ds), cfg, str(tmp_path / "bulk"), str(tmp_path / name)
    )


def reference(model_dir, ids):
    """HF hidden_states[k] for k < L and the last layer's output before the final norm."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    grabbed = {}
    model.model.layers[-1].register_forward_hook(
        lambda m, a, o: grabbed.__setitem__("x", o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        out = model.model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states, grabbed["x"][0]


def test_token_batches_respect_budget():
    lengths = {0: 12, 1: 7, 2: 20, 3: 5, 4: 16, 5: 9}
    batches = token_batches(lengths, 40)
    assert sorted(r for b in batches for r in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or max(lengths[r] for r in b) * len(b) <= 40
    assert token_batches({0: 100}, 10) == [[0]]  # one over-long sample still gets a batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "fp8"])
def test_shard_bytes_are_what_safetensors_writes(dtype):
    """Shards are written from host memory without `save`; the bytes must be the same."""
    from safetensors.torch import save

    for n in (1, 3, 20):  # header lengths that need different padding
        ids = torch.randint(0, 1000, (n,))
        tensors = extract.shard_tensors(ids, torch.randn(n, 4, 24), dtype)
        assert len(tensors) == (3 if dtype == "fp8" else 2)
        assert b"".join(safetensors_parts(tensors)) == save(tensors)


def test_shards_hold_the_configured_layers_and_the_pre_norm_final_slot(llama, tmp_path):
    man = run(llama, tmp_path)
    assert man["layer_ids"] == [0, 1, 3] and man["num_samples"] == 6
    assert man["num_tokens"] == sum((12, 7, 20, 5, 16, 9))
    assert man["bytes_per_token"] > 4 * 64 * 4  # 4 fp32 slots of 64 + header
    shard = load_file(f"{man['root']}/hs_2.safetensors")
    ids = shard["token_ids"].tolist()
    assert len(ids) == 20 and shard["hidden_states"].shape == (20, 4, 64)
    hs, final = reference(str(llama / "target"), ids)
    for slot, k in enumerate([0, 1, 3]):
        torch.testing.assert_close(shard["hidden_states"][:, slot], hs[k][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(shard["hidden_states"][:, 3], final, atol=1e-5, rtol=1e-4)
    # HF's last entry is after the final norm (random weight here): it must not be the slot
    assert (shard["hidden_states"][:, 3] - hs[4][0]).abs().max() > 0.1


def test_fp8_shards_are_speculators_layout_within_e4m3_rounding_at_a_quarter_of_fp32(
    llama, tmp_path
):
    from hs_connectors import FP8Transfer

    from eagleflow import disk

    full = run(llama, tmp_path)
    fp8 = run(llama, tmp_path, dict(CFG, dtype="fp8"), name="f.json")
    assert fp8["root"] != full["root"] and fp8["dtype"] == "fp8"
    raw = load_file(f"{fp8['root']}/hs_2.safetensors")
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn
    assert raw["hidden_states"].shape == (20, 4, 64)
    assert raw["hidden_states_scales"].dtype == torch.float32
    assert raw["hidden_states_scales"].shape == (20, 1, 1)  # one scale per token
    reader = FP8Transfer(Path(fp8["root"]), dequantize_dtype=torch.float32)
    for r in range(6):
        got, ref = extract.load_shard(fp8, r), extract.load_shard(full, r)
        assert torch.equal(got["token_ids"], ref["token_ids"])
        exact = ref["hidden_states"]
        # speculators' own reader sees what the certificate sees
        torch.testing.assert_close(reader.get_cached(r)["hidden_states"], got["hidden_states"])
        # every value within half an e4m3 step (2^-4 of itself) plus the subnormal floor
        err = (got["hidden_states"] - exact).abs()
        floor = exact.abs().amax(dim=(1, 2), keepdim=True) / 448 * 2.0**-10
        assert (err <= exact.abs() * 2.0**-4 + floor + 1e-7).all(), r
        assert err.max() > 0  # it was quantized
    ratio = fp8["bytes"] / full["bytes"]
    assert 0.25 < ratio < 0.35, ratio  # 1 byte per value instead of 4, plus ids and scales
    est = disk.extraction_bytes([12, 7, 20, 5, 16, 9], 4, 64, "fp8")
    assert abs(est - fp8["bytes"]) / fp8["bytes"] < 0.01, (est, fp8["bytes"])


def test_resume_redoes_only_missing_shards(llama, tmp_path):
    first = run(llama, tmp_path)
    root = first["root"]
    before = {r: extract.load_shard(first, r)["hidden_states"] for r in range(6)}
    progress = tmp_path / "bulk" / root.rsplit("/", 1)[1] / extract.PROGRESS
    lines = progress.read_text().splitlines(keepends=True)
    kept = [json.loads(x)["row"] for x in lines[:3]]
    # a SIGKILL mid-write: three rows recorded, a torn fourth line, the rest never written
    progress.write_text("".join(lines[:3]) + lines[3][:10])
    folder = tmp_path / "bulk" / root.rsplit("/", 1)[1]
    mtimes = {r: (folder / f"hs_{r}.safetensors").stat().st_mtime_ns for r in kept}
    second = run(llama, tmp_path, name="m2.json")
    assert second["run"]["new_tokens"] == first["num_tokens"] - sum(
        first["shards"][r]["tokens"] for r in kept
    )
    for r in kept:
        assert (folder / f"hs_{r}.safetensors").stat().st_mtime_ns == mtimes[r]  # not rewritten
    # redone rows are batched differently (padding changes fp32 summation order), so compare values
    for r in range(6):
        torch.testing.assert_close(extract.load_shard(second, r)["hidden_states"], before[r])
        assert second["shards"][r]["tokens"] == first["shards"][r]["tokens"]


def test_different_ids_do_not_reuse_shards(llama, tmp_path):
    a = run(llama, tmp_path)
    b = run(llama, tmp_path, dict(CFG, aux_layers=[0, 2, 3]), name="b.json")
    assert a["root"] != b["root"] and b["run"]["new_tokens"] == b["num_tokens"]


def test_manifest_catches_missing_and_altered_shards(llama, tmp_path):
    man = run(llama, tmp_path)
    path = tmp_path / "m.json"
    load_manifest(path, verify="sha256")
    shard = f"{man['root']}/hs_1.safetensors"
    data = open(shard, "rb").read()
    with open(shard, "wb") as f:
        f.write(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    load_manifest(path, verify="size")
    with pytest.raises(ManifestError, match="does not match its sha256"):
        load_manifest(path, verify="sha256")
    with open(shard, "wb") as f:
        f.write(data[:100])
    with pytest.raises(ManifestError, match="has 100 bytes"):
        load_manifest(path)
    os.unlink(shard)
    with pytest.raises(ManifestError, match="is missing"):
        load_manifest(path)


def test_bad_ids_refused_before_any_work(llama, tmp_path):
    from eagleflow.layers import LayerError

    with pytest.raises(LayerError, match="'default' is \\[2, 2, 1\\] on this 4-layer"):
        run(llama, tmp_path, dict(CFG, aux_layers="default"))
    assert not (tmp_path / "m.json").exists()


def test_deepseek_v3_layout(tmp_path):
    tiny_deepseek_v3(tmp_path / "target", num_layers=8)
    man = run(tmp_path, tmp_path, dict(CFG, aux_layers="default"))
    assert man["layer_ids"] == [2, 4, 5]
    shard = extract.load_shard(man, 0)
    hs, final = reference(str(tmp_path / "target"), shard["token_ids"].tolist())
    for slot, k in enumerate(man["layer_ids"]):
        torch.testing.assert_close(shard["hidden_states"][:, slot], hs[k][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(shard["hidden_states"][:, -1], final, atol=1e-5, rtol=1e-4)


# ---- disk space, checked before the work


def test_space_estimate_is_within_a_percent_of_the_bytes_written(llama, tmp_path):
    from eagleflow import disk

    man = run(llama, tmp_path)
    written = sum(s["bytes"] for s in man["shards"])
    est = disk.extraction_bytes([12, 7, 20, 5, 16, 9], 4, 64, "float32")
    assert abs(est - written) / written < 0.01, (est, written)
    assert disk.extraction_bytes([12], 4, 64, "bfloat16") < disk.extraction_bytes(
        [12], 4, 64, "float32"
    )


def _extract_on_tmpfs(llama, tmp_path, size: str):
    """extract_hidden_states with data_root on a tmpfs of `size`, in a mount namespace."""
    import subprocess
    import sys

    from tests.conftest import REPO

    (tmp_path / "bulk").mkdir(parents=True)
    ds = llama / "ds"
    if not ds.exists():
        tiny_dataset(ds)
    code = (
        "import json, sys\n"
        "from eagleflow.extract.hf import extract_hidden_states\n"
        "from eagleflow.errors import EagleflowError\n"
        "try:\n"
        f"    extract_hidden_states({target_json(llama / 'target')!r}, {str(ds)!r}, {CFG!r}, "
        f"{str(tmp_path / 'bulk')!r}, {str(tmp_path / 'm.json')!r})\n"
        "except EagleflowError as e:\n"
        "    print('REFUSED', e); sys.exit(3)\n"
    )
    inner = (
        f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(tmp_path / 'bulk'))} && "
        f"exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}; "
    )
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs in a mount namespace needs root")
def test_small_data_root_is_refused_before_extraction_with_the_numbers(llama, tmp_path):
    proc = _extract_on_tmpfs(llama, tmp_path / "small", "64k")
    assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
    msg = proc.stdout
    assert "extract_hidden_states (6 rows, 4 slots x 64 x float32) needs" in msg, msg
    assert "MB margin" in msg and "free" in msg and "extract.dtype" in msg, msg
    # every choice with its bytes: the stores' sizes and the streamed modes
    from eagleflow import disk

    lengths = [12, 7, 20, 5, 16, 9]
    for d in ("float32", "bfloat16", "fp8"):
        size = disk.human_bytes(disk.extraction_bytes(lengths, 4, 64, d))
        assert f"{d} {size}" in msg, (d, size, msg)
    assert "extract.mode online" in msg and "hybrid" in msg, msg
    assert not (tmp_path / "small" / "m.json").exists()  # no manifest: nothing looks complete
    # the same run with room enough passes (the tmpfs is gone with its namespace)
    ok = _extract_on_tmpfs(llama, tmp_path / "big", "8m")
    assert ok.returncode == 0, ok.stdout + ok.stderr[-3000:]
    assert json.loads((tmp_path / "big" / "m.json").read_text())["num_samples"] == 6


def test_target_with_its_own_code_needs_and_gets_trust_remote_code(llama, tmp_path):
    """target.json carries target.trust_remote_code to the loaders; without it, a clear error."""
    from eagleflow.errors import EagleflowError
    from tests.support.tiny import tiny_custom_code_llama

    folder = tmp_path / "custom"
    tiny_custom_code_llama(folder)  # tiny_llama's weights (seed 0), its own model type
    ds = llama / "ds"
    if not ds.exists():
        tiny_dataset(ds)
    tj = Path(target_json(folder))
    info = json.loads(tj.read_text())
    with pytest.raises(EagleflowError, match=r"set target.trust_remote_code: true"):
        extract_hidden_states(str(tj), str(ds), CFG, str(tmp_path / "b1"), str(tmp_path / "1.json"))
    tj.write_text(json.dumps({**info, "trust_remote_code": True}))
    got = extract_hidden_states(
        str(tj), str(ds), CFG, str(tmp_path / "b2"), str(tmp_path / "2.json")
    )
    plain = run(llama, tmp_path)  # the same weights as a plain llama
    for r in range(6):
        torch.testing.assert_close(
            extract.load_shard(got, r)["hidden_states"],
            extract.load_shard(plain, r)["hidden_states"],
        )
