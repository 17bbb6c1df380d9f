"""eagleflow's SGLang aux-capture client against the real sglang package (run in .venv-sglang).

The probe builds `/generate` responses with SGLang's own request, scheduler and output code
(sglang_aux_probe.py lists what it calls); `eagleflow.extract.sglang_capture` must read back exactly
the tensors they were built from, and must refuse the responses that lack them. What the probe
cannot call on CPU (the model forward, the tokenizer manager's output loop, http_server.py) is
pinned here by its source text: a release that changes those lines fails this test.
"""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

from eagleflow import layers as lay
from eagleflow.errors import EagleflowError
from eagleflow.extract.sglang_capture import (
    SGLANG_AUX_CAPTURE_FLAGS,
    capture_sglang,
    parse_sglang_aux_hidden_states,
    sglang_capture_launch_args,
    sglang_capture_request,
)
from tests.contract.probe import run_probe

pytestmark = pytest.mark.contract

NUM_LAYERS, HIDDEN = 8, 32
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}
DRAFT = dict(
    LLAMA, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=64
)
NUM_AUX = 3  # SGLang's default EAGLE3 capture: [2, L//2, L-3]
PROMPT = [1, 2, 3, 4, 5]
BATCH = [[1, 2, 3, 4, 5], [6, 7, 8]]


def _cases():
    single = sglang_capture_request(PROMPT)
    return [
        ("single", single, "capture"),
        ("batch", sglang_capture_request(BATCH), "capture"),
        ("decode", sglang_capture_request([9, 10, 11, 12], max_new_tokens=3), "capture"),
        ("mnt0", dict(single, sampling_params={"max_new_tokens": 0}), "capture"),
        ("no_return", dict(single, return_hidden_states=False), "capture"),
        ("last_layer_only", single, "last_layer_only"),
        ("plain_server", single, "plain"),
    ]


