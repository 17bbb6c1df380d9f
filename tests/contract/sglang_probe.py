"""Runs INSIDE .venv-sglang: asks the real sglang package what it does with our inputs.

stdin: JSON {"flags": [[argv...], ...]}. stdout: one JSON object with, per argv, the speculative
(steps, topk, draft_tokens) SGLang's own argument pipeline resolves it to, or the error it raises.
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


def main():
    request = json.load(sys.stdin)
    import sglang

    result = {"version": sglang.__version__}
    if "flags" in request:
        result["flags"] = resolve_flags(request["flags"])
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
