"""The layer certificate: stored shards proven, numerically, to hold the configured layers.

`verify_layers` reruns the target on probe samples (in the padded batch the hf backend extracted
them in, so bf16 kernels see the same shapes) with forward hooks on the *inputs* of the
configured decoder layers and the *output* of the last one (before the final norm), compares them
with the shards, checks that no other layer matches better, and, where an engine can capture
(vLLM here, SGLang on the GPU host), compares the engine's own capture of the same tokens.
Training and export call `require_certificate`, so a draft is never trained or exported on
layers nobody proved.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

from eagleflow import engines
from eagleflow import layers as lay
from eagleflow.errors import CertificateError
from eagleflow.extract.compare import probe_rows, rel_err, tolerance
from eagleflow.extract.hf import (
    decoder_layers,
    load_hf_target,
    load_shard,
    padded_batch,
    token_batches,
)
from eagleflow.extract.manifest import load_manifest
from eagleflow.extract.sglang_capture import capture_sglang, sglang_capture_launch_args
from eagleflow.target.prepare import load_target_json, sha256_file
from eagleflow.util import atomic_write_json

log = logging.getLogger(__name__)

CERT_VERSION = 1


def hook_capture(model, input_ids, aux: list[int]) -> dict:
    """Forward hooks: inputs of layers `aux`, output of the last layer, and HF's post-norm output.

    Returns {"aux": [T, n, H], "final": [T, H], "post_norm": [T, H], "inputs": [L, T, H]} for
    one unpadded sample (batch 1), all layer inputs included for the nearest-layer check.
    """
    return hook_capture_batch(model, input_ids, None, aux, {0: input_ids.shape[1]})[0]


def hook_capture_batch(model, input_ids, attention_mask, aux: list[int], keep: dict) -> dict:
    """`hook_capture` on a whole (padded) batch: {i: one sample's dict} for each i in `keep`.

    `keep` maps batch index to unpadded length; hooks copy only those rows' slices to the CPU
    (as float), so host memory stays within the batch's token budget.
    """
    import torch

    base, layer_list, _ = decoder_layers(model)
    inputs: dict = {i: {} for i in keep}
    final: dict = {}

    def rows_of(h) -> dict:
        return {i: h[i, :n].detach().float().cpu() for i, n in keep.items()}

    handles = []
    for k, layer in enumerate(layer_list):

        def pre(_m, args, kwargs, k=k):
            h = args[0] if args else kwargs["hidden_states"]
            for i, x in rows_of(h).items():
                inputs[i][k] = x

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))

    def post(_m, _a, output):
        final.update(rows_of(output[0] if isinstance(output, tuple) else output))

    handles.append(layer_list[-1].register_forward_hook(post))
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    try:
        with torch.no_grad():
            out = base(input_ids=input_ids, use_cache=False, **kwargs)
    finally:
        for h in handles:
            h.remove()
    post_norm = rows_of(out.last_hidden_state)
    refs = {}
    for i in keep:
        all_inputs = torch.stack([inputs[i][k] for k in range(len(layer_list))])
        refs[i] = {
            "aux": torch.stack([all_inputs[k] for k in aux], dim=1),
            "final": final[i],
            "post_norm": post_norm[i],
            "inputs": all_inputs,
        }
    return refs


def reference_batches(
    seq_lens: list[int], rows: list[int], batch_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """(batch, probe rows in it) for each extraction batch holding a probe row.

    The hf backend's batches (`extract.token_batches` over every row's length), recomputed, so
    the reference forward has the exact shape the shard was computed with: bf16 kernels differ
    with batch shape, and over dozens of layers that grows past the storage tolerance.
    """

    wanted = set(rows)
    lengths = dict(enumerate(seq_lens))
    out = []
    for batch in token_batches(lengths, batch_tokens):
        probes = [r for r in batch if r in wanted]
        if probes:
            out.append((batch, probes))
    return out


def _check(name: str, passed: bool, **detail) -> dict:
    return {"name": name, "ran": True, "passed": bool(passed), **detail}


def _skipped(name: str, reason: str) -> dict:
    return {"name": name, "ran": False, "passed": None, "reason": reason}


def compare_slots(stored, ref: dict, aux: list[int], tol: float) -> list[dict]:
    """Per slot: error against the claimed layer, and the layer the slot matches best."""
    candidates = {k: ref["inputs"][k] for k in range(ref["inputs"].shape[0])}
    candidates["final"] = ref["final"]
    candidates["post_norm"] = ref["post_norm"]
    out = []
    for slot, claimed in enumerate([*aux, "final"]):
        got = stored[:, slot]
        errs = {c: rel_err(got, v) for c, v in candidates.items()}
        nearest = min(errs, key=errs.get)
        want = ref["final"] if claimed == "final" else ref["aux"][:, slot]
        err = rel_err(got, want)
        out.append(
            {
                "slot": slot,
                "claimed": claimed,
                "rel_err": err,
                "max_abs_err": float((got.float() - want).abs().max()),
                "nearest": nearest,
                "ok": err <= tol and nearest == claimed,
            }
        )
    return out


def verify_layers(
    target_json: str,
    dataset: str,
    manifest: str,
    verify_cfg: dict,
    extract_cfg: dict,
    sglang_version: str,
    out: str,
    engine: str = "vllm",
    sglang_opts: dict | None = None,
) -> dict:
    """Run every check that can run here and write the certificate only if all of them pass."""
    import datasets
    import torch

    start = time.monotonic()
    target = load_target_json(target_json)
    plan = lay.plan_layers(target, extract_cfg["aux_layers"], sglang_version, engine)
    man = load_manifest(manifest, verify="size")
    checks: list[dict] = []

    # 1. Config, target and shards describe the same thing (the mission's failure: training data
    #    from one list of layers, a config claiming another).
    problems = []
    if man.get("layer_ids") != plan.aux:
        problems.append(
            f"the shards hold layers {lay.format_ids(man.get('layer_ids'))} (manifest {manifest}) "
            f"but extract.aux_layers resolves to {lay.format_ids(plan.aux)}; rerun "
            "extract_hidden_states for the configured ids, or set extract.aux_layers to the "
            "shards' ids"
        )
    for key in ("config_sha256", "weights_sha256"):
        if man.get("target", {}).get(key) != target.get(key):
            problems.append(
                f"the shards were extracted from a target with {key} "
                f"{man.get('target', {}).get(key)}, not this one ({target.get(key)}); rerun "
                "extract_hidden_states"
            )
    mode, want_mode = man.get("mode", "offline"), extract_cfg.get("mode", "offline")
    if mode != want_mode:
        problems.append(
            f"the manifest is of extract.mode {mode}, the config says {want_mode}; rerun "
            "extract_hidden_states"
        )
    if man.get("dtype") != extract_cfg["dtype"]:
        problems.append(
            f"the shards are {man.get('dtype')}, extract.dtype is {extract_cfg['dtype']}; rerun "
            "extract_hidden_states"
        )
    checks.append(_check("config_matches_shards", not problems, problems=problems))
    if problems:
        raise CertificateError("no layer certificate:\n" + "\n".join(f"  - {p}" for p in problems))

    data = datasets.load_from_disk(dataset).with_format(None)
    seq_lens = data["seq_len"]
    # offline: one shard per row; streamed: the probe rows, captured through the stream source
    rows = man.get("probe_rows") or probe_rows(len(seq_lens), int(verify_cfg["probe_samples"]))
    listed = range(len(seq_lens)) if mode == "offline" else rows
    counts_ok = (
        len(man["shards"]) == len(listed)
        and man.get("num_samples", len(seq_lens)) == len(seq_lens)
        and all(
            int(s.get("row", i)) == r and s["tokens"] == seq_lens[r]
            for i, (s, r) in enumerate(zip(man["shards"], listed, strict=False))
        )
    )
    checks.append(
        _check(
            "shard_token_counts",
            counts_ok,
            detail=f"{len(man['shards'])} shards ({mode}) vs {len(seq_lens)} dataset rows",
        )
    )
    load_manifest(manifest, verify="sha256", rows=rows)
    checks.append(_check("probe_shards_sha256", True, rows=rows))

    stored = {r: load_shard(man, r) for r in rows}
    tok_bad = [r for r in rows if stored[r]["token_ids"].tolist() != list(data[r]["input_ids"])]
    checks.append(
        _check(
            "token_ids_equal_input_ids",
            not tok_bad,
            rows=rows,
            mismatched_rows=tok_bad,
        )
    )
    tol = tolerance(extract_cfg["dtype"], target.get("run_dtype"))

    # 2. Forward hooks on the target itself.
    if verify_cfg.get("hf_forward", True):
        model = load_hf_target(
            target["path"],
            target.get("run_dtype") or "float32",
            bool(target.get("trust_remote_code")),
        )
        device = next(model.parameters()).device
        _, _, norm = decoder_layers(model)
        backend = man.get("backend") or extract_cfg["backend"]
        groups, reference = _reference_batches(seq_lens, rows, backend, man, extract_cfg)
        slot_rows, final_norm_err = [], 0.0
        for batch, probes in groups:  # one forward per batch; its references dropped after
            for r, ref, shape in _hf_references(model, device, data, batch, probes, plan.aux):
                per_slot = compare_slots(stored[r]["hidden_states"], ref, plan.aux, tol)
                slot_rows.append({"row": r, "batch_shape": shape, "slots": per_slot})
                # The stored final slot, normed by the target's own final norm, is HF's last entry.
                hs = stored[r]["hidden_states"][:, -1].to(device, norm.weight.dtype)
                with torch.no_grad():
                    normed = norm(hs)
                final_norm_err = max(
                    final_norm_err, rel_err(normed.float().cpu(), ref["post_norm"])
                )
        slot_rows.sort(key=lambda x: x["row"])
        worst = _worst(slot_rows)
        checks.append(
            _check(
                "hf_forward_hooks",
                all(s["ok"] for x in slot_rows for s in x["slots"]),
                tolerance_rel=tol,
                max_rel_err=worst,
                reference=reference,
                per_row=slot_rows,
            )
        )
        checks.append(
            _check(
                "final_slot_is_pre_norm",
                final_norm_err <= max(tol, 1e-3),
                max_rel_err=final_norm_err,
                detail="final_norm(stored final slot) equals HF's post-norm last hidden state",
            )
        )
        del model
    else:
        checks.append(_skipped("hf_forward_hooks", "verify.hf_forward is false"))

    # 3. The serving engine's own capture of the same tokens.
    checks.append(_engine_check(verify_cfg, target, plan, stored, rows, tol, engine, sglang_opts))

    # 4. SGLang's own layer rule, where sglang is importable (the GPU host).
    checks.append(_sglang_rule_check(plan))

    failed = [c for c in checks if c["ran"] and not c["passed"]]
    if failed:
        raise CertificateError(
            "layer certificate refused; failed checks: "
            + "; ".join(f"{c['name']}: {_summary(c)}" for c in failed)
        )
    cert = {
        "eagleflow_layer_certificate": CERT_VERSION,
        "passed": True,
        "target": {
            k: target.get(k)
            for k in (
                "name",
                "path",
                "architecture",
                "model_type",
                "family",
                "num_layers",
                "hidden_size",
                "vocab_size",
                "config_sha256",
                "weights_sha256",
            )
        },
        "convention": "aux id k = HF hidden_states[k] = input of decoder layer k (0 = embed)",
        "aux_layers": plan.aux,
        "aux_layers_text": lay.format_ids(plan.aux),
        "final_slot": lay.FINAL_SLOT,
        "ids_per_engine": {
            "speculators": plan.engine_ids["speculators"],
            "vllm": plan.engine_ids["vllm"],
            "sglang": {
                "eagle_config_ids": plan.sglang.written,
                "version": plan.sglang.version,
                "family": plan.family,
                "problems": plan.sglang.problems,
            },
        },
        "notes": plan.sglang.notes,
        "manifest": {
            "path": str(Path(manifest).resolve()),
            "sha256": sha256_file(manifest),
            "num_samples": man.get("num_samples"),
            "mode": mode,
            "dtype": man.get("dtype"),
            "host": man.get("host"),
        },
        "probe_rows": rows,
        "checks": checks,
        "host": socket.gethostname(),
        "seconds": round(time.monotonic() - start, 1),
    }
    atomic_write_json(out, cert)
    log.info(
        "layer certificate: %s + final slot on %s; checks %s",
        lay.format_ids(plan.aux),
        target.get("name"),
        ", ".join(f"{c['name']}={'pass' if c['passed'] else 'skipped'}" for c in checks),
    )
    return cert


def _reference_batches(seq_lens, rows, backend, man, extract_cfg):
    """The batches the hook reference runs, as (batch rows or None, probe rows), and a detail.

    Shards from the hf backend are recomputed in the very batch (same rows, padding and mask)
    that produced them, so the arithmetic is extraction's and only storage rounding remains.
    Other backends batch inside the engine, out of our sight: their probe rows run alone
    (None: batch 1, unpadded), and the detail says so.
    """
    if man.get("mode", "offline") != "offline":
        return [(None, [r]) for r in rows], {
            "mode": "batch1_unpadded",
            "detail": f"streamed probe rows ({man['mode']}, source {backend!r}) are captured "
            "alone, unpadded, as training streams them: the reference runs them the same way",
        }
    if backend != "hf":
        return [(None, [r]) for r in rows], {
            "mode": "batch1_unpadded",
            "detail": f"shards from backend {backend!r}, whose batches are formed inside the "
            "engine and cannot be reproduced here: each probe row ran alone, unpadded, so "
            "bf16/fp16 errors include batch-shape differences compounded over the layers",
        }
    batch_tokens = int(extract_cfg["batch_tokens"])
    detail = (
        "each probe row recomputed in its extraction batch (extract.token_batches over all "
        f"{len(seq_lens)} rows' lengths, batch_tokens {batch_tokens}, extract.padded_batch's "
        "right padding and attention mask), compared on its unpadded slice"
    )
    run = man.get("run") or {}
    if run.get("new_tokens") is not None and run["new_tokens"] != man.get("num_tokens"):
        detail += (
            f"; the last extraction run made {run['new_tokens']} of {man.get('num_tokens')} "
            "tokens (a resume), so rows made by an earlier run may have been batched "
            "differently and carry batch-shape error"
        )
    groups = reference_batches(seq_lens, rows, batch_tokens)
    return groups, {"mode": "extraction_batch", "batch_tokens": batch_tokens, "detail": detail}


def _hf_references(model, device, data, batch, probes, aux):
    """(row, hook reference, batch shape) for each probe row of one batch (None: batch 1)."""
    import torch

    if batch is None:
        (r,) = probes
        ids = torch.tensor([list(data[r]["input_ids"])], device=device)
        return [(r, hook_capture(model, ids, aux), list(ids.shape))]
    samples = {r: list(data[r]["input_ids"]) for r in batch}
    ids, mask = padded_batch(samples, batch)
    keep = {batch.index(r): len(samples[r]) for r in probes}
    got = hook_capture_batch(model, ids.to(device), mask.to(device), aux, keep)
    return [(batch[i], ref, list(ids.shape)) for i, ref in got.items()]


def _worst(slot_rows: list[dict]) -> float:
    return max((s["rel_err"] for x in slot_rows for s in x["slots"]), default=0.0)


def _summary(check: dict) -> str:
    if check.get("problems"):
        return " ".join(check["problems"])
    bad = [
        f"row {x['row']} slot {s['slot']} (claimed {s['claimed']}): rel err {s['rel_err']:.2e}, "
        f"matches {s['nearest']} best"
        for x in check.get("per_row", [])
        for s in x["slots"]
        if not s["ok"]
    ]
    return "; ".join(bad[:4]) or json.dumps({k: v for k, v in check.items() if k != "per_row"})


def _engine_check(verify_cfg, target, plan, stored, rows, tol, engine, sglang_opts) -> dict:
    """The serving engine's own capture of the probe tokens vs the shards."""
    if not verify_cfg.get("engine_check", True):
        return _skipped("engine_capture", "verify.engine_check is false")
    if engine == "sglang":
        return _sglang_engine_check(target, plan, stored, rows, tol, sglang_opts or {})
    from eagleflow.extract.vllm_capture import VllmCapture  # imports torch

    ids = [*plan.aux, int(target["num_layers"])]  # vLLM's id L: the last layer before the norm
    dtype = target.get("run_dtype") or "float32"
    remote_code = bool(target.get("trust_remote_code"))
    with VllmCapture(target["path"], ids, dtype=dtype, trust_remote_code=remote_code) as cap:
        got = cap.capture([stored[r]["token_ids"].tolist() for r in rows])
    per_row = []
    for r, hs in zip(rows, got, strict=True):
        errs = [rel_err(hs[:, s], stored[r]["hidden_states"][:, s]) for s in range(len(ids))]
        per_row.append({"row": r, "rel_err_per_slot": errs})
    return _engine_result("vllm", ids, per_row, tol)


