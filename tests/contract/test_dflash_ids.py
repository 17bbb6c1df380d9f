"""DFlash layer ids against vLLM's own code, in both releases eagleflow serves with: 0.32 (this
machine's) and 0.26 (the lent GPU's, unpacked into .device/vllm-src by `make vllm-gpu-src`).

eagleflow's ids (k: the input of layer k) go into speculators' `aux_hidden_state_layer_ids`;
vLLM's speculators adapter (`update_dflash`) turns them into `eagle_aux_hidden_state_layer_ids`
(read first by the runner) and a native `dflash_config.target_layer_ids`; a native draft with
only `dflash_config` is read back by the runner with +1. `eagleflow.dflash` must write and read
what vLLM does, or a DFlash draft is fed the layers next to the ones it was trained on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagleflow import dflash
from tests.conftest import REPO

SRC = REPO / ".device" / "vllm-src"
IDS = [2, 15, 27]  # SmolLM2-135M's default plan (30 layers)
PROBE = r"""
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()  # the 0.26 CUDA build finds no device here
import json, sys
from tests.contract.test_dflash_ids import vllm_reads
print("RESULT " + json.dumps(vllm_reads(json.loads(sys.argv[1]))))
"""


def vllm_reads(ids: list[int]) -> dict:
    """What the imported vLLM's own adapter writes for speculators' `ids`, and what its runner
    captures from that config and from a native one (only `dflash_config`)."""
    import types

    import vllm
    from vllm.transformers_utils.configs.speculators.algos import update_dflash
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    pre: dict = {}
    update_dflash({"aux_hidden_state_layer_ids": ids, "mask_token_id": 2}, pre)

    def runner_reads(hf_config):
        fake = types.SimpleNamespace(speculative_config=types.SimpleNamespace(
            draft_model_config=types.SimpleNamespace(hf_config=hf_config)))  # fmt: skip
        return list(GPUModelRunner._get_eagle3_aux_layers_from_config(fake))

    written = pre["dflash_config"]["target_layer_ids"]
    native = types.SimpleNamespace(dflash_config={"target_layer_ids": written, "mask_token_id": 2})
    return {
        "version": vllm.__version__,
        "file": vllm.__file__,
        "eagle_aux": pre["eagle_aux_hidden_state_layer_ids"],
        "target_layer_ids": written,
        "runner_adapter": runner_reads(types.SimpleNamespace(**pre)),
        "runner_native": runner_reads(native),
    }


def _probe(pythonpath: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(IDS)],
        env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.contract
@pytest.mark.timeout(600)
@pytest.mark.parametrize("release", ["installed", "gpu-host"])
def test_vllm_reads_dflash_ids_as_eagleflow_writes_them(release):
    if release == "gpu-host":  # another vLLM than this venv's: in a child process
        assert (SRC / "vllm" / "__init__.py").is_file(), "run `make vllm-gpu-src` (make test does)"
        got = _probe([str(SRC), str(REPO / "src"), str(REPO)])
    else:
        got = vllm_reads(IDS)
    assert got["file"].startswith(str(SRC)) == (release == "gpu-host"), got["file"]
    # the adapter: speculators' ids pass through as the runner's ids, and the native field
    # is eagleflow's translation
    assert got["eagle_aux"] == IDS
    assert got["target_layer_ids"] == dflash.dflash_target_layer_ids(IDS) == [1, 14, 26]
    # the runner captures the same layers from the adapter's config and from a native one
    assert got["runner_adapter"] == IDS
    assert got["runner_native"] == IDS == dflash.ids_from_dflash_target_layer_ids([1, 14, 26])


def test_speculators_converter_reads_native_ids_as_eagleflow_does(tmp_path):
    """speculators' own z-lab converter turns a native draft's target_layer_ids into the aux
    ids its trainer and data path use (eagleflow's ids): the same +1 as
    `dflash.ids_from_dflash_target_layer_ids`."""
    from speculators.convert.dflash.converter import DFlashConverter
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=30, hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256).save_pretrained(
        tmp_path / "verifier")  # fmt: skip
    native = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "dflash_config": {"target_layer_ids": dflash.dflash_target_layer_ids(IDS),
                          "mask_token_id": 2},
    }  # fmt: skip
    cfg = DFlashConverter()._build_config(native, str(tmp_path / "verifier"), None)
    assert cfg.aux_hidden_state_layer_ids == IDS
