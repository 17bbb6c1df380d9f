"""The config schema and eagleflow's validator: unknown keys, ranges, defaults, docs."""

import re

import pytest
import yaml

from eagleflow import config as cfg
from eagleflow.errors import ConfigError
from eagleflow.layers import LayerError, check_layers
from tests.conftest import REPO


def embedded() -> dict:
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def test_embedded_default_is_valid():
    full = cfg.validate(embedded())
    assert full["target"]["name"] == "smollm2-135m-instruct"
    # defaults the embedded file leaves out are filled from the schema
    assert full["benchmark"]["min_accept_ratio"] == 0.9


@pytest.mark.parametrize(
    "patch, key",
    [
        ({"train": {"learning_rate": 0.1}}, "train.learning_rate"),
        ({"serve": {"vllm": {"kv_cache": 1}}}, "serve.vllm.kv_cache"),
        ({"bogus": 1}, "bogus"),
        ({"serve": {"speculative": [{"name": "a", "num_steps": 3, "steps": 2}]}}, "steps"),
    ],
)
def test_unknown_keys_are_rejected_with_their_path(patch, key):
    with pytest.raises(ConfigError, match=re.escape(key)) as e:
        cfg.validate(cfg.deep_merge(embedded(), patch))
    assert "unknown config key" in str(e.value)


@pytest.mark.parametrize(
    "patch, key, value",
    [
        ({"train": {"lr": -1.0}}, "train.lr", "-1.0"),
        ({"benchmark": {"concurrency": [1, 0]}}, "benchmark.concurrency[1]", "0"),
        ({"serve": {"port": 70000}}, "serve.port", "70000"),
        ({"benchmark": {"temperature": 3}}, "benchmark.temperature", "3"),
        ({"benchmark": {"temperature": [0, 3]}}, "benchmark.temperature[1]", "3"),
    ],
)
def test_out_of_range_values_name_key_and_value(patch, key, value):
    with pytest.raises(ConfigError) as e:
        cfg.validate(cfg.deep_merge(embedded(), patch))
    msg = str(e.value)
    assert key in msg and value in msg and "out of range" in msg


def test_wrong_type_and_enum_are_rejected():
    with pytest.raises(ConfigError, match=r"extract\.backend: 'tensorrt' is not one of"):
        cfg.validate(cfg.deep_merge(embedded(), {"extract": {"backend": "tensorrt"}}))
    with pytest.raises(ConfigError, match=r"data\.num_samples: 'many' is not of type"):
        cfg.validate(cfg.deep_merge(embedded(), {"data": {"num_samples": "many"}}))


def test_all_problems_are_reported_at_once():
    bad = cfg.deep_merge(embedded(), {"train": {"lr": -1.0, "epochs": 0}})
    with pytest.raises(ConfigError, match="2 problems") as e:
        cfg.validate(bad)
    assert "train.lr" in str(e.value) and "train.epochs" in str(e.value)


def _walk(schema: dict, path: str = "", required: bool = False):
    """(path, node) pairs; _walk_required also says whether the parent lists the key as required."""
    yield from ((p, n) for p, n, _ in _walk_required(schema, path, required))


def _walk_required(schema: dict, path: str = "", required: bool = False):
    yield path, schema, required
    needed = set(schema.get("required", []))
    for key, sub in schema.get("properties", {}).items():
        yield from _walk_required(sub, f"{path}.{key}" if path else key, key in needed)
    if isinstance(schema.get("items"), dict):
        yield from _walk_required(schema["items"], f"{path}[]")


def test_schema_is_strict_and_documented():
    schema = cfg.load_schema()
    assert schema["$schema"].endswith("2020-12/schema")
    for path, node, required in _walk_required(schema):
        if node.get("type") == "object":
            assert node.get("additionalProperties") is False, f"{path or 'top'} allows unknown keys"
        if path and not path.endswith("[]"):
            assert node.get("description"), f"{path} has no description"
            # a key the schema requires has no default; every other key has one
            assert ("default" in node) != required, f"{path}: default and required disagree"


def test_config_readme_documents_every_key():
    readme = (REPO / "config" / "README.md").read_text()
    keys = [p for p, _ in _walk(cfg.load_schema()) if p and not p.endswith("[]")]
    missing = [k for k in keys if f"`{k}`" not in readme]
    assert not missing, f"config/README.md lacks: {missing}"


def test_schema_defaults_are_those_of_a_real_run():
    full = cfg.fill_defaults({})
    assert full["benchmark"]["max_tokens"] == 2048
    assert full["benchmark"]["repeats"] >= 3
    assert full["benchmark"]["temperature"] == 0.0
    cfg.check(full)  # the schema's own defaults pass the cross-field rules


