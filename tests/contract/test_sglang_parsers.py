"""eagleflow's lists of SGLang's reasoning and tool-call parsers against the real sglang package.

Config validation refuses a serve.reasoning_parser / serve.tool_call_parser that SGLang 0.5.23 does
not know, from names kept in eagleflow.engines (SGLang is not importable in the main venv). Here
they are compared with SGLang's own registries and with the choices its argument parser offers, so a
release that adds or renames a parser fails here, not on a GPU host. (The tool-call registry's
module imports xgrammar, which the contract venv lacks; its keys are read from the file, and the
argument parser's choices come from SGLang's own name list, which SGLang's tests keep equal to it.)
"""

from pathlib import Path

import pytest

from eagleflow import engines
from eagleflow.data import prompts as data_prompts
from eagleflow.data import regenerate as data_regen
from tests.contract.probe import run_probe

pytestmark = pytest.mark.contract


TOOL_CONVERSATION = Path(__file__).parents[1] / "data" / "tool_conversation.jsonl"


def _regeneration_body() -> dict:
    """What regeneration sends SGLang for the test conversation's tool exchange."""
    (prompt,), _ = data_prompts.read_source({"path": str(TOOL_CONVERSATION)})
    call, result = prompt["exchanges"][0]
    messages = [{"role": "user", "content": prompt["turns"][0]}]
    messages += [{**call, data_regen.FROM_DATASET: True}, result]
    cfg = {"max_tokens": 8, "temperature": 0.0, "engine": "sglang"}
    return data_regen.chat_request("target", messages, cfg, prompt["tools"])


@pytest.fixture(scope="module")
def sglang_parsers(sglang_python):
    return run_probe(sglang_python, "sglang_parsers_probe.py", {"body": _regeneration_body()})


def test_the_lists_are_sglangs_release(sglang_parsers):
    assert sglang_parsers["version"] == engines.SGLANG_PARSERS_RELEASE


def test_reasoning_parsers_match_sglangs_detector_map(sglang_parsers):
    assert sorted(engines.SGLANG_REASONING_PARSERS) == sglang_parsers["reasoning"]
    auto = [engines.SGLANG_AUTO_PARSER]
    assert (
        sorted(auto + list(engines.SGLANG_REASONING_PARSERS)) == sglang_parsers["reasoning_choices"]
    )


def test_tool_call_parsers_match_sglangs_parser_enum(sglang_parsers):
    assert sorted(engines.SGLANG_TOOL_CALL_PARSERS) == sglang_parsers["tool_call"]
    auto = [engines.SGLANG_AUTO_PARSER]
    assert (
        sorted(auto + list(engines.SGLANG_TOOL_CALL_PARSERS)) == sglang_parsers["tool_call_choices"]
    )


def test_sglang_reads_the_regeneration_request_as_raw_output(sglang_parsers):
    """SGLang's own request model keeps eagleflow's raw-output fields: special tokens kept,
    reasoning not separated, tool_choice auto (with "none" SGLang leaves the tools out of the
    prompt), and the dataset's tool call sent with OpenAI's JSON-string arguments."""
    assert sglang_parsers["request"] == {
        "skip_special_tokens": False,
        "separate_reasoning": False,
        "tool_choice": "auto",
        "tools": ["get_weather"],
        "tool_call_arguments": ['{"city": "Paris"}'],
        "roles": ["user", "assistant", "tool"],
    }
