"""Runs INSIDE .venv-sglang: the parser names SGLang knows, and how it reads a request body.

stdin: JSON {"body": a chat-completions request}. stdout: one JSON object with
- `reasoning`: the keys of `ReasoningParser.DetectorMap` (imported);
- `tool_call`: the keys of `FunctionCallParser.ToolCallParserEnum`, read from
  srt/function_call/function_call_parser.py with ast: the module imports xgrammar, which the
  contract venv lacks (SGLang needs it only to constrain decoding);
- `*_choices`: what SGLang's own argument parser accepts for --reasoning-parser /
  --tool-call-parser;
- `request`: the fields of `body` as SGLang's ChatCompletionRequest parses them.
"""

import argparse
import ast
import json
import logging
import sys
from pathlib import Path

logging.disable(logging.WARNING)


def class_dict_keys(path: Path, cls: str, attr: str) -> list[str]:
    """Keys of the dict literal assigned to `cls.attr` in the class body of `path`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for stmt in node.body:
                target = getattr(stmt, "target", None)
                if getattr(target, "id", None) == attr and isinstance(stmt.value, ast.Dict):
                    return sorted(ast.literal_eval(k) for k in stmt.value.keys)
    raise AssertionError(f"{path}: no dict literal {cls}.{attr}; the file changed, read it again")


def main():
    request = json.load(sys.stdin)
    import sglang
    import sglang.srt.function_call as fc
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.parser.reasoning_parser import ReasoningParser
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    choices = {a.dest: sorted(a.choices or []) for a in parser._actions}
    fc_file = Path(fc.__path__[0]) / "function_call_parser.py"
    req = ChatCompletionRequest.model_validate(request["body"])
    calls = [c for m in req.messages for c in (getattr(m, "tool_calls", None) or [])]
    json.dump(
        {
            "version": sglang.__version__,
            "reasoning": sorted(ReasoningParser.DetectorMap),
            "tool_call": class_dict_keys(fc_file, "FunctionCallParser", "ToolCallParserEnum"),
            "reasoning_choices": choices["reasoning_parser"],
            "tool_call_choices": choices["tool_call_parser"],
            "request": {
                "skip_special_tokens": req.skip_special_tokens,
                "separate_reasoning": req.separate_reasoning,
                "tool_choice": req.tool_choice,
                "tools": [t.function.name for t in req.tools or []],
                "tool_call_arguments": [c.function.arguments for c in calls],
                "roles": [m.role for m in req.messages],
            },
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
