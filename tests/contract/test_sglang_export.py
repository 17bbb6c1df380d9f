"""eagleflow's SGLang-format export against the real sglang package (run in .venv-sglang).

SGLang's own LlamaForCausalLMEagle3 is built on CPU and its own `load_weights` loads the export
(sglang_export_probe.py): every exported tensor must land in a parameter, with the values of the
checkpoint (fused qkv / gate_up shards in place), and no parameter may be left unset except the
embedding, which SGLang's EAGLE worker replaces with the target's. The exported config.json goes
through SGLang's config path (server args, ModelConfig, spec_aux_hidden_state, the target's
set_eagle3_layers_to_capture) and must make SGLang capture exactly the certified layers.
A one-layer (`midlayer.*`) and a two-layer (`layers.i.*`) draft are checked.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagleflow.drafts import sglang_names
from eagleflow.train.export import checkpoint_sha256, load_tensors
from tests.contract.probe import run_probe
from tests.unit.train.test_export import AUX, build_pipeline, run_export, train_tiny_draft

pytestmark = pytest.mark.contract

PROBE = Path(__file__).with_name("sglang_export_probe.py")


def _two_layer(built: dict, root: Path) -> dict:
    """A second, two-layer checkpoint (untrained) on the same target and certificate."""
    ckpt, _, _ = train_tiny_draft(
        built["target_dir"], built["manifest"], built["dataset"], root / "run2", 0, 2
    )
    summary = json.loads(Path(built["summary"]).read_text())
    summary.update(best_checkpoint=str(ckpt), best_checkpoint_sha256=checkpoint_sha256(ckpt))
    path = root / "summary2.json"
    path.write_text(json.dumps(summary))
    return {
        **built,
        "checkpoint": ckpt,
        "summary": str(path),
        "train_cfg": {**built["train_cfg"], "draft_layers": 2},
    }


@pytest.fixture(scope="module")
def probed(sglang_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_export")
    one = build_pipeline(root, steps=0)
    cases = {"one_layer": one, "two_layers": _two_layer(one, root)}
    request = {"target_dir": str(one["target_dir"]), "cases": []}
    for name, built in cases.items():
        run_export(built, root / name)
        built["export"] = root / name / "sglang"
        request["cases"].append(
            {"name": name, "draft_dir": str(built["export"]), "dump": str(root / f"{name}.st")}
        )
    result = run_probe(sglang_python, PROBE, request)
    return result, cases, {c["name"]: c["dump"] for c in request["cases"]}


def test_version_is_the_configured_default(probed):
    from eagleflow import config as cfg

    assert probed[0]["version"] == cfg.fill_defaults({})["serve"]["sglang"]["version"]


@pytest.mark.parametrize("case", ["one_layer", "two_layers"])
def test_config_path_reads_the_certified_ids(probed, case):
    result, cases, _ = probed
    got = result["cases"][case]["config_path"]
    cert = json.loads(Path(cases[case]["certificate"]).read_text())
    assert got["draft_architectures"] == ["LlamaForCausalLMEagle3"]
    assert got["use_aux_hidden_state"] is True
    assert got["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert (
        got["eagle_aux_hidden_state_layer_ids"]
        == (cert["ids_per_engine"]["sglang"]["eagle_config_ids"])
    )
    # what SGLang's target model then captures: the layers the draft was trained on
    assert got["captured"] == cert["aux_layers"] == AUX
    assert got["draft_num_layers"] == cases[case]["train_cfg"]["draft_layers"]


@pytest.mark.parametrize("case", ["one_layer", "two_layers"])
def test_every_tensor_lands_in_a_parameter(probed, case):
    result, cases, _ = probed
    got = result["cases"][case]
    exported = load_file(str(cases[case]["export"] / "model.safetensors"))
    assert sorted(got["tensors"]) == sorted(exported)
    for name in exported:
        if name == "d2t":
            # not a parameter: SGLang keeps it as hot_token_id = draft id + d2t
            assert got["received"][name] == []
            want = (torch.arange(exported["d2t"].numel()) + exported["d2t"]).tolist()
            assert got["hot_token_id"] == want
        else:
            assert got["received"][name], f"SGLang's load_weights dropped {name}"
    # the only parameter load_weights leaves unset is the embedding, which the EAGLE worker
    # replaces with the target's (the export leaves it out on purpose)
    assert got["unset_params"] == ["model.embed_tokens.weight"]
    assert got["load_lm_head_from_target"] is False  # -> set_embed, not set_embed_and_head
    source = Path(result["eagle_worker_file"]).read_text()
    init_lm_head = source[source.index("def init_lm_head") :]
    init_lm_head = init_lm_head[: init_lm_head.index("\n    def ", 10)]
    assert "self.draft_runner.model.set_embed(embed)" in init_lm_head


@pytest.mark.parametrize("case", ["one_layer", "two_layers"])
def test_loaded_values_are_the_checkpoints(probed, case):
    """Each SGLang parameter holds the checkpoint's tensor (bf16), fused shards in order."""
    result, cases, dumps = probed
    got = result["cases"][case]
    loaded = load_file(dumps[case])
    ckpt = load_tensors(cases[case]["checkpoint"])
    layers = cases[case]["train_cfg"]["draft_layers"]
    by_export = {new: t for name, t in ckpt.items() for new in sglang_names(name, layers)}
    parts: dict[str, dict] = {}
    for name, targets in got["received"].items():
        for param, shard in targets:
            parts.setdefault(param, {})[shard] = by_export[name].to(torch.bfloat16).float()
    order = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}
    for param, shards in parts.items():
        want = (
            shards[None]
            if None in shards
            else torch.cat([shards[k] for k in sorted(shards, key=order.get)], dim=0)
        )
        assert torch.equal(loaded[param], want), param
    assert set(parts) == set(got["params"]) - {"model.embed_tokens.weight"}


@pytest.mark.parametrize("case", ["one_layer", "two_layers"])
def test_model_is_built_as_trained(probed, case):
    result, cases, _ = probed
    got = result["cases"][case]
    cfg = cases[case]["train_cfg"]
    assert got["layers"] == cfg["draft_layers"]
    assert got["num_aux_hidden_states"] == len(AUX) and got["fc_in"] == len(AUX) * 64
    assert got["norm_before_fc"] is cfg["norm_before_fc"]
    assert got["fc_norm"] is cfg["fc_norm"]
    assert got["norm_output"] is cfg["norm_output"]
    assert got["tie_word_embeddings"] is False
    assert got["lm_head"] == [cfg["draft_vocab_size"], 64]


def test_sglang_draft_semantics_the_export_relies_on(probed):
    """Source facts of llama_eagle3.py the export's choices depend on; a release that changes
    them fails here."""
    source = Path(probed[0]["llama_eagle3_file"]).read_text()
    # no norm_before_residual: the first layer keeps the pre-norm hidden state as residual
    assert "norm_before_residual" not in source
    assert "residual = hidden_states\n            hidden_states = self.hidden_norm(" in source
    # later layers normalise with hidden_norm (speculators and vLLM: input_layernorm)
    assert "hidden_states, residual = self.hidden_norm(hidden_states, residual)" in source
    # legacy SafeAILab name, and the maps the loader skips
    assert '"midlayer": "layers.0"' in source
    assert 'if "t2d" in name:\n                continue' in source
