"""Runs INSIDE .venv-sglang: what SGLang's own code does with an eagleflow SGLang-format export.

stdin: JSON {"target_dir", "cases": [{"name", "draft_dir", "dump"}]}. stdout: one JSON object
with the sglang version and, per case:
- the config path: `prepare_server_args` + `publish` (the real server-args pipeline, on
  `--device cpu`), `ModelConfig.from_server_args` of the target, then
  `spec_aux_hidden_state.resolve_spec_aux_hidden_state_config` (which reads the draft's
  `eagle_config`) and `attention_backend_setup.configure_aux_hidden_state_capture` with the
  target's `LlamaForCausalLM.set_eagle3_layers_to_capture`: the ids read and the layers captured;
- the weights: `LlamaForCausalLMEagle3` built on CPU (gloo, world size 1) from the draft's
  ModelConfig hf_config, then its own `load_weights` fed by SGLang's own
  `safetensors_weights_iterator`; every parameter's weight loader is wrapped to record which
  exported tensor (and which shard of a fused qkv / gate_up parameter) it received. The loaded
  state dict is saved to `dump` so the test can compare values.

Stubbed: `vllm._custom_ops`, imported by SGLang's RotaryEmbedding constructor on a platform it
does not recognise (a CPU without its kernels); the stub's function is never called because no
forward runs.
"""

import json
import logging
import sys
import types

logging.disable(logging.WARNING)

ARGS = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
ARGS += ["--speculative-num-draft-tokens", "4"]


def _stub_vllm_ops():
    vllm = types.ModuleType("vllm")
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = None
    vllm._custom_ops = ops
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm._custom_ops", ops)


def _publish(target_dir, draft_dir):
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", target_dir, "--device", "cpu", "--speculative-algorithm", "EAGLE3"]
    argv += ["--speculative-draft-model-path", draft_dir, *ARGS]
    sa = prepare_server_args(argv)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))
    return sa


def _config_path(sa):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    target_config = ModelConfig.from_server_args(sa)
    cfg = resolve_spec_aux_hidden_state_config(
        server_args=sa,
        model_config=target_config,
        spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"),
        is_draft_worker=False,
    )
    target = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(is_last_rank=True),
        config=types.SimpleNamespace(num_hidden_layers=target_config.num_hidden_layers),
        model=types.SimpleNamespace(layers_to_capture=[]),
    )
    target.set_eagle3_layers_to_capture = types.MethodType(
        LlamaForCausalLM.set_eagle3_layers_to_capture, target
    )
    configure_aux_hidden_state_capture(
        model=target,
        eagle_use_aux_hidden_state=cfg.eagle_use_aux_hidden_state,
        eagle_aux_hidden_state_layer_ids=cfg.eagle_aux_hidden_state_layer_ids,
        dflash_use_aux_hidden_state=False,
        dflash_target_layer_ids=None,
        is_dspark=False,
    )
    read = cfg.eagle_aux_hidden_state_layer_ids
    return cfg.draft_model_config, {
        "use_aux_hidden_state": cfg.eagle_use_aux_hidden_state,
        "eagle_aux_hidden_state_layer_ids": list(read) if read is not None else None,
        "captured": list(target.model.layers_to_capture),
        "draft_architectures": list(cfg.draft_model_config.hf_config.architectures),
        "draft_num_layers": cfg.eagle_draft_num_layers,
    }


def _init_distributed():
    from sglang.srt.distributed import parallel_state as ps

    port = __import__("socket").socket()
    port.bind(("127.0.0.1", 0))
    addr = f"tcp://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    ps.init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=addr, local_rank=0, backend="gloo"
    )
    ps.initialize_model_parallel(backend="gloo")


def _load(draft_model_config, draft_dir, dump):
    from pathlib import Path

    import torch
    from safetensors.torch import save_file
    from sglang.srt.model_loader.weight_utils import (
        default_weight_loader,
        safetensors_weights_iterator,
    )
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    model = LlamaForCausalLMEagle3(draft_model_config.hf_config)
    current = [None]
    received = {}  # tensor name -> [[param, shard], ...]
    for pname, param in model.named_parameters():
        orig = getattr(param, "weight_loader", default_weight_loader)

        def record(p, w, *args, _pname=pname, _orig=orig):
            shard = args[0] if args else None
            received.setdefault(current[0], []).append([_pname, shard])
            return _orig(p, w, *args)

        param.weight_loader = record

    files = sorted(str(f) for f in Path(draft_dir).glob("*.safetensors"))
    names = []

    def weights():
        for name, tensor in safetensors_weights_iterator(files):
            current[0] = name
            names.append(name)
            yield name, tensor

    model.load_weights(weights())
    loaded = {p for targets in received.values() for p, _ in targets}
    params = {n: list(p.shape) for n, p in model.named_parameters()}
    save_file({n: p.detach().float().contiguous() for n, p in model.named_parameters()}, dump)
    hot = model.hot_token_id
    inner = model.model
    return {
        "tensors": names,
        "received": {n: received.get(n, []) for n in names},
        "params": params,
        "unset_params": sorted(set(params) - loaded),
        "hot_token_id": hot.tolist() if hot is not None else None,
        "num_aux_hidden_states": inner.num_aux_hidden_states,
        "fc_in": inner.fc.in_features,
        "norm_before_fc": inner.norm_before_fc,
        "fc_norm": inner.fc_norm is not None,
        "norm_output": bool(inner.norm_output),
        "load_lm_head_from_target": model.load_lm_head_from_target,
        "tie_word_embeddings": bool(model.config.tie_word_embeddings),
        "lm_head": list(model.lm_head.weight.shape),
        "layers": len(inner.layers),
        "dtype": str(torch.get_default_dtype()),
    }


def main():
    request = json.load(sys.stdin)
    _stub_vllm_ops()
    import importlib.util

    import sglang
    import sglang.srt.models.llama_eagle3 as eagle3

    # Located, not imported: it imports the scheduler, which needs setproctitle (not here).
    worker = importlib.util.find_spec("sglang.srt.speculative.eagle_worker_v2").origin

    out = {
        "version": sglang.__version__,
        "llama_eagle3_file": eagle3.__file__,
        "eagle_worker_file": worker,
        "cases": {},
    }
    started = False
    for case in request["cases"]:
        sa = _publish(request["target_dir"], case["draft_dir"])
        draft_model_config, config_path = _config_path(sa)
        if not started:
            _init_distributed()
            started = True
        result = {"config_path": config_path}
        result.update(_load(draft_model_config, case["draft_dir"], case["dump"]))
        out["cases"][case["name"]] = result
    # last line of stdout: SGLang's loaders may print progress before it
    sys.stdout.write("\n" + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
