"""Runs INSIDE .venv-sglang: how SGLang's DFLASH reads a native draft's layer ids.

stdin: JSON {"num_target_layers": L, "cases": {name: dflash_config.target_layer_ids}}.
stdout: one JSON object, per case: the ids `parse_dflash_draft_config(...)
.resolve_target_layer_ids` returns (or its error), and the layers LlamaForCausalLM's own
`set_dflash_layers_to_capture` then captures (`model.layers_to_capture`, "before layer c").
"""

import json
import logging
import sys
import types

logging.disable(logging.WARNING)


def main():
    req = json.load(sys.stdin)
    import sglang
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    num_layers = req["num_target_layers"]
    import inspect

    from sglang.srt.models.llama import LlamaModel

    src = inspect.getsource(LlamaModel.forward)
    out = {
        "version": sglang.__version__,
        "cases": {},
        # capture ids are layer indices of the forward loop: c in range(start, end) only
        "loop_captures_before_layer": "for i in range(self.start_layer, self.end_layer)" in src
        and "if i in self.layers_to_capture" in src,
    }
    for name, ids in req["cases"].items():
        draft = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "num_hidden_layers": 1,
            "block_size": 8,
            "num_target_layers": num_layers,
            "dflash_config": {"target_layer_ids": ids, "mask_token_id": 2},
        }
        case = {}
        try:
            parsed = parse_dflash_draft_config(draft_hf_config=draft)
            case["resolved"] = parsed.resolve_target_layer_ids(target_num_layers=num_layers)
        except ValueError as e:
            case["error"] = str(e)
        else:
            # the target's own method on a stand-in self (no weights, last pipeline rank)
            fake = types.SimpleNamespace(
                pp_group=types.SimpleNamespace(is_last_rank=True),
                model=types.SimpleNamespace(),
            )
            LlamaForCausalLM.set_dflash_layers_to_capture(fake, case["resolved"])
            case["layers_to_capture"] = fake.model.layers_to_capture
        out["cases"][name] = case
    print(json.dumps(out))


if __name__ == "__main__":
    main()
