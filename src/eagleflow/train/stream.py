"""Training's side of streamed hidden states (extract.mode online / hybrid): the loader's transfer
over the stream source, and the probe checks before step 0 and every verify.recheck_steps.
The source and the stream manifest are extraction's (`eagleflow.extract.stream`)."""

from __future__ import annotations

from pathlib import Path

from eagleflow import layers as lay
from eagleflow.errors import EagleflowError
from eagleflow.extract.compare import rel_err
from eagleflow.extract.hf import PROGRESS, load_shard
from eagleflow.extract.stream import as_stored, store_row, stored_whole
from eagleflow.util import read_jsonl_resumable


class StreamTransfer:
    """speculators' `HiddenStatesTransfer` over a source: `get_cached(row)` captures the row
    (hybrid: reads it from the store if an earlier epoch stored it, else captures and stores it).
    Used with the loader in the training process (train.num_workers 0): the source holds the
    target."""

    def __init__(self, source, dataset: str, manifest: dict, read_dtype):
        import datasets

        self.source, self.man, self.read_dtype = source, manifest, read_dtype
        self.data = datasets.load_from_disk(dataset).with_format(None)
        self.store = Path(manifest["root"]) if manifest["mode"] == "hybrid" else None
        self.dtype = manifest["dtype"]
        self.done = read_jsonl_resumable(self.store / PROGRESS, "row") if self.store else {}
        self.read = self.captured = 0

    def setup(self) -> None:
        pass

    def delete(self, handle: str) -> None:
        pass

    def get_generated(self, params):  # the server path; this transfer never generates
        raise NotImplementedError

    def get_cached(self, file_idx: int) -> dict:
        import torch

        file_idx = int(file_idx)  # the sampler's numpy integers
        if self.store is not None and stored_whole(self.store, self.done.get(file_idx)):
            self.read += 1
            shelf = {"root": str(self.store), "shards": [self.done[file_idx]]}
            got = load_shard(shelf, file_idx, dequantize_dtype=self.read_dtype)
            return {
                "token_ids": got["token_ids"],
                "hidden_states": got["hidden_states"].to(self.read_dtype),
            }
        ids = list(self.data[file_idx]["input_ids"])
        hs = self.source.capture(ids)
        self.captured += 1
        token_ids = torch.tensor(ids, dtype=torch.int64)
        if self.store is not None:
            self.done[file_idx] = store_row(self.store, file_idx, token_ids, hs, self.dtype)
        return {"token_ids": token_ids, "hidden_states": as_stored(hs, self.dtype, self.read_dtype)}


def match_probe(streamed, certified, aux: list[int], tol: float) -> list[dict]:
    """Per slot of a streamed probe: its error against the certified capture of the same slot,
    and the certified slot it matches best (a source capturing other layers shows up there)."""
    names = [*aux, "final"]
    out = []
    for slot, claimed in enumerate(names):
        got = streamed[:, slot]
        errs = {names[k]: rel_err(got, certified[:, k]) for k in range(len(names))}
        nearest = min(errs, key=errs.get)
        out.append(
            {
                "slot": slot,
                "claimed": claimed,
                "rel_err": errs[claimed],
                "nearest": nearest,
                "ok": errs[claimed] <= tol and nearest == claimed,
            }
        )
    return out


def check_probes(source, manifest: dict, rows: list[int], tol: float, when: str) -> dict:
    """Stream `rows` (probe rows of the manifest) again and hold them against their certified
    capture; raise naming the slots and ids when they differ."""
    import torch

    worst, bad = 0.0, []
    for r in rows:
        cert = load_shard(manifest, r)
        got = source.capture(cert["token_ids"].tolist())
        got = as_stored(got, manifest["dtype"], torch.float32)
        slots = match_probe(got, cert["hidden_states"].float(), manifest["layer_ids"], tol)
        worst = max(worst, *(s["rel_err"] for s in slots))
        bad += [dict(s, row=r) for s in slots if not s["ok"]]
    if bad:
        detail = "; ".join(
            f"row {s['row']} slot {s['slot']} (certified layer {s['claimed']}): relative error "
            f"{s['rel_err']:.3g} > {tol:.3g}, matches certified layer {s['nearest']} best"
            for s in bad[:6]
        )
        raise EagleflowError(
            f"streamed hidden states {when} differ from the certified capture of layers "
            f"{lay.format_ids(manifest['layer_ids'])} + final slot: {detail}. The source is not "
            "the certified target/layers: rerun extract_hidden_states and verify_layers for "
            "what it serves, or fix the source"
        )
    return {"rows": list(rows), "max_rel_err": worst, "tolerance_rel": tol, "when": when}
