"""Engine flag rules and launch commands (eagleflow.engines). SGLang's own resolution of the same
commands is checked in tests/contract/test_sglang_contract.py."""

import json

import pytest

from eagleflow import config as cfg
from eagleflow import engines
from eagleflow.engines import SpecConfig
from eagleflow.errors import ConfigError


def test_sglang_refuses_topk1_with_more_draft_tokens_and_says_what_sglang_would_do():
    problems = engines.sglang_spec_problems(SpecConfig("x", 1, 1, 16))
    assert len(problems) == 1
    msg = problems[0]
    assert "num_draft_tokens=16" in msg and "silently" in msg
    assert "num_draft_tokens=2" in msg  # what SGLang would really verify


@pytest.mark.parametrize(
    "spec, resolved",
    [
        (SpecConfig("a", 3, 1, 4), (3, 1, 4)),
        (SpecConfig("b", 3, 1, None), (3, 1, 4)),
        (SpecConfig("c", 7, 1, 8), (7, 1, 8)),
        (SpecConfig("d", 5, 4, 8), (5, 4, 8)),
    ],
)
def test_sglang_accepts_what_it_runs_unchanged(spec, resolved):
    assert engines.sglang_spec_problems(spec) == []
    assert engines.resolve_sglang_spec(spec, "LlamaForCausalLM") == resolved


def test_sglang_unset_steps_rules():
    auto = SpecConfig("auto")
    assert engines.sglang_spec_problems(auto) == []
    assert engines.resolve_sglang_spec(auto, "LlamaForCausalLM") == (5, 4, 8)
    assert engines.resolve_sglang_spec(auto, "DeepseekV3ForCausalLM") == (3, 1, 4)
    (msg,) = engines.sglang_spec_problems(SpecConfig("half", None, 1, None))
    assert "unset together" in msg
    (msg,) = engines.sglang_spec_problems(SpecConfig("nok", 3, None, None))
    assert "topk" in msg
    (msg,) = engines.sglang_spec_problems(SpecConfig("tree", 3, 4, None))
    assert "num_draft_tokens" in msg


def test_vllm_rules():
    assert engines.vllm_spec_problems(SpecConfig("a", 3, 1, None)) == []
    assert "chain" in engines.vllm_spec_problems(SpecConfig("t", 3, 4, 8))[0]
    assert "no automatic choice" in engines.vllm_spec_problems(SpecConfig("u"))[0]
    assert "verifies num_steps + 1" in engines.vllm_spec_problems(SpecConfig("n", 3, 1, 8))[0]


def test_extra_args_owned_and_ignored_flags():
    (msg,) = engines.extra_args_problems("sglang", ["--speculative-token-map", "x.pt"])
    assert "ignored" in msg
    (msg,) = engines.extra_args_problems("vllm", ["--port=9"])
    assert "--port" in msg and "set by eagleflow" in msg
    assert engines.extra_args_problems("sglang", ["--disable-cuda-graph"]) == []


def test_config_check_uses_the_engine_rules():
    full = cfg.fill_defaults(
        {
            "serve": {
                "engine": "sglang",
                "speculative": [{"name": "bad", "num_steps": 1, "topk": 1, "num_draft_tokens": 16}],
            }
        }
    )
    with pytest.raises(ConfigError, match=r"serve\.speculative\[bad\].*num_draft_tokens=2"):
        cfg.check(full)
    dup = cfg.fill_defaults({"serve": {"speculative": [{"name": "a"}, {"name": "a"}]}})
    with pytest.raises(ConfigError, match="used twice"):
        cfg.check(dup)


def test_sglang_command_writes_resolved_values_in_full():
    cmd = engines.sglang_command(
        "py", "/m", SpecConfig("a", 3, 1, None), {"tp_size": 8}, "h", 1, "/d"
    )
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    text = " ".join(cmd)
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path /d" in text
    assert (
        "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
        in text
    )
    assert "--tp-size 8" in text
    with pytest.raises(ConfigError, match="silently"):
        engines.sglang_command("py", "/m", SpecConfig("b", 1, 1, 16), {}, "h", 1, "/d")
    base = engines.sglang_command("py", "/m", SpecConfig("baseline"), {}, "h", 1)
    assert not any(a.startswith("--speculative") for a in base)


