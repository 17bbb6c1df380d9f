"""How the certificate and the stream checks compare captured hidden states: the error measure,
its limits per stored dtype, and which rows are probed. Torch-free at import; imported by
extraction (which captures the probe rows of streamed modes) without the certificate's engines.
"""

from __future__ import annotations

# Limits on `rel_err` (a slot's error relative to the reference, token by token). For hf-backend
# shards the check reruns the extraction's own padded batch, so float32 is the same arithmetic
# (1e-4 is margin, far below the distance between adjacent layers: 0.25 or more on SmolLM2) and
# bf16 / fp16 add only storage rounding (at most 2^-9 / 2^-12 of each value; measured 1.6e-3 for
# bf16 on SmolLM2). Other backends get a batch-1 reference, whose bf16 kernels differ with batch
# shape (compounded over the layers).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
# fp8 shards (e4m3, one scale per token over all slots): round-to-nearest with 3 mantissa bits
# moves a normal value by at most half a step, 2^-4 of it, so a token's error is at most 2^-4 of
# its norm (measured 2.2e-2 on SmolLM2). Values under e4m3's smallest normal (2^-6 of the token's
# scale, amax / 448) move by up to 2^-10 of the scale: a slot far smaller than the token's largest
# slot (SmolLM2's first token: 24,900 from layer 2 on, so an `embed` slot) loses that token,
# which adds 1/T to the slot's mean: short probe rows of such a slot can fail the limit below
# (2^-4 plus the arithmetic of the dtype the target ran in), and say so.
FP8_ROUNDING = 2.0**-4


def tolerance(store_dtype: str, run_dtype: str | None) -> float:
    """The certificate's limit on a slot's relative error for shards stored in `store_dtype`."""
    if store_dtype == "fp8":
        return FP8_ROUNDING + TOLERANCE[run_dtype or "float32"]
    return TOLERANCE[store_dtype]


def probe_rows(n_rows: int, n_probe: int) -> list[int]:
    """Evenly spread rows (first and last included), so probes cover short and long samples."""
    n = min(n_probe, n_rows)
    if n <= 1:
        return [0][:n_rows]
    return sorted({round(i * (n_rows - 1) / (n - 1)) for i in range(n)})


def rel_err(a, b) -> float:
    """Relative error of a slot [T, H], token by token: mean over tokens of |a_t - b_t| / |b_t|
    (L2 over the hidden size). Scale-free, so one tolerance serves every layer; per token, so a
    few tokens' massive activations do not set the scale. (A max-based error, max |a - b| /
    max |b|, is blind to the layer: SmolLM2's first token carries |x| of about 24,900 from layer 2
    on, against about 1 elsewhere, so its adjacent layers differ by ~2e-3 of that maximum, less
    than bf16 storage rounding; token by token they are 0.25 or more apart.)"""
    a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).mean())
