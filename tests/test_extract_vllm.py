"""vLLM's extract_hidden_states capture equals an HF forward, layer by layer (tiny Llama)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from eagleflow.errors import EagleflowError
from eagleflow.extract_vllm import check_layer_ids
from tests.tiny import tiny_llama

N_LAYERS = 4
TOL = 1e-4  # fp32; observed max abs error ~2e-7 (vLLM CPU kernels vs HF eager)


def hf_reference(model_dir, ids: list[int]):
    """[T, L+1, H]: hidden_states[k] for k < L, then the last layer's output before the norm."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    final = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: final.setdefault("h", out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    hook.remove()
    return torch.stack([*hs[:N_LAYERS], final["h"]], dim=0)[:, 0].transpose(0, 1)


def test_layer_ids_are_checked():
    assert check_layer_ids([4, 0, 1, 0], N_LAYERS) == [0, 1, 4]
    for bad in ([], [5], [-1], [1.0]):
        with pytest.raises(EagleflowError, match="layer_ids"):
            check_layer_ids(bad, N_LAYERS)


@pytest.mark.slow
def test_vllm_capture_matches_hf(tmp_path, monkeypatch):
    import torch

    from eagleflow.extract_vllm import VllmCapture

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model_dir = str(tmp_path / "tiny")
    tiny_llama(Path(model_dir), num_layers=N_LAYERS, hidden=128)  # 2 heads of 64
    prompts = [[1, 17, 250, 3, 99, 42, 7], [1, 200, 5]]
    layer_ids = [3, 0, 4, 1]  # unsorted on purpose; 4 = L = the final pre-norm slot

    t0 = time.monotonic()
    with VllmCapture(model_dir, layer_ids, max_model_len=64, max_num_seqs=4) as cap:
        t1 = time.monotonic()
        got = cap.capture(prompts)
        t2 = time.monotonic()
        again = cap.capture(prompts[:1])  # the engine is reused; files do not collide
        storage = cap.storage_dir
    print(f"engine start {t1 - t0:.1f} s, capture {t2 - t1:.2f} s")
    assert not Path(storage).exists(), "temporary storage left behind"
    assert torch.equal(again[0], got[0])

    for ids, vllm_hs in zip(prompts, got, strict=True):
        ref = hf_reference(model_dir, ids)  # [T, L+1, H], HF index k at position k
        assert vllm_hs.shape == (len(ids), len(layer_ids), 128)
        assert vllm_hs.dtype == torch.float32
        err = (vllm_hs - ref[:, layer_ids]).abs().max().item()
        print(f"T={len(ids)} max abs err {err:.2e}")
        assert err < TOL
        # The check can fail: the neighbouring HF index (an off-by-one convention) is far off.
        for j, k in enumerate(layer_ids):
            nb = k - 1 if k == N_LAYERS else k + 1
            assert (vllm_hs[:, j] - ref[:, nb]).abs().max().item() > 100 * TOL
