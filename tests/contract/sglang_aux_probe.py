"""Runs INSIDE .venv-sglang: builds `/generate` hidden-state responses with SGLang's real code.

stdin: JSON {"model_dir", "draft_dir", "capture_flags": [...], "cases": [{"name", "body",
"server": "capture"|"plain"}]}. stdout: one JSON object: the version, the request checks, the
resolved flags, the captured layers and, per case, the response text the server would send
(built by SGLang's own functions) with the per-request tensors it was built from.

Real code called (no GPU): server_args.prepare_server_args + resolve_once, the HTTP schema gate
(api_contract.generate_contract_error), GenerateReqInput.normalize_batch_and_arguments,
SamplingParams.normalize/verify, TokenizerManager._validate_one_request,
spec_aux_hidden_state._resolve_capture_only_aux_hidden_state,
attention_backend_setup.configure_aux_hidden_state_capture with LlamaForCausalLM's
set_eagle3_layers_to_capture, AuxHiddenStateList, LogitsProcessor._get_hidden_states_to_store,
SchedulerBatchResultProcessor._append_prefill_hidden_states / _append_decode_hidden_states,
Req.update_finish_state, SchedulerOutputStreamer._stream_output_generation, http_server's
and utils.json_response.dumps_json (the orjson_response body).
Not callable here: the model forward itself, TokenizerManager._handle_batch_output (an async
loop over live state) and http_server.py (imports setproctitle, not in this venv); the probe
mirrors the few lines it needs from them and the test checks that source text instead.
"""

import dataclasses
import json
import logging
import sys
import types
from array import array

logging.disable(logging.WARNING)

FIELDS = ("input_ids", "sampling_params", "return_hidden_states", "stream")


def resolve(argv):
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import prepare_server_args

    try:
        sa = prepare_server_args(list(argv))
        sa.resolve_once()
    except BaseException as e:  # SGLang raises ValueError/AssertionError alike
        return None, {"error": f"{type(e).__name__}: {e}"[:400]}
    names = (
        "speculative_algorithm",
        "aux_hidden_state_capture",
        "return_hidden_states_mode",
        "return_aux_hidden_state_layer_ids",
        "disable_radix_cache",
        "chunked_prefill_size",
        "pp_size",
    )
    return sa, {"resolved": {n: resolution_result(sa, n) for n in names}}


def publish(sa):
    from sglang.srt.runtime_context import get_context

    get_context().set_server_args(sa)


def captured_layers(num_layers, spec_algorithm):
    """Which layers the capture server hooks, through the model runner's own two steps."""
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        SpecAuxHiddenStateConfig,
        _resolve_capture_only_aux_hidden_state,
    )
    from sglang.srt.models.llama import LlamaForCausalLM

    cfg = SpecAuxHiddenStateConfig()
    model_config = types.SimpleNamespace(
        hf_text_config=types.SimpleNamespace(num_hidden_layers=num_layers)
    )
    _resolve_capture_only_aux_hidden_state(
        config=cfg, model_config=model_config, spec_algorithm=spec_algorithm, is_draft_worker=False
    )
    model = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(is_last_rank=True),
        config=types.SimpleNamespace(num_hidden_layers=num_layers),
        model=types.SimpleNamespace(layers_to_capture=[]),
        capture_aux_hidden_states=False,
    )
    model.set_eagle3_layers_to_capture = types.MethodType(
        LlamaForCausalLM.set_eagle3_layers_to_capture, model
    )
    configure_aux_hidden_state_capture(
        model=model,
        eagle_use_aux_hidden_state=cfg.eagle_use_aux_hidden_state,
        eagle_aux_hidden_state_layer_ids=cfg.eagle_aux_hidden_state_layer_ids,
        dflash_use_aux_hidden_state=cfg.dflash_use_aux_hidden_state,
        dflash_target_layer_ids=cfg.dflash_target_layer_ids,
        is_dspark=cfg.is_dspark,
    )
    return {
        "eagle_use_aux_hidden_state": cfg.eagle_use_aux_hidden_state,
        "capture_aux_hidden_states": model.capture_aux_hidden_states,
        "layers_to_capture": list(model.model.layers_to_capture),
    }