def _engine_result(engine: str, ids: list[int], per_row: list[dict], tol: float) -> dict:
    worst = max(max(x["rel_err_per_slot"]) for x in per_row)
    # The engine runs its own kernels and batch shapes: allow 10x the storage tolerance, still
    # far below the distance between adjacent layers (>1e-1).
    limit = max(10 * tol, 1e-3)
    return _check(
        "engine_capture",
        worst <= limit,
        engine=engine,
        ids_sent=ids,
        tolerance_rel=limit,
        max_rel_err=worst,
        rows=per_row,
    )


def _sglang_engine_check(target, plan, stored, rows, tol, opts) -> dict:
    """SGLang's capture (a server with --enable-return-aux-hidden-states), aux slots only.

    SGLang cannot capture the last layer's output, so the final slot is not compared here, and
    it refuses negative ids, so an embed slot that its Llama files need written as -1 is left out.
    Runs only where sglang is installed (the GPU host).
    """
    import importlib.util
    import sys

    if importlib.util.find_spec("sglang") is None:
        return _skipped("engine_capture", "sglang is not installed on this host")
    written = plan.sglang.written or []
    slots = [i for i, w in enumerate(written) if w >= 0]
    if not slots:
        return _skipped("engine_capture", f"no SGLang-capturable aux ids in {written}")
    port = engines.free_port()
    cmd = sglang_capture_command(
        sys.executable, target["path"], opts, port, [written[i] for i in slots]
    )
    env = engines.engine_env("sglang", opts)
    with engines.Server(cmd, "127.0.0.1", port, env=env) as server:
        got = capture_sglang(
            server.url,
            [stored[r]["token_ids"].tolist() for r in rows],
            len(slots),
            int(target["hidden_size"]),
        )
    per_row = []
    for r, hs in zip(rows, got, strict=True):
        ref = stored[r]["hidden_states"]
        errs = [rel_err(hs[:, j], ref[:, s]) for j, s in enumerate(slots)]
        per_row.append({"row": r, "rel_err_per_slot": errs})
    return _engine_result("sglang", [plan.aux[i] for i in slots], per_row, tol)


