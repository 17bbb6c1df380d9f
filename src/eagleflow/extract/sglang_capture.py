"""SGLang's own EAGLE-3 aux hidden-state capture, read from a running server over HTTP.

A server started with `SGLANG_AUX_CAPTURE_FLAGS` answers `/generate` with the target's aux hidden
states, as the engine computes them for its drafts: what eagleflow's layer certificate compares
with the training extraction. Every format rule below was read from the sglang 0.5.23 wheel
(`sglang/srt/...`) and is contract-tested against its real code
(tests/contract/test_sglang_aux_capture.py). No sglang import: this runs in eagleflow's venv.

What the server returns, per request (`meta_info.hidden_states`):
- one row per forwarded token: every prompt token (prefill) then every generated token but the
  last (decode rows; the last sampled token is never forwarded). With `max_new_tokens=1` the rows
  are exactly the prompt tokens. `max_new_tokens=0` returns no rows at all.
- a row is the aux layers concatenated along the hidden dim, in ascending layer order (whatever
  the order of the ids), `num_aux * hidden_size` floats in the model's dtype, `.tolist()`-ed.
- the slots are the residual stream *entering* the captured layers (eagleflow's internal ids);
  the last layer's output before the final norm is never among them.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from eagleflow.errors import EagleflowError

# srt/arg_groups/fields/exec_.py (enable_return_aux_hidden_states) and
# srt/arg_groups/validation_hook.py::handle_aux_hidden_state_capture: the flag needs
# --speculative-algorithm EAGLE3 to name the capture convention, refuses a draft
# (--speculative-draft-model-path) and pp_size != 1, and resets the algorithm to None, so no
# speculative decoding runs on this server. srt/arg_groups/serving_hook.py::
# handle_return_hidden_states_mode then sets --return-hidden-states-mode full.
# The last four flags keep every prompt row in the response:
# srt/managers/scheduler_components/batch_result_processor.py::_append_prefill_hidden_states
# stores only the rows a prefill forward computes (radix-cache hits are skipped) and
# process_batch_result_prefill stores nothing for a middle chunk of a chunked prefill.
SGLANG_AUX_CAPTURE_FLAGS: tuple[str, ...] = (
    "--enable-return-aux-hidden-states",
    "--speculative-algorithm",
    "EAGLE3",
    "--disable-radix-cache",
    "--chunked-prefill-size",
    "-1",
)
LAYER_IDS_FLAG = "--return-aux-hidden-state-layer-ids"
_FIX = (
    "start the SGLang server with `"
    + " ".join(SGLANG_AUX_CAPTURE_FLAGS)
    + "` (and no --speculative-draft-model-path)"
)


def sglang_capture_launch_args(written_ids: Sequence[int] | None = None) -> list[str]:
    """Flags to add to `python -m sglang.launch_server` for a capture server.

    `written_ids` are the ids in SGLang's convention (`layers.sglang_ids(...).written`, as in a
    draft's eagle_config): the model file maps them, e.g. Llama captures `[i + 1 for i in ids]`
    (srt/models/llama.py::set_eagle3_layers_to_capture). None keeps SGLang's default
    [2, L//2, L-3]. srt/arg_groups/validation_hook.py refuses negative or repeated ids.
    """
    args = list(SGLANG_AUX_CAPTURE_FLAGS)
    if written_ids is not None:
        ids = [int(i) for i in written_ids]
        if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
            raise EagleflowError(
                f"SGLang aux layer ids {ids} are empty, negative or repeated; SGLang refuses "
                f"them ({LAYER_IDS_FLAG}). Capture the embeddings (id 0) with backend 'hf' or "
                "'vllm' instead, and list each layer once"
            )
        args += [LAYER_IDS_FLAG, *map(str, ids)]
    return args


def sglang_capture_request(
    token_ids: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int = 1
) -> dict:
    """The `/generate` JSON body asking for the aux hidden states of these prompts.

    A flat list is one request (the response is one object), a list of lists is a batch (the
    response is a list, in order): srt/managers/io_struct.py::GenerateReqInput
    (`input_ids`, `sampling_params`, `return_hidden_states`, `stream`). `return_hidden_states`
    must be the boolean True: the HTTP schema (sglang/api/v1/api_types.py::GenerateRequest,
    BoolOrList) refuses the string "last", which would keep only one row anyway.
    """
    if max_new_tokens < 1:
        raise EagleflowError(
            f"max_new_tokens={max_new_tokens}: SGLang returns no hidden-state rows for 0 "
            "(output_streamer.py cuts them to finished_len = 0); use 1 to get the prompt rows"
        )
    ids: Any
    if len(token_ids) and isinstance(token_ids[0], (list, tuple)):
        ids = [[int(t) for t in row] for row in token_ids]  # type: ignore[union-attr]
        empty = [i for i, row in enumerate(ids) if not row]
    else:
        ids = [int(t) for t in token_ids]  # type: ignore[arg-type]
        empty = [0] if not ids else []
    if empty:
        raise EagleflowError(f"prompts {empty} have no tokens; SGLang needs at least one each")
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0.0},
        "return_hidden_states": True,
        "stream": False,
    }


def _rows(hidden_states: list) -> list:
    """Flatten SGLang's nesting: the prefill appends a list of rows, each decode step one row.

    batch_result_processor.py::_append_prefill_hidden_states does
    `req.hidden_states.append(rows.tolist())`; _append_decode_hidden_states does `.extend(...)`.
    """
    rows: list = []
    for item in hidden_states:
        if isinstance(item, list) and item and isinstance(item[0], list):
            rows.extend(item)
        elif isinstance(item, list) and item:
            rows.append(item)
    return rows


def _parse_one(resp: Any, num_aux: int, hidden_size: int, where: str):
    import torch

    if not isinstance(resp, dict):
        raise EagleflowError(f"{where}: expected a JSON object, got {type(resp).__name__}")
    if "error" in resp:  # srt/entrypoints/http_server.py::_create_error_response
        err = resp["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise EagleflowError(f"{where}: SGLang refused the request: {msg}. Fix: {_FIX}")
    meta = resp.get("meta_info")
    hs = meta.get("hidden_states") if isinstance(meta, dict) else None
    if hs is None:
        # srt/managers/tokenizer_manager.py::_handle_batch_output sets meta_info["hidden_states"]
        # only when the scheduler sent states for this request.
        raise EagleflowError(
            f"{where}: the response has no meta_info.hidden_states (keys: "
            f"{sorted(meta) if isinstance(meta, dict) else sorted(resp)}); expected the aux "
            f"hidden states. Fix: send return_hidden_states=true and {_FIX}"
        )
    rows = _rows(hs)
    width = num_aux * hidden_size
    if not rows:
        raise EagleflowError(
            f"{where}: meta_info.hidden_states is empty; expected one row per prompt token. "
            "Fix: request max_new_tokens >= 1 (0 yields no rows)"
        )
    widths = sorted({len(r) for r in rows})
    if widths != [width]:
        hint = (
            "these are last-layer states: the server has --enable-return-hidden-states but not "
            "--enable-return-aux-hidden-states"
            if widths == [hidden_size]
            else f"the server captures {widths[0] / hidden_size:g} layers, not {num_aux}; check "
            f"{LAYER_IDS_FLAG} (default 3 layers) and hidden_size"
        )
        raise EagleflowError(
            f"{where}: hidden-state rows have {widths} floats; expected num_aux * hidden_size = "
            f"{num_aux} * {hidden_size} = {width}: {hint}. Fix: {_FIX}"
        )
    prompt, completion = meta.get("prompt_tokens"), meta.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        expected = prompt + max(completion, 1) - 1
        if len(rows) != expected:
            cached = meta.get("cached_tokens") or 0
            cause = (
                f"{cached} prompt tokens came from the radix cache and were not recomputed"
                if cached
                else "a chunked prefill dropped its middle chunks' rows"
            )
            raise EagleflowError(
                f"{where}: {len(rows)} hidden-state rows; expected prompt_tokens + "
                f"completion_tokens - 1 = {expected} ({cause}). Fix: {_FIX}"
            )
    try:
        t = torch.tensor(rows, dtype=torch.float32)
    except TypeError:  # orjson (srt/utils/json_response.py::dumps_json) writes NaN/inf as null
        t = torch.tensor(
            [[math.nan if v is None else v for v in r] for r in rows], dtype=torch.float32
        )
    return t.view(len(rows), num_aux, hidden_size)


def parse_sglang_aux_hidden_states(response_json: Any, num_aux: int, hidden_size: int):
    """[T, num_aux, H] float32 from one `/generate` response, or a list of them for a batch.

    Slots are in ascending layer order (llama.py::LlamaModel.forward captures inside its layer
    loop; aux_hidden_states.py::pack_aux_hidden_states concatenates along dim -1); bf16/fp16
    values are exact in float32. A response without the field raises EagleflowError.
    """
    if isinstance(response_json, list):
        return [
            _parse_one(r, num_aux, hidden_size, f"SGLang response {i}")
            for i, r in enumerate(response_json)
        ]
    return _parse_one(response_json, num_aux, hidden_size, "SGLang response")


def _post(url: str, body: dict, timeout_s: float) -> Any:
    req = urllib.request.Request(
        url.rstrip("/") + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:  # 400 carries SGLang's {"error": {"message": ...}}
        text = e.read().decode(errors="replace")
        try:
            return json.loads(text)
        except ValueError:
            raise EagleflowError(f"SGLang {url} answered HTTP {e.code}: {text[:500]}") from e
    except (urllib.error.URLError, TimeoutError) as e:
        raise EagleflowError(
            f"cannot reach the SGLang server at {url} ({e}); start it with {_FIX}"
        ) from e


def capture_sglang(
    url: str,
    token_ids_list: Sequence[Sequence[int]],
    num_aux: int,
    hidden_size: int,
    batch_size: int = 8,
    timeout_s: float = 600.0,
) -> list:
    """Each prompt's aux hidden states [T_i, num_aux, H] (prompt tokens only), in order."""
    out: list = []
    for start in range(0, len(token_ids_list), max(1, batch_size)):
        chunk = [list(p) for p in token_ids_list[start : start + max(1, batch_size)]]
        resp = _post(url, sglang_capture_request(chunk), timeout_s)
        if isinstance(resp, dict):  # a refusal of the whole batch
            _parse_one(resp, num_aux, hidden_size, f"SGLang batch at prompt {start}")
        if not isinstance(resp, list) or len(resp) != len(chunk):
            raise EagleflowError(
                f"SGLang answered a batch of {len(chunk)} prompts with "
                f"{len(resp) if isinstance(resp, list) else type(resp).__name__}; expected a "
                "list of one response per prompt"
            )
        for i, (ids, r) in enumerate(zip(chunk, resp, strict=True)):
            t = _parse_one(r, num_aux, hidden_size, f"SGLang response for prompt {start + i}")
            if t.shape[0] != len(ids):
                raise EagleflowError(
                    f"prompt {start + i}: {t.shape[0]} rows for {len(ids)} tokens; expected one "
                    "per token (max_new_tokens=1). Fix: " + _FIX
                )
            out.append(t)
    return out