def check_request(body, vocab_size):
    """What SGLang's request path makes of our body (fields, schema gate, normalization)."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    names = {f.name for f in dataclasses.fields(GenerateReqInput)}
    out = {
        "fields_present": {k: k in names for k in FIELDS},
        "unknown_keys": sorted(k for k in body if k not in names),
        "contract_error": generate_contract_error(body),
    }
    obj = GenerateReqInput(**body)
    obj.normalize_batch_and_arguments()
    out["is_single"] = obj.is_single
    out["batch_size"] = 1 if obj.is_single else obj.batch_size
    subs = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
    out["sub_return_hidden_states"] = [s.return_hidden_states for s in subs]
    out["sub_input_ids"] = [list(s.input_ids) for s in subs]
    sps = []
    for s in subs:
        sp = SamplingParams(**s.sampling_params)
        sp.normalize(None)
        sp.verify(vocab_size)
        sps.append(sp)
    out["max_new_tokens"] = [sp.max_new_tokens for sp in sps]
    return obj, subs, sps, out


def validate(sub, context_len):
    """TokenizerManager._validate_one_request under the published server args."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    tm = types.SimpleNamespace(
        context_len=context_len,
        num_reserved_tokens=0,
        allow_auto_truncate=False,
        validate_total_tokens=True,
        is_generation=True,
        _validate_joint_schema_request=lambda obj, ids: None,
        _validate_token_ids_logprob=lambda obj: None,
    )
    TokenizerManager._validate_one_request(tm, sub, list(sub.input_ids))


def error_body(exc):
    """http_server.py::_create_error_response's body (that module needs setproctitle, absent
    here: the test checks its source text)."""
    from sglang.srt.utils.json_response import dumps_json

    return getattr(exc, "status_code", 400), dumps_json({"error": {"message": str(exc)}}).decode()


def run_requests(subs, sps, layers, hidden, is_single, seed):
    """Prefill then decode, as the scheduler does, with random residual streams per layer."""
    import torch
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor as P,
    )
    from sglang.srt.managers.scheduler_components.output_streamer import (
        SchedulerOutputStreamer,
    )
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        get_server_return_hidden_states_mode,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.utils.json_response import dumps_json

    gen = torch.Generator().manual_seed(seed)
    mode = get_server_return_hidden_states_mode()
    meta = types.SimpleNamespace(capture_hidden_mode=mode)

    def forward(num_tokens):
        """One forward: AuxHiddenStateList filled in layer order, as LlamaModel.forward does."""
        aux = AuxHiddenStateList()
        for i in range(max(layers, default=0) + 2):
            h = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
            if i in layers:
                aux.capture(h)
        final = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
        aux_arg = aux if len(aux) else None  # LlamaModel.forward returns no aux when none hooked
        stored = LogitsProcessor._get_hidden_states_to_store(
            None, final, None, aux_arg, final, None, aux_arg, None, meta
        )
        rows = torch.stack(list(aux), dim=1) if len(aux) else final[:, None]
        return rows, types.SimpleNamespace(hidden_states=stored)

    reqs = []
    for i, (s, sp) in enumerate(zip(subs, sps, strict=True)):
        reqs.append(
            Req(
                f"r{i}",
                "",
                array("q", s.input_ids),  # as tokenizer_manager.py builds it
                sp,
                return_hidden_states=s.return_hidden_states,
            )
        )
    expected = [[] for _ in reqs]
    lens = [len(r.origin_input_ids) for r in reqs]
    per_layer, out = forward(sum(lens))
    offset = 0
    for j, r in enumerate(reqs):
        expected[j].append(per_layer[offset : offset + lens[j]])
        offset = P._append_prefill_hidden_states(
            None,
            req=r,
            logits_output=out,
            hidden_state_offset=offset,
            capture_hidden_mode=CaptureHiddenMode.FULL if mode.is_full() else mode,
            extend_input_len=lens[j],
        )
        r.output_ids.append(11)
        r.update_finish_state()
    while True:
        running = [r for r in reqs if not r.finished()]
        if not running:
            break
        per_layer, out = forward(len(running))
        for k, r in enumerate(running):
            if r.return_hidden_states:
                P._append_decode_hidden_states(
                    req=r, hidden_states=out.hidden_states, start=k, accept_len=1
                )
            expected[reqs.index(r)].append(per_layer[k : k + 1])
            r.output_ids.append(12)
            r.update_finish_state()

    sent = []
    streamer = SchedulerOutputStreamer(
        send_to_detokenizer=types.SimpleNamespace(send_output=sent.append),
        tree_cache=None,
        server_args=None,
        is_generation=True,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        disaggregation_mode=DisaggregationMode.NULL,
        enable_hicache_storage=lambda: False,
    )
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_tp_rank=0, dp_rank=0):  # a single-GPU server's ranks
        streamer._stream_output_generation(reqs, return_logprob=False)
    payload = sent[0]
    responses = []
    for i, rid in enumerate(payload.rids):
        # tokenizer_manager.py::_handle_batch_output, the fields the client reads
        meta_info = {
            "id": rid,
            "finish_reason": payload.finished_reasons[i],
            "prompt_tokens": payload.prompt_tokens[i],
            "completion_tokens": payload.completion_tokens[i],
            "cached_tokens": payload.cached_tokens[i],
        }
        if getattr(payload, "output_hidden_states", None):
            hs = payload.output_hidden_states[i]
            if hs is not None:
                meta_info["hidden_states"] = hs
        responses.append(
            {"text": "", "output_ids": list(payload.output_ids[i]), "meta_info": meta_info}
        )
    ret = responses[0] if is_single else responses
    return {
        "json": dumps_json(ret).decode(),
        "expected": [torch.cat(e).float().tolist() for e in expected],
        "server_mode": mode.name,
    }


