"""Engine flags: the one place that builds launch commands and holds every flag rule.

Config validation, `doctor` and the benchmark all call these functions; no rule is written twice.
The SGLang rules are contract-tested against the real sglang package (tests/contract/).
Shared infrastructure: regeneration, the certificate's engine check, export's cards
and the benchmark all start engines through it, so no stage imports a later one for it.
"""

from __future__ import annotations

import ast
import functools
import json
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from eagleflow.errors import ConfigError, EagleflowError

BASELINE = "baseline"

# SGLang's _auto_choose_speculative_params (srt/arg_groups/speculative_hook.py, 0.5.23):
# used when --speculative-num-steps is unset.
SGLANG_AUTO_PARAMS_LLAMA = (5, 4, 8)
SGLANG_AUTO_PARAMS_OTHER = (3, 1, 4)
SGLANG_AUTO_LLAMA_ARCHS = {"LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM"}

# Flags eagleflow sets itself from config; passing them again in extra_args would fight it. The
# parser flags matter most: regeneration must run without them (data.regeneration_server).
_PARSER_FLAGS = {"--reasoning-parser", "--tool-call-parser"}
_OWNED_FLAGS = {
    "vllm": {
        "--host",
        "--port",
        "--model",
        "--speculative-config",
        "--served-model-name",
        "--enable-auto-tool-choice",
        *_PARSER_FLAGS,
    },
    "sglang": {
        *_PARSER_FLAGS,
        "--host",
        "--port",
        "--model-path",
        "--speculative-algorithm",
        "--speculative-draft-model-path",
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
    },
}


# Reasoning and tool-call parsers of SGLang 0.5.23 (`ReasoningParser.DetectorMap` in
# srt/parser/reasoning_parser.py, `FunctionCallParser.ToolCallParserEnum` in
# srt/function_call/function_call_parser.py; its --reasoning-parser / --tool-call-parser choices,
# plus "auto"). SGLang is not importable here: tests/contract/test_sglang_parsers.py compares
# these with the real registries.
SGLANG_PARSERS_RELEASE = "0.5.23"
SGLANG_REASONING_PARSERS = tuple(
    (
        "apertus2509 beam cohere_command4 deepseek-r1 deepseek-v3 deepseek-v4 deepseek-v41 "
        "dots gemma4 gigachat35 glm45 gpt-oss granite_thinking_parser hunyuan inkling "
        "interns1 iquest_q1 k2_horizon kimi kimi_k2 kimi_k3 ling3 mimo minimax "
        "minimax-append-think minimax-m3 mistral muse nanbeige nemotron_3 poolside_v1 qwen3 "
        "qwen3-thinking response_template step3 step3p5"
    ).split()
)
SGLANG_TOOL_CALL_PARSERS = tuple(
    (
        "apertus2509 beam cohere_command4 deepseekv3 deepseekv31 deepseekv32 deepseekv4 "
        "deepseekv41 dots gemma4 gigachat3 gigachat35 glm glm45 glm47 gpt-oss hermes hunyuan "
        "inkling interns1 iquest_q1 k2_horizon kimi_k2 kimi_k3 lfm2 ling3 llama3 mimo "
        "minicpm5 minimax-m2 minimax-m3 mistral muse nanbeige poolside_v1 pythonic qwen "
        "qwen25 qwen3_coder response_template spark25 step3 step3p5 trinity"
    ).split()
)
SGLANG_AUTO_PARSER = "auto"  # SGLang's own choice from the chat template or checkpoint

# vLLM's registries (ReasoningParserManager, ToolParserManager) are filled at import from these
# tables of the installed package; reading them with ast avoids importing vllm (~7 s on 2 cores)
# in every config validation. tests/unit/test_engines.py compares the read with the managers.
_VLLM_PARSER_TABLES = {
    "reasoning": ("reasoning/__init__.py", "_REASONING_PARSERS_TO_REGISTER"),
    "tool_call": ("tool_parsers/__init__.py", "_TOOL_PARSERS_TO_REGISTER"),
}
# A plugin registers names of its own, which no table lists.
_VLLM_PLUGIN_FLAGS = {"reasoning": "--reasoning-parser-plugin", "tool_call": "--tool-parser-plugin"}
_PARSER_KEYS = {"reasoning": "reasoning_parser", "tool_call": "tool_call_parser"}


