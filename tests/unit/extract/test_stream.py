"""Streamed hidden states (extract.mode online / hybrid) on the tiny pipeline (CPU, fp32):
online trains step for step like offline, hybrid's later epochs read what its first stored, a
source that is not the certified one stops training before step 0."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from eagleflow.errors import TrainError
from eagleflow.extract import stream
from eagleflow.extract.hf import PROGRESS
from tests.unit.train.test_loop import EXTRACT, run, training_inputs

STREAM = {"recheck_steps": 3}


def metrics(out: Path) -> dict[int, dict[str, float]]:
    """Training rows of metrics.csv by step: loss and every accuracy column."""
    with open(out / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "train"]
    keep = [k for k in rows[0] if k == "loss" or "acc" in k]
    return {int(r["step"]): {k: float(r[k]) for k in keep if r[k] != ""} for r in rows}


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline")
    inputs, man, _ = training_inputs(root)
    return root, inputs, run(inputs, root / "out")


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    inputs, man, _ = training_inputs(root, dict(EXTRACT, mode="online"))
    return root, inputs, man, run(inputs, root / "out", stream=STREAM)


def test_stream_manifest_holds_only_the_probe_rows(online):
    root, inputs, man, _ = online
    assert man["mode"] == "online" and man["num_samples"] == 16 and man["probe_rows"]
    assert [s["row"] for s in man["shards"]] == man["probe_rows"]
    files = sorted(p.name for p in Path(man["root"]).glob("hs_*.safetensors"))
    assert files == sorted(f"hs_{r}.safetensors" for r in man["probe_rows"])
    cert = json.loads(Path(inputs["certificate"]).read_text())
    checks = {c["name"]: c for c in cert["checks"]}
    assert checks["hf_forward_hooks"]["passed"]
    assert checks["hf_forward_hooks"]["reference"]["mode"] == "batch1_unpadded"
    assert cert["manifest"]["mode"] == "online"


@pytest.mark.slow
def test_online_trains_step_for_step_like_offline(offline, online):
    *_, off_summary = offline
    root, _, man, on_summary = online
    off, on = metrics(root.parent / offline[0].name / "out"), metrics(root / "out")
    assert sorted(on) == sorted(off) and len(on) >= 12
    worst = max(abs(on[s][k] - off[s][k]) for s in off for k in off[s])
    print(f"online vs offline, worst difference over {len(off)} steps: {worst:.2e}")
    assert worst <= 1e-6, worst
    hs = on_summary["hidden_states"]
    assert hs["source"] == "stream (hf)" and hs["mode"] == "online"
    assert hs["forwards"] > 0 and hs["batches_hashed"] == on_summary["steps"]
    whens = [c["when"] for c in hs["checks"]]
    assert whens[0] == "before step 0" and "at step 3" in whens  # verify.recheck_steps
    assert all(c["max_rel_err"] <= c["tolerance_rel"] for c in hs["checks"])
    assert off_summary["hidden_states"]["source"] == "shards"
    # nothing but the probe rows was ever stored
    assert len(list(Path(man["root"]).glob("hs_*.safetensors"))) == len(man["probe_rows"])


@pytest.mark.slow
def test_hybrid_later_epochs_read_what_the_first_stored(online, tmp_path):
    _, _, _, on_summary = online
    inputs, man, _ = training_inputs(tmp_path, dict(EXTRACT, mode="hybrid"))
    summary = run(inputs, tmp_path / "out", stream=STREAM)
    hs = summary["hidden_states"]
    store = Path(man["root"])
    stored = len(list(store.glob("hs_*.safetensors")))
    assert stored == 16  # every row, after the first epoch
    assert len((store / PROGRESS).read_text().splitlines()) == 16
    # later epochs read the store: far fewer forwards than samples seen
    assert hs["stored_rows_read"] > 0 and hs["forwards"] < 16 + len(hs["checks"]) * 3 + 1
    # the same states as the online run, batch for batch
    assert hs["batches_sha256"] == on_summary["hidden_states"]["batches_sha256"]


def _stops_before_step_0(inputs, tmp_path):
    """Training the certified run streams layers [1, 2, 3] for [embed, 1, 3]: stopped before
    step 0, slots and ids named, nothing written."""
    steps = []
    with pytest.raises(TrainError) as e:
        run(inputs, tmp_path / "out", stream=STREAM, on_step=steps.append)
    msg = str(e.value)
    assert "before step 0" in msg and "[embed, 1, 3]" in msg, msg
    assert "slot 0 (certified layer 0)" in msg and "matches certified layer 1 best" in msg, msg
    assert not steps and not (tmp_path / "out" / "summary.json").exists()


def test_a_source_of_other_layers_stops_training_before_step_0(online, tmp_path, monkeypatch):
    _, inputs, man, _ = online
    real = stream.HFSource.capture

    def shifted(self, ids):  # a server started with other aux ids: [1, 2, 3] for [embed, 1, 3]
        saved, self.aux = self.aux, [1, 2, 3]
        try:
            return real(self, ids)
        finally:
            self.aux = saved

    monkeypatch.setattr(stream.HFSource, "capture", shifted)
    _stops_before_step_0(inputs, tmp_path)


def test_as_stored_rounds_like_the_store(tmp_path):
    hs = torch.randn(5, 3, 8)
    assert torch.equal(stream.as_stored(hs, "float32", torch.float32), hs)
    assert torch.equal(
        stream.as_stored(hs, "bfloat16", torch.float32), hs.to(torch.bfloat16).float()
    )
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    v, s = quantize_tensor_to_fp8(hs)
    assert torch.equal(stream.as_stored(hs, "fp8", torch.bfloat16), dequantize_fp8_tensor(v, s))


# ---- backend vllm: a real vLLM CPU capture server, reached through speculators' online client


class _Slots:
    """A stream source on the module's one capture server, which captures every layer of the
    tiny target (ids 0..4): this source hands on the slots `slots`, as a server started with
    those aux ids would (one vLLM start serves the certified and the shifted case)."""

    name = "vllm"

    def __init__(self, server, slots):
        self.server, self.slots = server, slots

    def capture(self, ids):
        return self.server.capture(ids)[:, self.slots]

    forwards = property(lambda self: self.server.forwards)
    seconds = property(lambda self: self.server.seconds)

    def close(self):  # the module's server outlives each run
        pass


@pytest.fixture(scope="module")
def capture_server(online):
    from eagleflow.target.prepare import load_target_json

    _, inputs, _, _ = online
    target = load_target_json(inputs["target"])
    opts = {"max_model_len": 256, "max_num_seqs": 4, "enforce_eager": True, "kv_cache_gib": 1}
    src = stream.VllmSource(target, [0, 1, 2, 3], {"vllm": opts, "startup_timeout_s": 900})
    yield src
    src.close()


@pytest.fixture
def one_torch_thread():
    """Training beside the capture server runs on one torch thread (restored after). After each
    request vLLM's worker busy-polls its message queue for a second (shm_broadcast's
    SpinCondition), so while training streams it holds one of the 2 cores throughout; a 2-thread
    torch then waits at every parallel region for its starved thread (24 steps: ~32 s at 2
    threads, ~6 s at 1). What the test compares does not move: its tolerance is 1e-3, the
    difference ~1e-7."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _use(monkeypatch, source):
    from eagleflow.train import loop

    monkeypatch.setattr(stream, "open_source", lambda *a, **k: source)
    monkeypatch.setattr(loop, "open_source", lambda *a, **k: source)


