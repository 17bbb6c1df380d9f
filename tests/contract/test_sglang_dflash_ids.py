"""DFlash layer ids against SGLang 0.5.23's own code (run in .venv-sglang).

A native draft's `dflash_config.target_layer_ids` is what SGLang's DFLASH reads (it has no
speculators-format adapter); eagleflow writes `dflash.dflash_target_layer_ids(ids)` there, and
SGLang must then capture the layers the draft was trained on: `layers_to_capture` holds
"before layer c" ids, eagleflow's own convention. The ids `dflash.dflash_problems` refuses are
the ones SGLang refuses or cannot capture."""

import pytest

from eagleflow import dflash
from tests.contract.probe import run_probe

pytestmark = pytest.mark.contract

L = 30  # SmolLM2-135M's decoder layers
IDS = [2, 15, 27]


def test_sglang_captures_the_layers_eagleflow_trained_on(sglang_python):
    cases = {
        "plan": dflash.dflash_target_layer_ids(IDS),
        "embed": dflash.dflash_target_layer_ids([0, 15]),
        "final": dflash.dflash_target_layer_ids([15, L]),
    }
    got = run_probe(sglang_python, "sglang_dflash_probe.py", {"num_target_layers": L,
                                                              "cases": cases})  # fmt: skip
    assert got["version"] == "0.5.23" and got["loop_captures_before_layer"]
    plan = got["cases"]["plan"]
    assert plan["resolved"] == [1, 14, 26] and plan["layers_to_capture"] == IDS
    # id 0 (the embedding) is t = -1: SGLang refuses it, and so does eagleflow, first
    assert "out-of-range" in got["cases"]["embed"]["error"] and dflash.dflash_problems([0, 15], L)
    # id L is t = L - 1: SGLang accepts it but would capture "before layer L", a layer the
    # model does not have; eagleflow refuses it before any export
    final = got["cases"]["final"]
    assert final.get("layers_to_capture") == [15, L] and dflash.dflash_problems([15, L], L)