def sglang_capture_command(python: str, model: str, opts: dict, port: int, written: list[int]):
    """The serving engine's own launch command (serve owns engine flags: tp_size, extra_args
    such as --trust-remote-code), without a draft, plus the aux-capture flags for `written`."""

    base = engines.SpecConfig("baseline")
    cmd = engines.sglang_command(python, model, base, opts, "127.0.0.1", port)
    return cmd + sglang_capture_launch_args(written)


def _sglang_rule_check(plan: lay.LayerPlan) -> dict:
    if plan.sglang.written is None:
        reason = "no SGLang ids for this plan: " + "; ".join(plan.sglang.problems)
        return _skipped("sglang_rule", reason)
    real = lay.sglang_capture_real(plan.family, plan.sglang.written, plan.num_layers)
    if real is None:
        return _skipped(
            "sglang_rule",
            "sglang is not importable here; the rule table (contract-tested against sglang "
            f"0.5.23) gives eagle_config ids {plan.sglang.written}",
        )
    captured, version = real
    return _check(
        "sglang_rule",
        captured == plan.aux,
        sglang_version=version,
        eagle_config_ids=plan.sglang.written,
        captured=captured,
    )


def require_certificate(path: str | Path, target: dict, aux: list[int] | None = None) -> dict:
    """The certificate at `path`, refusing one that failed or covers another target or ids."""
    path = Path(path)
    if not path.is_file():
        raise CertificateError(
            f"no layer certificate at {path}; run verify_layers (snakemake "
            f"{path}) before training or export"
        )
    cert = json.loads(path.read_text())
    fix = "rerun verify_layers for this target and these ids"
    if not cert.get("passed"):
        raise CertificateError(f"layer certificate {path} did not pass; {fix}")
    for key in ("config_sha256", "weights_sha256"):
        if cert["target"].get(key) != target.get(key):
            raise CertificateError(
                f"layer certificate {path} is for a target with {key} {cert['target'].get(key)}, "
                f"not {target.get(key)}; {fix}"
            )
    if aux is not None and cert["aux_layers"] != list(aux):
        raise CertificateError(
            f"layer certificate {path} proves layers {cert['aux_layers_text']}, not "
            f"{lay.format_ids(aux)}; {fix}"
        )
    return cert