@pytest.mark.slow
def test_online_through_vllm_capture_trains_like_hf_in_process(
    online, capture_server, one_torch_thread, tmp_path, monkeypatch
):
    """extract.backend vllm, mode online: the probe rows come from vLLM's capture, the certificate
    holds them against HF's forward hooks (fp32 tolerance), training streams every batch from the
    server and trains like the in-process source; no shard but the probes is written."""
    _use(monkeypatch, _Slots(capture_server, [0, 1, 3, 4]))  # [embed, 1, 3] + final
    before = capture_server.forwards
    inputs, man, _ = training_inputs(tmp_path, dict(EXTRACT, mode="online", backend="vllm"))
    assert man["backend"] == "vllm" and man["stream"]["source"] == "vllm"
    cert = json.loads(Path(inputs["certificate"]).read_text())
    hooks = {c["name"]: c for c in cert["checks"]}["hf_forward_hooks"]
    assert hooks["passed"] and hooks["max_rel_err"] <= 1e-4, hooks["max_rel_err"]
    summary = run(inputs, tmp_path / "out", stream=STREAM)
    hs = summary["hidden_states"]
    assert hs["source"] == "stream (vllm)" and capture_server.forwards - before > 16
    assert all(c["max_rel_err"] <= c["tolerance_rel"] for c in hs["checks"])
    root, _, _, _ = online
    on, got = metrics(root / "out"), metrics(tmp_path / "out")
    assert sorted(got) == sorted(on)
    worst = max(abs(got[s][k] - on[s][k]) for s in on for k in on[s])
    print(f"vllm vs hf online, worst difference over {len(on)} steps: {worst:.2e}")
    assert worst <= 1e-3, worst
    assert len(list(Path(man["root"]).glob("hs_*.safetensors"))) == len(man["probe_rows"])


