"""The config model: JSON-Schema validation with dotted key paths, defaults, cross-field checks.

The schema (workflow/schemas/config.schema.yaml) is the single source of truth; the Snakefile
validates through snakemake.utils.validate and then calls `check`, the CLI calls `load`.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

from eagleflow.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"


def load_schema(path: Path = SCHEMA_PATH) -> dict:
    """Read the config JSON Schema."""
    with open(path) as f:
        return yaml.safe_load(f)


def _key_path(error) -> str:
    out = ""
    for p in error.absolute_path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _describe(error) -> str:
    if error.validator in ("oneOf", "anyOf") and error.context:
        # a number-or-list key: report the branch whose type matched (the range), not "not an
        # array"
        matched = [e for e in error.context if e.validator != "type"]
        if matched:
            return _describe(min(matched, key=lambda e: len(list(e.absolute_path))))
        types = [b.get("type") for b in error.validator_value if isinstance(b, dict)]
        return (
            f"config key {_key_path(error)}: {error.instance!r} is not of type "
            f"{' or '.join(str(t) for t in types if t)} (see config/README.md)"
        )
    path = _key_path(error)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        where = f"{path}." if path != "(top level)" else ""
        if not allowed:
            # an object whose keys are not listed (a pattern or free-form section): say so
            patterns = sorted(error.schema.get("patternProperties", {}))
            extra = [k for k in extra if not any(re.search(p, k) for p in patterns)]
            return (
                f"config key {path}: key(s) {', '.join(map(repr, extra))} not accepted: "
                f"expected names matching {' or '.join(patterns) or '(none)'} "
                f"(see config/README.md)"
            )
        return (
            f"unknown config key {', '.join(where + k for k in extra)}: "
            f"expected one of {', '.join(allowed)} (see config/README.md)"
        )
    if error.validator in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        return (
            f"config key {path}: {error.instance!r} is out of range "
            f"({error.validator} {error.validator_value}); set a value within the range"
        )
    if error.validator == "enum":
        return (
            f"config key {path}: {error.instance!r} is not one of "
            f"{', '.join(map(repr, error.validator_value))}"
        )
    if error.validator == "type":
        return f"config key {path}: {error.instance!r} is not of type {error.validator_value}"
    if error.validator == "required":
        return f"config key {path}: {error.message}"
    return f"config key {path}: {error.message}"


def validation_errors(config: dict, schema: dict | None = None) -> list[str]:
    """All schema violations of `config`, each naming its dotted key path."""
    schema = schema or load_schema()
    validator = Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    return [_describe(e) for e in errors]


def fill_defaults(config: dict, schema: dict | None = None) -> dict:
    """A copy of `config` with every schema default filled in (objects recursively)."""
    schema = schema or load_schema()

    def fill(node: Any, sch: dict) -> Any:
        if sch.get("type") == "object" and isinstance(node, dict):
            for key, sub in sch.get("properties", {}).items():
                if key not in node and "default" in sub:
                    node[key] = copy.deepcopy(sub["default"])
                if key in node:
                    node[key] = fill(node[key], sub)
        elif sch.get("type") == "array" and isinstance(node, list) and "items" in sch:
            node = [fill(item, sch["items"]) for item in node]
        return node

    return fill(copy.deepcopy(config or {}), schema)


def check(config: dict) -> None:
    """Cross-field rules JSON Schema cannot express; raises ConfigError listing every problem."""
    # Imported here, not at the top: config is read at Snakefile parse time and by every module
    # that checks a config, and the benchmark's own rules live in the serve stage (bench), which
    # a top-level helper must not import at module level (tests/unit/test_imports.py whitelists
    # this).
    from eagleflow import dflash, engines, layers  # engine flags and layer ids: one module each
    from eagleflow.serve import bench  # the benchmark's settings (benchmark.endpoints, ...)

    problems = list(engines.config_problems(config))
    problems += layers.config_problems(config)
    problems += dflash.config_problems(config)
    problems += bench.config_problems(config)
    problems += stream_problems(config)
    if problems:
        raise ConfigError(_join(problems))


def stream_problems(config: dict) -> list[str]:
    """extract.mode online / hybrid: what a stream source can serve (hf: the target in the
    training process; vllm: a capture server), and extract.gpus."""
    ex, train = config.get("extract", {}), config.get("train", {})
    mode, backend = ex.get("mode", "offline"), ex.get("backend", "hf")
    gpus = int(ex.get("gpus") or 0)
    if mode == "offline":
        if gpus:
            return [
                f"extract.gpus {gpus} gives a capture server GPUs of its own while training "
                "streams (extract.mode online / hybrid, backend vllm); extract.mode is offline: "
                "set extract.gpus: 0, or extract.mode: online"
            ]
        return []
    out = []
    if backend not in ("hf", "vllm"):
        out.append(
            f"extract.mode {mode} streams from the target in the training process (extract."
            f"backend hf) or from a vLLM capture server (vllm); extract.backend is {backend!r}: "
            "set extract.backend: hf or vllm, or extract.mode: offline to extract shards with it"
        )
    if gpus and backend != "vllm":
        out.append(
            f"extract.gpus {gpus} is for a vLLM capture server (extract.backend vllm); backend "
            f"{backend!r} runs the target in the training process: set extract.gpus: 0"
        )
    if int(train.get("gpus", 0)) > 1:
        out.append(
            f"extract.mode {mode} with train.gpus {train['gpus']}: streamed hidden states reach "
            "one training process; use train.gpus 0 or 1, or extract.mode: offline"
        )
    return out


def _join(problems: Iterable[str]) -> str:
    problems = list(problems)
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems in the config:\n" + "\n".join(f"  - {p}" for p in problems)


def raise_for_schema(config: dict) -> None:
    """Raise ConfigError listing every schema violation of `config`."""
    errors = validation_errors(config or {})
    if errors:
        raise ConfigError(_join(errors))


def validate(config: dict) -> dict:
    """Validate against the schema and the cross-field rules; return the config with defaults."""
    raise_for_schema(config)
    full = fill_defaults(config)
    check(full)
    return full


def load(path: str | Path, overrides: dict | None = None) -> dict:
    """Read a YAML config file (plus nested overrides), validate it, and fill defaults."""
    config = read_yaml(path)
    if overrides:
        config = deep_merge(config, overrides)
    return validate(config)


def load_layers(paths: Iterable[str | Path]) -> dict:
    """Config files layered like Snakemake's `--configfile A B` over the first one, validated,
    defaults filled."""
    paths = list(paths)
    layered: dict = {}
    for p in paths[1:]:
        layered = deep_merge(layered, read_yaml(p))
    return load(paths[0], layered)


def read_yaml(path: str | Path) -> dict:
    """One config file's mapping, or a ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing YAML file")
    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(config).__name__}")
    return config


