"""DFlash's layer-id translation (the engines' own code holds it in tests/contract)."""

from eagleflow import dflash


def test_dflash_ids_translate_both_ways_and_refuse_what_sglang_cannot_capture():
    # a native dflash_config names the output of layer t: eagleflow's id t + 1
    assert dflash.dflash_target_layer_ids([2, 15, 27]) == [1, 14, 26]
    assert dflash.ids_from_dflash_target_layer_ids([1, 14, 26]) == [2, 15, 27]
    # z-lab's Qwen3-8B draft (36 layers): target_layer_ids [1, 9, 17, 25, 33] are speculators'
    # aux ids [2, 10, 18, 26, 34] (speculators' own converter test expects the same)
    assert dflash.ids_from_dflash_target_layer_ids([1, 9, 17, 25, 33]) == [2, 10, 18, 26, 34]
    assert dflash.dflash_problems([2, 15, 27], 30) == []
    embed, last = dflash.dflash_problems([0, 15], 30), dflash.dflash_problems([15, 30], 30)
    assert len(embed) == 1 and "id 0 is outside 1..29" in embed[0] and "t = id - 1 = -1" in embed[0]
    assert len(last) == 1 and "id 30 is outside 1..29" in last[0]
    assert "distinct and ascending" in dflash.dflash_problems([15, 2], 30)[0]


def _config(**draft) -> dict:
    import yaml

    from eagleflow import config as cfg
    from tests.conftest import REPO

    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    return cfg.deep_merge(base, {"draft": {"algorithm": "dflash", "dflash": draft}})


def test_a_dflash_config_is_refused_where_a_block_draft_cannot_follow_it():
    import pytest

    from eagleflow import config as cfg
    from eagleflow.errors import ConfigError

    assert cfg.validate(_config(block_size=8))["draft"]["dflash"]["layers"] == 5  # defaults
    bad = cfg.deep_merge(
        _config(block_size=4, loss_fn="kl_div"),
        {"serve": {"speculative": [{"name": "s5", "num_steps": 5, "topk": 2}]}},
    )
    bad["extract"]["aux_layers"] = [0, 15, 27]
    with pytest.raises(ConfigError) as e:
        cfg.validate(bad)
    text = str(e.value)
    assert "dpace" in text and "loss_fn ce, not 'kl_div'" in text
    assert "num_steps 5 exceeds" in text and "num_steps <= 3" in text
    assert "topk 2" in text and "id 0 (the embedding output)" in text
    # EAGLE-3 (the default) is not held to the block's bounds nor to DFlash's loss
    bad["draft"]["algorithm"] = "eagle3"
    bad["serve"]["speculative"][0]["topk"] = 1  # vLLM refuses EAGLE-3 trees too
    cfg.validate(bad)


def test_vllm_is_told_dflash_for_a_native_dflash_folder_and_eagle3_otherwise(tmp_path):
    import json

    from eagleflow import engines

    native, eagle = tmp_path / "dflash", tmp_path / "eagle3"
    native.mkdir()
    eagle.mkdir()
    (native / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    (eagle / "config.json").write_text(json.dumps({"architectures": ["Eagle3DraftModel"]}))
    assert engines.vllm_method(str(native)) == "dflash"
    assert engines.vllm_method(str(eagle)) == engines.vllm_method(None) == "eagle3"
    spec = engines.SpecConfig("s3", num_steps=3, topk=1)
    cmd = engines.vllm_command("python", "t", spec, {}, "127.0.0.1", 1, str(native))
    sent = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert sent == {"method": "dflash", "model": str(native), "num_speculative_tokens": 3}