def test_a_vllm_server_of_other_layers_stops_training_before_step_0(
    online, capture_server, tmp_path, monkeypatch
):
    """The certified run's manifest, streamed from a capture server of aux ids [1, 2, 3] (for the
    certified [embed, 1, 3]): stopped before step 0, slots and ids named."""
    _, inputs, _, _ = online
    _use(monkeypatch, _Slots(capture_server, [1, 2, 3, 4]))
    _stops_before_step_0(inputs, tmp_path)


class _Counting:
    """A source of fixed random states (3 slots of 16, with one massive token as real targets
    have), counting its forwards."""

    def __init__(self):
        self.forwards = 0

    def capture(self, ids):
        self.forwards += 1
        g = torch.Generator().manual_seed(len(ids))
        hs = torch.randn(len(ids), 3, 16, generator=g)
        hs[0] *= 1000.0
        return hs


@pytest.mark.parametrize("dtype", ["fp8", "bfloat16"])
def test_hybrid_store_keeps_what_it_streamed_in_the_store_dtype(tmp_path, dtype):
    """A hybrid store of fp8 (or bf16): the first read of a row captures and stores it, the second
    reads the store (no forward) and gets the same values the first handed to training; a shard
    cut short is captured again."""
    from eagleflow.train.stream import StreamTransfer
    from tests.support.tiny import tiny_dataset

    ds = tiny_dataset(tmp_path / "ds")
    store = tmp_path / "store"
    store.mkdir()
    man = {"root": str(store), "mode": "hybrid", "dtype": dtype}
    src = _Counting()
    first = StreamTransfer(src, ds, man, torch.float32).get_cached(2)
    again = StreamTransfer(src, ds, man, torch.float32)  # a resumed run: the progress file
    second = again.get_cached(2)
    assert src.forwards == 1 and again.read == 1
    assert torch.equal(first["hidden_states"], second["hidden_states"])
    assert torch.equal(first["token_ids"], second["token_ids"])
    ref = src.capture(first["token_ids"].tolist())
    assert torch.equal(first["hidden_states"], stream.as_stored(ref, dtype, torch.float32))
    if dtype == "fp8":
        assert not torch.equal(first["hidden_states"], ref)  # e4m3 rounding, not the raw values
    shard = next(store.glob("hs_2.*"))
    shard.write_bytes(shard.read_bytes()[:-8])  # a crash mid-write
    third = StreamTransfer(src, ds, man, torch.float32)
    third.get_cached(2)
    assert third.read == 0 and third.captured == 1
