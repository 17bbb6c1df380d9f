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