def test_example_configs_validate_over_the_embedded_default():
    for example in sorted((REPO / "config" / "examples").glob("*.yaml")):
        overlay = yaml.safe_load(example.read_text())
        cfg.validate(cfg.deep_merge(embedded(), overlay))


def test_the_gpu_quality_stack_is_the_quality_recipe_with_the_gpu_benchmark():
    """gpu.yaml + smollm2-quality.yaml + gpu-quality.yaml, in that order (the lent GPU's quality
    run): the quality data and compiled training, all 80 first turns at concurrency 8 and 20
    at 1, bf16 standalone check."""
    merged = embedded()
    for name in ("gpu.yaml", "smollm2-quality.yaml", "gpu-quality.yaml"):
        merged = cfg.deep_merge(
            merged, yaml.safe_load((REPO / "config" / "examples" / name).read_text())
        )
    full = cfg.validate(merged)
    bench = full["benchmark"]
    assert full["data"]["num_samples"] == 3000 and full["train"]["epochs"] == 8
    assert full["train"]["compile"] is True  # gpu.yaml's false cost 700 s here (2026-12-08)
    assert bench["turns"] == 1 and bench["num_prompts"] is None
    assert [(r["concurrency"], r.get("num_prompts")) for r in bench["runs"]] == [
        (8, None),
        (1, 20),
    ]
    assert bench["standalone_dtype"] == "bfloat16" and full["serve"]["vllm"]["dtype"] == "bfloat16"


def test_unknown_key_of_a_free_form_section_names_the_key_and_the_pattern():
    kwargs = {"bad-key": 1, "ok": 2}
    bad = cfg.deep_merge(embedded(), {"regenerate": {"chat_template_kwargs": kwargs}})
    with pytest.raises(ConfigError) as e:
        cfg.validate(bad)
    msg = str(e.value)
    assert "regenerate.chat_template_kwargs" in msg and "'bad-key'" in msg
    assert "'ok'" not in msg and "^[A-Za-z_]" in msg


def test_layer_ids_are_checked_against_the_prepared_target(tmp_path):
    """check_layers: a no-op until target.json exists or when it describes another target;
    then the ids must fit it, with the id and the layer count named."""
    import json

    config = cfg.load(REPO / "config" / "config.yaml", {"results_dir": str(tmp_path)})
    config["extract"]["aux_layers"] = [0, 3, 31]
    check_layers(config)  # no target.json yet
    target_json = tmp_path / "target" / "target.json"
    target_json.parent.mkdir()
    target = {"name": "other-model", "num_layers": 30, "family": "llama"}
    target_json.write_text(json.dumps(target))
    check_layers(config)  # another target: prepare_target reruns before anything reads it
    target_json.write_text(json.dumps(dict(target, name=config["target"]["name"])))
    with pytest.raises(LayerError, match=r"31 does not exist: the target has 30 decoder layers"):
        check_layers(config)
    config["extract"]["aux_layers"] = [0, 3, 29]
    check_layers(config)


def test_config_readme_key_tables_are_generated_from_the_schema():
    readme = (REPO / "config" / "README.md").read_text()
    assert cfg.DOCS_BEGIN in readme and cfg.DOCS_END in readme, "config/README.md lacks the markers"
    between = readme.split(cfg.DOCS_BEGIN + "\n", 1)[1].split(cfg.DOCS_END, 1)[0]
    assert between == cfg.key_tables(), (
        "config/README.md's key tables differ from workflow/schemas/config.schema.yaml: "
        "edit the schema's descriptions, then run `make config-docs`"
    )


def test_key_tables_follow_the_schema_descriptions():
    import copy

    schema = cfg.load_schema()
    changed = copy.deepcopy(schema)
    changed["properties"]["train"]["properties"]["lr"]["description"] = "A changed meaning."
    before, after = cfg.key_tables(schema), cfg.key_tables(changed)
    assert before != after
    assert "| `train.lr` | `0.0001` | A changed meaning. |" in after.splitlines()
    assert "A changed meaning." not in before


def test_write_docs_rewrites_only_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# prose\n\n{cfg.DOCS_BEGIN}\nstale\n{cfg.DOCS_END}\nmore prose\n")
    assert cfg.write_docs(readme) is True
    assert readme.read_text() == (
        f"# prose\n\n{cfg.DOCS_BEGIN}\n{cfg.key_tables()}{cfg.DOCS_END}\nmore prose\n"
    )
    assert cfg.write_docs(readme) is False
    readme.write_text("no markers\n")
    with pytest.raises(ConfigError, match="lacks the lines"):
        cfg.write_docs(readme)