def deep_merge(base: dict, extra: dict) -> dict:
    """`extra` layered over `base` (nested dicts merged, everything else replaced)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# config/README.md's key tables are rendered from the schema between these two lines
# (`make config-docs`); tests/unit/test_config.py fails when they differ.
DOCS_BEGIN = (
    "<!-- generated from workflow/schemas/config.schema.yaml by `make config-docs`: "
    "edit the schema, not this table -->"
)
DOCS_END = "<!-- end of generated key tables -->"


def _is_section(node: dict) -> bool:
    """An object with listed keys gets its own heading and table (not a free-form one)."""
    return node.get("type") == "object" and bool(node.get("properties"))


def _default_cell(node: dict, required: bool) -> str:
    if "default" not in node:
        return "(required)" if required else "–"
    value = node["default"]
    nested = isinstance(value, dict | list) and any(
        isinstance(v, dict | list) for v in (value.values() if isinstance(value, dict) else value)
    )
    if nested or (isinstance(value, dict) and value):
        return "see schema"
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _text(node: dict) -> str:
    return " ".join(str(node.get("description", "")).split()).replace("|", "\\|")


def _rows(prefix: str, node: dict) -> Iterable[str]:
    """Table rows of an object: its keys and array items' keys, not sub-sections."""
    needed = set(node.get("required", []))
    for key, sub in node.get("properties", {}).items():
        dotted = f"{prefix}.{key}" if prefix else key
        if _is_section(sub):
            continue
        yield f"| `{dotted}` | {_default_cell(sub, key in needed)} | {_text(sub)} |"
        items = sub.get("items")
        if isinstance(items, dict) and items.get("properties"):
            yield from _rows(f"{dotted}[]", items)


def key_tables(schema: dict | None = None) -> str:
    """config/README.md's "Every key" tables: a heading, description and table per section,
    in the schema's order (nested objects after their parent's table)."""
    schema = schema or load_schema()
    blocks: list[str] = []

    def section(path: str, node: dict) -> None:
        lines = [f"### `{path}`" if path else "### Top level", ""]
        if path:
            lines += [_text(node), ""]
        lines += ["| key | default | meaning |", "|---|---|---|"]
        lines += _rows(path, node)
        blocks.append("\n".join(lines) + "\n\n")
        for key, sub in node.get("properties", {}).items():
            if _is_section(sub):
                section(f"{path}.{key}" if path else key, sub)

    section("", schema)
    return "".join(blocks)


def write_docs(path: str | Path, schema: dict | None = None) -> bool:
    """Rewrite the key tables between DOCS_BEGIN and DOCS_END in `path`; True if it changed."""
    path = Path(path)
    text = path.read_text()
    head, begin, rest = text.partition(DOCS_BEGIN + "\n")
    _, end, tail = rest.partition(DOCS_END)
    if not begin or not end:
        raise ConfigError(f"{path} lacks the lines {DOCS_BEGIN!r} and {DOCS_END!r}")
    new = head + begin + key_tables(schema) + end + tail
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m eagleflow.config")
    parser.add_argument("--write-docs", metavar="README", required=True, type=Path)
    args = parser.parse_args()
    changed = write_docs(args.write_docs)
    print(f"{args.write_docs}: {'rewritten' if changed else 'up to date'}")