def test_vllm_command_speculative_config():
    opts = {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 8, "enforce_eager": True}
    cmd = engines.vllm_command("py", "/m", SpecConfig("a", 5, 1, None), opts, "127.0.0.1", 5, "/d")
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 5}
    assert "--enforce-eager" in cmd and cmd[cmd.index("--dtype") + 1] == "float32"


def test_spec_configs_start_with_baseline():
    full = cfg.fill_defaults({})
    names = [s.name for s in engines.spec_configs(full)]
    assert names[0] == "baseline" and len(names) == 1 + len(full["serve"]["speculative"])


# ------------------------------------------------------------------ reasoning and tool-call parsers


def _with_parsers(engine: str, **serve_keys) -> dict:
    return cfg.fill_defaults({"serve": {"engine": engine, **serve_keys}})


def test_vllm_parser_names_are_the_installed_registries():
    """The names read from vllm's registration tables (no vllm import) are the ones its
    ReasoningParserManager and ToolParserManager hold once imported."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    assert engines.vllm_parser_names("reasoning") == tuple(ReasoningParserManager.list_registered())
    tools = set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers)
    assert engines.vllm_parser_names("tool_call") == tuple(sorted(tools))
    assert "qwen3" in engines.vllm_parser_names("reasoning")
    assert "hermes" in engines.vllm_parser_names("tool_call")


@pytest.mark.parametrize(
    "engine, key, value, known",
    [
        ("vllm", "reasoning_parser", "deepseek-r1", "deepseek_r1"),  # SGLang's spelling
        ("vllm", "tool_call_parser", "qwen25", "hermes"),
        ("sglang", "reasoning_parser", "deepseek_r1", "deepseek-r1"),  # vLLM's spelling
        ("sglang", "tool_call_parser", "llama3_json", "llama3"),
    ],
)
def test_unknown_parser_is_refused_naming_value_known_names_and_fix(engine, key, value, known):
    with pytest.raises(ConfigError) as e:
        cfg.check(_with_parsers(engine, **{key: value}))
    msg = str(e.value)
    assert f"serve.{key}: {value!r} is not a" in msg
    assert f" {known}," in msg or f" {known}." in msg  # among the known names
    assert {"vllm": "vLLM", "sglang": "SGLang 0.5.23"}[engine] in msg
    assert f"Set serve.{key} to" in msg and "null" in msg


def test_known_parsers_pass_and_reach_the_launch_commands():
    vllm = _with_parsers("vllm", reasoning_parser="qwen3", tool_call_parser="hermes")
    cfg.check(vllm)
    cmd = engines.vllm_command(
        "py", "/m", SpecConfig("baseline"), {}, "h", 1, **engines.parser_options(vllm["serve"])
    )
    text = engines.format_command(cmd)
    assert "--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes" in text
    sg = _with_parsers("sglang", reasoning_parser="auto", tool_call_parser="kimi_k2")
    cfg.check(sg)
    cmd = engines.sglang_command(
        "py", "/m", SpecConfig("baseline"), {}, "h", 1, **engines.parser_options(sg["serve"])
    )
    assert "--reasoning-parser auto --tool-call-parser kimi_k2" in engines.format_command(cmd)
    # none configured: no parser flag at all
    plain = engines.vllm_command("py", "/m", SpecConfig("baseline"), {}, "h", 1)
    assert not {"--reasoning-parser", "--tool-call-parser", "--enable-auto-tool-choice"} & set(
        plain
    )


def test_parser_checks_step_aside_where_they_cannot_know():
    # a vLLM plugin registers names of its own
    plugin = _with_parsers(
        "vllm",
        reasoning_parser="mine",
        vllm={"extra_args": ["--reasoning-parser-plugin=/p/mine.py"]},
    )
    cfg.check(plugin)
    # eagleflow knows SGLang 0.5.23's names only; another release's engine checks its own
    other = _with_parsers("sglang", reasoning_parser="new-one", sglang={"version": "0.6.0"})
    cfg.check(other)


def test_parser_flags_in_extra_args_are_refused():
    for engine in ("vllm", "sglang"):
        (msg,) = engines.extra_args_problems(engine, ["--reasoning-parser=qwen3"])
        assert "set by eagleflow" in msg
    (msg,) = engines.extra_args_problems("vllm", ["--enable-auto-tool-choice"])
    assert "set by eagleflow" in msg


@pytest.mark.timeout(300)
def test_vllm_commands_parse_with_the_installed_vllm_and_a_bad_flag_is_named():
    """serve-command --check-flags: the installed vLLM's own server parser reads every command
    eagleflow builds for the GPU overlay; a flag it does not know is refused with the command."""
    full = cfg.load_layers([cfg.REPO_ROOT / "config" / "config.yaml",
                            cfg.REPO_ROOT / "config" / "examples" / "gpu.yaml"])  # fmt: skip
    opts = full["serve"]["vllm"]
    for spec in engines.spec_configs(full):
        draft = None if spec.is_baseline else "/d"
        cmd = engines.vllm_command("py", "/m", spec, opts, "127.0.0.1", 5, draft)
        assert engines.vllm_flag_problems(cmd) == [], engines.format_command(cmd)
    bad = engines.vllm_command(
        "py", "/m", SpecConfig("s3", 3, 1), {**opts, "extra_args": ["--no-such-flag"]},
        "127.0.0.1", 5, "/d",
    )  # fmt: skip
    problems = engines.vllm_flag_problems(bad)
    assert len(problems) == 1 and "refused" in problems[0] and "--no-such-flag" in problems[0]


@pytest.mark.timeout(300)
def test_vllm_flag_check_finds_the_parser_where_an_older_vllm_keeps_it(monkeypatch):
    """vLLM 0.26 (the lent GPU's) keeps the server parser in entrypoints.openai.cli_args and has
    no entrypoints.launchers: the check must look there instead of failing on the import (it did,
    on the lent H100, 2026-12-07)."""
    monkeypatch.setattr(
        engines, "_VLLM_CLI_ARGS", ("vllm.entrypoints.no_such_module", *engines._VLLM_CLI_ARGS)
    )
    opts = cfg.fill_defaults({})["serve"]["vllm"]
    cmd = engines.vllm_command("py", "/m", SpecConfig("s3", 3, 1), opts, "127.0.0.1", 5, "/d")
    assert engines.vllm_flag_problems(cmd) == []


def test_engine_env_turns_off_the_flashinfer_sampler_where_flashinfer_is_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a)
    )
    assert engines.engine_env("vllm", {})["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object())
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in engines.engine_env("vllm", {})


@pytest.mark.timeout(300)
def test_the_capture_server_command_parses_and_serve_command_checks_it(capsys):
    """A streamed run's vLLM capture server (extract.mode online, backend vllm): its command
    parses with the installed vLLM's own server parser, and `serve-command --check-flags` prints
    and checks it with the serving commands (the device driver's install step runs that)."""
    from eagleflow import cli
    from eagleflow.extract.vllm_capture import capture_server_command

    opts = cfg.fill_defaults({})["serve"]["vllm"]
    for cpu in (True, False):
        cmd = capture_server_command(
            "py", "/m", [0, 3, 4], opts, "127.0.0.1", 5, "/s", "float32", cpu
        )
        assert engines.vllm_flag_problems(cmd) == [], engines.format_command(cmd)
        assert "--no-enable-prefix-caching" in cmd  # a cached prefix would not be captured
    overlay = cfg.REPO_ROOT / "config" / "examples" / "online-vllm.yaml"
    rc = cli.main(["serve-command", "--configfile", str(cfg.REPO_ROOT / "config" / "config.yaml"),
                   str(overlay), "--check-flags"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "# vllm capture server (extract.mode online)" in out
    assert out.count(": ok") == out.count("# flags parsed by vLLM")
