"""DFlash block-draft training (draft.algorithm dflash) on a tiny random target: speculators'
DFlashDraftModel through eagleflow's loop, on the same shards and certificate as EAGLE-3."""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from eagleflow import config as efconfig
from eagleflow import doctor
from eagleflow.errors import ExportError, TrainError
from eagleflow.train import dflash_train
from eagleflow.train.dflash_export import export_dflash
from tests.unit.train.test_loop import TRAIN, _one_thread, run, training_inputs  # noqa: F401

# DFlash reads layer outputs 1..num_layers-1 (no embedding): the tiny target has 4 layers.
EXTRACT = {"backend": "hf", "aux_layers": [1, 2, 3], "batch_tokens": 512, "dtype": "float32"}
DFLASH = {
    **TRAIN,
    "algorithm": "dflash",
    "dflash": {**efconfig.fill_defaults({})["draft"]["dflash"], "block_size": 4, "layers": 1},
}
DFLASH["dflash"]["max_anchors"] = 8


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return training_inputs(tmp_path_factory.mktemp("dflash"), EXTRACT)[0]


def test_a_block_draft_trains_on_the_shared_shards_and_says_what_it_is(inputs, tmp_path):
    summary = run(inputs, tmp_path, DFLASH)
    draft = summary["draft"]
    # The tiny tokenizer has no mask token and no spare row: speculators' fallback is its eos.
    assert draft == {
        "algorithm": "dflash",
        "layers": 1,
        "draft_vocab_size": TRAIN["draft_vocab_size"],
        "block_size": 4,
        "mask_token_id": 2,
        "max_anchors": 8,
        "loss_fn": "ce",
        "per_position_loss_weight": "dpace",
    }
    assert summary["aux_layers"] == [1, 2, 3]
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == dflash_train.metric_columns(DFLASH)
    assert list(rows[0])[-3:] == ["position_1_acc", "position_2_acc", "position_3_acc"]
    train = [float(r["loss"]) for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    assert len(val) == TRAIN["epochs"] and all(float(r["eal"]) >= 1.0 for r in val)
    assert sum(train[-3:]) < sum(train[:3]), train  # it learns
    # the exported checkpoint is speculators' DFlash one, with the ids and mask it trained on
    cfg = json.loads((tmp_path / "ckpt").glob("*/best/config.json").__next__().read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == 4
    assert cfg["aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["mask_token_id"] == 2
    assert cfg["transformer_layer_config"]["layer_types"] == ["full_attention"]

    # The native export: what vLLM's and SGLang's DFlash loaders read, no `causal` key (vLLM's
    # speculators adapter would make every layer causal), ids both ways.
    out = tmp_path / "export" / "dflash"
    export_dflash(
        inputs["target"], inputs["certificate"], str(tmp_path / "summary.json"), DFLASH, "", out
    )
    native = json.loads((out / "config.json").read_text())
    assert native["architectures"] == ["DFlashDraftModel"] and native["model_type"] == "qwen3"
    assert native["dflash_config"] == {"target_layer_ids": [0, 1, 2], "mask_token_id": 2}
    assert native["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert native["block_size"] == 4 and native["num_target_layers"] == 4
    assert native["layer_types"] == ["full_attention"] and "causal" not in json.dumps(native)
    assert (out / "model.safetensors").is_file()
    card = (out / "README.md").read_text()  # its serve command holds the JSON vLLM parses
    sent = json.loads(card.split("--speculative-config '", 1)[1].split("'", 1)[0])
    assert sent == {"method": "dflash", "model": str(out.resolve()), "num_speculative_tokens": 3}
    # doctor: clean for vLLM; each way an engine would serve it differently is named
    target_dir = json.loads(open(inputs["target"]).read())["path"]
    assert doctor.diagnose(target_dir, out, "vllm").ok
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    bad = {**native, "dflash_config": {**native["dflash_config"], "causal": True}}
    bad["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (broken / "config.json").write_text(json.dumps(bad))
    report = doctor.diagnose(
        target_dir, broken, "vllm", '--speculative-config \'{"method": "eagle3", '
        '"num_speculative_tokens": 4}\''
    )  # fmt: skip
    text = "\n".join(f.line() for f in report.findings)
    assert not report.ok and report.exit_status == 1
    assert "vllm feeds the draft layers [0, 1, 2]" in text and "trained on [1, 2, 3]" in text
    assert "name other layers" in text and "DFlash layer id 0 is outside 1..3" in text
    assert "dflash_config.causal is true" in text and "method 'eagle3'" in text
    assert "num_speculative_tokens 4 exceeds the block's 3" in text
    sg = doctor.diagnose(target_dir, out, "sglang", "--speculative-num-draft-tokens 8")
    sg_text = "\n".join(f.line() for f in sg.findings)
    assert "SGLang's DFLASH borrows the target's head" in sg_text  # a reduced vocab
    assert "--speculative-num-draft-tokens 8" in sg_text
    # a config that asks for another block size is refused, and nothing is replaced
    other = {**DFLASH, "dflash": {**DFLASH["dflash"], "block_size": 8}}
    with pytest.raises(ExportError, match="block_size 4, the config 8"):
        export_dflash(
            inputs["target"], inputs["certificate"], str(tmp_path / "summary.json"), other, "", out
        )
    assert json.loads((out / "config.json").read_text()) == native
    assert [p.name for p in out.parent.iterdir()] == ["dflash"]  # no partial folder left


def test_the_embedding_is_refused_before_any_training(tmp_path):
    with_embed = training_inputs(tmp_path / "in", {**EXTRACT, "aux_layers": ["embed", 1, 3]})[0]
    with pytest.raises(TrainError, match=r"DFlash layer id 0 is outside 1\.\.3"):
        run(with_embed, tmp_path / "out", DFLASH)
    assert not (tmp_path / "out" / "summary.json").exists()
