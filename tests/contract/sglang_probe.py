"""Runs INSIDE .venv-sglang: asks the real sglang package what it does with our inputs.

stdin: JSON {"flags": [[argv...], ...], "capture": [{family, num_layers, written}, ...]}.
stdout: one JSON object with, per argv, the speculative (steps, topk, draft_tokens) SGLang's own
argument pipeline resolves it to (or the error it raises), and per capture case the layers its
model files' `set_eagle3_layers_to_capture` selects for the written eagle_config ids.
"""

import json
import logging
import sys

logging.disable(logging.WARNING)


def resolve_flags(argvs):
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import prepare_server_args

    out = []
    for argv in argvs:
        try:
            sa = prepare_server_args(list(argv))
            sa.resolve_once()
            fields = (
                "speculative_num_steps",
                "speculative_eagle_topk",
                "speculative_num_draft_tokens",
            )
            out.append({"resolved": [resolution_result(sa, f) for f in fields]})
        except BaseException as e:  # SGLang raises AssertionError/TypeError/ValueError alike
            out.append({"error": f"{type(e).__name__}: {e}"[:300]})
    return out


def capture_layers(cases):
    """SGLang's own set_eagle3_layers_to_capture, called unbound on a stand-in model object."""
    import types

    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM
    from sglang.srt.models.llama import LlamaForCausalLM

    classes = {"llama": LlamaForCausalLM, "deepseek": DeepseekV2ForCausalLM}
    out = []
    for case in cases:
        ns = types.SimpleNamespace(
            pp_group=types.SimpleNamespace(is_last_rank=True),
            config=types.SimpleNamespace(num_hidden_layers=case["num_layers"]),
            model=types.SimpleNamespace(layers_to_capture=[]),
        )
        classes[case["family"]].set_eagle3_layers_to_capture(ns, case["written"])
        out.append(list(ns.model.layers_to_capture))
    return out


def main():
    request = json.load(sys.stdin)
    import sglang

    result = {"version": sglang.__version__}
    if "capture" in request:
        result["capture"] = capture_layers(request["capture"])
    if "flags" in request:
        result["flags"] = resolve_flags(request["flags"])
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