@functools.cache
def vllm_parser_names(kind: str) -> tuple[str, ...] | None:
    """Names vLLM's `kind` ("reasoning" / "tool_call") parser registry holds in the installed
    package; None when vllm is not installed here."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    rel, table = _VLLM_PARSER_TABLES[kind]
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    try:
        for node in ast.parse(path.read_text()).body:
            target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
            if getattr(target, "id", None) == table and isinstance(node.value, ast.Dict):
                return tuple(sorted(ast.literal_eval(k) for k in node.value.keys))
    except (OSError, SyntaxError, ValueError):
        pass
    return _vllm_registered(kind)  # the table moved: ask the registry itself (imports vllm)


def _vllm_registered(kind: str) -> tuple[str, ...]:
    if kind == "reasoning":
        from vllm.reasoning import ReasoningParserManager

        return tuple(ReasoningParserManager.list_registered())
    from vllm.tool_parsers import ToolParserManager

    return tuple(sorted(set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers)))


def _vllm_version() -> str:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "?"


def parser_problems(serve_cfg: dict) -> list[str]:
    """serve.reasoning_parser / serve.tool_call_parser names the serving engine does not know."""
    engine = serve_cfg["engine"]
    extra = [a.split("=", 1)[0] for a in serve_cfg[engine].get("extra_args", [])]
    problems = []
    for kind, key in _PARSER_KEYS.items():
        name = serve_cfg.get(key)
        if name is None:
            continue
        if engine == "vllm":
            known = vllm_parser_names(kind)
            if known is None or _VLLM_PLUGIN_FLAGS[kind] in extra:
                continue  # no vLLM here to ask, or a plugin registers names of its own
            where = f"vLLM {_vllm_version()} (the installed package's registry)"
        else:
            if serve_cfg["sglang"]["version"] != SGLANG_PARSERS_RELEASE:
                continue  # eagleflow knows one release's names; the GPU host's engine checks
            known = (SGLANG_AUTO_PARSER,) + (
                SGLANG_REASONING_PARSERS if kind == "reasoning" else SGLANG_TOOL_CALL_PARSERS
            )
            where = f"SGLang {SGLANG_PARSERS_RELEASE}"
        if name not in known:
            what = kind.replace("_", "-")
            problems.append(
                f"serve.{key}: {name!r} is not a {what} parser {where} knows; known: "
                f"{', '.join(sorted(known))}. Set serve.{key} to the target's parser (its model "
                "card names it) or to null to serve without one."
            )
    return problems


def parser_options(serve_cfg: dict) -> dict:
    """The configured parsers as keyword arguments of vllm_command / sglang_command."""
    return {key: serve_cfg.get(key) for key in _PARSER_KEYS.values()}


def regeneration_settings(serve_cfg: dict) -> dict:
    """The serve settings a regeneration server uses: no speculative configs, no parsers (a
    change of those reruns the benchmarks, not regeneration)."""
    skip = {"speculative", *_PARSER_KEYS.values()}
    return {k: v for k, v in serve_cfg.items() if k not in skip}


def raw_output_request(engine: str, tools: list | None = None) -> dict:
    """Chat-request fields that make `engine` return the target's raw text: special tokens (think
    and tool-call markers) kept, reasoning not split off, and the tools rendered into the prompt
    without asking a tool-call parser for them (regeneration's server runs without parsers)."""
    body: dict = {"skip_special_tokens": False}
    if engine == "vllm":
        body["spaces_between_special_tokens"] = False
        if tools:
            # vLLM renders the tools with tool_choice "none" too; "auto" (the default with tools)
            # is refused by a server without --enable-auto-tool-choice.
            body.update(tools=tools, tool_choice="none")
    else:
        body["separate_reasoning"] = False
        if tools:
            # SGLang leaves the tools out of the prompt with "none"; with "auto" and no
            # --tool-call-parser the output is not parsed.
            body.update(tools=tools, tool_choice="auto")
    return body


@dataclass(frozen=True)
class SpecConfig:
    """One speculative configuration; `name == "baseline"` means no speculation."""

    name: str
    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None

    @property
    def is_baseline(self) -> bool:
        return self.name == BASELINE

    @classmethod
    def from_config(cls, item: dict) -> SpecConfig:
        return cls(
            name=item["name"],
            num_steps=item.get("num_steps"),
            topk=item.get("topk"),
            num_draft_tokens=item.get("num_draft_tokens"),
        )


def spec_configs(config: dict) -> list[SpecConfig]:
    """The baseline followed by the configured speculative configs."""
    return [SpecConfig(BASELINE)] + [
        SpecConfig.from_config(s) for s in config["serve"]["speculative"]
    ]


def sglang_auto_params(architecture: str | None) -> tuple[int, int, int]:
    """(steps, topk, draft_tokens) SGLang picks when --speculative-num-steps is unset."""
    if architecture in SGLANG_AUTO_LLAMA_ARCHS:
        return SGLANG_AUTO_PARAMS_LLAMA
    return SGLANG_AUTO_PARAMS_OTHER


def sglang_spec_problems(spec: SpecConfig) -> list[str]:
    """Why SGLang would not run `spec` as written (silent rewrites included); [] when it would."""
    if spec.is_baseline:
        return []
    s, k, n = spec.num_steps, spec.topk, spec.num_draft_tokens
    where = f"serve.speculative[{spec.name}]"
    if s is None:
        if k is not None or n is not None:
            return [
                f"{where}: num_steps is unset but topk={k}, num_draft_tokens={n} are set; SGLang "
                "asserts that all three are unset together (it then auto-chooses them). Set "
                "num_steps, or unset topk and num_draft_tokens too."
            ]
        return []
    if k is None:
        return [
            f"{where}: num_steps={s} with topk unset crashes SGLang's argument resolution "
            "(TypeError comparing None with int); set topk (1 = chain drafting)."
        ]
    if k == 1 and n is not None and n != s + 1:
        return [
            f"{where}: num_steps={s}, topk=1, num_draft_tokens={n}: SGLang would silently run "
            f"with num_draft_tokens={s + 1} (it forces num_steps + 1 when topk is 1, with only a "
            f"log warning). Set num_draft_tokens to {s + 1}, or raise num_steps to {n - 1} to "
            f"verify {n} tokens."
        ]
    if k > 1 and n is None:
        return [
            f"{where}: topk={k} needs num_draft_tokens (SGLang leaves it unset and fails later); "
            f"set num_draft_tokens, e.g. {min(k * s + 1, 2 * (s + 1))}."
        ]
    return []


def resolve_sglang_spec(spec: SpecConfig, architecture: str | None) -> tuple[int, int, int]:
    """(steps, topk, draft_tokens) SGLang will really run for a valid `spec`."""
    if spec.num_steps is None:
        return sglang_auto_params(architecture)
    n = spec.num_draft_tokens
    if spec.topk == 1:
        n = spec.num_steps + 1
    return spec.num_steps, spec.topk, n


def vllm_spec_problems(spec: SpecConfig) -> list[str]:
    """Why vLLM cannot run `spec` as written; [] when it can."""
    if spec.is_baseline:
        return []
    where = f"serve.speculative[{spec.name}]"
    problems = []
    if spec.num_steps is None:
        problems.append(
            f"{where}: num_steps is unset; vLLM has no automatic choice. Set num_steps "
            "(vLLM's num_speculative_tokens), e.g. 3."
        )
    if spec.topk not in (None, 1):
        problems.append(
            f"{where}: topk={spec.topk}, but vLLM drafts EAGLE-3 as a chain only; set topk: 1."
        )
    if (
        spec.num_steps is not None
        and spec.num_draft_tokens is not None
        and spec.num_draft_tokens != spec.num_steps + 1
    ):
        problems.append(
            f"{where}: num_draft_tokens={spec.num_draft_tokens} cannot be honoured by vLLM, which "
            f"verifies num_steps + 1 = {spec.num_steps + 1} tokens; set it to null or "
            f"{spec.num_steps + 1}."
        )
    return problems


def extra_args_problems(engine: str, args: Sequence[str]) -> list[str]:
    """Flags in `serve.<engine>.extra_args` that eagleflow owns, or that the engine ignores."""
    problems = []
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in _OWNED_FLAGS[engine]:
            problems.append(
                f"serve.{engine}.extra_args: {flag} is set by eagleflow from the config; remove "
                "it from extra_args and use the config key instead (config/README.md)."
            )
        if engine == "sglang" and flag == "--speculative-token-map":
            problems.append(
                f"serve.sglang.extra_args: {flag} is ignored by SGLang for EAGLE3 (the draft's "
                "d2t mapping is used); remove it."
            )
    return problems


def config_problems(config: dict) -> Iterator[str]:
    """Every engine-flag problem of a validated config (cross-field rules)."""
    names = [s["name"] for s in config["serve"]["speculative"]]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        yield f"serve.speculative: name {dup!r} is used twice; give every config its own name."
    engine = config["serve"]["engine"]
    rules = sglang_spec_problems if engine == "sglang" else vllm_spec_problems
    for spec in spec_configs(config):
        yield from rules(spec)
    yield from extra_args_problems(engine, config["serve"][engine]["extra_args"])
    yield from parser_problems(config["serve"])


def _refuse(problems: list[str]) -> None:
    """Raise the engine-flag problems of a launch command as one ConfigError."""
    if problems:
        raise ConfigError("; ".join(problems))


def vllm_method(draft: str | None) -> str:
    """vLLM's speculative method for a draft folder: `dflash` for a native DFlash draft
    (`architectures ["DFlashDraftModel"]`, eagleflow's DFlash export), else `eagle3`."""
    try:
        config = json.loads(Path(draft or "", "config.json").read_text())
    except (OSError, ValueError):
        return "eagle3"
    return "dflash" if "DFlashDraftModel" in (config.get("architectures") or []) else "eagle3"


def vllm_command(
    python: str,
    model: str,
    spec: SpecConfig,
    options: dict,
    host: str,
    port: int,
    draft: str | None = None,
    served_name: str | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
) -> list[str]:
    """The vLLM OpenAI-server launch command for `spec` (the `vllm` console script is not used:
    the CPU distribution is named vllm-cpu and the script fails to find its metadata)."""
    problems = vllm_spec_problems(spec) + extra_args_problems("vllm", options.get("extra_args", []))
    _refuse(problems)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", host, "--port", str(port), "--served-model-name", served_name or model]
    cmd += ["--dtype", options.get("dtype", "auto")]
    cmd += ["--max-model-len", str(options.get("max_model_len", 8192))]
    cmd += ["--max-num-seqs", str(options.get("max_num_seqs", 64))]
    if options.get("tensor_parallel_size", 1) > 1:
        cmd += ["--tensor-parallel-size", str(options["tensor_parallel_size"])]
    if options.get("enforce_eager", True):
        cmd.append("--enforce-eager")
    if not spec.is_baseline:
        if draft is None:
            raise ValueError(f"speculative config {spec.name} needs a draft path")
        speculative = {
            "method": vllm_method(draft),
            "model": draft,
            "num_speculative_tokens": spec.num_steps,
        }
        cmd += ["--speculative-config", json.dumps(speculative)]
    if reasoning_parser:
        cmd += ["--reasoning-parser", reasoning_parser]
    if tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    cmd += list(options.get("extra_args", []))
    return cmd


def sglang_command(
    python: str,
    model: str,
    spec: SpecConfig,
    options: dict,
    host: str,
    port: int,
    draft: str | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
) -> list[str]:
    """The SGLang server launch command for `spec`, refused when SGLang would rewrite it."""
    problems = sglang_spec_problems(spec) + extra_args_problems(
        "sglang", options.get("extra_args", [])
    )
    _refuse(problems)
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model]
    cmd += ["--host", host, "--port", str(port)]
    if options.get("tp_size", 1) > 1:
        cmd += ["--tp-size", str(options["tp_size"])]
    if options.get("mem_fraction_static") is not None:
        cmd += ["--mem-fraction-static", str(options["mem_fraction_static"])]
    if options.get("context_length") is not None:
        cmd += ["--context-length", str(options["context_length"])]
    if not spec.is_baseline:
        if draft is None:
            raise ValueError(f"speculative config {spec.name} needs a draft path")
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft]
        if spec.num_steps is not None:
            # Written out in full (draft tokens included) so the logged command is what runs.
            steps, topk, draft_tokens = resolve_sglang_spec(spec, None)
            cmd += ["--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk)]
            cmd += ["--speculative-num-draft-tokens", str(draft_tokens)]
    if reasoning_parser:
        cmd += ["--reasoning-parser", reasoning_parser]
    if tool_call_parser:
        cmd += ["--tool-call-parser", tool_call_parser]
    cmd += list(options.get("extra_args", []))
    return cmd


# Where vLLM keeps the OpenAI server's argument parser: 0.32 moved it under `launchers`.
_VLLM_CLI_ARGS = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")
_VLLM_ARGPARSE = ("vllm.utils.argparse_utils", "vllm.utils")


def vllm_flag_problems(cmd: Sequence[str]) -> list[str]:
    """Parse a `vllm_command` with the installed vLLM's own server parser (and its checks of the
    parsed arguments): [] when this vLLM version accepts every flag, else what it said."""
    import importlib

    def first(modules: tuple[str, ...], name: str):
        for mod in modules:
            try:
                obj = getattr(importlib.import_module(mod), name, None)
            except ImportError:
                continue
            if obj is not None:
                return obj
        raise ImportError(f"{name} not found in {', '.join(modules)}")

    make_arg_parser = first(_VLLM_CLI_ARGS, "make_arg_parser")
    version = getattr(importlib.import_module("vllm"), "__version__", None) or _vllm_version()
    parser = make_arg_parser(first(_VLLM_ARGPARSE, "FlexibleArgumentParser")())
    argv = list(cmd)[3:]  # after `python -m <module>`
    try:
        args = parser.parse_args(argv)
        validate = None
        try:
            validate = first(_VLLM_CLI_ARGS, "validate_parsed_serve_args")
        except ImportError:  # a release without the post-parse checks
            pass
        if validate is not None:
            validate(args)
    except SystemExit as e:  # argparse's error exit; its message went to stderr
        return [f"vLLM {version} refused {format_command(argv)} (exit {e.code})"]
    except (TypeError, ValueError) as e:
        return [f"vLLM {version} refused {format_command(argv)}: {e}"]
    if json.loads(json.dumps(getattr(args, "speculative_config", None) or {})) != (
        json.loads(argv[argv.index("--speculative-config") + 1])
        if "--speculative-config" in argv
        else {}
    ):
        return [f"vLLM {version} read --speculative-config as {args.speculative_config}"]
    return []


def format_command(cmd: Sequence[str]) -> str:
    """A shell-quoted command line for logs and model cards."""
    return shlex.join(cmd)


# ---------------------------------------------------------------------------------------------
# Managed servers: start, wait, stream the log, detect early death, stop the process group.


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Own process group, and SIGTERM when the stage process dies (even by SIGKILL)."""
    import ctypes
    import os
    import signal

    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Server:
    """An OpenAI-compatible engine run as a managed subprocess (a context manager).

    Output goes to `log_path` (the rule's log). `__enter__` waits until `/v1/models` answers, or
    raises EagleflowError with the last log lines if the process dies or the timeout passes.
    `__exit__` stops the whole process group: SIGTERM, then SIGKILL after `grace_s`.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        host: str,
        port: int,
        log_path: str | None = None,
        env: dict | None = None,
        startup_timeout_s: float = 900,
        grace_s: float = 20,
        api_key: str | None = None,
    ):
        self.cmd, self.host, self.port = list(cmd), host, port
        self.log_path, self.env = log_path, env
        self.startup_timeout_s, self.grace_s = startup_timeout_s, grace_s
        self.api_key = api_key
        self.proc = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Server:
        import os
        import subprocess
        import tempfile
        import time

        import requests

        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="eagleflow-server-", suffix=".log")
            os.close(fd)
        self._log = open(self.log_path, "ab", buffering=0)
        self._log.write(f"\n=== eagleflow: starting {format_command(self.cmd)}\n".encode())
        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=_die_with_parent,
        )
        start = time.monotonic()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while True:
            code = self.proc.poll()
            if code is not None:
                tail = self.log_tail()
                self._close_log()
                raise EagleflowError(
                    f"server exited with status {code} before answering on {self.url} "
                    f"(command: {format_command(self.cmd)}). Last log lines:\n{tail}"
                )
            try:
                r = requests.get(f"{self.url}/v1/models", timeout=2, headers=headers)
                if r.status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() - start > self.startup_timeout_s:
                tail = self.log_tail()
                self.stop()
                raise EagleflowError(
                    f"server did not answer on {self.url} within {self.startup_timeout_s:.0f} s "
                    f"(serve.startup_timeout_s); it was stopped. Last log lines:\n{tail}"
                )
            time.sleep(0.5)
        self.startup_s = time.monotonic() - start
        self._log.write(f"=== eagleflow: server ready after {self.startup_s:.1f} s\n".encode())
        return self

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server's whole process group (idempotent)."""
        import os
        import signal
        import subprocess

        if self.proc is None or self.proc.poll() is not None and not _group_alive(self.proc.pid):
            self._close_log()
            return
        for sig, wait in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.proc.pid):
                break
        # SIGKILL is delivered at once but a loaded machine takes a moment to tear the
        # processes down: wait for the group to be gone, so a stopped server holds nothing
        import time

        deadline = time.monotonic() + 60
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """True while a live (non-zombie) process of group `pgid` exists. Zombies are ignored: in a
    container without an init that reaps, killed orphans linger as zombies forever."""
    import os

    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def engine_env(engine: str, options: dict) -> dict:
    """Environment for a managed engine: offline hubs, and vLLM CPU's KV-cache size."""
    import importlib.util

    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(options.get("kv_cache_gib", 2))
        if importlib.util.find_spec("flashinfer") is None:
            # vLLM's CUDA sampler imports flashinfer unless told not to; the offline bundle
            # leaves flashinfer out (requirements/device-drop.txt)
            env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


def target_server(
    serve_cfg: dict,
    model: str,
    spec: SpecConfig,
    log_path: str | None,
    draft: str | None = None,
    served_name: str = "target",
    engine: str | None = None,
    parsers: bool = True,
) -> Server:
    """A managed Server for `model` (and `draft` for a speculative spec), flags from config.

    `parsers=False` leaves serve.reasoning_parser / serve.tool_call_parser out: a server with
    them returns the thinking and the tool calls parsed apart, not the text the target wrote."""
    import sys

    engine = engine or serve_cfg["engine"]
    host = serve_cfg["host"]
    port = serve_cfg["port"] or free_port(host)
    options = serve_cfg[engine]
    kw = parser_options(serve_cfg) if parsers and engine == serve_cfg["engine"] else {}
    if engine == "vllm":
        cmd = vllm_command(
            sys.executable, model, spec, options, host, port, draft, served_name, **kw
        )
    else:
        cmd = sglang_command(sys.executable, model, spec, options, host, port, draft, **kw)
        cmd += ["--served-model-name", served_name]
    return Server(
        cmd,
        host,
        port,
        log_path=log_path,
        env=engine_env(engine, options),
        startup_timeout_s=serve_cfg["startup_timeout_s"],
    )
