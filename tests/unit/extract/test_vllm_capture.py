"""vLLM's extract_hidden_states capture: the layer ids it accepts, and the two tests that run a
real vLLM CPU engine in-process (the vllm extraction backend, the certificate's engine check),
on one engine for the module: a start costs ~25-40 s on 2 cores, and both ask for the same one.

That vLLM's capture equals HF's hidden states layer by layer is test_vllm_backend_matches_hf_backend
below (the vllm backend's shards against the hf backend's, which test_hf.py's
test_shards_hold_the_configured_layers_and_the_pre_norm_final_slot checks against HF's own
output_hidden_states).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from eagleflow.errors import EagleflowError
from eagleflow.extract import hf as extract
from eagleflow.extract import vllm_capture
from eagleflow.extract.certificate import verify_layers
from eagleflow.extract.hf import extract_hidden_states
from eagleflow.extract.vllm_capture import VllmCapture, check_layer_ids
from tests.support.tiny import target_json, tiny_dataset, tiny_llama
from tests.unit.extract.test_certificate import EXTRACT, VERIFY
from tests.unit.extract.test_hf import CFG, run

N_LAYERS = 4
# What both callers open for the tiny target's aux ["embed", 1, 3] (test_hf's CFG and
# test_certificate's EXTRACT): the ids + vLLM's id L (the final slot), the target's run dtype.
IDS, DTYPE, KWARGS = [0, 1, 3, N_LAYERS], "float32", {"trust_remote_code": False}


def test_layer_ids_are_checked():
    assert check_layer_ids([4, 0, 1, 0], N_LAYERS) == [0, 1, 4]
    for bad in ([], [5], [-1], [1.0]):
        with pytest.raises(EagleflowError, match="layer_ids"):
            check_layer_ids(bad, N_LAYERS)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The 4-layer tiny Llama (test_hf's and test_certificate's, same seed), its dataset, and
    one real vLLM CPU capture engine on it, opened as the extraction backend and the
    certificate's engine check open theirs."""
    root = tmp_path_factory.mktemp("vllm-capture")
    tiny_llama(root / "target", num_layers=N_LAYERS)
    tiny_dataset(root / "ds")
    path = json.loads(open(target_json(root / "target")).read())["path"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM CPU's default takes a large share
        cap = VllmCapture(path, IDS, dtype=DTYPE, **KWARGS).__enter__()
    try:
        yield root, cap
    finally:
        cap.close()


@pytest.fixture
def shared_engine(engine, monkeypatch):
    """The module's engine in place of a fresh one: each VllmCapture the code under test opens
    must ask for exactly the engine the module started (model, ids, dtype, engine arguments),
    and is recorded (so a test also proves the vLLM path ran)."""
    root, cap = engine
    opened = []

    def reuse(model_dir, layer_ids, dtype="float32", **kwargs):
        asked = (model_dir, list(layer_ids), dtype, kwargs)
        assert asked == (cap.model_dir, cap.layer_ids, cap.dtype, KWARGS), asked
        opened.append(asked)
        return contextlib.nullcontext(cap)  # the module closes it

    monkeypatch.setattr(vllm_capture, "VllmCapture", reuse)
    return root, opened


@pytest.mark.slow
def test_vllm_backend_matches_hf_backend(shared_engine, tmp_path):
    """backend vllm (vLLM's own capture; id L = the final slot) writes the same shards as hf."""
    llama, opened = shared_engine
    hf = run(llama, tmp_path)
    v = run(llama, tmp_path, dict(CFG, backend="vllm"), name="v.json")
    assert opened and v["root"] != hf["root"] and v["backend"] == "vllm"
    for r in range(6):
        torch.testing.assert_close(
            extract.load_shard(v, r)["hidden_states"],
            extract.load_shard(hf, r)["hidden_states"],
            atol=1e-4,
            rtol=1e-4,
        )


@pytest.mark.slow
def test_engine_capture_check_with_vllm(shared_engine, tmp_path):
    """vLLM CPU's own capture of the probe tokens agrees with the shards (final slot included)."""
    root, opened = shared_engine
    ds = str(root / "ds")
    manifest = tmp_path / "manifest.json"
    extract_hidden_states(
        target_json(root / "target"), ds, EXTRACT, str(tmp_path / "bulk"), str(manifest)
    )
    out = tmp_path / "c.json"
    result = verify_layers(
        target_json(root / "target"),
        ds,
        str(manifest),
        dict(VERIFY, engine_check=True),
        EXTRACT,
        "0.5.23",
        str(out),
    )
    check = {c["name"]: c for c in result["checks"]}["engine_capture"]
    assert opened and check["ran"] and check["passed"] and check["engine"] == "vllm"
    assert check["ids_sent"] == [0, 1, 3, 4]  # vLLM's id L = the last layer before the norm
    assert check["max_rel_err"] < 1e-5