@pytest.fixture(scope="module")
def probe(sglang_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_aux")
    for name, conf in (("target", LLAMA), ("draft", DRAFT)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(conf))
    request = {
        "model_dir": str(root / "target"),
        "draft_dir": str(root / "draft"),
        "capture_flags": list(SGLANG_AUX_CAPTURE_FLAGS),
        "cases": [{"name": n, "body": b, "server": s} for n, b, s in _cases()],
    }
    return run_probe(sglang_python, "sglang_aux_probe.py", request, timeout=900)


def _expected(case):
    return [torch.tensor(e) for e in case["expected"]]


# --- request side ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n, _, _ in _cases()])
def test_request_is_what_sglang_reads(probe, name):
    body = dict((n, b) for n, b, _ in _cases())[name]
    req = probe["cases"][name]["request"]
    assert all(req["fields_present"].values()), req["fields_present"]  # GenerateReqInput fields
    assert req["unknown_keys"] == []
    assert req["contract_error"] is None  # the HTTP schema gate admits the body
    ids = body["input_ids"]
    assert req["sub_input_ids"] == (ids if isinstance(ids[0], list) else [ids])
    assert req["is_single"] == (not isinstance(ids[0], list))
    assert req["sub_return_hidden_states"] == [body["return_hidden_states"]] * req["batch_size"]
    assert req["max_new_tokens"] == [body["sampling_params"]["max_new_tokens"]] * len(
        req["sub_input_ids"]
    )


def test_request_builder_refuses_what_returns_nothing():
    with pytest.raises(EagleflowError, match="max_new_tokens=0"):
        sglang_capture_request(PROMPT, max_new_tokens=0)
    with pytest.raises(EagleflowError, match="no tokens"):
        sglang_capture_request([[1, 2], []])


# --- flags and layers -----------------------------------------------------------------------


def test_capture_flags_resolve_to_a_capture_only_server(probe):
    r = probe["flags"]["capture"]["resolved"]
    assert r["aux_hidden_state_capture"] == "eagle3"
    assert r["speculative_algorithm"] is None  # no draft, no speculative decoding on this server
    assert r["return_hidden_states_mode"] == "full"
    assert r["disable_radix_cache"] is True and r["chunked_prefill_size"] == -1


def test_capture_flags_are_refused_with_a_draft_or_without_the_algorithm(probe):
    f = probe["flags"]
    assert "drop --speculative-draft-model-path" in f["with_draft"]["error"]
    assert "needs --speculative-algorithm EAGLE3" in f["no_algorithm"]["error"]
    assert "non-negative" in f["capture_negative_id"]["error"]
    with pytest.raises(EagleflowError, match="negative"):
        sglang_capture_launch_args([-1, 3])


def test_captured_layers(probe):
    lays = probe["layers"]
    assert lays["capture"]["layers_to_capture"] == lay.default_aux(NUM_LAYERS)  # [2, 4, 5]
    # explicit ids follow the Llama file's +1, like a draft's eagle_config
    args = sglang_capture_launch_args([1, 3, 5])
    assert args[-4:] == ["--return-aux-hidden-state-layer-ids", "1", "3", "5"]
    assert probe["flags"]["capture_ids"]["resolved"]["return_aux_hidden_state_layer_ids"] == [
        1,
        3,
        5,
    ]
    assert lays["capture_ids"]["layers_to_capture"] == [2, 4, 6]
    # the highest id SGLang accepts hooks the input of layer L, which does not exist: the last
    # layer's pre-norm output (EAGLE-3's final slot) is never captured
    assert lays["capture_last_id"]["layers_to_capture"] == [NUM_LAYERS]


# --- response side --------------------------------------------------------------------------


def test_single_round_trip(probe):
    case = probe["cases"]["single"]
    got = parse_sglang_aux_hidden_states(json.loads(case["json"]), NUM_AUX, HIDDEN)
    (want,) = _expected(case)
    assert got.shape == (len(PROMPT), NUM_AUX, HIDDEN) and got.dtype == torch.float32
    assert torch.equal(got, want)  # bf16 values survive JSON exactly


def test_batch_round_trip(probe):
    case = probe["cases"]["batch"]
    resp = json.loads(case["json"])
    assert isinstance(resp, list) and len(resp) == len(BATCH)
    got = parse_sglang_aux_hidden_states(resp, NUM_AUX, HIDDEN)
    for g, w, ids in zip(got, _expected(case), BATCH, strict=True):
        assert g.shape == (len(ids), NUM_AUX, HIDDEN)
        assert torch.equal(g, w)


def test_decode_rows_follow_the_prompt_rows(probe):
    case = probe["cases"]["decode"]
    resp = json.loads(case["json"])
    hs = resp["meta_info"]["hidden_states"]
    # prefill appends one list of rows, each decode step one row; the last token is not forwarded
    assert [len(hs[0]), len(hs[1]), len(hs[2])] == [4, NUM_AUX * HIDDEN, NUM_AUX * HIDDEN]
    got = parse_sglang_aux_hidden_states(resp, NUM_AUX, HIDDEN)
    assert got.shape == (4 + 3 - 1, NUM_AUX, HIDDEN)
    assert torch.equal(got, _expected(case)[0])


@pytest.mark.parametrize(
    "name, match",
    [
        ("mnt0", "empty"),
        ("no_return", "no meta_info.hidden_states"),
        ("last_layer_only", "last-layer states"),
        ("plain_server", "not configured to return hidden states"),
    ],
)
def test_responses_without_aux_states_are_refused(probe, name, match):
    case = probe["cases"][name]
    resp = json.loads(case["json"])
    with pytest.raises(EagleflowError, match=match) as err:
        parse_sglang_aux_hidden_states(resp, NUM_AUX, HIDDEN)
    assert "--enable-return-aux-hidden-states" in str(err.value) or name == "mnt0"
    if name == "plain_server":
        assert case["status"] == 400


def test_missing_prompt_rows_are_refused(probe):
    resp = json.loads(probe["cases"]["single"]["json"])
    hs = resp["meta_info"]["hidden_states"]
    resp["meta_info"]["hidden_states"] = [hs[0][2:]]
    resp["meta_info"]["cached_tokens"] = 2
    with pytest.raises(EagleflowError, match="radix cache"):
        parse_sglang_aux_hidden_states(resp, NUM_AUX, HIDDEN)


def test_non_finite_values_come_back_as_nan(probe):
    assert probe["nan_json"] == "[null,1.0]"  # orjson's NaN
    resp = json.loads(probe["cases"]["single"]["json"])
    resp["meta_info"]["hidden_states"][0][0][0] = None
    got = parse_sglang_aux_hidden_states(resp, NUM_AUX, HIDDEN)
    assert torch.isnan(got[0, 0, 0]) and torch.isfinite(got[1:]).all()


def test_capture_sglang_over_http(probe):
    """The client end to end against a stub server answering with SGLang's batch response."""
    body = probe["cases"]["batch"]["json"].encode()
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(
                (self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            )
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        got = capture_sglang(url, BATCH, NUM_AUX, HIDDEN, batch_size=2)
    finally:
        server.shutdown()
    assert seen == [("/generate", sglang_capture_request(BATCH))]
    for g, w in zip(got, _expected(probe["cases"]["batch"]), strict=True):
        assert torch.equal(g, w)


# --- what the probe cannot call: pinned by source text ---------------------------------------


def _src(probe, rel):
    return re.sub(r"\s+", " ", (Path(probe["srt_dir"]) / rel).read_text())


@pytest.mark.parametrize(
    "rel, snippet",
    [
        # the capture loop: hooks fire inside the layer loop, on layer inputs, in layer order
        ("models/llama.py", "for i in range(self.start_layer, self.end_layer):"),
        (
            "models/llama.py",
            "capture_output=aux_hidden_states.capture if i in self.layers_to_capture else None,",
        ),
        ("models/llama.py", "if len(aux_hidden_states) == 0: return hidden_states"),
        # the detokenizer passes the scheduler's lists through untouched
        ("managers/detokenizer_manager.py", "output_hidden_states=recv_obj.output_hidden_states,"),
        # the tokenizer manager puts them in meta_info, per request of a batch
        (
            "managers/tokenizer_manager.py",
            "hidden_states = recv_obj.output_hidden_states[i] if hidden_states is not None: "
            'meta_info["hidden_states"] = hidden_states',
        ),
        # http_server: a plain /generate answers with orjson_response; errors as {"error": ...}
        ("entrypoints/http_server.py", "return orjson_response(ret)"),
        (
            "entrypoints/http_server.py",
            'return ORJSONResponse( {"error": {"message": str(e)}}, '
            'status_code=getattr(e, "status_code", HTTPStatus.BAD_REQUEST), )',
        ),
    ],
)
def test_uncallable_rules_are_unchanged(probe, rel, snippet):
    assert snippet in _src(probe, rel), f"{rel} changed: re-check extract/sglang_capture.py"