def main():
    request = json.load(sys.stdin)
    import sglang
    import torch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    config = json.load(open(f"{request['model_dir']}/config.json"))
    num_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    base = ["--model-path", request["model_dir"], "--device", "cuda"]
    flags = request["capture_flags"]
    result = {"version": sglang.__version__, "srt_dir": sglang.srt.__path__[0]}

    servers, flag_results = {}, {}
    for name, argv in {
        "capture": base + flags,
        "capture_ids": base + flags + ["--return-aux-hidden-state-layer-ids", "1", "3", "5"],
        "capture_last_id": base
        + flags
        + ["--return-aux-hidden-state-layer-ids", str(num_layers - 1)],
        "capture_negative_id": base + flags + ["--return-aux-hidden-state-layer-ids", "-1"],
        "no_algorithm": base + ["--enable-return-aux-hidden-states"],
        "with_draft": base + flags + ["--speculative-draft-model-path", request["draft_dir"]],
        "last_layer_only": base + ["--enable-return-hidden-states"],
        "plain": base,
    }.items():
        sa, flag_results[name] = resolve(argv)
        servers[name] = sa
    result["flags"] = flag_results

    layers = {}
    for name in ("capture", "capture_ids", "capture_last_id"):
        sa = servers[name]
        if sa is None:
            continue
        publish(sa)
        algo = SpeculativeAlgorithm.from_string(
            flag_results[name]["resolved"]["speculative_algorithm"]
        )
        layers[name] = captured_layers(num_layers, algo)
    result["layers"] = layers
    result["num_layers"], result["hidden_size"] = num_layers, hidden

    cases = {}
    for seed, case in enumerate(request["cases"]):
        publish(servers[case["server"]])
        obj, subs, sps, checks = check_request(case["body"], config["vocab_size"])
        entry = {"request": checks}
        try:
            for s in subs:
                validate(s, config["max_position_embeddings"])
        except ValueError as e:
            entry["status"], entry["json"] = error_body(e)
            cases[case["name"]] = entry
            continue
        hooked = layers["capture"]["layers_to_capture"] if case["server"] == "capture" else []
        entry.update(run_requests(subs, sps, hooked, hidden, obj.is_single, seed))
        cases[case["name"]] = entry
    result["cases"] = cases
    from sglang.srt.utils.json_response import dumps_json

    result["nan_json"] = dumps_json(torch.tensor([float("nan"), 1.0]).tolist()).decode()
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
